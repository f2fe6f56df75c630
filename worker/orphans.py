"""Orphaned chunk jobs: of an unfinished batch, QUEUED or STARTED, and yet in none of the places from which
anything runs them again: their queue, its intermediate list, its StartedJobRegistry. Owns the orphan sweep
and its keys (`cbq:orphans:{queue}:*`).

Every transition of a chunk job keeps it in one of those places, each in one transaction: submit, the dequeue
(`worker.lost_dequeues.take_next` moves it into the intermediate list), the admission (registered before it
leaves the list), rq's success and failure handlers and its cleanup of abandoned jobs, the requeue of lost
dequeues, `cbq cancel` and the quarantine. So an orphan is the trace of something outside that design: a write
Redis acknowledged and then lost (a server without `appendfsync always`, a failover to a replica that had not
received it), an rq path cbq does not know, a person's `LREM`, or a bug. Issue 31's soak lost one 15-request
chunk to such a path (rq popped jobs with plain LPOPs over several queues; a worker killed after the pop held
the job alone). Nothing in rq ever looks at a job in none of its lists, and the batch waited forever.

The sweep is the net under all of them. At most once per `every_seconds` per queue (whichever worker comes
first), it lists the chunk jobs of the unfinished batches whose origin is the queue, and takes a snapshot of
the queue, its intermediate list and its registry. A job missing from all three is noted (`seen`, with the
time); one still missing `grace_seconds` later is put back at the head of its queue, QUEUED, in one WATCHed
transaction that checks again that it is nowhere. Its requests already written are skipped by whoever runs it
(the results are written once per request), so a needless requeue costs time, never a duplicate.
"""

from __future__ import annotations

import logging
import time
from typing import Any, cast

import redis
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.utils import parse_composite_key

from schemas import keys
from schemas.keys import BatchField

log = logging.getLogger(__name__)

WAITING = {JobStatus.QUEUED.value.encode(), JobStatus.STARTED.value.encode()}  # statuses someone must act on
SEEN_TTL_SECONDS = 24 * 3600


def sweep_orphans(
    conn: redis.Redis, queue: Queue, owner: str, every_seconds: float, grace_seconds: float
) -> list[str]:
    """Requeue `queue`'s orphaned chunk jobs seen orphaned at least `grace_seconds` ago; returns their ids.
    Does nothing if a sweep of `queue` (by any worker) started less than `every_seconds` ago."""
    if not conn.set(keys.orphan_sweep(queue.name), owner, nx=True, ex=max(1, int(every_seconds))):
        return []
    orphans = set(find_orphans(conn, queue))
    seen_key = keys.orphans_seen(queue.name)
    seen: dict[str, float] = {}
    for raw_id, raw_time in cast("dict[bytes, bytes]", conn.hgetall(seen_key)).items():
        try:
            seen[_text(raw_id)] = float(raw_time)
        except ValueError:
            seen[_text(raw_id)] = 0.0
    now = time.time()
    with conn.pipeline(transaction=False) as pipe:
        if gone := [job_id for job_id in seen if job_id not in orphans]:
            pipe.hdel(seen_key, *gone)
        if new := [job_id for job_id in orphans if job_id not in seen]:
            pipe.hset(seen_key, mapping={job_id: now for job_id in new})
            pipe.expire(seen_key, SEEN_TTL_SECONDS)
        pipe.execute()
    requeued = []
    for job_id in sorted(orphans):
        if job_id in seen and now - seen[job_id] >= grace_seconds and requeue_orphan(conn, queue, job_id):
            conn.hdel(seen_key, job_id)
            requeued.append(job_id)
            log.warning(
                "chunk job %s was in no queue, list or registry for %.0f s (an orphan); requeued",
                job_id,
                now - seen[job_id],
            )
    return requeued


def find_orphans(conn: redis.Redis, queue: Queue) -> list[str]:
    """The chunk jobs of unfinished batches, from `queue`, that are QUEUED or STARTED and in neither the queue,
    its intermediate list nor its StartedJobRegistry (statuses and the snapshot of the three are read apart: a
    job that ends meanwhile can show up here once; `sweep_orphans` waits for a second sighting)."""
    batch_ids = _texts(conn.zrange(keys.BATCHES, 0, -1))
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in batch_ids:
            pipe.hget(keys.batch(batch_id), BatchField.NUM_REQUESTS.value)
            pipe.hlen(keys.batch_results(batch_id))  # one field per request written: exact, unlike counters
        replies = pipe.execute()
    unfinished = [
        b for b, total, written in zip(batch_ids, replies[0::2], replies[1::2], strict=True) if _is_below(written, total)
    ]
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in unfinished:
            pipe.hkeys(keys.batch_jobs(batch_id))
        job_ids = [job_id for chunk_ids in pipe.execute() for job_id in _texts(chunk_ids)]
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hmget(Job.key_for(job_id), ["status", "origin"])
        fields = pipe.execute()
    origin = queue.name.encode()
    candidates = [j for j, (status, o) in zip(job_ids, fields, strict=True) if status in WAITING and o == origin]
    if not candidates:
        return []
    with conn.pipeline(transaction=True) as pipe:  # one instant of all three
        pipe.lrange(queue.key, 0, -1)
        pipe.lrange(queue.intermediate_queue_key, 0, -1)
        pipe.zrange(queue.started_job_registry.key, 0, -1)
        queued, taken, started = pipe.execute()
    held = {*_texts(queued), *_texts(taken)} | {parse_composite_key(entry)[0] for entry in _texts(started)}
    return [job_id for job_id in candidates if job_id not in held]


def requeue_orphan(conn: redis.Redis, queue: Queue, job_id: str) -> bool:
    """Put `job_id` back at the head of `queue`, QUEUED, if it is still QUEUED or STARTED and in none of the
    queue, its intermediate list and its registry; all read under WATCH, so nothing can take it meanwhile."""
    job_key = Job.key_for(job_id)
    with conn.pipeline(transaction=True) as pipe:
        try:
            pipe.watch(job_key, queue.key, queue.intermediate_queue_key, queue.started_job_registry.key)
            if pipe.hget(job_key, "status") not in WAITING:
                return False
            if pipe.lpos(queue.key, job_id) is not None or pipe.lpos(queue.intermediate_queue_key, job_id) is not None:
                return False
            started = _texts(pipe.zrange(queue.started_job_registry.key, 0, -1))
            if any(parse_composite_key(entry)[0] == job_id for entry in started):
                return False
            pipe.multi()
            pipe.hset(job_key, "status", JobStatus.QUEUED.value)
            pipe.lpush(queue.key, job_id)
            pipe.execute()
            return True
        except redis.WatchError:  # something moved meanwhile: the next sweep looks again
            return False


def _is_below(written: int, total: bytes | None) -> bool:
    """Whether fewer results are written than the batch has requests; False for a batch gone or unreadable."""
    try:
        return total is not None and written < int(total)
    except ValueError:
        return False


def _texts(raw: Any) -> list[str]:
    """Redis replies as text (anything in Redis may be forged: bytes that are not UTF-8 do not raise)."""
    return [_text(item) for item in cast("list[bytes | str]", raw)]


def _text(item: bytes | str) -> str:
    return item.decode(errors="replace") if isinstance(item, bytes) else item
