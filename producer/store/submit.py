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
import zlib
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import redis
from rq import Queue, Retry
from rq.serializers import JSONSerializer

from producer import settings
from producer.store import marker
from schemas import keys
from schemas.chat import checked_chat_template_kwargs
from schemas.chunk import CHUNK_FUNC
from schemas.errors import FieldIssue, InvalidRequest, RequestLineError
from schemas.keys import BatchField
from schemas.lines import ParsedRequest, Request, parse_request_line
from schemas.result import ResultLine
from schemas.sampling import Sampling

STAGING_SLICE = 2000  # requests per staging pipeline: bounded client memory, few round trips
# Staged requests expire after this unless the commit comes (it sets the batch's TTL on every key), so even
# a submit killed with SIGKILL leaves nothing for long.
STAGING_TTL_SECONDS = 3600
FORGET_EXPIRED_LIMIT = 100  # oldest `cbq:batches` entries each submit checks for expiry


Entry = ParsedRequest | InvalidRequest  # a request of the batch: valid, or one that fails alone (status 400)


class ValidRequests:
    """The requests of a validated source, in line order: `len()` and iteration. Each is a `ParsedRequest`, or
    an `InvalidRequest` for a well-formed line whose request is invalid: it is stored as failed, not run.

    A source that can be read again (a file: `reread` opens it anew) keeps only each request's custom_id,
    and iterating parses its lines again. So a 200 MB OpenAI batch file is never held as a million
    objects: submitting it needs memory for its custom_ids, not for its requests. Other sources (lines
    handed over in memory) keep the parsed requests.
    """

    def __init__(
        self,
        custom_ids: list[str | None],
        kept: list[Entry] | None = None,
        reread: Callable[[], Iterable[str | bytes]] | None = None,
        skip_lines: frozenset[int] = frozenset(),
        checksum: int = 0,
        invalid: list[InvalidRequest] | None = None,
        model: str | None = None,
    ):
        assert (kept is None) != (reread is None), "either the requests or a way to read them again"
        assert kept is None or len(kept) == len(custom_ids)
        self.custom_ids = custom_ids  # one per request (None: the line has none)
        self.invalid = invalid or []  # the requests that fail alone, in line order
        self.model = model  # the model the batch's lines name (None: they name none)
        self._kept = kept
        self._reread = reread
        self._skip_lines = skip_lines  # lines with format errors, and duplicate custom_ids
        self._checksum = checksum  # of every line read at validation (`_line_crc`), to notice any edit

    def __len__(self) -> int:
        return len(self.custom_ids)

    def __iter__(self) -> Iterator[Entry]:
        if self._kept is not None:
            yield from self._kept
            return
        assert self._reread is not None
        invalid_lines = {error.line_no for error in self.invalid}
        count = crc = 0
        for line_no, text in enumerate(self._reread(), start=1):
            crc = _line_crc(text, crc)
            if line_no in self._skip_lines:
                continue
            entry: Entry | None
            try:
                entry = parse_request_line(text, line_no)
            except InvalidRequest as exc:
                entry = exc if line_no in invalid_lines else None
                if entry is None:
                    raise SourceChanged(f"the input changed after it was validated ({exc})") from None
            except RequestLineError as exc:
                raise SourceChanged(f"the input changed after it was validated ({exc})") from None
            if entry is None:
                continue
            entry = _of_the_batch_model(entry, self.model)
            for member in entry.members() if isinstance(entry, ParsedRequest) else [entry]:
                if count >= len(self.custom_ids) or member.custom_id != self.custom_ids[count]:
                    raise SourceChanged(f"the input changed after it was validated (line {line_no})")
                count += 1
                yield member
        if count != len(self.custom_ids):
            raise SourceChanged(f"the input changed after it was validated ({count} of {len(self)} requests left)")
        if crc != self._checksum:  # the same requests by custom_id, but some text changed
            raise SourceChanged("the input changed after it was validated (its content differs)")


