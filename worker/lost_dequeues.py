"""Chunk jobs whose dequeue reached Redis but whose reply never reached a worker. Owns nothing.

rq dequeues with LMOVE from the queue into its intermediate list. If Redis dies after executing the LMOVE
(with `appendfsync always` it is on disk) but before the reply is sent, no worker knows it holds the job:
the id sits in the intermediate list with the job still QUEUED. rq's own cleanup fails such a job after a
minute (`Job was stuck in intermediate queue`), which costs a retry, or the whole chunk where retries are
off (`cbq run`). Seen in `tests/reliability/test_redis_outage.py` about once in 40 runs: a batch stuck at
110 of 120 requests for that minute.

Here a job is put back at the head of its queue instead, as if never dequeued, once it has sat in the
intermediate list, QUEUED and in no StartedJobRegistry, for `stuck_after` seconds (a live worker registers a
job it dequeued within milliseconds). The move is one WATCHed transaction, so two workers' cleanups cannot
both push it back.
"""

from __future__ import annotations

import logging

import redis
from rq import Queue
from rq.job import Job, JobStatus
from rq.utils import now as rq_now

log = logging.getLogger(__name__)
QUEUED = JobStatus.QUEUED.value.encode()


def requeue_lost_dequeues(conn: redis.Redis, queue: Queue, stuck_after: float) -> list[str]:
    """Put back at the head of `queue` the jobs lost between dequeue and reply. Returns their ids.

    The clock is rq's own first-sighting mark (`IntermediateQueue.set_first_seen`), which rq's cleanup
    reads too; it is cleared on the move, so a later loss of the same job starts a fresh grace period."""
    intermediate = queue.intermediate_queue
    requeued = []
    for job_id in intermediate.get_job_ids():
        if job_id in queue.started_job_registry or conn.hget(Job.key_for(job_id), "status") != QUEUED:
            continue
        if intermediate.set_first_seen(job_id):  # the first sighting starts the clock
            continue
        first_seen = intermediate.get_first_seen(job_id)
        if first_seen is not None and (rq_now() - first_seen).total_seconds() < stuck_after:
            continue
        if _move_back(conn, queue, job_id):
            conn.delete(intermediate.get_first_seen_key(job_id))
            requeued.append(job_id)
            log.warning("job %s was lost between its dequeue and the reply (Redis failed); requeued", job_id)
    return requeued


def _move_back(conn: redis.Redis, queue: Queue, job_id: str) -> bool:
    with conn.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(queue.intermediate_queue_key, queue.started_job_registry.key)
            if job_id.encode() not in pipe.lrange(queue.intermediate_queue_key, 0, -1):
                return False
            pipe.multi()
            pipe.lrem(queue.intermediate_queue_key, 1, job_id)
            pipe.lpush(queue.key, job_id)
            pipe.execute()
            return True
        except redis.WatchError:  # a worker dequeued or registered something meanwhile: next round
            return False
