"""Orphaned chunk jobs: chunk jobs of an unfinished batch that nothing will run again, so that the batch would
wait forever. Owns the orphan sweep and its keys (`cbq:orphans:{queue}:*`). Two kinds:

- QUEUED or STARTED, and yet in none of the places from which anything runs them again: their queue, its
  intermediate list, its StartedJobRegistry.
- FINISHED, while some of their requests have no result.

Every transition of a chunk job keeps it in one of those places, each in one transaction: submit, the dequeue
(`worker.lost_dequeues.take_next` moves it into the intermediate list), the admission (registered before it
leaves the list), rq's success and failure handlers and its cleanup of abandoned jobs, the requeue of lost
dequeues, `cbq cancel` and the quarantine. And a chunk is finished only after all its results are written
(`worker.result_writer` writes them, then hands the chunk to rq). So an orphan is the trace of something outside
that design: a write Redis acknowledged and then lost (a server without `appendfsync always`, a failover to a
replica that had not received it: a lost result write whose chunk's completion came after, on the new primary,
leaves the second kind), an rq path cbq does not know, a person's `LREM` or `HDEL`, or a bug. Issue 31's soak
lost one 15-request chunk to such a path (rq popped jobs with plain LPOPs over several queues; a worker killed
after the pop held the job alone). Nothing in rq ever looks at a job in none of its lists, nor at a finished
one again, and the batch waited forever.

The sweep is the net under all of them. At most once per `every_seconds` per queue (whichever worker comes
first), it lists the chunk jobs of the unfinished batches whose origin is the queue, and takes a snapshot of
the queue, its intermediate list and its registry, and of the finished jobs' results. A job found orphaned is
noted (`seen`, with the time); one still orphaned `grace_seconds` later is put back at the head of its queue,
QUEUED, in one WATCHed transaction that checks again that it is an orphan. Its requests already written are
skipped by whoever runs it (the results are written once per request), so a needless requeue costs time, never
a duplicate.
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
FINISHED = JobStatus.FINISHED.value.encode()
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
        if job_id not in seen or now - seen[job_id] < grace_seconds:
            continue
        if why := requeue_orphan(conn, queue, job_id):
            conn.hdel(seen_key, job_id)
            requeued.append(job_id)
            log.warning("chunk job %s %s for %.0f s (an orphan); requeued", job_id, why, now - seen[job_id])
    return requeued


def find_orphans(conn: redis.Redis, queue: Queue) -> list[str]:
    """The chunk jobs of unfinished batches, from `queue`, that are QUEUED or STARTED and in neither the queue,
    its intermediate list nor its StartedJobRegistry, or FINISHED with requests that have no result (statuses,
    the snapshot of the three and the results are read apart: a job that ends meanwhile can show up here once;
    `sweep_orphans` waits for a second sighting)."""
    batch_ids = _texts(conn.zrange(keys.BATCHES, 0, -1))
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in batch_ids:
            pipe.hget(keys.batch(batch_id), BatchField.NUM_REQUESTS.value)
            pipe.hlen(keys.batch_results(batch_id))  # one field per request written: exact, unlike counters
        replies = pipe.execute()
    unfinished = {
        b: int(total)
        for b, total, written in zip(batch_ids, replies[0::2], replies[1::2], strict=True)
        if _is_below(written, total)
    }
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in unfinished:
            pipe.hgetall(keys.batch_jobs(batch_id))
        ranges = {
            _text(job_id): (batch_id, _indices(_text(recorded), unfinished[batch_id]))
            for batch_id, chunks in zip(unfinished, pipe.execute(), strict=True)
            for job_id, recorded in cast("dict[bytes, bytes]", chunks).items()
        }
    job_ids = list(ranges)
    with conn.pipeline(transaction=False) as pipe:
        for job_id in job_ids:
            pipe.hmget(Job.key_for(job_id), ["status", "origin"])
        fields = pipe.execute()
    origin = queue.name.encode()
    ours = [(j, status) for j, (status, o) in zip(job_ids, fields, strict=True) if o == origin]
    waiting = [j for j, status in ours if status in WAITING]
    finished = [j for j, status in ours if status == FINISHED]
    orphans = []
    if waiting:
        with conn.pipeline(transaction=True) as pipe:  # one instant of all three
            pipe.lrange(queue.key, 0, -1)
            pipe.lrange(queue.intermediate_queue_key, 0, -1)
            pipe.zrange(queue.started_job_registry.key, 0, -1)
            queued, taken, started = pipe.execute()
        held = {*_texts(queued), *_texts(taken), *(parse_composite_key(entry)[0] for entry in _texts(started))}
        orphans += [job_id for job_id in waiting if job_id not in held]
    if finished:  # read after the statuses: a chunk finishes only once its results are written
        batches_of_finished = sorted({ranges[job_id][0] for job_id in finished})
        with conn.pipeline(transaction=False) as pipe:
            for batch_id in batches_of_finished:
                pipe.hkeys(keys.batch_results(batch_id))
            written = {
                batch_id: {_text(index) for index in indices}
                for batch_id, indices in zip(batches_of_finished, pipe.execute(), strict=True)
            }
        for job_id in finished:
            batch_id, indices = ranges[job_id]
            if any(str(index) not in written[batch_id] for index in indices):
                orphans.append(job_id)
    return orphans


def requeue_orphan(conn: redis.Redis, queue: Queue, job_id: str) -> str | None:
    """Put `job_id` back at the head of `queue`, QUEUED, if it still is an orphan: QUEUED or STARTED and in none
    of the queue, its intermediate list and its registry, or FINISHED with requests that have no result; the job
    and the lists read under WATCH, so nothing can take it meanwhile. Returns what made it an orphan (for the
    log), None when it was not requeued."""
    job_key = Job.key_for(job_id)
    batch_id = keys.batch_of_chunk_job(job_id)
    with conn.pipeline(transaction=True) as pipe:
        try:
            if batch_id is None:
                return None
            # Not the results hash: the batch's other chunks write it all the time, and this would rarely get
            # through. A result that lands meanwhile makes the requeue needless, which costs a run that skips it.
            pipe.watch(job_key, queue.key, queue.intermediate_queue_key, queue.started_job_registry.key)
            status = pipe.hget(job_key, "status")
            if status == FINISHED:
                recorded = cast("bytes | None", pipe.hget(keys.batch_jobs(batch_id), job_id))
                total = cast("bytes | None", pipe.hget(keys.batch(batch_id), BatchField.NUM_REQUESTS.value))
                indices = _indices(_text(recorded or b""), int(total) if total and _is_below(0, total) else 0)
                results_key = keys.batch_results(batch_id)
                results = cast("list[bytes | None]", pipe.hmget(results_key, indices)) if indices else []
                if not (missing := sum(1 for result in results if result is None)):
                    return None
                why = f"was finished with {missing} of its {len(indices)} requests without a result"
            elif status in WAITING:
                if pipe.lpos(queue.key, job_id) is not None:
                    return None
                if pipe.lpos(queue.intermediate_queue_key, job_id) is not None:
                    return None
                started = _texts(pipe.zrange(queue.started_job_registry.key, 0, -1))
                if any(parse_composite_key(entry)[0] == job_id for entry in started):
                    return None
                why = "was in no queue, list or registry"
            else:
                return None
            pipe.multi()
            pipe.hset(job_key, "status", JobStatus.QUEUED.value)
            pipe.zrem(queue.finished_job_registry.key, job_id)  # rq adds it again when it finishes
            pipe.lpush(queue.key, job_id)
            pipe.execute()
            return why
        except redis.WatchError:  # something moved meanwhile: the next sweep looks again
            return None


def _indices(recorded: str, num_requests: int) -> range:
    """The request indices of a chunk's recorded "start:stop" (within the batch's `num_requests`); empty when it
    does not parse (anything in Redis may be forged; such a chunk is left alone)."""
    start, _, stop = recorded.partition(":")
    if not (start.isdigit() and stop.isdigit()):
        return range(0)
    return range(int(start), min(int(stop), num_requests))


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
