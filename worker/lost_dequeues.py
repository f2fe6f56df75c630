"""Dequeues that no crash can lose: every dequeue moves the job into rq's intermediate list, and jobs left
there by a dequeue whose worker never learnt of it go back to their queue. Owns nothing.

rq dequeues with LMOVE from a queue into its intermediate list only when a worker listens on one queue; over
several queues (a `cbq worker` listens on its model's queue and the shared one) it uses plain LPOPs. A job
popped that way is held by the popping worker's memory alone until that worker registers it: a worker
SIGKILLed in that instant, Redis killed after executing the LPOP but before replying, or a lost reply that
redis-py answers by re-sending the LPOP (popping a second job), leaves a QUEUED job in no queue, no
intermediate list and no registry, which nothing ever runs (issue 31: the soak lost one 15-request chunk this
way in one of two CI runs). So `take_next` always moves, whatever the number of queues (LMOVE needs Redis
6.2).

If the worker never registers a moved job (killed, or the reply lost), the id sits in the intermediate list
with the job still QUEUED. rq's own cleanup fails such a job after a minute (`Job was stuck in intermediate
queue`), which costs a retry, or the whole chunk where retries are off (`cbq run`). Seen in
`tests/reliability/test_redis_outage.py` about once in 40 runs: a batch stuck at 110 of 120 requests for that
minute.

Here a job is put back at the head of its queue instead, as if never dequeued, once it has sat in the
intermediate list, QUEUED and in no StartedJobRegistry, for `stuck_after` seconds (a live worker registers a
job it dequeued within milliseconds). The move is one WATCHed transaction, so two workers' cleanups cannot
both push it back.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from typing import cast

import redis
from rq import Queue
from rq.exceptions import DequeueTimeout
from rq.intermediate_queue import IntermediateQueue
from rq.job import Job, JobStatus
from rq.utils import now as rq_now
from rq.utils import utcparse
from rq.worker_registration import get_keys as worker_keys

log = logging.getLogger(__name__)
QUEUED = JobStatus.QUEUED.value.encode()
# A blocking dequeue over several queues blocks on the first for this long at a time, then looks at all of
# them again: Redis has no blocking move from several lists. A job on another queue waits at most this long.
BLOCK_SLICE_SECONDS = 0.2


class UndecodableEntry(ValueError):
    """A queue entry that is not UTF-8 text, so no job id at all (anyone who can write to Redis can push one).
    It was moved into the intermediate list like any other; `raw` is the entry as stored."""

    def __init__(self, queue_key: str, raw: bytes):
        super().__init__(f"the entry {raw[:80]!r} of {queue_key} is not UTF-8")
        self.queue_key = queue_key
        self.raw = raw


def take_next(conn: redis.Redis, queue_keys: Sequence[str], timeout: float | None) -> tuple[str, str] | None:
    """Move the next job id of the first non-empty queue of `queue_keys` (in order) into that queue's
    intermediate list; returns (queue key, job id). `timeout` None: return None at once when all are empty;
    else block up to `timeout` seconds, then raise rq's DequeueTimeout (as rq's dequeue does). An entry that
    is not UTF-8 raises UndecodableEntry once moved (`worker.job_quarantine` takes it out)."""
    if not queue_keys:
        return None
    deadline = None if timeout is None else time.monotonic() + timeout
    while True:
        for key in queue_keys:
            job_id = conn.lmove(key, IntermediateQueue.get_intermediate_queue_key(key))
            if job_id is not None:
                return key, _job_id(key, job_id)
        if deadline is None:
            return None
        left = deadline - time.monotonic()
        if left <= 0:
            raise DequeueTimeout(timeout, queue_keys)
        key = queue_keys[0]
        block = left if len(queue_keys) == 1 else min(left, BLOCK_SLICE_SECONDS)
        blocked_from = time.monotonic()
        # Redis takes fractional seconds (redis-py types it int)
        job_id = conn.blmove(key, IntermediateQueue.get_intermediate_queue_key(key), block)  # type: ignore[arg-type]
        if job_id is not None:
            return key, _job_id(key, job_id)
        # fakeredis answers BLMOVE at once instead of blocking: wait here rather than spin
        time.sleep(max(0.0, blocked_from + block - time.monotonic()))


def _job_id(queue_key: str, value: bytes | str) -> str:
    if isinstance(value, str):
        return value
    try:
        return value.decode()
    except UnicodeDecodeError:
        raise UndecodableEntry(queue_key, value) from None


def decodable_ids(raw_ids: Sequence[bytes]) -> list[str]:
    """The entries of a list that are UTF-8 text (the others are `worker.job_quarantine`'s to take out)."""
    ids = []
    for raw in raw_ids:
        try:
            ids.append(raw.decode())
        except UnicodeDecodeError:
            continue
    return ids


def forget_sighting(conn: redis.Redis, queue: Queue, job_id: str) -> None:
    """A worker registered `job_id`: clear the mark of a sighting in the intermediate list (maintenance may
    have seen it there in the instant between the dequeue and the registration). The mark outlives the stay
    otherwise (rq keeps it a day), and the next time the job passes through the list (a retry) it would count
    as stuck at once: put back in its queue while a worker admits it, and run twice."""
    conn.delete(queue.intermediate_queue.get_first_seen_key(job_id))


def requeue_lost_dequeues(conn: redis.Redis, queue: Queue, stuck_after: float) -> list[str]:
    """Put back at the head of `queue` the jobs lost between dequeue and reply. Returns their ids.

    The clock is rq's own first-sighting mark (`IntermediateQueue.set_first_seen`), which rq's cleanup
    reads too; it is cleared on the move, so a later loss of the same job starts a fresh grace period."""
    intermediate = queue.intermediate_queue
    requeued = []
    for job_id in decodable_ids(cast("list[bytes]", conn.lrange(queue.intermediate_queue_key, 0, -1))):
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
            cause = _cause(conn, queue, stuck_after)
            log.warning("job %s was dequeued and never registered (%s); requeued", job_id, cause)
    return requeued


def _cause(conn: redis.Redis, queue: Queue, stuck_after: float) -> str:
    """Why a dequeue was never followed up: a worker of the queue that stopped heartbeating (killed as it took
    the job) or, every worker being alive, a reply Redis never sent. A live worker heartbeats at least twice
    per --stale-after, and `stuck_after` is at most that."""
    silent = []
    for key in sorted(worker_keys(queue)):
        raw = cast("bytes | None", conn.hget(key, "last_heartbeat"))
        try:
            last = utcparse(raw.decode()) if raw is not None else None
        except (UnicodeDecodeError, ValueError):
            last = None
        if last is None or (rq_now() - last).total_seconds() > 0.75 * stuck_after:
            silent.append(key.rsplit(":", 1)[-1])
    if silent:
        return f"its worker was killed or stopped: {', '.join(silent[:3])} stopped heartbeating"
    return "every worker of the queue is alive: Redis's reply to the dequeue was lost"


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
