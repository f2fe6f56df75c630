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
