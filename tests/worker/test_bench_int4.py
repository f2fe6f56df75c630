"""Issue 46's W4A16 benchmark on the CPU with tiny shapes: `bench engine --precision bf16 --precision int4` (both in
one process, the int4 model's linears packed at load), its floor (weights at half a byte plus group scales), and what
benchmarks/collect_results.py makes of it (W1_int4 with int4, bf16 and int4_over_bf16)."""

from __future__ import annotations

import json

import torch
from click.testing import CliRunner

from tests.worker.test_bench_fp8 import _collect_results
from worker.bench import engine as bench_engine
from worker.bench import floors
from worker.engine.models import load_model
from worker.engine.quant.int4 import linear as int4_linear
from worker.engine.quant.int4.linear import Int4LinearModule, quantize_linears


def test_engine_bench_runs_bf16_and_int4_in_one_process_and_collects_w1_int4(tmp_path, monkeypatch):
    # tiny-llama's hidden size is 64: groups of 32 (the H200 runs Llama-3-8B at the preset's 128)
    monkeypatch.setitem(bench_engine.PACKED_INT4, "int4", (32, True))
    packed_models = []

    def recording(model, group_size, symmetric):
        packed_models.append(model)
        return quantize_linears(model, group_size, symmetric)

    monkeypatch.setattr(int4_linear, "quantize_linears", recording)  # the bench imports it when it runs
    out = tmp_path / "w1_int4.json"
    args = ["--model", "tiny-llama", "--workload", "tiny", "--num-requests", "3", "--device", "cpu", "--mode", "async"]
    args += ["--precision", "bf16", "--precision", "int4", "--json-out", str(out)]
    result = CliRunner().invoke(bench_engine.engine_bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert len(packed_models) == 1, "only the int4 run's model is packed"
    assert sum(isinstance(m, Int4LinearModule) for m in packed_models[0].modules()) == 14
    assert "14 linears packed as INT4 (group 32)" in result.output
    report = json.loads(out.read_text())
    runs = report["results"]
    assert set(runs) == {"async-bf16", "async-int4"}
    assert runs["async-int4"]["extra"]["precision"] == "int4"
    assert "async-int4 / async-bf16 output tok/s" in result.output
    entry = _collect_results().main([tmp_path])["W1_int4"]
    assert set(entry) >= {"int4", "bf16", "int4_over_bf16", "date"}
    assert entry["int4_over_bf16"] == entry["int4"]["output_tok_s"] / entry["bf16"]["output_tok_s"] > 0


def test_the_int4_floor_reads_packed_weights_at_half_a_byte_plus_group_scales():
    bf16, _ = load_model("tiny-llama", torch.device("cpu"), torch.bfloat16)
    linears = sum(m.weight.numel() for n, m in bf16.named_modules() if isinstance(m, torch.nn.Linear) and n != "lm_head")
    dense_bytes, dense_params = floors.model_bytes(bf16)
    int4, _ = load_model("tiny-llama", torch.device("cpu"), torch.bfloat16)
    assert quantize_linears(int4, group_size=32, symmetric=True) == 14
    packed_bytes, packed_params = floors.model_bytes(int4)
    assert packed_params == dense_params
    assert packed_bytes == dense_bytes - 2 * linears + linears // 2 + 2 * (linears // 32)
