"""`cbq bench e2e` measures the queue alone: the through-Redis run computes every prompt token again (no prefix
cache carried over from the engine-only run)."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from worker.bench.e2e import e2e_bench


@pytest.mark.redis_server
def test_e2e_runs_compute_the_same_prompts_twice(private_redis_url, tmp_path):
    out = tmp_path / "e2e.json"
    result = CliRunner().invoke(
        e2e_bench,
        ["--model", "tiny-llama", "--workload", "tiny", "--num-requests", "8", "--redis-url", private_redis_url,
         "--max-num-seqs", "8", "--max-num-batched-tokens", "256", "--json-out", str(out)],
    )
    assert result.exit_code == 0, result.output
    report = json.loads(out.read_text())
    assert report["num_requests"] == 8 and report["prefix_caching"] is False
    engine_only, through_redis = report["engine_only"], report["through_redis"]
    assert through_redis["prefix_cache_hits"] == 0
    assert through_redis["prompt_tokens_computed"] == engine_only["prompt_tokens_computed"] > 0
    assert through_redis["output_tokens"] == engine_only["output_tokens"]
