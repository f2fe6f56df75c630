"""Prefix caching through the whole engine (fp32, CPU): greedy output with caching on equals caching off
and `model.generate` token for token, for prompts sharing prefixes, with chunked prefill, forced
preemption and requests arriving while others run; blocks are shared only once written."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from worker.engine.api import EngineRequest, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.model_runner import StepHandle
from worker.engine.models import load_model

from .conftest import FAMILY_DECODERS, TINY_FAMILIES, generate_with_late_arrivals, hf_greedy

MODELS = TINY_FAMILIES
# Budgets that are not multiples of the block size (16), so chunks end inside blocks.
SCENARIOS = {
    "chunked_prefill": dict(max_num_batched_tokens=40),
    "preemption": dict(num_kv_blocks=30, max_num_batched_tokens=72),
}


def shared_prefix_requests(tok, seed: int = 0, num: int = 20, max_new: int = 24) -> list[EngineRequest]:
    """Requests over three shared prefixes (37, 64 and 90 tokens): unique suffixes, exact repeats,
    and a prompt that is exactly a prefix of whole blocks."""
    rng = random.Random(seed)
    prefixes = [[tok.bos_token_id] + [rng.randrange(256) for _ in range(n - 1)] for n in (37, 64, 90)]
    prompts = [prefixes[1], prefixes[0] + [5]]
    while len(prompts) < num - 2:
        prompts.append(rng.choice(prefixes) + [rng.randrange(256) for _ in range(rng.randint(1, 20))])
    prompts += [prompts[2], prompts[3]]  # the same prompt twice
    return [
        EngineRequest(f"p{i}", ids, SamplingParams(max_new_tokens=rng.randint(1, max_new)))
        for i, ids in enumerate(prompts)
    ]


_REFERENCES: dict[str, tuple[list[EngineRequest], dict[str, list[int]]]] = {}


def references(tiny_models, name: str):
    if name not in _REFERENCES:
        model, tok = tiny_models(name)
        reqs = shared_prefix_requests(tok, seed=MODELS.index(name))
        _REFERENCES[name] = (reqs, {r.request_id: hf_greedy(model, tok, r) for r in reqs})
    return _REFERENCES[name]


def assert_clean(engine: Engine) -> None:
    engine.blocks.check_integrity([])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    assert not engine.scheduler.has_unfinished()


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(("name", "decoder"), FAMILY_DECODERS)
def test_greedy_with_caching_equals_generate(tiny_models, name, scenario, mode, decoder):
    model, tok = tiny_models(name)
    reqs, ref = references(tiny_models, name)
    engine = Engine(model, tok, EngineConfig(mode=mode, decoder=decoder, **SCENARIOS[scenario]))
    results = engine.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.token_ids == ref[req.request_id], f"{req.request_id} (prompt {len(req.prompt_ids)} tokens)"
    stats = engine.stats()
    assert stats.prefix_cache_hits > 0 and 0 < stats.prefix_cache_hit_rate < 1
    assert sum(r.usage.cached_tokens for r in results) > 0
    assert all(r.usage.cached_tokens < len(q.prompt_ids) for r, q in zip(results, reqs, strict=True))
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
        assert engine.blocks.num_evictions > 0, "the small cache was meant to evict cached blocks"
    assert_clean(engine)


@pytest.mark.parametrize("name", MODELS)
def test_caching_off_gives_the_same_tokens_and_no_hits(tiny_models, name):
    model, tok = tiny_models(name)
    reqs, ref = references(tiny_models, name)
    engine = Engine(
        model, tok, EngineConfig(mode="async", enable_prefix_caching=False, **SCENARIOS["preemption"])
    )
    results = engine.generate(reqs)
    assert {r.request_id: r.token_ids for r in results} == ref
    assert engine.stats().prefix_cache_queries == 0 and all(r.usage.cached_tokens == 0 for r in results)
    assert_clean(engine)


@pytest.fixture(scope="module")
def llama():
    """This module's own tiny-llama for engines whose runner a test patches."""
    return load_model("tiny-llama", torch.device("cpu"), torch.float32)


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_requests_arriving_while_others_run_hit_the_cache(tiny_models, mode):
    model, tok = tiny_models("tiny-llama")
    reqs, ref = references(tiny_models, "tiny-llama")
    engine = Engine(model, tok, EngineConfig(mode=mode, max_num_batched_tokens=40, num_kv_blocks=60))
    results = generate_with_late_arrivals(engine, reqs, 8)
    assert {r.request_id: r.token_ids for r in results} == ref
    assert engine.stats().prefix_cache_hits > 0
    assert_clean(engine)


