"""rq jobs a worker cannot decode or must not trust (issue 10, items 3 and 4): each lands in the
FailedJobRegistry with its reason, its requests count as failed with that reason, and the worker, and the
next one, carry on with the good batch. Real worker processes on a private redis-server."""

from __future__ import annotations

import json
import pickle
import signal
import zlib

from rq.job import Job
from rq.queue import Queue
from rq.serializers import JSONSerializer

from producer import store
from schemas import keys
from tests.reliability.conftest import (
    FAST_RECOVERY_FLAGS,
    SLOW_FAKE,
    assert_exactly_once,
    submit_prompts,
    wait_until,
)


def _payload(job: Job) -> list:
    return json.loads(zlib.decompress(job.connection.hget(job.key, "data")))


def _poison(conn, batch_id: str) -> dict[str, str]:
    """Corrupt the 7 chunk jobs of `batch_id`, each its own way; returns job id -> expected failure text."""
    jobs = [
        Job.fetch(keys.chunk_job_id(batch_id, c), connection=conn, serializer=JSONSerializer)
        for c in range(7)
    ]
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    func, instance, args, kwargs = _payload(jobs[0])
    expected = {}

    conn.hset(jobs[0].key, "data", zlib.compress(pickle.dumps((func, instance, args, kwargs))))
    expected[jobs[0].id] = "undecodable job data"
    conn.hset(jobs[1].key, "data", b"{not json")
    expected[jobs[1].id] = "undecodable job data"
    conn.hset(jobs[2].key, "created_at", "yesterday")
    expected[jobs[2].id] = "undecodable job data"
    conn.hset(jobs[3].key, "timeout", "soon")
    expected[jobs[3].id] = "undecodable job data"
    conn.hset(jobs[4].key, "status", "bogus")
    expected[jobs[4].id] = "undecodable job data"
    # A forged range: 10^9 requests in a batch of 70 (the old worker allocated for all of them).
    forged = [func, instance, args, {**_payload(jobs[5])[3], "start": 0, "stop": 10**9}]
    conn.hset(jobs[5].key, "data", zlib.compress(json.dumps(forged).encode()))
    expected[jobs[5].id] = "past the batch's 70 requests"
    # Abandoned by a dead worker with a bad created_at: rq's startup cleanup used to die on it, holding its lock.
    conn.lrem(queue.key, 0, jobs[6].id)
    conn.hset(jobs[6].key, mapping={"status": "started", "created_at": "not a date"})
    conn.zadd(queue.started_job_registry.key, {f"{jobs[6].id}:dead-execution": 1})
    expected[jobs[6].id] = "undecodable job data"
    return expected


def test_poison_jobs_fail_alone_with_their_reason(redis_server, start_worker, cbq, tmp_path):
    conn = redis_server.connect()
    poisoned = submit_prompts(cbq, tmp_path, 70, "--chunk-size", "10", "--retries", "0")
    expected = _poison(conn, poisoned)
    good = submit_prompts(cbq, tmp_path, 30, "--chunk-size", "10")

    worker = start_worker("--fake-engine", "--burst", *FAST_RECOVERY_FLAGS)
    assert worker.wait(30) == 0, worker.output()
    assert_exactly_once(conn, good, 30)

    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    assert sorted(queue.failed_job_registry.get_job_ids()) == sorted(expected)
    for job_id, text in expected.items():
        job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
        assert text in job.latest_result().exc_string, (job_id, job.latest_result().exc_string)
    assert not conn.exists(queue.registry_cleaning_key), "the cleanup lock was left behind"
    status = store.get_status(conn, poisoned)
    assert (status.num_failed, status.state) == (70, "done")
    errors = {line.error for line in store.iter_results(conn, poisoned)}
    assert all("undecodable job data" in e or "past the batch" in e for e in errors), errors

    # The next worker starts, cleans up and works as well.
    again = submit_prompts(cbq, tmp_path, 20, "--chunk-size", "10")
    successor = start_worker("--fake-engine", "--burst", *FAST_RECOVERY_FLAGS)
    assert successor.wait(30) == 0, successor.output()
    assert_exactly_once(conn, again, 20)


POISON_ENTRY = b"\xff\xfe not utf-8 \x80"


def test_a_non_utf8_queue_entry_is_quarantined_and_maintenance_goes_on(
    redis_server, start_worker, cbq, tmp_path
):
    """Issue 44, item 1: a non-UTF-8 entry on the queue list killed the worker that took it, and its id, left in
    the intermediate list, made every worker's maintenance fail: a dead worker's chunks were never cleaned up."""
    conn = redis_server.connect()
    batch_id = submit_prompts(cbq, tmp_path, 120, "--chunk-size", "10")
    first = start_worker(*SLOW_FAKE)
    second = start_worker(*SLOW_FAKE)
    wait_until(lambda: store.get_status(conn, batch_id).num_running >= 40, timeout=30)
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    conn.lpush(queue.key, POISON_ENTRY)
    conn.rpush(queue.key, POISON_ENTRY)
    # as left by a worker killed right after it moved the entry, and a forged abandoned execution
    conn.lpush(queue.intermediate_queue_key, b"\xfe moved")
    conn.zadd(queue.started_job_registry.key, {b"\xfe started:execution": 1})
    first.kill(signal.SIGKILL)  # its chunks wait for the abandoned-chunk cleanup of the other worker
    first.wait()
    wait_until(lambda: store.get_status(conn, batch_id).is_done, timeout=60, context=second.output)
    assert second.proc.poll() is None, second.output()
    assert_exactly_once(conn, batch_id, 120)
    assert conn.lrange(queue.key, 0, -1) == conn.lrange(queue.intermediate_queue_key, 0, -1) == []
    # The batch can finish (its requests' results written) before maintenance has reaped the killed worker's
    # abandoned executions (stale after 4 s; the cutoff is the cleaner's own last heartbeat): they must go.
    wait_until(
        lambda: conn.zrange(queue.started_job_registry.key, 0, -1) == [], timeout=30, context=second.output
    )
    placeholders = queue.failed_job_registry.get_job_ids()
    assert len(placeholders) == 3 and all(p.startswith("cbq-bad-id-") for p in placeholders), placeholders
    messages = [
        Job.fetch(p, connection=conn, serializer=JSONSerializer).latest_result().exc_string
        for p in placeholders
    ]
    assert all("not UTF-8" in m for m in messages), messages
    assert any(r"\xff\xfe not utf-8" in m for m in messages), messages
    assert "a queue entry rq rejects" in first.output() + second.output()
