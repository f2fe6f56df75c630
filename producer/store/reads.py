"""Reading batches back: status, results in input order, listings of batches and workers.

Owns the read side of the store. Counts come from the batch counters, plus requests that no one will ever
finish: those of chunk jobs that rq failed for good (e.g. a worker died and retries ran out), and, in a
cancelled batch, those whose chunk is on no live worker. They have no result record, so they are derived here
at read time from the chunk jobs' rq status.

A chunk is on a live worker while its execution in rq's StartedJobRegistry has not expired (workers renew it
with heartbeats). Requests of a chunk whose worker stopped heartbeating are "stalled": they wait for rq's
cleanup to re-enqueue them, and no ETA is given meanwhile.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterator

import redis
from pydantic import BaseModel
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import parse_composite_key

from schemas import keys
from schemas.keys import BatchField
from schemas.request import Request
from schemas.result import (
    OUTCOME_OF_REASON,
    OUTCOMES,
    OUTPUT_FORMATS,
    FinishReason,
    OpenAIBatchOutputLine,
    Outcome,
    ResultLine,
    merge_choice_group,
    to_openai_output,
)
from schemas.status import BatchStatus, WorkerStats

PAGE_SIZE = 1000


class BatchNotFound(LookupError):
    def __init__(self, batch_id: str):
        super().__init__(f"no batch {batch_id!r} (never submitted, or its results expired)")


class BatchNotFinished(RuntimeError):
    def __init__(self, status: BatchStatus):
        self.status = status
        pending = status.num_queued + status.num_running
        super().__init__(f"batch {status.batch_id} has {pending} unfinished requests")


def read_meta(conn: redis.Redis, batch_id: str) -> dict[str, str]:
    raw = conn.hgetall(keys.batch(batch_id))
    if not raw:
        raise BatchNotFound(batch_id)
    return {k.decode(): v.decode() for k, v in raw.items()}


def get_status(conn: redis.Redis, batch_id: str) -> BatchStatus:
    meta = read_meta(conn, batch_id)
    total = int(meta[BatchField.NUM_REQUESTS.value])
    counts = _recorded_outcomes(meta)
    lost = {} if counts.total() >= total else find_lost_requests(conn, batch_id, meta)
    counts.update(OUTCOME_OF_REASON[reason] for reason, _ in lost.values())
    completed, failed, cancelled = counts["completed"], counts["failed"], counts["cancelled"]
    unfinished = total - counts.total()
    running, stalled = _running_requests(conn, batch_id, meta[BatchField.QUEUE.value])
    running = min(running, unfinished)
    stalled = min(stalled, unfinished - running)

    first_started_at = _float_or_none(meta.get(BatchField.FIRST_STARTED_AT.value))
    last_finished_at = _float_or_none(meta.get(BatchField.LAST_FINISHED_AT.value))
    num_finished = total - unfinished
    end = last_finished_at if unfinished == 0 else time.time()
    elapsed_seconds = (end - first_started_at) if first_started_at and end else 0.0
    completion_tokens = int(meta.get(BatchField.COMPLETION_TOKENS.value, 0))
    rate = num_finished / elapsed_seconds if elapsed_seconds > 0 else 0.0
    if unfinished == 0:
        eta_seconds: float | None = 0.0
    elif rate > 0 and not stalled:
        eta_seconds = unfinished / rate
    else:
        eta_seconds = None  # no rate yet, or some requests wait for a dead worker's chunks to come back
    model = meta.get(BatchField.ROUTED_MODEL.value)
    num_model_workers = None
    if model and unfinished:
        num_model_workers = sum(worker.model == model for worker in list_workers(conn))
    return BatchStatus(
        batch_id=batch_id,
        name=meta.get(BatchField.NAME.value),
        queue=meta[BatchField.QUEUE.value],
        model=model,
        num_model_workers=num_model_workers,
        created_at=float(meta[BatchField.CREATED_AT.value]),
        first_started_at=first_started_at,
        last_finished_at=last_finished_at,
        cancelled_at=_float_or_none(meta.get(BatchField.CANCELLED_AT.value)),
        num_total=total,
        num_queued=unfinished - running,
        num_running=running,
        num_stalled=stalled,
        num_completed=completed,
        num_failed=failed,
        num_cancelled=cancelled,
        prompt_tokens=int(meta.get(BatchField.PROMPT_TOKENS.value, 0)),
        completion_tokens=completion_tokens,
        gpu_seconds=float(meta.get(BatchField.GPU_SECONDS.value, 0.0)),
        requests_per_second=rate,
        completion_tokens_per_second=completion_tokens / elapsed_seconds if elapsed_seconds > 0 else 0.0,
        eta_seconds=eta_seconds,
    )


def _running_requests(conn: redis.Redis, batch_id: str, queue: str) -> tuple[int, int]:
    """(requests inside a live worker's engine, requests of chunks whose worker stopped heartbeating).

    Entries of chunks that ended without their worker removing them (rq's cleanup failed them for good) are
    removed here; entries of chunks re-enqueued and not yet taken again count as neither (they are queued).
    """
    table = {job_id.decode(): int(n) for job_id, n in conn.hgetall(keys.batch_running(batch_id)).items()}
    if not table:
        return 0, 0
    with conn.pipeline(transaction=False) as pipe:
        for job_id in table:
            pipe.hget(Job.key_for(job_id), "status")
        statuses = pipe.execute()
    live = _live_job_ids(conn, queue)
    running = stalled = 0
    ended = []
    started, waiting = JobStatus.STARTED.value, {JobStatus.QUEUED.value, JobStatus.SCHEDULED.value}
    for (job_id, num), raw_status in zip(table.items(), statuses, strict=True):
        status = raw_status.decode() if raw_status is not None else None
        if status == started:
            if job_id in live:
                running += max(0, num)
            else:
                stalled += max(0, num)
        elif status not in waiting:
            ended.append(job_id)
    if ended:
        conn.hdel(keys.batch_running(batch_id), *ended)
    return running, stalled


def _live_job_ids(conn: redis.Redis, queue: str) -> set[str]:
    """Jobs of `queue` with an unexpired execution in rq's StartedJobRegistry (a worker heartbeats them)."""
    registry_key = StartedJobRegistry(queue, connection=conn).key
    entries = conn.zrangebyscore(registry_key, time.time(), "+inf")
    return {parse_composite_key(entry.decode())[0] for entry in entries}


_LOST_STATUSES = {
    JobStatus.FAILED.value: "error",
    JobStatus.STOPPED.value: "cancelled",
    JobStatus.CANCELED.value: "cancelled",
    None: "error",  # the job hash is gone: deleted (`rq empty`, the failed registry) or expired
}


def find_lost_requests(
    conn: redis.Redis, batch_id: str, meta: dict[str, str] | None = None
) -> dict[int, tuple[FinishReason, str]]:
    """Unfinished requests that no worker will finish: index -> (finish_reason, message). Those of chunk jobs
    rq ended for good, and, once the batch is cancelled, those of chunks on no live worker (a worker that
    takes such a chunk again writes them as cancelled)."""
    meta = meta if meta is not None else read_meta(conn, batch_id)
    is_cancelled = BatchField.CANCELLED_AT.value in meta
    ranges = chunk_ranges(conn, batch_id)
    with conn.pipeline(transaction=False) as pipe:
        for job_id in ranges:
            pipe.hget(Job.key_for(job_id), "status")
        statuses = [s.decode() if s is not None else None for s in pipe.execute()]
    queue = meta[BatchField.QUEUE.value]
    live = _live_job_ids(conn, queue) if is_cancelled else set()
    lost: dict[int, tuple[FinishReason, str]] = {}
    for (job_id, (start, stop)), status in zip(ranges.items(), statuses, strict=True):
        if status in _LOST_STATUSES:
            reason = _LOST_STATUSES[status]
        elif is_cancelled and _is_idle_chunk(conn, queue, job_id, status, live):
            reason = "cancelled"
        else:
            continue
        indices = list(range(start, stop))
        done = conn.hmget(keys.batch_results(batch_id), indices)
        missing = [i for i, raw in zip(indices, done, strict=True) if raw is None]
        if missing:
            message = _job_failure_message(conn, batch_id, job_id, status) if reason == "error" else "batch cancelled"
            lost.update({i: (reason, message) for i in missing})
    return lost


def _is_idle_chunk(conn: redis.Redis, queue: str, job_id: str, status: str | None, live: set[str]) -> bool:
    """The chunk is on no worker: started by one that stopped heartbeating, or back in the queue. (A chunk a
    worker has just popped, before it registers it, is neither: that worker writes it.)"""
    if status == JobStatus.STARTED.value:
        return job_id not in live
    if status == JobStatus.QUEUED.value:
        return conn.lpos(Queue(queue, connection=conn).key, job_id) is not None
    return False


def _job_failure_message(conn: redis.Redis, batch_id: str, job_id: str, status: str | None) -> str:
    if status is None:
        return _gone_job_message(conn, batch_id, job_id)
    reason = status
    try:
        latest = Job.fetch(job_id, connection=conn, serializer=JSONSerializer).latest_result()
        if latest is not None and latest.exc_string:
            reason = latest.exc_string.strip().splitlines()[-1]
    except Exception:  # the message is best effort; the count is what matters
        pass
    return f"chunk job {job_id} {status}: {reason}"


def _gone_job_message(conn: redis.Redis, batch_id: str, job_id: str) -> str:
    """Why a chunk job's hash is gone. It was created with the batch's TTL, so before that TTL has passed
    since the batch was created, it cannot have expired: someone deleted it."""
    created_at, ttl_seconds = conn.hmget(
        keys.batch(batch_id), [BatchField.CREATED_AT.value, BatchField.TTL_SECONDS.value]
    )
    if created_at is not None and ttl_seconds is not None:
        if time.time() - float(created_at) < int(ttl_seconds):
            return (
                f"chunk job {job_id} was deleted from Redis before a worker finished it (e.g. by `rq empty` "
                "or from rq's failed job registry); its unfinished requests will not run"
            )
    return f"chunk job {job_id} expired (its TTL ran out) before a worker ran it"


def iter_results(
    conn: redis.Redis, batch_id: str, output_format: str = "cbq", partial: bool = False
) -> Iterator[BaseModel]:
    """Results in input order: `ResultLine`s, or `OpenAIBatchOutputLine`s for output_format="openai".

    Raises BatchNotFinished unless every request finished; with partial=True, yields the finished ones only.
    """
    if output_format not in OUTPUT_FORMATS:
        raise ValueError(f"unknown output format {output_format!r}; expected one of {OUTPUT_FORMATS}")
    status = get_status(conn, batch_id)
    if not status.is_done and not partial:
        raise BatchNotFinished(status)
    meta = read_meta(conn, batch_id)
    lost = (
        find_lost_requests(conn, batch_id, meta)
        if _recorded_outcomes(meta).total() < status.num_total
        else {}
    )
    model = meta.get(BatchField.MODEL.value) or meta.get(BatchField.ROUTED_MODEL.value) or "cbq"
    created_at = int(float(meta[BatchField.CREATED_AT.value]))
    group: list[OpenAIBatchOutputLine | None] = []  # the prompts of a request with several, so far
    for page_start in range(0, status.num_total, PAGE_SIZE):
        indices = list(range(page_start, min(page_start + PAGE_SIZE, status.num_total)))
        raw_results = conn.hmget(keys.batch_results(batch_id), indices)
        need_requests = output_format == "openai" or any(i in lost for i in indices)
        raw_requests = (
            conn.hmget(keys.batch_requests(batch_id), indices) if need_requests else [None] * len(indices)
        )
        for index, raw_result, raw_request in zip(indices, raw_results, raw_requests, strict=True):
            request = Request.model_validate_json(raw_request) if raw_request is not None else None
            result: ResultLine | None = None
            if raw_result is not None:
                result = ResultLine.model_validate_json(raw_result)
            elif index in lost:
                reason, message = lost[index]
                custom_id = request.custom_id if request is not None else None
                error = message if reason == "error" else None
                result = ResultLine(custom_id=custom_id, index=index, finish_reason=reason, error=error)
            if output_format == "cbq":
                if result is not None:  # else still running (partial output)
                    yield result
                continue
            request = request or Request(index=index, line_no=1, shape="prompt", prompt="")
            line = to_openai_output(result, request, batch_id, model, created_at) if result is not None else None
            if request.choice_group is None:
                if line is not None:
                    yield line
                continue
            # One prompt of a request with several: its line comes once all its prompts have theirs.
            group.append(line)
            if request.choice_group.position == request.choice_group.size - 1:
                if len(group) == request.choice_group.size and None not in group:
                    yield merge_choice_group([g for g in group if g is not None], request.n)
                group = []


def list_batches(conn: redis.Redis, limit: int = 20) -> list[BatchStatus]:
    """The most recent batches first; forgets batches whose keys expired."""
    out = []
    for raw_id in conn.zrevrange(keys.BATCHES, 0, max(0, limit - 1)):
        batch_id = raw_id.decode()
        try:
            out.append(get_status(conn, batch_id))
        except BatchNotFound:
            conn.zrem(keys.BATCHES, batch_id)
    return out


def list_workers(conn: redis.Redis) -> list[WorkerStats]:
    """Workers that published stats recently; forgets those whose stats expired."""
    names = [n.decode() for n in conn.zrange(keys.WORKERS, 0, -1)]
    raw_stats = conn.mget([keys.worker_stats(n) for n in names]) if names else []
    out = []
    for name, raw in zip(names, raw_stats, strict=True):
        if raw is None:
            conn.zrem(keys.WORKERS, name)
        else:
            out.append(WorkerStats.model_validate_json(raw))
    return out


def chunk_ranges(conn: redis.Redis, batch_id: str) -> dict[str, tuple[int, int]]:
    """rq job id -> (start, stop) of the requests that chunk job carries."""
    ranges = {}
    for job_id, raw in conn.hgetall(keys.batch_jobs(batch_id)).items():
        start, stop = raw.decode().split(":")
        ranges[job_id.decode()] = (int(start), int(stop))
    return ranges


def _recorded_outcomes(meta: dict[str, str]) -> Counter[Outcome]:
    """The batch counters, by outcome (requests of failed chunk jobs are not in them: see find_lost_requests)."""
    return Counter({outcome: int(meta.get(BatchField.counter_of(outcome).value, 0)) for outcome in OUTCOMES})


def _float_or_none(value: str | None) -> float | None:
    return float(value) if value else None
