"""Issue 10, items 7, 8 and 9: job timeouts count from a chunk's turn, the same chunk dequeued twice runs once,
a cold stop exits non-zero, and the store forgets what is gone (expired batches, chunks failed for good)."""

from __future__ import annotations

import math
import signal
import threading
import time

from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.serializers import JSONSerializer

from producer import store
from schemas import keys
from tests.reliability.conftest import FAST_RECOVERY_FLAGS, assert_exactly_once, submit_prompts, wait_until
from tests.worker.conftest import run_burst_worker
from worker.engine.api import EngineStats
from worker.fake_engine import FakeEngine
from worker.queue_worker import CbqWorker


class SlotEngine(FakeEngine):
    """Runs `num_slots` requests at a time in arrival order, each for `latency_seconds` from when it starts,
    like an engine that admits more than it can run: the rest wait inside it."""

    def __init__(self, num_slots: int, latency_seconds: float):
        super().__init__(max_num_running=2 * num_slots, latency_seconds=latency_seconds)
        self.num_slots = num_slots

    def add_request(self, req) -> None:
        super().add_request(req)
        with self._lock:
            self._pending[req.request_id].ready_at = math.inf  # not started yet

    def _collect_ready(self, now: float) -> None:
        for pending in list(self._pending.values())[: self.num_slots]:
            if pending.ready_at == math.inf:
                pending.ready_at = now + self.latency_seconds
        super()._collect_ready(now)

    def stats(self) -> EngineStats:
        with self._lock:
            return EngineStats(num_running=min(self.num_slots, len(self._pending)))


def test_a_job_timeout_counts_from_the_chunks_turn_not_its_admission(redis_server, cbq, tmp_path):
    """4 chunks of 5 are admitted at once into an engine that runs 5 requests at a time, 1 s each: the last
    chunk starts after 3 s. With --job-timeout 2 none of them runs long; the old clock failed chunks 3 and 4."""
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 20, "--chunk-size", "5", "--job-timeout", "2", "--retries", "0")
    engine = SlotEngine(num_slots=5, latency_seconds=1.0)
    engine.max_num_running = 20  # all four chunks admitted up front
    worker = run_burst_worker(conn, engine)
    assert worker.num_jobs_admitted == 4
    assert_exactly_once(conn, batch_id, 20)


def test_a_job_timeout_still_aborts_a_chunk_that_runs_too_long(redis_server, cbq, tmp_path):
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 5, "--chunk-size", "5", "--job-timeout", "1", "--retries", "0")
    run_burst_worker(conn, SlotEngine(num_slots=5, latency_seconds=30))
    status = store.get_status(conn, batch_id)
    assert (status.num_failed, status.state) == (5, "done")
    assert "chunk ran longer than 1 s" in next(store.iter_results(conn, batch_id)).error


def test_the_same_chunk_dequeued_again_while_it_runs_here_runs_once(redis_server, cbq, tmp_path):
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 10, "--chunk-size", "10")
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    job_id = keys.chunk_job_id(batch_id, 0)
    engine = FakeEngine(latency_seconds=1.5)
    worker = CbqWorker(["cbq"], engine, connection=conn, model_name="fake")
    thread = threading.Thread(target=worker.work, kwargs={"burst": True, "logging_level": "WARNING"})
    thread.start()
    wait_until(lambda: store.get_status(conn, batch_id).num_running == 10)
    queue.push_job_id(job_id)  # e.g. `rq requeue`, or a cleanup that took it for abandoned
    thread.join(timeout=20)
    assert not thread.is_alive(), "the worker hung"
    assert engine.num_added == 10, "a request ran twice"
    assert_exactly_once(conn, batch_id, 10)
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    assert job.get_status() == JobStatus.FINISHED
    assert conn.zcard(queue.started_job_registry.key) == 0, "an execution was left behind"


def test_a_cold_stop_exits_non_zero_and_hands_the_chunks_back(redis_server, start_worker, cbq, tmp_path):
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 20, "--chunk-size", "10")
    worker = start_worker("--fake-engine", "--fake-latency", "60", *FAST_RECOVERY_FLAGS)
    wait_until(lambda: store.get_status(conn, batch_id).num_running == 20)
    worker.kill(signal.SIGTERM)
    time.sleep(1.2)  # rq ignores a second signal within 1 s of the first
    worker.kill(signal.SIGTERM)
    assert worker.wait(20) == 1, worker.output()
    assert Queue("cbq", connection=conn, serializer=JSONSerializer).count == 2  # retried at once
    successor = start_worker("--fake-engine", "--burst", *FAST_RECOVERY_FLAGS)
    assert successor.wait(30) == 0
    assert_exactly_once(conn, batch_id, 20)


def test_chunks_failed_for_good_leave_no_running_count(redis_server, start_worker, cbq, tmp_path):
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 20, "--chunk-size", "10", "--retries", "0")
    worker = start_worker("--fake-engine", "--fake-latency", "60", *FAST_RECOVERY_FLAGS)
    wait_until(lambda: store.get_status(conn, batch_id).num_running == 20)
    worker.kill(signal.SIGKILL)
    worker.wait()
    time.sleep(4.5)  # stale
    cleaner = start_worker("--fake-engine", "--burst", *FAST_RECOVERY_FLAGS)
    assert cleaner.wait(30) == 0
    status = store.get_status(conn, batch_id)
    assert (status.num_failed, status.num_running, status.num_stalled, status.state) == (20, 0, 0, "done")
    assert conn.hlen(keys.batch_running(batch_id)) == 0


def test_the_batches_index_forgets_expired_batches(redis_server, cbq, tmp_path):
    conn = redis_server.connect()
    short_lived = submit_prompts(cbq, tmp_path, 2, "--ttl", "1")
    assert conn.zscore(keys.BATCHES, short_lived) is not None
    wait_until(lambda: not conn.exists(keys.batch(short_lived)), timeout=5)
    kept = submit_prompts(cbq, tmp_path, 3)
    assert conn.zrange(keys.BATCHES, 0, -1) == [kept.encode()]


def test_a_chunk_re_enqueued_from_under_its_worker_is_dropped_there_and_run_once_elsewhere(
    redis_server, cbq, tmp_path
):
    """What rq's cleanup does to a worker whose heartbeats were late (say, after a long Redis outage, if another
    worker cleaned up first): the worker finds, before it writes, that it no longer owns the chunk."""
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 10, "--chunk-size", "10")
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    job_id = keys.chunk_job_id(batch_id, 0)
    late = CbqWorker(["cbq"], FakeEngine(latency_seconds=1.0), connection=conn, model_name="late")
    thread = threading.Thread(
        target=late.work, kwargs={"burst": True, "logging_level": "WARNING", "max_jobs": 1}
    )
    thread.start()
    wait_until(lambda: store.get_status(conn, batch_id).num_running == 10)
    # rq's cleanup of an abandoned chunk: its execution leaves the registry, the job is queued again.
    conn.delete(queue.started_job_registry.key)
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    job.set_status(JobStatus.QUEUED)
    queue.push_job_id(job_id)
    thread.join(timeout=20)
    assert not thread.is_alive()
    assert late.num_requests_finished == 0, "the late worker wrote results of a chunk it no longer owned"
    other = FakeEngine()
    run_burst_worker(conn, other)
    assert other.num_added == 10
    assert_exactly_once(conn, batch_id, 10)
