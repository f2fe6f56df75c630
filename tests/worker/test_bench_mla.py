"""`bench engine` on a latent attention model (DeepSeek-V2-Lite's fixture on the CPU): the run goes through the latent
path, and its floor is the MoE one with the latent's bytes per cached token (what run_gpu.sh w1mla / w2mla measure on
the H200 with the deepseek-v2-lite and moonlight-16b-a3b shapes)."""

from __future__ import annotations

import json

from click.testing import CliRunner

from tests.fixtures.deepseek_checkpoints import build_deepseek_checkpoint
from worker.bench import engine as bench_engine


def test_engine_bench_runs_a_latent_attention_model(tmp_path, monkeypatch):
    checkpoint = build_deepseek_checkpoint(tmp_path / "v2-lite", "v2-lite")
    monkeypatch.setattr(bench_engine, "measure_copy_bandwidth", lambda device: 1e12)
    out = tmp_path / "bench.json"
    args = ["--model", str(checkpoint.path), "--workload", "tiny", "--num-requests", "4", "--device", "cpu"]
    result = CliRunner().invoke(bench_engine.engine_bench, [*args, "--mode", "async", "--json-out", str(out)])
    assert result.exit_code == 0, result.output + repr(result.exception)
    assert json.loads(out.read_text())["results"]["async"]["floor_ratio"] > 0


def test_engine_bench_compares_latent_prefills_in_one_process(tmp_path, monkeypatch):
    """`--mla-prefill` repeated: each run steps under its choice (CBQ_MLA_PREFILL, set for its engine and cleared at
    the end), named by it, with the ratio to the absorbed one printed."""
    from worker.engine import latent_attention
    from worker.engine.latent_prefill import MLA_PREFILL_ENV

    checkpoint = build_deepseek_checkpoint(tmp_path / "v2-lite", "v2-lite")
    monkeypatch.setattr(bench_engine, "measure_copy_bandwidth", lambda device: 1e12)
    monkeypatch.delenv(MLA_PREFILL_ENV, raising=False)
    calls = []
    expanded_prefill = latent_attention.expanded_prefill
    monkeypatch.setattr(latent_attention, "expanded_prefill", lambda *a, **k: calls.append(1) or expanded_prefill(*a, **k))
    out = tmp_path / "bench.json"
    args = ["--model", str(checkpoint.path), "--workload", "tiny", "--num-requests", "4", "--device", "cpu"]
    args += ["--mode", "sync", "--mla-prefill", "absorbed", "--mla-prefill", "expanded", "--json-out", str(out)]
    result = CliRunner().invoke(bench_engine.engine_bench, args)
    assert result.exit_code == 0, result.output + repr(result.exception)
    results = json.loads(out.read_text())["results"]
    assert set(results) == {"sync-absorbed", "sync-expanded"}
    assert results["sync-expanded"]["extra"]["mla_prefill"] == "expanded"
    assert "sync-expanded / sync-absorbed output tok/s" in result.output
    assert calls, "the expanded run took the expanded path"
    assert MLA_PREFILL_ENV not in __import__("os").environ
