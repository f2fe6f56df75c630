"""Admission off the adding thread (worker/engine/admission.py, engine.py): the ordered pool delivers in
submission order whatever order its work finishes in, an item put behind work waits for it, a raising work item
is skipped; a vision-language engine started in its thread runs requests added in a burst (their images processed
on the pool) to the same tokens as `generate`, a bad image failing alone, and an abort right after its add
cancels that request (it never overtakes it)."""

from __future__ import annotations

import threading
import time

import pytest

from tests.fixtures.vision_checkpoints import build_qwen2_5_vl
from tests.worker.engine.test_engine_vision import engine, picture, request
from worker.engine.admission import OrderedPool, default_workers
from worker.engine.api import EngineRequest, ErrorCode, FinishReason


def test_deliveries_keep_the_submission_order():
    delivered: list[int] = []
    pool: OrderedPool[int] = OrderedPool(delivered.append, workers=4)
    release = threading.Event()

    def slow() -> int:
        release.wait(5)
        return 0

    pool.submit(slow)
    for i in range(1, 6):
        pool.submit(lambda i=i: i)
    pool.put(6)  # no work: behind the others still
    time.sleep(0.1)
    assert delivered == [] and pool.num_pending() == 7  # all wait for the head of the line
    release.set()
    pool.wait()
    assert delivered == [0, 1, 2, 3, 4, 5, 6] and pool.num_pending() == 0
    pool.close()


def test_a_raising_work_item_is_skipped_and_the_line_goes_on(caplog):
    delivered: list[int] = []
    pool: OrderedPool[int] = OrderedPool(delivered.append, workers=2)

    def broken() -> int:
        raise RuntimeError("boom")

    pool.submit(lambda: 1)
    pool.submit(broken)
    pool.submit(lambda: 3)
    pool.wait()
    pool.close()
    assert delivered == [1, 3]
    assert "admission work failed" in caplog.text


def test_default_workers_are_bounded():
    assert 1 <= default_workers() <= 8


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return build_qwen2_5_vl(tmp_path_factory.mktemp("qwen2_5_vl"))


def collect(eng, num: int) -> dict:
    results: dict = {}
    deadline = time.monotonic() + 120
    while len(results) < num and time.monotonic() < deadline:
        for result in eng.get_results(timeout=0.5):
            results[result.request_id] = result
    return results


def test_a_burst_of_image_requests_in_the_started_engine(checkpoint):
    reqs = [
        request(checkpoint, f"r{i}", "describe the picture", [picture((60 + 20 * i, 150 - 10 * i), i)])
        for i in range(6)
    ]
    thin = request(checkpoint, "thin", "describe", [picture((2000, 5), 9)])
    missing = EngineRequest("missing", reqs[0].prompt_ids, reqs[0].sampling)  # a pad and no image
    expected = {r.request_id: r.token_ids for r in engine(checkpoint, mode="sync").generate(reqs)}
    eng = engine(checkpoint, mode="async")
    eng.start()
    try:
        for req in [*reqs[:3], thin, missing, *reqs[3:]]:
            eng.add_request(req)
        results = collect(eng, len(reqs) + 2)
    finally:
        eng.close()
    assert {k: results[k].token_ids for k in expected} == expected
    assert "aspect ratio" in results["thin"].error and "no images" in results["missing"].error
    assert results["thin"].error_code == results["missing"].error_code == ErrorCode.INVALID_PROMPT
    assert eng.num_unfinished() == 0


def test_an_abort_right_after_its_add_cancels_it(checkpoint, monkeypatch):
    eng = engine(checkpoint, mode="async")
    release = threading.Event()
    prepare = eng.image_prompts.prepare

    def held(*args):
        release.wait(10)
        return prepare(*args)

    monkeypatch.setattr(eng.image_prompts, "prepare", held)
    eng.start()
    try:
        long = request(checkpoint, "long", "describe", [picture((100, 70), 0)], max_new_tokens=200)
        eng.add_request(long)
        eng.abort("long")  # the add is still on the pool: the abort waits behind it
        release.set()
        results = collect(eng, 1)
    finally:
        eng.close()
    assert results["long"].finish_reason == FinishReason.CANCELLED
