"""A dequeue whose reply was lost (Redis died between executing the LMOVE and answering): the job sits in rq's
intermediate list, QUEUED, held by no worker. It must run again soon, without costing a retry."""

from __future__ import annotations

import json
import time

from rq import Queue
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from producer import store
from worker.lost_dequeues import requeue_lost_dequeues


def submit(cbq, write_jsonl, n: int) -> str:
    path = write_jsonl([{"prompt": f"p{i}", "custom_id": f"c{i}"} for i in range(n)])
    return json.loads(cbq("submit", path, "--chunk-size", "4", "--retries", "0", "--json").stdout.splitlines()[-1])[
        "batch_id"
    ]


def lose_one_dequeue(conn, queue: Queue) -> str:
    """What the LMOVE of rq's dequeue leaves behind when its reply never arrives."""
    job_id = conn.lmove(queue.key, queue.intermediate_queue_key).decode()
    assert Job.fetch(job_id, connection=conn, serializer=JSONSerializer).get_status() == JobStatus.QUEUED
    return job_id


def test_a_lost_dequeue_goes_back_to_the_head_of_its_queue_after_the_grace_period(conn, cbq, write_jsonl):
    submit(cbq, write_jsonl, 12)
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    job_id = lose_one_dequeue(conn, queue)
    assert queue.count == 2

    assert requeue_lost_dequeues(conn, queue, stuck_after=0) == []  # first sighting starts the clock
    assert requeue_lost_dequeues(conn, queue, stuck_after=3600) == []  # still within the grace period
    assert requeue_lost_dequeues(conn, queue, stuck_after=0) == [job_id]
    assert queue.job_ids[0] == job_id and queue.count == 3
    assert conn.llen(queue.intermediate_queue_key) == 0
    assert requeue_lost_dequeues(conn, queue, stuck_after=0) == []  # nothing twice


def test_a_started_or_finished_job_in_the_intermediate_list_is_left_alone(conn, cbq, write_jsonl):
    submit(cbq, write_jsonl, 4)
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    job_id = lose_one_dequeue(conn, queue)
    job = Job.fetch(job_id, connection=conn, serializer=JSONSerializer)
    job.set_status(JobStatus.FINISHED)
    for _ in range(2):
        assert requeue_lost_dequeues(conn, queue, stuck_after=0) == []
    assert queue.count == 0


def test_a_worker_runs_the_lost_chunk_and_the_batch_completes_without_a_retry(conn, cbq, write_jsonl, burst_worker):
    batch_id = submit(cbq, write_jsonl, 12)
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    job_id = lose_one_dequeue(conn, queue)
    # An earlier maintenance round saw it a minute ago; this worker's first round puts it back.
    requeue_lost_dequeues(conn, queue, stuck_after=60)
    conn.set(queue.intermediate_queue.get_first_seen_key(job_id), time.time() - 60)
    burst_worker(stale_after_seconds=2, job_monitoring_interval=1)
    status = store.get_status(conn, batch_id)
    assert status.is_done and status.num_completed == 12 and status.num_failed == 0
