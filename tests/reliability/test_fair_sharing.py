"""Fair sharing (issue 44): a worker that joins while another holds a large batch gets work at once. The first
worker's engine runs 40 requests at a time and, like the real engine, would take twice that; a worker
holds at most about one chunk beyond what its engine runs, so the rest stays queued for the second."""

from __future__ import annotations

import threading
import time

from producer import store
from tests.reliability.conftest import assert_exactly_once, submit_prompts, wait_until
from worker.fake_engine import FakeEngine
from worker.queue_worker import CbqWorker

NUM_SLOTS = 40
JOIN_AFTER_SECONDS = 10


def _run(conn, engine: FakeEngine, workers: list[CbqWorker]) -> None:
    worker = CbqWorker(["cbq"], engine, connection=conn, model_name="fake")
    workers.append(worker)
    worker.work(burst=True, logging_level="WARNING")


def test_a_worker_that_joins_late_gets_a_share_of_a_large_batch(redis_server, cbq, tmp_path):
    conn = redis_server.connect()
    # 80 requests: what the first engine would take at once (2 x 40); each runs 11 s from its start
    batch_id = submit_prompts(cbq, tmp_path, 2 * NUM_SLOTS, "--chunk-size", "10")
    first_engine = FakeEngine(max_num_running=2 * NUM_SLOTS, num_slots=NUM_SLOTS, latency_seconds=11)
    workers: list[CbqWorker] = []
    first = threading.Thread(target=_run, args=(redis_server.connect(), first_engine, workers), daemon=True)
    first.start()
    wait_until(lambda: store.get_status(conn, batch_id).num_running > 0)
    time.sleep(JOIN_AFTER_SECONDS)
    joined_at = time.monotonic()
    second_engine = FakeEngine(max_num_running=2 * NUM_SLOTS, num_slots=NUM_SLOTS, latency_seconds=1)
    second = threading.Thread(target=_run, args=(redis_server.connect(), second_engine, workers), daemon=True)
    second.start()
    wait_until(lambda: second_engine.num_added > 0, timeout=5)
    assert time.monotonic() - joined_at < 2, "the second worker waited for work"
    first.join(60)
    second.join(60)
    assert not first.is_alive() and not second.is_alive()
    assert_exactly_once(conn, batch_id, 2 * NUM_SLOTS)
    num_first, num_second = (w.num_requests_finished for w in workers)
    assert num_first >= NUM_SLOTS and num_second > 0 and num_first + num_second == 2 * NUM_SLOTS, (
        num_first,
        num_second,
    )
