"""The W3/W4 bench workloads: W3 shares one prefix; W4 with caching off is the same work as n samples."""

from __future__ import annotations

import torch

from worker.bench.cache_workloads import CACHE_WORKLOADS, make_cache_workload
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model


def test_w3_requests_share_one_prefix_and_differ_after_it():
    spec = CACHE_WORKLOADS["W3"]
    reqs = make_cache_workload("W3", 32000, prefix_caching=True, num_requests=20)
    prefix = reqs[0].prompt_ids[: spec.prefix_len]
    assert len(reqs) == 20 and all(r.prompt_ids[: spec.prefix_len] == prefix for r in reqs)
    lo, hi = spec.unique_len
    assert all(lo <= len(r.prompt_ids) - spec.prefix_len <= hi for r in reqs)
    assert all(r.sampling.max_new_tokens == 128 and r.sampling.ignore_eos for r in reqs)


def test_w4_without_caching_sends_the_same_samples_as_separate_requests():
    model, tok = load_model("tiny-llama", torch.device("cpu"), torch.float32)
    grouped = make_cache_workload("W4-tiny", 256, prefix_caching=True, num_requests=2)
    separate = make_cache_workload("W4-tiny", 256, prefix_caching=False, num_requests=2)
    n = CACHE_WORKLOADS["W4-tiny"].n
    assert [r.n for r in grouped] == [n, n] and len(separate) == 2 * n
    on = Engine(model, tok, EngineConfig(mode="async", num_kv_blocks=64)).generate(grouped)
    off = Engine(
        model, tok, EngineConfig(mode="async", num_kv_blocks=64, enable_prefix_caching=False)
    ).generate(separate)
    assert [s.token_ids for r in on for s in r.all_samples] == [r.token_ids for r in off]


def test_the_bench_warm_up_has_the_workload_shape_and_shares_no_prefix_with_it():
    from worker.bench.common import warmup_requests

    for reqs in (
        make_cache_workload("W3", 32000, prefix_caching=True, num_requests=40),
        make_cache_workload("W4-tiny", 256, prefix_caching=True, num_requests=3),
    ):
        warm = warmup_requests(reqs, 32000)
        assert [len(w.prompt_ids) for w in warm] == [len(r.prompt_ids) for r in reqs]
        assert [w.n for w in warm] == [r.n for r in reqs]
        assert all(w.prompt_ids[0] != r.prompt_ids[0] for w, r in zip(warm, reqs, strict=True))
        assert {w.request_id for w in warm}.isdisjoint(r.request_id for r in reqs)
        caps = [w.sampling.max_new_tokens for w in warm]
        assert all(4 <= c <= 32 for c in caps) and len(set(caps)) > 1  # the batch shrinks step by step
        whole = warmup_requests(reqs, 32000, full_length=True)  # the bench's first-run warm-up
        assert [w.sampling for w in whole] == [r.sampling for r in reqs]
        assert [w.prompt_ids for w in whole] == [w.prompt_ids for w in warm]
    # caching on: a warm-up then the measured run finds none of the warm-up's blocks
    model, tok = load_model("tiny-llama", torch.device("cpu"), torch.float32)
    reqs = make_cache_workload("W4-tiny", 256, prefix_caching=True, num_requests=2)
    engine = Engine(model, tok, EngineConfig(mode="async", num_kv_blocks=128))
    engine.generate(warmup_requests(reqs, 256))
    engine.generate(warmup_requests(reqs, 256, full_length=True))
    engine.reset_stats()
    cold = Engine(model, tok, EngineConfig(mode="async", num_kv_blocks=128))
    assert [s.token_ids for r in engine.generate(reqs) for s in r.all_samples] == [
        s.token_ids for r in cold.generate(reqs) for s in r.all_samples
    ]
    assert engine.stats().prefix_cache_hit_rate == cold.stats().prefix_cache_hit_rate
