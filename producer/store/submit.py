"""Submitting a batch: validate every line, dedupe, then store requests and enqueue chunk jobs atomically.

Owns the write side of a batch's creation. Two phases, so a huge file never needs one huge transaction and
a crash leaves nothing visible:
1. staging: the normalized requests go to `cbq:batch:{id}:requests`, pipelined in slices. Nothing refers to
   that key yet, and it carries the result TTL, so an interrupted submit leaves only garbage that expires.
2. commit: one MULTI/EXEC writes the batch hash, the chunk table, the rq jobs and queue entries, the
   `--name` index and the batch list. Workers see all of the batch or none of it.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

import redis
from rq import Queue, Retry
from rq.serializers import JSONSerializer

from producer import settings
from schemas import keys
from schemas.chunk import CHUNK_FUNC
from schemas.errors import FieldIssue, RequestLineError
from schemas.keys import BatchField
from schemas.request import ParsedRequest, Request, SamplingOverrides, parse_request_line

STAGING_SLICE = 2000  # requests per staging pipeline: bounded client memory, few round trips
# Staged requests expire after this unless the commit comes (it sets the batch's TTL on every key), so even
# a submit killed with SIGKILL leaves nothing for long.
STAGING_TTL_SECONDS = 3600
FORGET_EXPIRED_LIMIT = 100  # oldest `cbq:batches` entries each submit checks for expiry


@dataclass
class ValidatedFile:
    requests: list[ParsedRequest] = field(default_factory=list)
    errors: list[RequestLineError] = field(default_factory=list)
    num_blank_lines: int = 0


def validate_lines(lines: Iterable[str | bytes], on_line: Callable[[], None] | None = None) -> ValidatedFile:
    """Parse every line (1-based line numbers) and flag duplicate custom_ids, naming both lines."""
    out = ValidatedFile()
    first_line_of: dict[str, int] = {}
    for line_no, text in enumerate(lines, start=1):
        if on_line is not None:
            on_line()
        try:
            parsed = parse_request_line(text, line_no)
        except RequestLineError as exc:
            out.errors.append(exc)
            continue
        if parsed is None:
            out.num_blank_lines += 1
            continue
        if parsed.custom_id is not None:
            first = first_line_of.setdefault(parsed.custom_id, line_no)
            if first != line_no:
                issue = FieldIssue(
                    "custom_id", f"duplicate custom_id {parsed.custom_id!r} (first on line {first})"
                )
                out.errors.append(RequestLineError(line_no, [issue]))
                continue
        out.requests.append(parsed)
    return out


@dataclass(frozen=True)
class SubmitOptions:
    queue: str
    name: str | None = None  # resubmissions with the same name skip custom_ids already submitted
    chunk_size: int = settings.DEFAULT_CHUNK_SIZE
    ttl_seconds: int = settings.DEFAULT_RESULT_TTL_SECONDS
    defaults: SamplingOverrides = field(default_factory=SamplingOverrides)
    return_token_ids: bool = False
    retries: int = settings.DEFAULT_RETRIES
    job_timeout_seconds: int = settings.NO_JOB_TIMEOUT  # or a positive number of seconds

    def __post_init__(self):
        if self.chunk_size < 1:
            raise ValueError(f"chunk_size must be >= 1, got {self.chunk_size}")
        if self.ttl_seconds < 1:
            raise ValueError(f"ttl_seconds must be >= 1, got {self.ttl_seconds}")
        if self.retries < 0:
            raise ValueError(f"retries must be >= 0, got {self.retries}")
        if self.job_timeout_seconds != settings.NO_JOB_TIMEOUT and self.job_timeout_seconds < 1:
            raise ValueError(
                f"job_timeout_seconds must be {settings.NO_JOB_TIMEOUT} (no limit) or >= 1, "
                f"got {self.job_timeout_seconds}"
            )


@dataclass
class SubmitReport:
    batch_id: str | None  # None when every request was already submitted under this name
    num_requests: int
    num_chunks: int
    skipped_custom_ids: list[str]  # already submitted under --name


class SubmitConflict(RuntimeError):
    """Another submit with the same --name committed in between; running the same command again is safe."""


class SubmitInterrupted(Exception):
    """Ctrl-C during a submit. Nothing was enqueued, unless the interrupt hit after the commit: then
    `batch_id` is the batch, complete."""

    def __init__(self, batch_id: str | None):
        self.batch_id = batch_id
        super().__init__(
            "interrupted; nothing was enqueued"
            if batch_id is None
            else f"interrupted after the batch was enqueued: {batch_id}"
        )


def submit_batch(
    conn: redis.Redis,
    parsed: list[ParsedRequest],
    options: SubmitOptions,
    on_progress: Callable[[int], None] | None = None,
) -> SubmitReport:
    """Store and enqueue `parsed` as one batch. The caller validated the lines (see `validate_lines`)."""
    skipped = _already_submitted(conn, options.name, parsed)
    remaining = [p for p in parsed if p.custom_id is None or p.custom_id not in skipped]
    if not remaining:
        return SubmitReport(None, 0, 0, sorted(skipped))

    batch_id = uuid.uuid4().hex[:16]
    requests = [p.resolve(i, options.defaults, options.return_token_ids) for i, p in enumerate(remaining)]
    try:
        _stage_requests(conn, batch_id, requests, min(options.ttl_seconds, STAGING_TTL_SECONDS), on_progress)
        num_chunks = _commit(conn, batch_id, requests, options)
    except BaseException as exc:  # Ctrl-C included: leave nothing behind
        committed = _discard_staged(conn, batch_id)
        if isinstance(exc, KeyboardInterrupt):
            raise SubmitInterrupted(batch_id if committed else None) from None
        raise
    forget_expired_batches(conn)
    return SubmitReport(batch_id, len(requests), num_chunks, sorted(skipped))


def forget_expired_batches(conn: redis.Redis, limit: int = FORGET_EXPIRED_LIMIT) -> int:
    """Drop the oldest entries of the `cbq:batches` index whose batch expired (at most `limit`, so each submit
    does a bounded amount of work and the index stays about as long as the number of live batches)."""
    oldest = [raw.decode() for raw in conn.zrange(keys.BATCHES, 0, limit - 1)]
    if not oldest:
        return 0
    with conn.pipeline(transaction=False) as pipe:
        for batch_id in oldest:
            pipe.exists(keys.batch(batch_id))
        expired = [b for b, exists in zip(oldest, pipe.execute(), strict=True) if not exists]
    if expired:
        conn.zrem(keys.BATCHES, *expired)
    return len(expired)


def _discard_staged(conn: redis.Redis, batch_id: str) -> bool:
    """After a failed or interrupted submit: delete the staged requests, unless the commit went through (its
    reply may be what was lost). Returns whether it did. If this fails too, the staging TTL cleans up."""
    try:
        if conn.exists(keys.batch(batch_id)):
            return True
        conn.delete(keys.batch_requests(batch_id))
    except (redis.RedisError, KeyboardInterrupt):
        pass
    return False


def _already_submitted(conn: redis.Redis, name: str | None, parsed: list[ParsedRequest]) -> set[str]:
    custom_ids = [p.custom_id for p in parsed if p.custom_id is not None]
    if name is None or not custom_ids:
        return set()
    found = conn.hmget(keys.name_index(name), custom_ids)
    return {cid for cid, batch_id in zip(custom_ids, found, strict=True) if batch_id is not None}


def _stage_requests(conn, batch_id, requests: list[Request], ttl_seconds: int, on_progress) -> None:
    key = keys.batch_requests(batch_id)
    for start in range(0, len(requests), STAGING_SLICE):
        piece = requests[start : start + STAGING_SLICE]
        with conn.pipeline(transaction=False) as pipe:
            pipe.hset(key, mapping={r.index: r.model_dump_json(exclude_defaults=True) for r in piece})
            pipe.expire(key, ttl_seconds)
            pipe.execute()
        if on_progress is not None:
            on_progress(len(piece))


def _commit(conn: redis.Redis, batch_id: str, requests: list[Request], options: SubmitOptions) -> int:
    queue = Queue(options.queue, connection=conn, serializer=JSONSerializer)
    ranges = [
        (s, min(s + options.chunk_size, len(requests))) for s in range(0, len(requests), options.chunk_size)
    ]
    custom_ids = {r.custom_id: batch_id for r in requests if r.custom_id is not None}
    name_key = keys.name_index(options.name) if options.name else None
    ttl = options.ttl_seconds

    with conn.pipeline(transaction=True) as pipe:
        if name_key is not None and custom_ids:
            # WATCH makes a concurrent submit under the same name abort one of the two commits.
            pipe.watch(name_key)
            clash = [
                cid
                for cid, found in zip(custom_ids, pipe.hmget(name_key, list(custom_ids)), strict=True)
                if found
            ]
            if clash:
                raise SubmitConflict(
                    f"{len(clash)} custom_ids were just submitted under --name {options.name!r}"
                )
            pipe.multi()
        pipe.hset(keys.batch(batch_id), mapping=_batch_fields(batch_id, requests, len(ranges), options))
        job_ids = [keys.chunk_job_id(batch_id, k) for k in range(len(ranges))]
        pipe.hset(
            keys.batch_jobs(batch_id),
            mapping={jid: f"{s}:{e}" for jid, (s, e) in zip(job_ids, ranges, strict=True)},
        )
        queue.enqueue_many(
            [
                Queue.prepare_data(
                    CHUNK_FUNC,
                    kwargs={"batch_id": batch_id, "start": s, "stop": e},
                    job_id=jid,
                    description=f"cbq chunk {batch_id}[{s}:{e}]",
                    timeout=options.job_timeout_seconds,
                    result_ttl=ttl,
                    failure_ttl=ttl,
                    ttl=ttl,
                    retry=_retry(options.retries),
                )
                for jid, (s, e) in zip(job_ids, ranges, strict=True)
            ],
            pipeline=pipe,
        )
        if name_key is not None and custom_ids:
            pipe.hset(name_key, mapping=custom_ids)
            pipe.expire(name_key, ttl)
        pipe.zadd(keys.BATCHES, {batch_id: time.time()})
        for key in keys.all_batch_keys(batch_id):
            pipe.expire(key, ttl)
        try:
            pipe.execute()
        except redis.WatchError:
            raise SubmitConflict(f"another submit under --name {options.name!r} committed first") from None
    return len(ranges)


def _batch_fields(batch_id: str, requests: list[Request], num_chunks: int, options: SubmitOptions) -> dict:
    fields = {
        BatchField.QUEUE.value: options.queue,
        BatchField.CREATED_AT.value: repr(time.time()),
        BatchField.NUM_REQUESTS.value: len(requests),
        BatchField.NUM_CHUNKS.value: num_chunks,
        BatchField.TTL_SECONDS.value: options.ttl_seconds,
        BatchField.NUM_COMPLETED.value: 0,
        BatchField.NUM_FAILED.value: 0,
        BatchField.NUM_CANCELLED.value: 0,
    }
    if options.name:
        fields[BatchField.NAME.value] = options.name
    return fields


def _retry(retries: int) -> Retry | None:
    return Retry(max=retries) if retries > 0 else None
