"""Orphaned chunk jobs (issue 31, 44): of an unfinished batch, QUEUED or STARTED, in no queue, intermediate list or
started registry, or FINISHED with requests that have no result, as a write Redis lost or an unknown path leaves
them. Nothing in rq ever runs such a job; the sweep puts it back in its queue after a second sighting, and never
touches a job that something holds or a finished one whose results are all written."""

from __future__ import annotations

import json

import pytest
from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from producer import store
from schemas import keys
from tests.reliability.conftest import lose_result_write
from worker.orphans import find_orphans, requeue_orphan, sweep_orphans


def submit(cbq, write_jsonl, n: int) -> str:
    path = write_jsonl([{"prompt": f"p{i}", "custom_id": f"c{i}"} for i in range(n)])
    out = cbq("submit", path, "--chunk-size", "4", "--retries", "0", "--json")
    return json.loads(out.stdout.splitlines()[-1])["batch_id"]


def sweep(conn, queue, grace=0.0):
    conn.delete(keys.orphan_sweep(queue.name))  # not rate-limited here
    return sweep_orphans(conn, queue, "test", every_seconds=60, grace_seconds=grace)


@pytest.fixture
def queue(conn):
    return Queue("cbq", connection=conn, serializer=JSONSerializer)


def orphan_one(conn, queue, status=JobStatus.QUEUED) -> str:
    """Take the first chunk job out of every list, as a lost write would leave it."""
    job_id = queue.job_ids[0]
    conn.lrem(queue.key, 0, job_id)
    Job.fetch(job_id, connection=conn, serializer=JSONSerializer).set_status(status)
    return job_id


@pytest.mark.parametrize("status", [JobStatus.QUEUED, JobStatus.STARTED])
def test_an_orphan_goes_back_to_its_queue_on_the_second_sighting(conn, cbq, write_jsonl, queue, burst_worker, status):
    batch_id = submit(cbq, write_jsonl, 12)
    job_id = orphan_one(conn, queue, status)
    assert find_orphans(conn, queue) == [job_id]
    assert sweep(conn, queue) == []  # first sighting
    assert sweep(conn, queue) == [job_id]
    assert queue.job_ids[0] == job_id and queue.count == 3
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == JobStatus.QUEUED
    assert sweep(conn, queue) == [] and conn.hlen(keys.orphans_seen("cbq")) == 0  # nothing twice
    burst_worker()
    status_ = store.get_status(conn, batch_id)
    assert status_.is_done and status_.num_completed == 12 and status_.num_failed == 0


def test_the_grace_period_counts_from_the_first_sighting(conn, cbq, write_jsonl, queue):
    submit(cbq, write_jsonl, 8)
    job_id = orphan_one(conn, queue)
    assert sweep(conn, queue, grace=3600) == []
    assert sweep(conn, queue, grace=3600) == []
    conn.hset(keys.orphans_seen("cbq"), job_id, 0)  # first seen long ago
    assert sweep(conn, queue, grace=3600) == [job_id]


def test_a_job_found_again_meanwhile_is_forgotten(conn, cbq, write_jsonl, queue):
    submit(cbq, write_jsonl, 8)
    job_id = orphan_one(conn, queue)
    assert sweep(conn, queue) == []
    conn.rpush(queue.key, job_id)  # e.g. the write arrived after all
    assert sweep(conn, queue) == []
    assert conn.hlen(keys.orphans_seen("cbq")) == 0
    assert queue.job_ids.count(job_id) == 1


def test_jobs_something_holds_are_never_orphans(conn, cbq, write_jsonl, queue):
    batch_id = submit(cbq, write_jsonl, 16)  # 4 chunks
    queued, dequeued, started, finished = queue.job_ids
    conn.lmove(queue.key, queue.intermediate_queue_key)  # `dequeued`: in the intermediate list
    conn.lrem(queue.key, 0, started)
    conn.zadd(queue.started_job_registry.key, {f"{started}:exec1": 1})  # expired even: rq's cleanup's job
    Job.fetch(started, connection=conn, serializer=JSONSerializer).set_status(JobStatus.STARTED)
    conn.lrem(queue.key, 0, finished)
    Job.fetch(finished, connection=conn, serializer=JSONSerializer).set_status(JobStatus.FINISHED)
    conn.hset(keys.batch_results(batch_id), mapping={i: "{}" for i in range(12, 16)})  # its results, all
    assert find_orphans(conn, queue) == []
    for job_id in (queued, dequeued, started, finished):
        assert not requeue_orphan(conn, queue, job_id)


