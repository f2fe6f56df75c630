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
from typing import TypeVar

import redis
from pydantic import BaseModel
from rq.job import Job, JobStatus
from rq.queue import Queue
from rq.registry import StartedJobRegistry
from rq.serializers import JSONSerializer
from rq.utils import parse_composite_key

from producer.store import marker
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
T = TypeVar("T")


class BatchNotFound(LookupError):
    def __init__(self, batch_id: str):
        super().__init__(f"no batch {batch_id!r} (never submitted, or its results expired)")


class StoreWiped(BatchNotFound):
    """The batch's keys are missing and so is the store marker: Redis lost its data."""

    def __init__(self, batch_id: str):
        LookupError.__init__(self, marker.wiped_line(batch_id))


class BatchNotFinished(RuntimeError):
    def __init__(self, status: BatchStatus):
        self.status = status
        pending = status.num_queued + status.num_running
        super().__init__(f"batch {status.batch_id} has {pending} unfinished requests")


def read_meta(conn: redis.Redis, batch_id: str) -> dict[str, str]:
    raw = conn.hgetall(keys.batch(batch_id))
    if not raw:
        # a wiped store and one never used look alike: only an id that submit could have made is taken as lost
        if keys.is_batch_id(batch_id) and marker.is_wiped(conn):
            raise StoreWiped(batch_id)
        raise BatchNotFound(batch_id)
    return {k.decode(errors="replace"): v.decode(errors="replace") for k, v in raw.items()}


def get_status(conn: redis.Redis, batch_id: str) -> BatchStatus:
    """The batch's counts, tokens, rate and ETA. Never fails on what it finds stored: a field that does not
    parse, counters that are negative or count more requests than the batch has (a write applied twice) are
    clamped, and each is named in `BatchStatus.inconsistencies`."""
    meta = read_meta(conn, batch_id)
    fields = _Fields(meta)
    total = fields.int(BatchField.NUM_REQUESTS)
    counts = _recorded_outcomes(meta, fields)
    lost = {} if counts.total() >= total else find_lost_requests(conn, batch_id, meta)
    counts.update(OUTCOME_OF_REASON[reason] for reason, _ in lost.values())
    tokens = {f: fields.int(f, default=0) for f in (BatchField.PROMPT_TOKENS, BatchField.COMPLETION_TOKENS)}
    if counts.total() > total:
        fields.issues.append(
            f"the counters record {counts.total()} finished requests of {total} "
            f"(completed {counts['completed']}, failed {counts['failed']}, cancelled {counts['cancelled']}, "
            f"prompt tokens {tokens[BatchField.PROMPT_TOKENS]}); counts and tokens shown are recounted from the "
            "result lines"
        )
        counts, tokens = _recount_from_lines(conn, batch_id, lost, fields.issues)
        counts = _clamped(counts, total)
    completed, failed, cancelled = counts["completed"], counts["failed"], counts["cancelled"]
    unfinished = total - counts.total()
    queue = meta.get(BatchField.QUEUE.value) or fields.missing(BatchField.QUEUE, "")
    running, stalled = _running_requests(conn, batch_id, queue, fields.issues) if queue else (0, 0)
    running = min(running, unfinished)
    stalled = min(stalled, unfinished - running)

    first_started_at = fields.float_or_none(BatchField.FIRST_STARTED_AT)
    last_finished_at = fields.float_or_none(BatchField.LAST_FINISHED_AT)
    num_finished = total - unfinished
    end = last_finished_at if unfinished == 0 else time.time()
    elapsed_seconds = (end - first_started_at) if first_started_at and end else 0.0
    completion_tokens = tokens[BatchField.COMPLETION_TOKENS]
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
        queue=queue,
        model=model,
        num_model_workers=num_model_workers,
        created_at=fields.float_or_none(BatchField.CREATED_AT) or fields.missing(BatchField.CREATED_AT, 0.0),
        first_started_at=first_started_at,
        last_finished_at=last_finished_at,
        cancelled_at=fields.float_or_none(BatchField.CANCELLED_AT),
        num_total=total,
        num_queued=unfinished - running,
        num_running=running,
        num_stalled=stalled,
        num_completed=completed,
        num_failed=failed,
        num_cancelled=cancelled,
        prompt_tokens=tokens[BatchField.PROMPT_TOKENS],
        completion_tokens=completion_tokens,
        gpu_seconds=fields.float_or_none(BatchField.GPU_SECONDS) or 0.0,
        requests_per_second=rate,
        completion_tokens_per_second=completion_tokens / elapsed_seconds if elapsed_seconds > 0 else 0.0,
        eta_seconds=eta_seconds,
        inconsistencies=fields.issues,
    )


