"""`python -m worker.bench engine` end to end on CPU with a tiny model: A/B runs and the HF comparison row."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from worker.bench import engine as bench_engine


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
    peak = bench_engine.PEAK_BF16_FLOPS
    weight_bytes, params, kv_per_token, bandwidth = 16e9, 8e9, 131072, 4e12
    compute_bound = (4096, 500, 400_000, 0.0)  # 4,096 tokens: 83 ms of FLOPs, 4 + 13 ms of bytes
    memory_bound = (32, 32, 24_576, 0.0)  # a W1-like decode step: all bytes
    gemm_s = 2 * params * 4096 / peak
    kv_s = 400_000 * kv_per_token / bandwidth

    def floor(steps, serial):
        return bench_engine.floor_seconds(steps, weight_bytes, params, kv_per_token, bandwidth, serial=serial)

    assert floor([compute_bound], serial=False) == pytest.approx(gemm_s)
    assert floor([compute_bound], serial=True) == pytest.approx(gemm_s + kv_s)
    # where the weights dominate, both floors are the bytes read
    decode = (weight_bytes + 24_576 * kv_per_token) / bandwidth
    assert floor([memory_bound], serial=False) == pytest.approx(decode) == floor([memory_bound], serial=True)
    assert bench_engine.floor_seconds([compute_bound], weight_bytes, params, kv_per_token, 0.0, serial=True) == 0.0
