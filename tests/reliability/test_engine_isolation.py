"""A request whose step inputs cannot be built (issue 10, item 5: `top_k >= 2**31` overflowed an int32 buffer
and failed all 200 requests of its step) fails alone; the others in the step carry on, token for token."""

from __future__ import annotations

import pytest
import torch

from worker.engine.api import EngineRequest, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model


@pytest.fixture(scope="module")
def tiny():
    return load_model("tiny-llama", torch.device("cpu"), torch.float32)


def good_requests(tok) -> list[EngineRequest]:
    return [
        EngineRequest(f"r{i}", tok.encode(f"request number {i}"), SamplingParams(max_new_tokens=6))
        for i in range(7)
    ]


@pytest.fixture(scope="module")
def clean(tiny):
    """The good requests' results without the poison (greedy: the same in sync and async mode)."""
    model, tok = tiny
    return Engine(model, tok, EngineConfig(mode="sync")).generate(good_requests(tok))


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_request_that_cannot_be_prepared_fails_alone(tiny, clean, mode):
    model, tok = tiny
    good = good_requests(tok)
    # The engine's own API accepts it (the queue's schema bounds top_k; a library caller may not).
    poison = EngineRequest(
        "poison", tok.encode("bad"), SamplingParams(max_new_tokens=6, top_k=2**31, temperature=1)
    )

    engine = Engine(model, tok, EngineConfig(mode=mode))
    results = engine.generate([*good[:3], poison, *good[3:]])
    by_id = {r.request_id: r for r in results}
    assert by_id["poison"].finish_reason == FinishReason.ERROR
    assert by_id["poison"].error.startswith("request cannot be prepared: OverflowError")
    for want in clean:
        got = by_id[want.request_id]
        assert got.finish_reason == want.finish_reason and got.token_ids == want.token_ids, got
    engine.blocks.check_integrity([])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    assert engine.num_unfinished() == 0


def test_a_step_no_single_request_explains_still_fails_as_a_whole(tiny):
    model, tok = tiny
    engine = Engine(model, tok, EngineConfig(mode="sync"))
    real_build, calls = engine.runner.builder.build, []

    def fails_once_for_the_whole_step(step, *args):
        calls.append(step.num_seqs)
        if len(calls) == 1:
            raise ValueError("transient")
        return real_build(step, *args)

    engine.runner.builder.build = fails_once_for_the_whole_step
    reqs = [EngineRequest(f"r{i}", tok.encode(f"x{i}"), SamplingParams(max_new_tokens=3)) for i in range(3)]
    results = engine.generate(reqs)
    assert [r.finish_reason for r in results] == [FinishReason.ERROR] * 3
    assert all("engine step failed" in r.error for r in results)
    assert engine.num_unfinished() == 0
