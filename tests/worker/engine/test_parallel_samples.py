"""n > 1: parallel samples of one prompt share its KV blocks. Sample i of a seeded request draws from
the stream of `sample_seed(seed, i)`, alone or in any batch; the prompt is counted once."""

from __future__ import annotations

import dataclasses
import time

import pytest
import torch

from worker.engine.api import MAX_SAMPLES_PER_REQUEST, EngineRequest, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model
from worker.engine.sampler import sample_seed

from .test_seeded_sampling import neighbours

SEEDED = SamplingParams(max_new_tokens=20, temperature=0.9, top_p=0.95, seed=99, ignore_eos=True)
N = 4


@pytest.fixture(scope="module")
def llama():
    return load_model("tiny-llama", torch.device("cpu"), torch.float32)


def prompt(tok) -> list[int]:
    return tok.encode("A prompt long enough to fill a few KV blocks of sixteen tokens each, and then some.")


def run(llama, reqs, **config):
    model, tok = llama
    engine = Engine(model, tok, EngineConfig(**{"mode": "sync", "num_kv_blocks": 256, **config}))
    results = engine.generate(reqs)
    assert all(r.finish_reason != FinishReason.ERROR for r in results), [r.error for r in results]
    engine.blocks.check_integrity([])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    return {r.request_id: r for r in results}, engine


@pytest.fixture(scope="module")
def singles(llama):
    """Sample i's expected tokens: an n = 1 request seeded with sample_seed(seed, i), caching off."""
    _, tok = llama
    reqs = [
        EngineRequest(f"s{i}", prompt(tok), dataclasses.replace(SEEDED, seed=sample_seed(SEEDED.seed, i)))
        for i in range(N)
    ]
    out, _ = run(llama, reqs, enable_prefix_caching=False)
    return [out[f"s{i}"].token_ids for i in range(N)]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_seeded_samples_alone_are_their_own_streams(llama, singles, mode):
    _, tok = llama
    out, engine = run(llama, [EngineRequest("g", prompt(tok), SEEDED, n=N)], mode=mode)
    res = out["g"]
    assert [s.index for s in res.samples] == list(range(N))
    assert [s.token_ids for s in res.samples] == singles
    assert res.token_ids == singles[0] and sample_seed(SEEDED.seed, 0) == SEEDED.seed
    assert len({tuple(ids) for ids in singles}) == N, "samples of one prompt must differ"
    assert all(s.finish_reason == FinishReason.LENGTH for s in res.samples)
    usage = res.usage
    assert usage.prompt_tokens == len(prompt(tok)), "the prompt is counted once"
    assert usage.completion_tokens == N * SEEDED.max_new_tokens
    assert engine.stats().prompt_tokens < 2 * len(prompt(tok)), "followers compute only the partial block"


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_seeded_samples_in_a_busy_batch_match_alone(llama, singles, mode):
    _, tok = llama
    others = neighbours(tok)
    group = EngineRequest("g", prompt(tok), SEEDED, n=N)
    out, engine = run(
        llama, others[:10] + [group] + others[10:], mode=mode, max_num_batched_tokens=48, num_kv_blocks=24
    )
    assert [s.token_ids for s in out["g"].samples] == singles
    assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"


@pytest.mark.parametrize("caching", [True, False])
def test_greedy_samples_share_the_prompt_and_equal_one_request(llama, caching):
    _, tok = llama
    greedy = SamplingParams(max_new_tokens=12)
    reqs = [EngineRequest("one", prompt(tok), greedy), EngineRequest("g", prompt(tok), greedy, n=3)]
    out, engine = run(llama, reqs, mode="async", enable_prefix_caching=caching)
    assert [s.token_ids for s in out["g"].samples] == [out["one"].token_ids] * 3
    assert out["g"].usage.completion_tokens == 3 * len(out["one"].token_ids)
    assert out["g"].usage.prompt_tokens == len(prompt(tok))
    # A second run of the same prompt finds its full blocks in the cache (if on).
    again = engine.generate([EngineRequest("again", prompt(tok), greedy, n=2)])[0]
    num_full = (len(prompt(tok)) - 1) // 16 * 16
    assert again.usage.cached_tokens == (num_full if caching else 0)
    assert [s.token_ids for s in again.samples] == [out["one"].token_ids] * 2


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_abort_cancels_every_sample(llama, mode):
    model, tok = llama
    engine = Engine(model, tok, EngineConfig(mode=mode, num_kv_blocks=256))
    params = SamplingParams(max_new_tokens=1000, temperature=1.0, ignore_eos=True)
    engine.start()
    try:
        engine.add_request(EngineRequest("g", prompt(tok), params, n=3))
        deadline = time.monotonic() + 60
        while engine.stats().output_tokens < 3 * 5:  # every sample under way
            assert time.monotonic() < deadline, "samples did not start"
            time.sleep(0.01)
        engine.abort("g")
        [res] = engine.get_results(timeout=60)
    finally:
        engine.shutdown()
    assert res.finish_reason == FinishReason.CANCELLED
    assert [s.finish_reason for s in res.samples] == [FinishReason.CANCELLED] * 3
    assert all(len(s.token_ids) < 1000 for s in res.samples)
    assert engine.num_unfinished() == 0 and engine.has_capacity()
    engine.blocks.check_integrity([])
    assert not engine.scheduler.has_unfinished()


def test_invalid_n_is_rejected_without_disturbing_others(llama):
    _, tok = llama
    reqs = [
        EngineRequest("zero", prompt(tok), n=0),
        EngineRequest("ok", prompt(tok), SamplingParams(max_new_tokens=3), n=2),
        EngineRequest("huge", prompt(tok), n=MAX_SAMPLES_PER_REQUEST + 1),
    ]
    model, _ = llama
    engine = Engine(model, tok, EngineConfig(mode="sync", num_kv_blocks=64))
    zero, ok, huge = engine.generate(reqs)
    assert zero.finish_reason == huge.finish_reason == FinishReason.ERROR
    assert "n must be an integer in [1, 128]" in zero.error and "got 129" in huge.error
    assert ok.finish_reason == FinishReason.LENGTH and len(ok.samples) == 2
    assert engine.num_unfinished() == 0
