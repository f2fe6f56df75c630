"""Cancelling a batch. Owns the cancel flag and the hand-over of queued chunk jobs from the queue to cancel."""

from __future__ import annotations

import time
from dataclasses import dataclass

import redis
from rq import Queue
from rq.job import Job
from rq.serializers import JSONSerializer

from producer.store.reads import chunk_ranges, get_status, read_meta
from producer.store.writes import queue_results
from schemas import keys
from schemas.keys import BatchField
from schemas.request import Request
from schemas.result import ResultLine

CANCEL_ATTEMPTS = 20  # WATCH retries when workers keep dequeuing while cancel looks


@dataclass
class CancelReport:
    batch_id: str
    num_chunks_dequeued: int  # removed from the queue before any worker took them
    # Every request without a result when cancel ran: those of dequeued chunks, written as cancelled right
    # away, and `num_requests_aborting`, which workers hold (running, or waiting in their engine).
    num_requests_cancelled: int
    num_requests_aborting: int = 0
    already_finished: bool = False  # every request had its result: nothing was changed


def cancel_batch(conn: redis.Redis, batch_id: str) -> CancelReport:
    """Stop a batch: queued chunks never run, running requests are aborted by their workers.

    1. The cancel flag is set first, so a worker dequeuing a chunk from now on skips it.
    2. Chunk jobs still in the queue are taken out and their unfinished requests written as cancelled in ONE
       transaction, under WATCH of the queue: if a worker dequeues in between, the transaction is retried.
       So a chunk is owned either by a worker or by cancel, and a crash leaves nothing half-cancelled.
    """
    meta = read_meta(conn, batch_id)
    already_cancelled = BatchField.CANCELLED_AT.value in meta  # cancel again: complete what the first began
    if not already_cancelled and get_status(conn, batch_id).is_done:  # a finished batch stays as it ended
        return CancelReport(batch_id, 0, 0, already_finished=True)
    ttl_seconds = int(meta[BatchField.TTL_SECONDS.value])
    with conn.pipeline(transaction=True) as pipe:
        pipe.set(keys.batch_cancel(batch_id), "1", ex=ttl_seconds)
        pipe.hsetnx(keys.batch(batch_id), BatchField.CANCELLED_AT.value, repr(time.time()))
        pipe.execute()

    ranges = chunk_ranges(conn, batch_id)
    queue = Queue(meta[BatchField.QUEUE.value], connection=conn, serializer=JSONSerializer)
    for _ in range(CANCEL_ATTEMPTS):
        with conn.pipeline(transaction=True) as pipe:
            try:
                pipe.watch(queue.key)
                # errors="replace": a forged entry that is not UTF-8 is no chunk of a batch (a worker quarantines it)
                queued = {job_id.decode(errors="replace") for job_id in pipe.lrange(queue.key, 0, -1)}
                owned = [job_id for job_id in ranges if job_id in queued]
                if not owned:
                    return _with_aborting(conn, CancelReport(batch_id, 0, 0))
                results = _cancelled_results(conn, batch_id, [i for j in owned for i in range(*ranges[j])])
                jobs = [
                    j
                    for j in Job.fetch_many(owned, connection=conn, serializer=JSONSerializer)
                    if j is not None
                ]
                pipe.multi()
                for job_id in owned:
                    pipe.lrem(queue.key, 1, job_id)
                for job in jobs:
                    if not job.is_canceled:
                        job.cancel(pipeline=pipe)
                queue_results(pipe, batch_id, ttl_seconds, results)
                pipe.execute()
                return _with_aborting(conn, CancelReport(batch_id, len(owned), len(results)))
            except redis.WatchError:
                continue  # a worker took a chunk meanwhile: look again
    raise RuntimeError(f"could not cancel batch {batch_id}: the queue kept changing; run cancel again")


def _with_aborting(conn: redis.Redis, report: CancelReport) -> CancelReport:
    """`report` with the requests still without a result after the queued ones were written: the workers
    holding them abort them."""
    status = get_status(conn, report.batch_id)
    aborting = status.num_total - status.num_finished
    report.num_requests_aborting = aborting
    report.num_requests_cancelled += aborting
    return report


def _cancelled_results(conn: redis.Redis, batch_id: str, indices: list[int]) -> list[ResultLine]:
    """Cancelled result lines for the requests among `indices` that have no result yet."""
    done = conn.hmget(keys.batch_results(batch_id), indices)
    todo = [
        i for i, raw in zip(indices, done, strict=True) if raw is None
    ]  # a retried chunk may have finished some
    requests = conn.hmget(keys.batch_requests(batch_id), todo) if todo else []
    return [
        ResultLine(custom_id=_custom_id(raw), index=i, finish_reason="cancelled")
        for i, raw in zip(todo, requests, strict=True)
    ]


def _custom_id(raw_request: bytes | None) -> str | None:
    return Request.model_validate_json(raw_request).custom_id if raw_request is not None else None