# -- blocks in flight ------------------------------------------------------------------------------
def defer_compute(engine: Engine, fail_step: int | None = None) -> list[str]:
    """Make the CPU runner behave like a GPU: `launch` only queues a step, which computes at `wait`
    (in async mode, after the next step was scheduled). Every block shared from then on (cache hit or
    fork) is checked to have all its K/V slots written by a completed step since it was allocated; the
    returned list collects violations (raising inside the scheduler would wedge the loop instead).
    Step number `fail_step` writes garbage into its K/V slots and raises, like a step dying midway."""
    runner, blocks = engine.runner, engine.blocks
    bs = blocks.block_size
    written: set[int] = set()
    violations: list[str] = []
    real_launch, real_wait, real_allocate, real_share = (
        runner._launch,
        runner.wait,
        blocks.allocate,
        blocks._share,
    )
    num_steps = 0

    def launch(meta, extras=None, prompt_rows=None, images=None):  # images: a vision model's (none here)
        return StepHandle(
            meta, runner.builder.slots[meta.slot].sampled_host, None, extras=extras, is_sampled=True,
            prompt_rows=prompt_rows,
        )

    def wait(handle):
        nonlocal num_steps
        num_steps += 1
        meta = handle.meta
        slots = runner.builder.slots[meta.slot].host["slot_mapping"][: meta.num_tokens].tolist()
        if num_steps == fail_step:
            for k_cache, v_cache in runner.kv_caches:
                for cache in (k_cache, v_cache):
                    flat = cache.view(-1, *cache.shape[2:])
                    flat[slots] = torch.randn_like(flat[slots])
            raise RuntimeError("step died")
        computed = real_launch(meta, handle.extras, handle.prompt_rows)  # computes now
        for field in dataclasses.fields(computed):
            setattr(handle, field.name, getattr(computed, field.name))
        written.update(slots)
        return real_wait(handle)

    def allocate(seq, num_tokens):
        before = len(seq.block_table)
        real_allocate(seq, num_tokens)
        for block in seq.block_table[before:]:
            written.difference_update(range(block * bs, (block + 1) * bs))

    def share(seq, shared):
        for block in shared:
            unwritten = [s for s in range(block * bs, (block + 1) * bs) if s not in written]
            if unwritten:
                violations.append(f"{seq.request_id}: shares block {block} with slots {unwritten} unwritten")
        real_share(seq, shared)

    runner._launch, runner.wait, blocks.allocate, blocks._share = launch, wait, allocate, share
    return violations


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_block_is_shared_only_after_the_step_writing_it_completed(llama, mode):
    """Budget 40: the first request's prompt takes three steps; the others (same prefix) are admitted
    while its later chunks are in flight, and may share only the blocks of completed steps."""
    model, tok = llama
    rng = random.Random(7)
    prefix = [tok.bos_token_id] + [rng.randrange(256) for _ in range(99)]
    reqs = [EngineRequest("first", prefix, SamplingParams(max_new_tokens=8))]
    reqs += [
        EngineRequest(
            f"s{i}", prefix + [rng.randrange(256) for _ in range(i + 1)], SamplingParams(max_new_tokens=8)
        )
        for i in range(5)
    ]
    reqs.append(EngineRequest("group", prefix + [3], SamplingParams(max_new_tokens=8), n=3))
    expected = Engine(model, tok, EngineConfig(mode="sync", enable_prefix_caching=False)).generate(reqs)
    engine = Engine(model, tok, EngineConfig(mode=mode, max_num_batched_tokens=40))
    violations = defer_compute(engine)
    results = engine.generate(reqs)
    assert not violations, violations[:3]
    for got, want in zip(results, expected, strict=True):
        assert [s.token_ids for s in got.all_samples] == [s.token_ids for s in want.all_samples], (
            got.request_id
        )
    assert engine.stats().prefix_cache_hits > 0
    assert_clean(engine)


def test_blocks_of_a_failed_step_are_never_shared(llama):
    """A step that dies after writing part of a prefix's K/V: a later request with that prefix must
    compute it again, not read the garbage."""
    model, tok = llama
    rng = random.Random(8)
    prefix = [tok.bos_token_id] + [rng.randrange(256) for _ in range(63)]
    later = EngineRequest("later", prefix + [1, 2, 3], SamplingParams(max_new_tokens=10))
    [want] = Engine(model, tok, EngineConfig(mode="sync")).generate([later])
    engine = Engine(model, tok, EngineConfig(mode="async", max_num_batched_tokens=40))
    violations = defer_compute(engine, fail_step=2)
    [first] = engine.generate([EngineRequest("first", prefix + [9], SamplingParams(max_new_tokens=4))])
    assert first.finish_reason == FinishReason.ERROR and "step died" in first.error
    # The completed step 1 wrote blocks 0-1 (tokens 0-39): they may be shared; step 2's may not.
    [got] = engine.generate([later])
    assert not violations, violations[:3]
    assert got.token_ids == want.token_ids
    assert got.usage.cached_tokens == 32
    assert_clean(engine)


def test_a_cache_salt_keeps_requests_from_sharing_cached_blocks():
    """vLLM's cache_salt: a prompt's cached blocks serve only requests with the same salt (and no salt only
    requests without one); the output is the same either way."""
    engine = Engine.from_model("tiny-llama", device="cpu", dtype="float32", mode="sync")
    prompt = [1] + list(range(10, 10 + 47))  # two full blocks and a partial one

    def cached(request_id: str, salt: str | None) -> tuple[int, list[int]]:
        [result] = engine.generate(
            [EngineRequest(request_id, prompt, SamplingParams(max_new_tokens=2), cache_salt=salt)]
        )
        return result.usage.cached_tokens, result.token_ids

    first_cached, first_ids = cached("a", None)
    assert first_cached == 0
    assert cached("b", None)[0] == 32  # same prompt, no salt: both full blocks are hits
    salted, salted_ids = cached("c", "tenant-1")
    assert salted == 0 and salted_ids == first_ids
    assert cached("d", "tenant-1")[0] == 32
    assert cached("e", "tenant-2")[0] == 0
