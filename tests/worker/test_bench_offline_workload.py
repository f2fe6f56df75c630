"""W5, the MLPerf-shaped offline workload of `bench engine` (issue 49): its length distribution, and a CPU run of
its scaled-down twin through the command (warm-up of its first requests, the JSON's workload fields)."""

from __future__ import annotations

import importlib.util
import json
import math
import statistics
from pathlib import Path

from click.testing import CliRunner

from worker.bench import engine as bench_engine
from worker.bench.common import OFFLINE_WORKLOADS, make_workload, workload_stats

REPO_ROOT = Path(__file__).resolve().parents[2]


def _clipped_normal_mean_std(mean: float, std: float, lo: float, hi: float) -> tuple[float, float]:
    """Mean and std of N(mean, std) clipped to [lo, hi] (the clipped mass sits at the bounds)."""
    pdf = lambda z: math.exp(-z * z / 2) / math.sqrt(2 * math.pi)  # noqa: E731
    cdf = lambda z: (1 + math.erf(z / math.sqrt(2))) / 2  # noqa: E731
    a, b = (lo - mean) / std, (hi - mean) / std
    inside = cdf(b) - cdf(a)
    m1 = lo * cdf(a) + hi * (1 - cdf(b)) + mean * inside + std * (pdf(a) - pdf(b))
    # E[x^2] inside the bounds, for x = mean + std z: mean^2 P + 2 mean std E[z] + std^2 E[z^2]
    ez = pdf(a) - pdf(b)
    ez2 = inside + a * pdf(a) - b * pdf(b)
    m2 = lo**2 * cdf(a) + hi**2 * (1 - cdf(b)) + mean**2 * inside + 2 * mean * std * ez + std**2 * ez2
    return m1, math.sqrt(m2 - m1 * m1)


def test_w5_draws_2000_mlperf_shaped_requests_from_seed_7():
    spec = OFFLINE_WORKLOADS["W5"]
    assert (spec.num_requests, spec.prompt_len_mean, spec.prompt_len_std) == (2000, 780.0, 350.0)
    assert (spec.prompt_len_range, spec.output_len_range, spec.seed, spec.num_warmup) == ((100, 2000), (30, 128), 7, 64)
    reqs = make_workload("W5", 32000)
    assert len(reqs) == 2000 and all(r.sampling.ignore_eos for r in reqs)
    prompt_lens = [len(r.prompt_ids) for r in reqs]
    outputs = [r.sampling.max_new_tokens for r in reqs]
    assert min(prompt_lens) == 100 and max(prompt_lens) <= 2000  # N(780, 350) puts 2.6% below 100: clipped there
    assert 0.01 < prompt_lens.count(100) / 2000 < 0.05
    want_mean, want_std = _clipped_normal_mean_std(780, 350, 100, 2000)
    assert abs(statistics.fmean(prompt_lens) - want_mean) < 3 * want_std / math.sqrt(2000)  # ~23 tokens
    assert abs(statistics.pstdev(prompt_lens) - want_std) < 0.05 * want_std
    assert min(outputs) == 30 and max(outputs) == 128 and abs(statistics.fmean(outputs) - 79) < 2.5  # U(30, 128)
    assert all(0 <= t < 32000 for r in reqs[:50] for t in r.prompt_ids)
    again = make_workload("W5", 32000, seed=123)  # its own seed, whatever the caller's
    assert [r.prompt_ids for r in again[:5]] == [r.prompt_ids for r in reqs[:5]]
    assert [r.prompt_ids for r in make_workload("W5", 32000, num_requests=10)] == [r.prompt_ids for r in reqs[:10]]


def test_bench_engine_runs_an_offline_workload_after_its_own_warm_up_and_collects_w5(tmp_path):
    """run_gpu.sh's w5 stage at CPU size: bf16 and FP8 in one process; collect_results.py's W5_bf16 and W5_fp8."""
    out = tmp_path / "w5.json"
    args = ["--model", "tiny-llama", "--workload", "W5-tiny", "--num-requests", "6", "--device", "cpu"]
    args += ["--dtype", "float32", "--mode", "async", "--precision", "bf16", "--precision", "fp8"]
    args += ["--json-out", str(out)]
    result = CliRunner().invoke(bench_engine.engine_bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    report = json.loads(out.read_text())
    assert report["workload"] == "W5-tiny" and report["num_requests"] == 6
    stats = report["workload_stats"]
    assert stats == {**workload_stats(make_workload("W5-tiny", 256, num_requests=6)), "num_warmup_requests": 4}
    assert 8 <= stats["prompt_len_min"] <= stats["prompt_len_mean"] <= stats["prompt_len_max"] <= 96
    assert 4 <= stats["output_len_min"] and stats["output_len_max"] <= 12
    assert set(report["results"]) == {"async-bf16", "async-fp8"}
    for run in report["results"].values():
        assert run["output_tokens"] == round(stats["output_len_mean"] * 6)  # EOS ignored: every output at its length
        assert run["total_tok_s"] > run["output_tok_s"] > 0 and run["steps"] > 0
        assert {"floor_ratio", "serial_floor_ratio", "floor_tok_s", "gpu_busy", "extra"} <= set(run)
    assert "async-fp8 / async-bf16 output tok/s" in result.output and "W5-tiny on tiny-llama" in result.output
    collected = _collect_results().main([tmp_path])
    assert set(collected) >= {"W5_bf16", "W5_fp8"}
    for precision in ("bf16", "fp8"):
        entry = collected[f"W5_{precision}"]
        assert entry["async"]["output_tok_s"] == report["results"][f"async-{precision}"]["output_tok_s"]
        assert entry["async"]["total_tok_s"] > 0 and entry["workload"] == stats and entry["date"] == report["date"]
    want = report["results"]["async-fp8"]["output_tok_s"] / report["results"]["async-bf16"]["output_tok_s"]
    assert collected["W5_fp8"]["fp8_over_bf16"] == want


def _collect_results():
    spec = importlib.util.spec_from_file_location("collect_results", REPO_ROOT / "benchmarks" / "collect_results.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_a_prefill_step_floor_is_its_flops_at_the_bf16_or_fp8_peak():
    """W5 is prefill-bound: an 8,192-token step's floor is 2 x params x tokens at the peak of its linears' format
    (bf16, or FP8 at twice the rate), whatever the bytes it reads at a bandwidth that makes them cheap."""
    import pytest
    import torch

    from worker.bench import floors
    from worker.engine.models import load_model

    bf16, _ = load_model("tiny-llama", torch.device("cpu"), torch.bfloat16)
    fp8, _ = load_model("tiny-llama", torch.device("cpu"), torch.bfloat16, quantization="fp8", keep_fp8=True)
    step = [(8192, 10, 8192 * 400, 0.0)]  # ten 780-token prompts and a few decodes' worth of context
    _, params = floors.model_bytes(bf16)
    bf16_floor, bf16_serial = floors.engine_floors(bf16, step, 1e24)
    fp8_floor, _ = floors.engine_floors(fp8, step, 1e24, kv_dtype=torch.float8_e4m3fn)
    assert bf16_floor == pytest.approx(2 * params * 8192 / floors.PEAK_BF16_FLOPS) == pytest.approx(bf16_serial)
    assert fp8_floor == pytest.approx(2 * floors.model_bytes(fp8)[1] * 8192 / floors.PEAK_FP8_FLOPS)
    assert fp8_floor == pytest.approx(bf16_floor / 2)