class _Fields:
    """Typed reads of a batch hash that never raise: what is missing, malformed or negative reads as a default
    and is noted in `issues`."""

    def __init__(self, meta: dict[str, str]):
        self.meta = meta
        self.issues: list[str] = []

    def int(self, name: BatchField, default: int | None = None) -> int:
        raw = self.meta.get(name.value)
        if raw is None:
            return default if default is not None else self.missing(name, 0)
        try:
            value = int(raw)
        except ValueError:
            self.issues.append(f"{name.value} is {raw[:40]!r}, not an integer; read as 0")
            return 0
        if value < 0:
            self.issues.append(f"{name.value} is {value}; read as 0")
            return 0
        return value

    def float_or_none(self, name: BatchField) -> float | None:
        raw = self.meta.get(name.value)
        if not raw:
            return None
        try:
            return float(raw)
        except ValueError:
            self.issues.append(f"{name.value} is {raw[:40]!r}, not a number; ignored")
            return None

    def missing(self, name: BatchField, default: T) -> T:
        self.issues.append(f"the batch has no {name.value}")
        return default


def _recount_from_lines(
    conn: redis.Redis, batch_id: str, lost: dict[int, tuple[FinishReason, str]], issues: list[str]
) -> tuple[Counter[Outcome], dict[BatchField, int]]:
    """Outcomes and token sums from the stored result lines (and `lost` requests): what the counters should
    say. Reads every line, so it runs only when the counters are known to be wrong."""
    counts: Counter[Outcome] = Counter(OUTCOME_OF_REASON[reason] for reason, _ in lost.values())
    tokens = dict.fromkeys((BatchField.PROMPT_TOKENS, BatchField.COMPLETION_TOKENS), 0)
    num_unreadable = 0
    for raw in conn.hvals(keys.batch_results(batch_id)):
        try:
            line = ResultLine.model_validate_json(raw)
        except ValueError:
            num_unreadable += 1
            continue
        counts[OUTCOME_OF_REASON[line.finish_reason]] += 1
        tokens[BatchField.PROMPT_TOKENS] += line.usage.prompt_tokens
        tokens[BatchField.COMPLETION_TOKENS] += line.usage.completion_tokens
    if num_unreadable:
        issues.append(f"{num_unreadable} stored result lines are unreadable")
    return counts, tokens


def _clamped(counts: Counter[Outcome], total: int) -> Counter[Outcome]:
    """`counts` lowered to add up to `total`: the excess comes off completed first, then failed, cancelled."""
    excess = counts.total() - total
    out = Counter(counts)
    for outcome in ("completed", "failed", "cancelled"):
        cut = min(excess, out[outcome])
        out[outcome] -= cut
        excess -= cut
    return out


