"""--deterministic at --tensor-parallel-size 2 and 4 over gloo on the CPU: a request's tokens and their logprobs
are bitwise the same alone and in a busy batch (other traffic, another token budget, chunked prefill, preemption),
sync and async. Each rank's ops are deterministic.py's row-at-a-time ones; the all-reduce of two ranks adds two
values, the same bits in either order, and above two ranks the partial sums are added in rank order
(group.sum_in_rank_order), since an all-reduce's order follows the message size. fp32: there torch's CPU GEMMs give
a row other bits at another batch size, so without --deterministic the logprobs differ (the test checks that it
can tell)."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from worker.engine.api import EngineRequest
from worker.engine.engine_builder import build_engine

from .test_deterministic import requests

MODEL = "tiny-llama"
TP2 = dict(dtype="float32", tensor_parallel_size=2)


@pytest.fixture(autouse=True)
def one_thread():
    """The row-at-a-time CPU ops cost ~15 ms each on torch's thread pool of a loaded machine, ~50 us on one."""
    num_threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(num_threads)


def with_logprobs(reqs: list[EngineRequest]) -> list[EngineRequest]:
    return [dataclasses.replace(r, sampling=dataclasses.replace(r.sampling, logprobs=1)) for r in reqs]


def outputs(results) -> dict[str, list[tuple[int, float]]]:
    """Per request: each token with its logprob (compared bitwise)."""
    return {r.request_id: [(lp.token_id, lp.logprob) for lp in r.logprobs] for r in results}


def alone_and_in_a_batch(mode: str, deterministic: bool, tensor_parallel_size: int = 2):
    targets = with_logprobs(requests(256, 0, 6, "t", max_suffix=24, max_new=8))
    batch = targets + with_logprobs(requests(256, 1, 6, "o", max_suffix=24, max_new=8))
    random.Random(mode).shuffle(batch)
    tp = dict(TP2, tensor_parallel_size=tensor_parallel_size)
    engine = build_engine(MODEL, mode="sync", deterministic=deterministic, **tp)
    try:
        alone = outputs([engine.generate([r])[0] for r in targets])
    finally:
        engine.close()
    engine = build_engine(
        MODEL, mode=mode, deterministic=deterministic, max_num_batched_tokens=23, num_kv_blocks=8, **tp
    )
    try:
        in_batch = outputs(engine.generate(batch))
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
    finally:
        engine.close()
    return alone, {k: in_batch[k] for k in alone}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_deterministic_outputs_at_tp2_do_not_depend_on_the_batch(mode):
    alone, in_batch = alone_and_in_a_batch(mode, deterministic=True)
    assert in_batch == alone


def test_without_deterministic_the_batch_changes_the_bits():
    """The check above can fail: the default GEMMs round a row differently at another batch size."""
    alone, in_batch = alone_and_in_a_batch("sync", deterministic=False)
    assert in_batch != alone


def test_deterministic_outputs_at_tp4_do_not_depend_on_the_batch():
    """Four ranks (KV heads replicated, one q head each): the partial sums in rank order."""
    alone, in_batch = alone_and_in_a_batch("async", deterministic=True, tensor_parallel_size=4)
    assert in_batch == alone