def _line_crc(text: str | bytes, crc: int) -> int:
    return zlib.crc32(text if isinstance(text, bytes) else text.encode("utf-8", "surrogatepass"), crc)


class SourceChanged(RuntimeError):
    """A file changed between its validation and its submission (nothing was enqueued)."""


@dataclass
class ValidatedFile:
    requests: ValidRequests  # every request, those that fail alone included (`requests.invalid`)
    errors: list[RequestLineError] = field(default_factory=list)  # format errors: the file is refused
    num_blank_lines: int = 0
    # Format errors past `validate_lines`' max_errors: counted, not kept (`errors` holds the first ones).
    num_errors_dropped: int = 0

    @property
    def num_errors(self) -> int:
        return len(self.errors) + self.num_errors_dropped

    @property
    def invalid(self) -> list[InvalidRequest]:
        """The requests that fail alone (each gets a status 400 result; `strict` refuses the file for them)."""
        return self.requests.invalid

    def refusal(self, strict: bool) -> list[RequestLineError]:
        """Why the file is refused, line by line: its format errors, and with `strict` its invalid requests."""
        if not strict:
            return self.errors
        return sorted([*self.errors, *self.invalid], key=lambda e: e.line_no)


def _of_the_batch_model(entry: Entry, model: str | None) -> Entry:
    """`entry`, or for a line naming another model than its batch's, its `model_not_found` failure."""
    if isinstance(entry, InvalidRequest) or entry.model is None or model is None or entry.model == model:
        return entry
    message = f"the model {entry.model!r} is not this batch's {model!r} (a batch names one model)"
    return InvalidRequest(entry.line_no, [FieldIssue("body.model", message, "model_not_found")], entry.custom_id, entry.url)


def validate_lines(
    lines: Iterable[str | bytes],
    on_line: Callable[[str | bytes], None] | None = None,
    reread: Callable[[], Iterable[str | bytes]] | None = None,
    endpoint: str | None = None,
    model: str | None = None,
    max_errors: int | None = None,
) -> ValidatedFile:
    """Parse every line (1-based line numbers) and flag duplicate custom_ids, naming both lines.

    With `reread` (opens the same lines again), the parsed requests are not kept: `requests` parses them
    again when iterated. `on_line` sees each raw line (progress by bytes or by lines). `endpoint`: the batch's
    OpenAI endpoint, which every OpenAI line's url must be (a format error otherwise, as OpenAI's). `model`:
    the one model the lines may name (`cbq run`: the one it serves); by default, the first model a line names.
    A line naming another fails alone as `model_not_found`. `max_errors`: keep only the first that many format
    errors and count the others (`num_errors_dropped`), so that a file of a million bad lines costs no more
    memory than one of a thousand; the file is refused either way."""
    errors: list[RequestLineError] = []
    num_errors_dropped = 0

    def add_error(error: RequestLineError) -> None:
        nonlocal num_errors_dropped
        if max_errors is not None and len(errors) >= max_errors:
            num_errors_dropped += 1
        else:
            errors.append(error)

    invalid: list[InvalidRequest] = []
    kept: list[Entry] | None = [] if reread is None else None
    custom_ids: list[str | None] = []
    num_blank = crc = 0
    first_line_of: dict[str, int] = {}
    for line_no, text in enumerate(lines, start=1):
        if on_line is not None:
            on_line(text)
        if reread is not None:
            crc = _line_crc(text, crc)
        entry: Entry | None
        try:
            entry = parse_request_line(text, line_no)
        except InvalidRequest as exc:
            entry = exc
        except RequestLineError as exc:
            add_error(exc)
            continue
        if entry is None:
            num_blank += 1
            continue
        if endpoint is not None and entry.url is not None and entry.url != endpoint:
            message = f"the line's url {entry.url} differs from the batch's endpoint {endpoint}"
            add_error(RequestLineError(line_no, [FieldIssue("url", message, "mismatched_endpoint")]))
            continue
        if entry.custom_id is not None:
            first = first_line_of.setdefault(entry.custom_id, line_no)
            if first != line_no:
                issue = FieldIssue("custom_id", f"duplicate custom_id {entry.custom_id!r} (first on line {first})")
                add_error(RequestLineError(line_no, [issue]))
                continue
        if model is None and isinstance(entry, ParsedRequest):
            model = entry.model
        entry = _of_the_batch_model(entry, model)
        if isinstance(entry, InvalidRequest):
            invalid.append(entry)
        members: list[Entry] = entry.members() if isinstance(entry, ParsedRequest) else [entry]
        custom_ids += [member.custom_id for member in members]  # one per stored request
        if kept is not None:
            kept += members
    # NOTE: with errors dropped, `skip` misses their lines; no matter, since a file with errors is refused.
    skip = frozenset(e.line_no for e in errors if e.line_no is not None)
    requests = ValidRequests(
        custom_ids, kept=kept, reread=reread, skip_lines=skip, checksum=crc, invalid=invalid, model=model
    )
    return ValidatedFile(requests, errors, num_blank, num_errors_dropped)