def _running_requests(conn: redis.Redis, batch_id: str, queue: str, issues: list[str]) -> tuple[int, int]:
    """(requests inside a live worker's engine, requests of chunks whose worker stopped heartbeating).

    Entries of chunks that ended without their worker removing them (rq's cleanup failed them for good) are
    removed here; entries of chunks re-enqueued and not yet taken again count as neither (they are queued).
    """
    table: dict[str, int] = {}
    for raw_job_id, raw_num in conn.hgetall(keys.batch_running(batch_id)).items():
        job_id = raw_job_id.decode(errors="replace")
        try:
            table[job_id] = int(raw_num)
        except ValueError:
            issues.append(f"the running table holds {raw_num[:40]!r} for job {job_id}; ignored")
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
    return {parse_composite_key(entry.decode(errors="replace"))[0] for entry in entries}


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


def cancelled_batch_ids(conn: redis.Redis, batch_ids: list[str]) -> list[str]:
    """The batches among `batch_ids` whose cancel flag is set (workers poll it to abort their chunks)."""
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in batch_ids:
            pipe.exists(keys.batch_cancel(batch_id))
        flags = pipe.execute()
    return [batch_id for batch_id, flag in zip(batch_ids, flags, strict=True) if flag]


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
    created_at = int(status.created_at)
    group: list[OpenAIBatchOutputLine | None] = []  # the prompts of a request with several, so far
    for page_start in range(0, status.num_total, PAGE_SIZE):
        indices = list(range(page_start, min(page_start + PAGE_SIZE, status.num_total)))
        raw_results = conn.hmget(keys.batch_results(batch_id), indices)
        need_requests = output_format == "openai" or any(i in lost for i in indices)
        raw_requests = (
            conn.hmget(keys.batch_requests(batch_id), indices) if need_requests else [None] * len(indices)
        )
        for index, raw_result, raw_request in zip(indices, raw_results, raw_requests, strict=True):
            request = _stored_request(raw_request)
            result: ResultLine | None = None
            if raw_result is not None:
                result = _stored_result(index, raw_result, request)
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


def _stored_request(raw: bytes | None) -> Request | None:
    try:
        return Request.model_validate_json(raw) if raw is not None else None
    except ValueError:  # only the custom_id and the OpenAI shape come from it: go without
        return None


def _stored_result(index: int, raw: bytes, request: Request | None) -> ResultLine:
    """The stored result line; one that does not parse reads as an error line saying so (never raises)."""
    try:
        return ResultLine.model_validate_json(raw)
    except ValueError as exc:
        custom_id = request.custom_id if request is not None else None
        message = f"the stored result is unreadable ({type(exc).__name__}: {str(exc).splitlines()[0][:200]})"
        return ResultLine(custom_id=custom_id, index=index, finish_reason="error", error=message)


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
    """Workers that published stats recently; forgets those whose stats expired. Stats that do not parse (not
    written by a cbq worker of this version) are left out, never raised."""
    names = [n.decode(errors="replace") for n in conn.zrange(keys.WORKERS, 0, -1)]
    raw_stats = conn.mget([keys.worker_stats(n) for n in names]) if names else []
    out = []
    for name, raw in zip(names, raw_stats, strict=True):
        if raw is None:
            conn.zrem(keys.WORKERS, name)
            continue
        try:
            out.append(WorkerStats.model_validate_json(raw))
        except ValueError:
            continue
    return out


def chunk_ranges(conn: redis.Redis, batch_id: str) -> dict[str, tuple[int, int]]:
    """rq job id -> (start, stop) of the requests that chunk job carries."""
    ranges = {}
    for job_id, raw in conn.hgetall(keys.batch_jobs(batch_id)).items():
        try:
            start, stop = raw.decode().split(":")
            ranges[job_id.decode()] = (int(start), int(stop))
        except ValueError:  # not written by submit: such a "chunk" has no requests of the batch
            continue
    return ranges


def _recorded_outcomes(meta: dict[str, str], fields: _Fields | None = None) -> Counter[Outcome]:
    """The batch counters, by outcome (requests of failed chunk jobs are not in them: see find_lost_requests)."""
    fields = fields or _Fields(meta)
    return Counter({outcome: fields.int(BatchField.counter_of(outcome), default=0) for outcome in OUTCOMES})

