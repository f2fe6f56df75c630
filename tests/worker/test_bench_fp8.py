"""Issue 26's benchmarks on the CPU with tiny shapes: `bench quality` (KL and top-1 agreement of FP8 weights / FP8 KV
vs the model dtype), `bench engine --precision bf16 --precision fp8` (both in one process) and what
benchmarks/collect_results.py makes of them (W1_fp8 / W2_fp8 with fp8 and bf16 entries, FP8_quality)."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import torch
from click.testing import CliRunner

from worker.bench import engine as bench_engine
from worker.bench import floors, quality

REPO_ROOT = Path(__file__).resolve().parents[2]


def _collect_results():
    spec = importlib.util.spec_from_file_location("collect_results", REPO_ROOT / "benchmarks" / "collect_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_quality_bench_reports_kl_and_top1_for_each_fp8_setup(tmp_path):
    out = tmp_path / "fp8_quality.json"
    args = ["--model", "tiny-llama", "--num-prompts", "2", "--prompt-len", "20", "--decode-len", "4", "--device", "cpu"]
    result = CliRunner().invoke(quality.quality_bench, [*args, "--json-out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert set(report["setups"]) == {"fp8_kv", "fp8_weights", "fp8_weights_kv"}
    for name, setup in report["setups"].items():
        assert setup["positions"] == 2 * 20, name
        assert 0 < setup["mean_kl"] <= setup["max_kl"], name  # FP8 changes something, KL is never negative
        assert 0.5 <= setup["top1_agreement"] <= 1.0, name  # ... but not everything
    assert report["reference"]["mean_entropy"] < report["reference"]["max_entropy"] - 1, "logits are not flat"
    assert "fp8_weights_kv" in result.output and "top-1 agree" in result.output


def test_quality_compare_is_zero_for_the_same_logits_and_counts_flipped_argmaxes():
    ref = [torch.tensor([[2.0, 0.0, -1.0], [0.0, 1.0, 0.5]])]
    same = quality.compare(ref, ref)
    assert same.mean_kl == 0 and same.top1_agreement == 1.0 and same.positions == 2
    flipped = quality.compare(ref, [torch.tensor([[2.0, 0.0, -1.0], [1.0, 0.0, 0.5]])])
    assert flipped.top1_agreement == 0.5 and flipped.mean_kl > 0


def test_teacher_forced_logits_of_prefill_plus_decode_equal_one_prefill():
    """The bench's decode steps read the cache its prefill wrote: the logits equal an all-prefill pass."""
    model, _ = quality.build_models("tiny-llama", 1, torch.float32, torch.device("cpu"), 0, 0.0, torch.tensor([1, 2]))
    prompt = [[5, 9, 30, 7, 100, 3, 44, 8, 61, 2]]
    mixed = quality.teacher_forced_logits(model, "auto", prompt, decode_len=4)[0]
    whole = quality.teacher_forced_logits(model, "auto", prompt, decode_len=0)[0]
    assert mixed.shape == (10, model.config.vocab_size)
    torch.testing.assert_close(mixed, whole, rtol=1e-4, atol=1e-4)


def test_engine_bench_runs_bf16_and_fp8_in_one_process_and_collects_w1_fp8(tmp_path):
    out = tmp_path / "w1_fp8.json"
    args = ["--model", "tiny-llama", "--workload", "tiny", "--num-requests", "3", "--device", "cpu", "--mode", "async"]
    args += ["--precision", "bf16", "--precision", "fp8", "--json-out", str(out)]
    result = CliRunner().invoke(bench_engine.engine_bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    runs = report["results"]
    assert set(runs) == {"async-bf16", "async-fp8"}
    assert (runs["async-fp8"]["extra"]["quantization"], runs["async-fp8"]["extra"]["kv_cache_dtype"]) == ("fp8", "fp8")
    assert (runs["async-bf16"]["extra"]["quantization"], runs["async-bf16"]["extra"]["kv_cache_dtype"]) == (None, "auto")
    assert "quantization" not in report["config"] and report["config"]["precisions"] == ["bf16", "fp8"]
    assert "async-fp8 / async-bf16 output tok/s" in result.output
    (tmp_path / "w2_fp8.json").write_text(out.read_text())
    quality_run = {"setups": {"fp8_weights_kv": {"mean_kl": 0.01, "top1_agreement": 0.98}}, "date": "2026-12-01"}
    (tmp_path / "fp8_quality.json").write_text(json.dumps(quality_run))
    collected = _collect_results().main([tmp_path])
    for name in ("W1_fp8", "W2_fp8"):
        entry = collected[name]
        assert set(entry) >= {"fp8", "bf16", "fp8_over_bf16", "date"}
        assert entry["fp8"]["output_tok_s"] > 0 and "floor_ratio" in entry["fp8"] and "floor_ratio" in entry["bf16"]
    assert collected["FP8_quality"]["setups"]["fp8_weights_kv"]["top1_agreement"] == 0.98


def test_engine_bench_ab_tests_decode_gemms_at_one_precision_and_collects_w1_fp8_step(tmp_path):
    """run_gpu.sh's w1fp8step: several --decode-gemm with one --precision run in one process, named
    MODE-GEMM. ("triton" needs an sm90 GPU: here "auto" runs, and the report is renamed as the H200's would be.)"""
    out = tmp_path / "run.json"
    args = ["--model", "tiny-llama", "--workload", "tiny", "--num-requests", "3", "--device", "cpu", "--mode", "async"]
    args += ["--precision", "fp8", "--decode-gemm", "cublas", "--decode-gemm", "auto", "--json-out", str(out)]
    result = CliRunner().invoke(bench_engine.engine_bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"async-cublas", "async-auto"}
    assert all(r["extra"]["quantization"] == "fp8" for r in report["results"].values())
    report["results"]["async-triton"] = report["results"].pop("async-auto")
    (tmp_path / "w1_fp8_step.json").write_text(json.dumps(report))
    entry = _collect_results().main([tmp_path])["W1_fp8_step"]
    assert set(entry) >= {"cublas", "triton", "triton_over_cublas", "date"}
    want = entry["triton"]["output_tok_s"] / entry["cublas"]["output_tok_s"]
    assert entry["triton_over_cublas"] == want > 0


def test_the_fp8_floor_reads_weights_and_kv_at_one_byte():
    from worker.engine.models import load_model

    bf16, _ = load_model("tiny-llama", torch.device("cpu"), torch.bfloat16)
    fp8, _ = load_model("tiny-llama", torch.device("cpu"), torch.bfloat16, quantization="fp8", keep_fp8=True)
    log = [(1, 1, 1000, 0.0)]  # one decode step reading 1,000 tokens of KV: bound by bytes
    bf16_floor, _ = floors.engine_floors(bf16, log, 1e9)
    fp8_floor, _ = floors.engine_floors(fp8, log, 1e9, kv_dtype=torch.float8_e4m3fn)
    assert fp8_floor < 0.6 * bf16_floor, (fp8_floor, bf16_floor)  # the head stays bf16; the rest halves
