"""`python -m worker.bench engine` end to end on CPU with a tiny model: A/B runs and the HF comparison row."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from worker.bench import engine as bench_engine
from worker.bench import floors


def test_engine_bench_reports_an_ab_of_decode_gemms_and_the_hf_row(tmp_path, monkeypatch):
    # transformers' generate_batch needs CUDA; its result row (no request variant) is what broke the report
    def fake_hf(model, reqs, cap):
        return bench_engine.ModeResult(mode="hf", output_tokens=8, wall_seconds=1.0, output_tok_s=8.0, total_tok_s=9.0)

    monkeypatch.setattr(bench_engine, "run_hf", fake_hf)
    out = tmp_path / "bench.json"
    args = ["--model", "tiny-llama", "--workload", "tiny", "--num-requests", "4", "--device", "cpu"]
    args += ["--mode", "async", "--decode-gemm", "auto", "--decode-gemm", "cublas", "--compare-hf"]
    result = CliRunner().invoke(bench_engine.engine_bench, [*args, "--json-out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert set(report["results"]) == {"async-auto", "async-cublas", "hf"}
    assert report["config"]["decode_gemms"] == ["auto", "cublas"]
    # on CPU the small-step Triton path cannot run, so "auto" is cuBLAS too
    assert {r["extra"]["small_step_gemm"] for k, r in report["results"].items() if k != "hf"} == {"cublas"}
    assert report["results"]["async-auto"]["output_tokens"] == report["results"]["async-cublas"]["output_tokens"] > 0
    for key in ("async-auto", "async-cublas"):  # no Triton kernel runs on CPU; every run names its slowest steps
        extra = report["results"][key]["extra"]
        assert extra["triton_compiles"] == []
        steps = extra["slowest_steps"]
        assert 1 <= len(steps) <= 3 and steps[0]["device_ms"] >= steps[-1]["device_ms"] and steps[0]["tokens"] > 0


def test_triton_compiles_records_what_the_hook_reports_and_restores_it():
    """The bench's compile counter rides Triton's jit_cache_hook: it records the kernel name of each call,
    passes the call on to a hook that was already set, and puts that hook back."""
    knobs = pytest.importorskip("triton").knobs
    from worker.bench.common import triton_compiles

    seen, original = [], knobs.runtime.jit_cache_hook
    knobs.runtime.jit_cache_hook = lambda *a, **kw: seen.append(kw["repr"])
    try:
        with triton_compiles() as names:
            knobs.runtime.jit_cache_hook(repr="_prefill_kernel[num_warps=8](q_ptr: *bf16)", key=1)
            knobs.runtime.jit_cache_hook(repr="_decode_split_kernel[num_warps=4]()", key=2)
        assert names == ["_prefill_kernel", "_decode_split_kernel"]
        assert len(seen) == 2
        knobs.runtime.jit_cache_hook(repr="_after[]", key=3)
        assert names == ["_prefill_kernel", "_decode_split_kernel"] and len(seen) == 3
    finally:
        knobs.runtime.jit_cache_hook = original


def test_the_serial_floor_adds_kv_reads_to_the_gemms_where_the_default_floor_hides_them():
    peak = floors.PEAK_BF16_FLOPS
    weight_bytes, params, kv_per_token, bandwidth = 16e9, 8e9, 131072, 4e12
    compute_bound = (4096, 500, 400_000, 0.0)  # 4,096 tokens: 83 ms of FLOPs, 4 + 13 ms of bytes
    memory_bound = (32, 32, 24_576, 0.0)  # a W1-like decode step: all bytes
    gemm_s = 2 * params * 4096 / peak
    kv_s = 400_000 * kv_per_token / bandwidth

    def floor(steps, serial):
        return floors.floor_seconds(steps, weight_bytes, params, kv_per_token, bandwidth, serial=serial)

    assert floor([compute_bound], serial=False) == pytest.approx(gemm_s)
    assert floor([compute_bound], serial=True) == pytest.approx(gemm_s + kv_s)
    # where the weights dominate, both floors are the bytes read
    decode = (weight_bytes + 24_576 * kv_per_token) / bandwidth
    assert floor([memory_bound], serial=False) == pytest.approx(decode) == floor([memory_bound], serial=True)
    assert floors.floor_seconds([compute_bound], weight_bytes, params, kv_per_token, 0.0, serial=True) == 0.0


def test_an_moe_model_takes_the_floor_that_counts_the_experts_its_steps_hit(tmp_path, monkeypatch):
    """`bench engine` on a mixture of experts: the floor is moe/cost.py's (dense weights, the distinct experts a
    step's tokens hit, the KV), not the dense one that reads every expert every step."""
    import torch

    from worker.engine.models import load_model
    from worker.engine.moe.cost import MoeModelShape

    model, _ = load_model("tiny-qwen3-moe", torch.device("cpu"), torch.float32)
    shape, bandwidth = MoeModelShape.from_config(model.config), 1e12
    decode = [(1, 1, 100, 0.0)]  # one token: 8 of the 16 experts in each layer
    floor, serial = floors.engine_floors(model, decode, bandwidth)
    assert floor == pytest.approx(floors.moe_floor_seconds(decode, shape, 4, bandwidth))
    assert serial >= floor > 0
    weight_bytes, params = floors.model_bytes(model)
    dense_floor = floors.floor_seconds(decode, weight_bytes, params, 2 * 2 * 2 * 16 * 4, bandwidth)
    expert_bytes = 2 * 16 * 3 * 64 * 32 * 4  # layers x experts x (gate, up, down) x hidden x intermediate x fp32
    assert dense_floor - floor == pytest.approx(expert_bytes / 2 / bandwidth, rel=1e-6)  # half the experts unread

    calls = []
    real = floors.moe_floor_seconds
    monkeypatch.setattr(bench_engine, "measure_copy_bandwidth", lambda device: bandwidth)
    monkeypatch.setattr(floors, "moe_floor_seconds", lambda *a, **kw: calls.append(a) or real(*a, **kw))
    out = tmp_path / "bench.json"
    args = ["--model", "tiny-qwen3-moe", "--workload", "tiny", "--num-requests", "4", "--device", "cpu"]
    result = CliRunner().invoke(bench_engine.engine_bench, [*args, "--mode", "async", "--json-out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert len(calls) == 2  # the floor and the serial floor of the one run
    assert json.loads(out.read_text())["results"]["async"]["floor_ratio"] > 0


def test_fp8_experts_are_read_at_a_byte_a_weight_in_the_moe_floor():
    """`--quantization fp8` keeps a mixture of experts' routed experts FP8 on sm89+ GPUs (forced here on the CPU): the
    floor reads the experts a step hits at one byte a weight and their scales, and computes at the FP8 rate."""
    import torch

    from worker.engine.models import load_model
    from worker.engine.moe.cost import MoeModelShape, fp8_expert_bytes_per_param
    from worker.engine.moe.fp8 import Fp8ExpertFormat

    model, _ = load_model(
        "tiny-qwen3-moe", torch.device("cpu"), torch.float32, quantization="fp8", keep_fp8=True, keep_fp8_experts=True
    )
    shape, bandwidth = MoeModelShape.from_config(model.config), 1e12
    decode = [(1, 1, 100, 0.0)]  # one token: 8 of the 16 experts in each of the 2 layers
    per_param = fp8_expert_bytes_per_param(shape.spec, Fp8ExpertFormat())
    assert 1 < per_param < 1.1  # 3 x 64 x 32 e4m3 weights and (2 x 32 + 64) fp32 scales an expert
    floor, _ = floors.engine_floors(model, decode, bandwidth)
    fp8_floor = floors.moe_floor_seconds(decode, shape, 4, bandwidth, False, per_param, floors.PEAK_FP8_FLOPS)
    assert floor == pytest.approx(fp8_floor)
    dense_experts = floors.moe_floor_seconds(decode, shape, 4, bandwidth)
    assert dense_experts - floor == pytest.approx(2 * 8 * 3 * 64 * 32 * (4 - per_param) / bandwidth, rel=1e-6)


def test_the_dense_floor_reads_a_tied_head_and_bounds_sliding_layers_by_their_window():
    """A tied LM head (Gemma) is read whole every step, though the input embedding is a lookup; a sliding layer
    reads at most `num_seqs * window` cached tokens (Gemma 3's five local layers in six)."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    def tiny(tied: bool):
        config = LlamaConfig(
            vocab_size=320, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, tie_word_embeddings=tied,
        )  # fmt: skip
        return LlamaForCausalLM(config).to(torch.float32)

    untied_bytes, untied_params = floors.model_bytes(tiny(False))
    tied_bytes, tied_params = floors.model_bytes(tiny(True))
    assert tied_bytes == untied_bytes and tied_params == untied_params  # the head's 320 x 64 either way
    assert untied_params == sum(p.numel() for p in tiny(False).parameters()) - 320 * 64
    step = [(2, 2, 100, 0.0)]  # two decodes reading 100 cached tokens in all
    full = floors.floor_seconds(step, 0, 0, 1000, 1.0)
    windowed = floors.floor_seconds(step, 0, 0, 1000, 1.0, windows=(4, 0))
    assert full == pytest.approx(100 * 1000) and windowed == pytest.approx((8 + 100) / 2 * 1000)


def test_several_models_in_one_call(tmp_path, monkeypatch):
    """`--model` repeated: each model loaded, run and freed in turn in one process; results named MODE-MODEL,
    each model's floor ratio printed against the first's."""
    monkeypatch.setattr(bench_engine, "measure_copy_bandwidth", lambda device: 1e12)
    out = tmp_path / "bench.json"
    args = ["--model", "tiny-llama", "--model", "tiny-gemma3", "--workload", "tiny", "--num-requests", "4"]
    args += ["--device", "cpu", "--mode", "async", "--json-out", str(out)]
    result = CliRunner().invoke(bench_engine.engine_bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert report["models"] == ["tiny-llama", "tiny-gemma3"]
    assert set(report["results"]) == {"async-tiny-llama", "async-tiny-gemma3"}
    assert {r["extra"]["model"] for r in report["results"].values()} == {"tiny-llama", "tiny-gemma3"}
    assert "async-tiny-gemma3 floor ratio / async-tiny-llama's" in result.output
