"""Seeded sampling is reproducible: a request's tokens depend only on its seed and its positions, not on
what shares the batch (chunking, preemption) nor on sync vs async mode."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from worker.engine.api import EngineRequest, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

MAX_NEW = 24
TARGET = SamplingParams(
    max_new_tokens=MAX_NEW, temperature=0.8, top_p=0.9, top_k=40, seed=1234, ignore_eos=True
)


@pytest.fixture(scope="module")
def llama():
    """This module's own tiny-llama (fp32, CPU): an Engine switches its model's attention to the paged
    kernel, so the shared `tiny_models` instances, which other tests run through HF generate, stay out."""
    return load_model("tiny-llama", torch.device("cpu"), torch.float32)


def target_request(tok, seed: int = 1234) -> EngineRequest:
    return EngineRequest(
        "target", tok.encode("Once upon a time, in a land far away,"), dataclasses.replace(TARGET, seed=seed)
    )


def neighbours(tok, num: int = 30) -> list[EngineRequest]:
    """Mixed greedy and sampled requests of mixed lengths (some without a seed: derived from the id)."""
    rng = random.Random(5)
    reqs = []
    for i in range(num):
        ids = [tok.bos_token_id] + [rng.randrange(256) for _ in range(rng.randint(0, 120))]
        if i % 3 == 0:
            sampling = SamplingParams(max_new_tokens=rng.randint(1, 30))
        else:
            sampling = SamplingParams(
                max_new_tokens=rng.randint(1, 30),
                temperature=rng.choice([0.5, 1.0, 1.3]),
                top_p=rng.choice([1.0, 0.7]),
                top_k=rng.choice([0, 5]),
                seed=rng.choice([None, i]),
            )
        reqs.append(EngineRequest(f"n{i}", ids, sampling))
    return reqs


def run(llama, mode: str, reqs: list[EngineRequest], **config) -> dict[str, list[int]]:
    return run_engine(llama, mode, reqs, **config)[0]


def run_engine(llama, mode: str, reqs: list[EngineRequest], **config) -> tuple[dict[str, list[int]], Engine]:
    model, tok = llama
    engine = Engine(model, tok, EngineConfig(mode=mode, **{"num_kv_blocks": 256, **config}))
    results = engine.generate(reqs)
    assert all(r.finish_reason != FinishReason.ERROR for r in results), [r.error for r in results if r.error]
    return {r.request_id: r.token_ids for r in results}, engine


@pytest.fixture(scope="module")
def alone(llama):
    _, tok = llama
    return {mode: run(llama, mode, [target_request(tok)])["target"] for mode in ("sync", "async")}


def test_seeded_request_alone_is_the_same_in_sync_and_async(alone, llama):
    _, tok = llama
    assert len(alone["sync"]) == MAX_NEW
    assert alone["sync"] == alone["async"]
    # It really samples: the greedy continuation differs.
    greedy = run(llama, "sync", [EngineRequest("g", target_request(tok).prompt_ids, SamplingParams(MAX_NEW))])
    assert greedy["g"] != alone["sync"]


# "busy": chunked prefill and a cache small enough to preempt. The target sits in the middle of the batch.
BATCH_CONFIGS = {"default": {}, "busy": {"max_num_batched_tokens": 48, "num_kv_blocks": 24}}


@pytest.mark.parametrize("config", list(BATCH_CONFIGS))
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_seeded_request_in_a_batch_matches_alone(llama, alone, mode, config):
    _, tok = llama
    others = neighbours(tok)
    reqs = others[:15] + [target_request(tok)] + others[15:]
    out, engine = run_engine(llama, mode, reqs, **BATCH_CONFIGS[config])
    assert out["target"] == alone["sync"]
    if config == "busy":
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"


def test_sampled_neighbours_are_reproducible_across_modes(llama):
    """Requests without a seed get one from their id: the same in sync and async, alone or not."""
    _, tok = llama
    reqs = neighbours(tok, 12)
    sync = run(llama, "sync", reqs)
    assert sync == run(llama, "async", reqs)
    assert sync["n1"] == run(llama, "async", [reqs[1]])["n1"]


def test_different_seeds_give_different_outputs(llama, alone):
    _, tok = llama
    other = run(llama, "sync", [target_request(tok, seed=4321)])["target"]
    assert len(other) == MAX_NEW
    assert other != alone["sync"]
    assert sum(a != b for a, b in zip(other, alone["sync"], strict=True)) > MAX_NEW // 2, (
        "seeds look correlated"
    )