@dataclass(frozen=True)
class SubmitOptions:
    queue: str
    name: str | None = None  # resubmissions with the same name skip custom_ids already submitted
    chunk_size: int = settings.DEFAULT_CHUNK_SIZE
    ttl_seconds: int = settings.DEFAULT_RESULT_TTL_SECONDS
    defaults: Sampling = field(default_factory=Sampling)
    model: str | None = None  # the model the lines name: `queue` is then that model's (`keys.model_queue`)
    # The chat template's extra variables for every chat of the batch (a line's own win, name by name).
    chat_template_kwargs: dict[str, Any] | None = None
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
        if self.chat_template_kwargs is not None:  # the same bounds as on a line
            try:
                checked_chat_template_kwargs(self.chat_template_kwargs)
            except ValueError as exc:
                raise ValueError(f"chat_template_kwargs: {exc}") from None


@dataclass
class SubmitReport:
    batch_id: str | None  # None when every request was already submitted under this name
    num_requests: int
    num_chunks: int
    skipped_custom_ids: list[str]  # already submitted under --name
    num_invalid: int = 0  # of num_requests: failed alone at submit (status 400)


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
    parsed: ValidRequests,
    options: SubmitOptions,
    on_progress: Callable[[int], None] | None = None,
) -> SubmitReport:
    """Store and enqueue `parsed` as one batch. The caller validated the lines (see `validate_lines`).

    The requests stream through: each staging slice is resolved, written and dropped, so memory holds
    one slice (plus the custom_ids), however large the batch. A request that fails alone (`InvalidRequest`)
    is staged as its result (status 400) and counted failed from the start: workers skip what has a result."""
    skipped = _already_submitted(conn, options.name, parsed.custom_ids)
    remaining_ids = [cid for cid in parsed.custom_ids if cid is None or cid not in skipped]
    num_requests = len(remaining_ids)
    if num_requests == 0:
        return SubmitReport(None, 0, 0, sorted(skipped))

    batch_id = keys.new_batch_id()
    remaining = (p for p in parsed if p.custom_id is None or p.custom_id not in skipped)
    entries = (
        ResultLine.of_invalid_request(i, p)
        if isinstance(p, InvalidRequest)
        else p.resolve(i, options.defaults, options.return_token_ids, options.chat_template_kwargs)
        for i, p in enumerate(remaining)
    )
    custom_ids = {cid: batch_id for cid in remaining_ids if cid is not None}
    try:
        ttl = min(options.ttl_seconds, STAGING_TTL_SECONDS)
        staged, num_invalid = _stage_requests(conn, batch_id, entries, ttl, on_progress)
        assert staged == num_requests, f"staged {staged} requests, expected {num_requests}"
        num_chunks = _commit(conn, batch_id, num_requests, custom_ids, options, num_invalid)
    except BaseException as exc:  # Ctrl-C included: leave nothing behind
        committed = _discard_staged(conn, batch_id)
        if isinstance(exc, KeyboardInterrupt):
            raise SubmitInterrupted(batch_id if committed else None) from None
        raise
    forget_expired_batches(conn)
    return SubmitReport(batch_id, num_requests, num_chunks, sorted(skipped), num_invalid)


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
        conn.delete(keys.batch_requests(batch_id), keys.batch_results(batch_id))
    except (redis.RedisError, KeyboardInterrupt):
        pass
    return False


