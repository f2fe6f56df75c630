"""A failing step fails the requests it touched and the engine carries on; a dead loop thread is reported."""

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


def requests(tok, n: int) -> list[EngineRequest]:
    return [
        EngineRequest(f"r{i}", tok.encode(f"request number {i}"), SamplingParams(max_new_tokens=6))
        for i in range(n)
    ]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_failing_step_fails_only_its_requests(tiny, mode):
    model, tok = tiny
    reqs = requests(tok, 6)
    clean = Engine(model, tok, EngineConfig(mode=mode, max_num_seqs=2)).generate(reqs)
    engine = Engine(model, tok, EngineConfig(mode=mode, max_num_seqs=2))
    real_launch, calls = engine.runner.launch, []

    def flaky_launch(step):
        calls.append(step)
        if len(calls) == 3:
            raise RuntimeError("boom")
        return real_launch(step)

    engine.runner.launch = flaky_launch
    results = engine.generate(reqs)
    failed = [r for r in results if r.finish_reason == FinishReason.ERROR]
    assert failed and all(r.error == "engine step failed: RuntimeError: boom" for r in failed)
    assert len(failed) <= 2, "only the running requests (max_num_seqs=2) may fail"
    survivors = [(r, c) for r, c in zip(results, clean, strict=True) if r.finish_reason != FinishReason.ERROR]
    assert len(survivors) >= 4
    for got, want in survivors:
        assert got.token_ids == want.token_ids, got.request_id
    engine.blocks.check_integrity([])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks
    assert engine.num_unfinished() == 0


def test_a_dead_loop_thread_is_reported_by_get_results(tiny):
    model, tok = tiny
    engine = Engine(model, tok)

    def broken_inbox(block):
        raise MemoryError("simulated")

    engine._drain_inbox = broken_inbox
    engine.start()
    try:
        with pytest.raises(RuntimeError, match="engine loop has died"):
            for _ in range(50):
                engine.get_results(timeout=0.1)
    finally:
        engine.shutdown()