def test_finished_batches_and_other_queues_are_not_looked_at(conn, cbq, write_jsonl, queue):
    batch_id = submit(cbq, write_jsonl, 8)
    job_id = orphan_one(conn, queue)
    assert find_orphans(conn, Queue("other", connection=conn)) == []
    conn.hset(keys.batch_results(batch_id), mapping={i: "{}" for i in range(8)})  # every result written
    assert find_orphans(conn, queue) == []
    conn.hdel(keys.batch_results(batch_id), 0)
    assert find_orphans(conn, queue) == [job_id]


def test_sweeps_are_rate_limited_across_workers(conn, cbq, write_jsonl, queue):
    submit(cbq, write_jsonl, 8)
    job_id = orphan_one(conn, queue)
    assert sweep_orphans(conn, queue, "w1", every_seconds=60, grace_seconds=0) == []  # first sighting
    assert sweep_orphans(conn, queue, "w2", every_seconds=60, grace_seconds=0) == []  # too soon: no sweep
    conn.delete(keys.orphan_sweep("cbq"))
    assert sweep_orphans(conn, queue, "w2", every_seconds=60, grace_seconds=0) == [job_id]


def finish_first_chunk(conn, queue, burst_worker, batch_id) -> str:
    """Run the whole batch, then take the first chunk's second result away with its counters, as a result write
    that a failover lost while the chunk's completion reached the new primary would leave it."""
    job_id = queue.job_ids[0]
    burst_worker()
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == JobStatus.FINISHED
    lose_result_write(conn, batch_id, 1)
    return job_id



def test_a_finished_chunk_with_a_lost_result_runs_again_and_only_that_request(
    conn, cbq, write_jsonl, queue, burst_worker
):
    batch_id = submit(cbq, write_jsonl, 12)
    job_id = finish_first_chunk(conn, queue, burst_worker, batch_id)
    kept = conn.hget(keys.batch_results(batch_id), 0)
    assert find_orphans(conn, queue) == [job_id]
    assert sweep(conn, queue) == []  # first sighting
    assert sweep(conn, queue) == [job_id]
    assert queue.job_ids == [job_id]
    assert job_id not in queue.finished_job_registry.get_job_ids()
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == JobStatus.QUEUED
    burst_worker()
    status = store.get_status(conn, batch_id)
    assert status.is_done and status.num_completed == 12 and status.inconsistencies == []
    assert conn.hget(keys.batch_results(batch_id), 0) == kept  # written once: the re-run skipped it
    assert find_orphans(conn, queue) == [] and sweep(conn, queue) == []


def test_a_finished_chunk_whose_results_arrive_meanwhile_is_left_alone(
    conn, cbq, write_jsonl, queue, burst_worker
):
    batch_id = submit(cbq, write_jsonl, 8)
    job_id = finish_first_chunk(conn, queue, burst_worker, batch_id)
    assert sweep(conn, queue) == []
    conn.hset(keys.batch_results(batch_id), 1, "{}")  # the write arrived after all
    assert sweep(conn, queue) == [] and conn.hlen(keys.orphans_seen("cbq")) == 0
    assert requeue_orphan(conn, queue, job_id) is None and queue.count == 0


def test_a_forged_chunk_range_is_left_alone(conn, cbq, write_jsonl, queue, burst_worker):
    batch_id = submit(cbq, write_jsonl, 8)
    job_id = finish_first_chunk(conn, queue, burst_worker, batch_id)
    conn.hset(keys.batch_jobs(batch_id), job_id, "0:\xff")
    assert find_orphans(conn, queue) == []
    assert requeue_orphan(conn, queue, job_id) is None
