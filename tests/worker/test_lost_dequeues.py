"""A dequeue whose reply was lost (Redis died between executing the LMOVE and answering): the job sits in rq's
intermediate list, QUEUED, held by no worker. It must run again soon, without costing a retry."""

from __future__ import annotations

import datetime
import json
import signal
import time

import pytest
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.job import Job, JobStatus
from rq.serializers import JSONSerializer

from producer import store
from worker.fake_engine import FakeEngine
from worker.lost_dequeues import requeue_lost_dequeues
from worker.queue_worker import CbqWorker
from worker.rq_classes import CbqJob, CbqQueue


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


# Issue 31: a `cbq worker` listens on two queues (its model's and the shared one). rq pops from several queues
# with plain LPOPs, and a job popped that way by a worker SIGKILLed before it registered the job (or whose
# reply was lost) was in no list and no registry: never run again (the soak lost one 15-request chunk so).
TWO_QUEUES = ("cbq:fake", "cbq")


def worker_dequeue(conn, names=TWO_QUEUES):
    """The dequeue of a worker listening on `names`, as `worker.job_quarantine.dequeue_decodable` makes it."""
    queues = [CbqQueue(name, connection=conn, serializer=JSONSerializer) for name in names]
    return CbqQueue.dequeue_any(queues, None, connection=conn, job_class=CbqJob, serializer=JSONSerializer)


def test_a_dequeue_over_several_queues_leaves_the_job_in_the_intermediate_list(conn, cbq, write_jsonl):
    submit(cbq, write_jsonl, 8)
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    first = queue.job_ids[0]
    taken = worker_dequeue(conn)
    assert taken is not None
    job, from_queue = taken
    assert (job.id, from_queue.name) == (first, "cbq")
    # Until the worker registers it, the job is where maintenance looks, not only in the worker's memory.
    assert conn.lrange(queue.intermediate_queue_key, 0, -1) == [first.encode()]
    assert conn.llen(CbqQueue("cbq:fake", connection=conn).intermediate_queue_key) == 0


def test_the_first_of_several_queues_goes_first(conn):
    for name, job_id in (("cbq", "shared"), ("cbq:fake", "model")):
        Queue(name, connection=conn, serializer=JSONSerializer).enqueue_call(
            "worker.chunk_job.run_chunk", kwargs={}, job_id=job_id
        )
    assert [worker_dequeue(conn)[0].id for _ in range(2)] == ["model", "shared"]  # type: ignore[index]
    assert worker_dequeue(conn) is None


def test_a_blocking_dequeue_over_several_queues_times_out_like_rqs(conn):
    queues = [CbqQueue(name, connection=conn, serializer=JSONSerializer) for name in TWO_QUEUES]
    started = time.monotonic()
    with pytest.raises(DequeueTimeout):
        CbqQueue.dequeue_any(queues, 1, connection=conn, job_class=CbqJob, serializer=JSONSerializer)
    assert 0.9 < time.monotonic() - started < 3


def test_a_worker_killed_between_dequeue_and_registration_loses_no_chunk(conn, cbq, write_jsonl):
    batch_id = submit(cbq, write_jsonl, 12)
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    taken = worker_dequeue(conn)  # ... and the worker is SIGKILLed before it registers the job
    assert taken is not None
    lost_job = taken[0].id
    # The next workers' maintenance: first sighting, then the job is put back (a grace period of 0 here).
    assert requeue_lost_dequeues(conn, queue, stuck_after=0) == []
    assert requeue_lost_dequeues(conn, queue, stuck_after=0) == [lost_job]
    run_burst_worker_on(conn, TWO_QUEUES)
    status = store.get_status(conn, batch_id)
    assert status.is_done and status.num_completed == 12 and status.num_failed == 0


def run_burst_worker_on(conn, names) -> None:
    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    worker = CbqWorker(list(names), FakeEngine(), connection=conn, model_name="fake")
    try:
        worker.work(burst=True, logging_level="WARNING")
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_a_sighting_of_an_earlier_stay_in_the_intermediate_list_does_not_count(conn, cbq, write_jsonl, burst_worker):
    """Maintenance saw the job in the instant between a dequeue and its registration (the clock starts); the
    job ran, and later passes through the list again (a retry). That stay's clock starts afresh: the job is
    not pushed back while a worker admits it, which would run it twice."""
    submit(cbq, write_jsonl, 4)
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    job_id = lose_one_dequeue(conn, queue)
    assert requeue_lost_dequeues(conn, queue, stuck_after=30) == []  # the sighting, in that instant
    conn.set(queue.intermediate_queue.get_first_seen_key(job_id), time.time() - 60)  # ... a minute ago
    conn.lrem(queue.intermediate_queue_key, 0, job_id)
    conn.lpush(queue.key, job_id)
    burst_worker()  # a worker takes it and runs it
    # Retried later: queued again, and a worker has just dequeued it.
    Job.fetch(job_id, connection=conn, serializer=JSONSerializer).set_status(JobStatus.QUEUED)
    conn.rpush(queue.key, job_id)
    lose_one_dequeue(conn, queue)
    assert requeue_lost_dequeues(conn, queue, stuck_after=30) == []
    assert queue.count == 0


@pytest.mark.parametrize("worker_died", [False, True])
def test_the_requeue_log_says_whether_a_worker_died_or_a_reply_was_lost(
    conn, cbq, write_jsonl, caplog, worker_died
):
    """Issue 44, item 6: the log blamed Redis for every lost dequeue, also when a worker was killed."""
    import logging

    from rq.utils import now as rq_now
    from rq.utils import utcformat

    submit(cbq, write_jsonl, 8)
    queue = Queue("cbq", connection=conn, serializer=JSONSerializer)
    worker = CbqWorker(["cbq"], FakeEngine(), connection=conn, name="w-one")
    worker.register_birth()
    worker.heartbeat()
    if worker_died:  # killed as it took the job: it stopped heartbeating then
        conn.hset(worker.key, "last_heartbeat", utcformat(rq_now() - datetime.timedelta(minutes=5)))
    job_id = lose_one_dequeue(conn, queue)
    long_ago = (rq_now() - datetime.timedelta(minutes=5)).timestamp()
    conn.set(queue.intermediate_queue.get_first_seen_key(job_id), long_ago)
    with caplog.at_level(logging.WARNING, logger="worker.lost_dequeues"):
        assert requeue_lost_dequeues(conn, queue, stuck_after=60) == [job_id]
    expected = "w-one stopped heartbeating" if worker_died else "Redis's reply to the dequeue was lost"
    assert expected in caplog.text, caplog.text