def _already_submitted(conn: redis.Redis, name: str | None, custom_ids: list[str | None]) -> set[str]:
    given = [cid for cid in custom_ids if cid is not None]
    if name is None or not given:
        return set()
    found: list = []
    for start in range(0, len(given), STAGING_SLICE):  # bounded replies for a million ids
        found += conn.hmget(keys.name_index(name), given[start : start + STAGING_SLICE])
    return {cid for cid, batch_id in zip(given, found, strict=True) if batch_id is not None}


def _stage_requests(
    conn, batch_id, entries: Iterable[Request | ResultLine], ttl_seconds: int, on_progress
) -> tuple[int, int]:
    """Write the requests, and the results of those that failed at submit; returns (staged, failed)."""
    requests_key, results_key = keys.batch_requests(batch_id), keys.batch_results(batch_id)
    staged = num_invalid = 0
    for piece in _slices(entries, STAGING_SLICE):
        requests = {r.index: r.model_dump_json(exclude_defaults=True) for r in piece if isinstance(r, Request)}
        results = {r.index: r.model_dump_json(exclude_none=True) for r in piece if isinstance(r, ResultLine)}
        with conn.pipeline(transaction=False) as pipe:
            for key, mapping in ((requests_key, requests), (results_key, results)):
                if mapping:
                    pipe.hset(key, mapping=mapping)
                    pipe.expire(key, ttl_seconds)
            pipe.execute()
        staged += len(piece)
        num_invalid += len(results)
        if on_progress is not None:
            on_progress(len(piece))
    return staged, num_invalid


def _slices(items: Iterable[Request | ResultLine], size: int) -> Iterator[list[Request | ResultLine]]:
    piece: list[Request | ResultLine] = []
    for item in items:
        piece.append(item)
        if len(piece) == size:
            yield piece
            piece = []
    if piece:
        yield piece


def _commit(
    conn: redis.Redis,
    batch_id: str,
    num_requests: int,
    custom_ids: dict[str, str],
    options: SubmitOptions,
    num_invalid: int = 0,
) -> int:
    queue = Queue(options.queue, connection=conn, serializer=JSONSerializer)
    ranges = [(s, min(s + options.chunk_size, num_requests)) for s in range(0, num_requests, options.chunk_size)]
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
        fields = _batch_fields(batch_id, num_requests, len(ranges), options, num_invalid)
        pipe.hset(keys.batch(batch_id), mapping=fields)
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
        marker.mark(pipe)
        for key in keys.all_batch_keys(batch_id):
            pipe.expire(key, ttl)
        try:
            pipe.execute()
        except redis.WatchError:
            raise SubmitConflict(f"another submit under --name {options.name!r} committed first") from None
    return len(ranges)


def _batch_fields(
    batch_id: str, num_requests: int, num_chunks: int, options: SubmitOptions, num_invalid: int
) -> dict:
    fields = {
        BatchField.QUEUE.value: options.queue,
        BatchField.CREATED_AT.value: repr(time.time()),
        BatchField.NUM_REQUESTS.value: num_requests,
        BatchField.NUM_CHUNKS.value: num_chunks,
        BatchField.TTL_SECONDS.value: options.ttl_seconds,
        BatchField.NUM_COMPLETED.value: 0,
        BatchField.NUM_FAILED.value: num_invalid,  # the requests that failed at submit
        BatchField.NUM_CANCELLED.value: 0,
    }
    if options.name:
        fields[BatchField.NAME.value] = options.name
    if options.model:
        fields[BatchField.ROUTED_MODEL.value] = options.model
    return fields


def _retry(retries: int) -> Retry | None:
    return Retry(max=retries) if retries > 0 else None
