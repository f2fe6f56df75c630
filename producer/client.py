"""The Python client for pipelines: submit a batch, follow it, read its results in input order, cancel it.

Owns nothing in Redis: it is the one entry point that `cbq submit/status/wait/results/cancel`, the HTTP server
(`producer.server`) and user code share, over `producer.store`.

    from producer.client import Client

    client = Client("redis://127.0.0.1:6379/0")
    batch = client.submit([{"prompt": "Hello"}, {"prompt": "Bye"}], max_new_tokens=32)
    batch.wait(progress=True)
    for line in batch.results():
        print(line.custom_id, line.text)
"""

from __future__ import annotations

import json
import os
import sys
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any, Literal

import redis
from pydantic import BaseModel, ValidationError

from producer import settings, store
from producer.store import (
    BatchNotFinished,
    BatchNotFound,
    CancelReport,
    SourceChanged,
    SubmitConflict,
    SubmitInterrupted,
    SubmitOptions,
    ValidatedFile,
    submit_batch,
    validate_lines,
)
from schemas import keys
from schemas.errors import InvalidRequest, RequestLineError
from schemas.sampling import Sampling
from schemas.status import BatchStatus, WorkerStats

__all__ = [
    "REDIS_ERRORS",
    "Batch",
    "BatchNotFinished",
    "BatchNotFound",
    "Client",
    "InvalidInput",
    "NothingToSubmit",
    "OutageRetry",
    "RedisUnreachable",
    "one_line_error",
    "SourceChanged",
    "Submission",
    "SubmitConflict",
    "SubmitInterrupted",
]

# A path to a JSONL file, or the lines themselves: dicts (one request each) or JSON strings (or bytes).
Source = str | os.PathLike | Iterable[dict | str | bytes]
# Opens a source's lines anew at each call (validation reads them once, submission again).
Reopen = Callable[[], Iterable[str | bytes]]
OutputFormat = Literal["cbq", "openai"]
# What a restarting, paused or failing-over Redis raises (BusyLoadingError, ReadOnlyError after a failover and
# redis-py's "no master found" are ConnectionErrors too).
REDIS_ERRORS = (redis.ConnectionError, redis.TimeoutError)
OUTAGE_BACKOFF_SECONDS = (0.25, 5.0)  # first and longest wait between two tries, as the workers wait


class RedisUnreachable(ConnectionError):
    """Redis did not answer for longer than an `OutageRetry`'s limit."""


@dataclass
class OutageRetry:
    """Calls a Redis read again, with a growing backoff, while Redis is unreachable, for at most `limit_s` seconds
    of one outage; past that raises `RedisUnreachable`. `on_outage(exc)` hears the first failure of each outage,
    `on_recovery(seconds)` its end. Only for reads and idempotent calls: a write retried after a lost reply
    could apply twice."""

    limit_s: float = settings.DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS
    on_outage: Callable[[Exception], None] | None = None
    on_recovery: Callable[[float], None] | None = None

    def __call__(self, fn: Callable[..., Any], *args, **kwargs) -> Any:
        outage_started: float | None = None
        delay, longest = OUTAGE_BACKOFF_SECONDS
        while True:
            try:
                result = fn(*args, **kwargs)
            except REDIS_ERRORS as exc:
                if isinstance(exc, redis.AuthenticationError):  # a ConnectionError that no wait cures
                    raise
                now = time.monotonic()
                if outage_started is None:
                    outage_started = now
                    if self.on_outage is not None:
                        self.on_outage(exc)
                elapsed = now - outage_started
                if elapsed >= self.limit_s:
                    raise RedisUnreachable(
                        f"Redis unreachable for {elapsed:.0f} s (limit {self.limit_s:g} s): {one_line_error(exc)}"
                    ) from None
                time.sleep(min(delay, self.limit_s - elapsed))
                delay = min(2 * delay, longest)
                continue
            if outage_started is not None and self.on_recovery is not None:
                self.on_recovery(time.monotonic() - outage_started)
            return result


def one_line_error(exc: Exception) -> str:
    """`exc` as one line with its type, for notices."""
    text = " ".join(str(exc).split())
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class InvalidInput(ValueError):
    """The input has format errors (or, with `strict`, invalid requests), so nothing was enqueued. `errors`
    names every bad line and field."""

    def __init__(self, errors: list[RequestLineError]):
        self.errors = errors
        super().__init__(
            f"{len(errors)} invalid line(s); nothing was enqueued:\n" + "\n".join(map(str, errors))
        )


SKIP_INVALID_REMOVED = (
    "skip_invalid was removed: a line whose request is invalid now fails alone (status 400 in the errors "
    "output) and the others run; strict=True (--strict) refuses the whole file instead"
)


class NothingToSubmit(RuntimeError):
    """Every request was already submitted under this batch name (or the input has no requests)."""

    def __init__(self, message: str, skipped_custom_ids: list[str] | None = None):
        self.skipped_custom_ids = skipped_custom_ids or []
        super().__init__(message)


@dataclass(frozen=True)
class Submission:
    """What `Client.submit` did."""

    num_requests: int
    num_chunks: int
    skipped_custom_ids: list[str] = field(default_factory=list)  # already submitted under the same name
    # Requests that failed alone at submit (status 400 results, counted failed); part of num_requests.
    invalid: list[InvalidRequest] = field(default_factory=list)


class Client:
    """A connection to cbq's Redis and a default queue."""

    def __init__(
        self, redis_url: str | None = None, *, connection: redis.Redis | None = None, queue: str | None = None
    ):
        self.connection = (
            connection
            if connection is not None
            else settings.connect(redis_url or settings.default_redis_url())
        )
        self.queue = queue or os.environ.get(settings.QUEUE_ENV, settings.DEFAULT_QUEUE)

    def validate(
        self,
        source: Source | Reopen,
        on_line: Callable[[str | bytes], None] | None = None,
        endpoint: str | None = None,
        model: str | None = None,
        max_errors: int | None = None,
    ) -> ValidatedFile:
        """Parse every line of `source` (nothing is enqueued). Files are read line by line and not kept:
        submitting reads them again, so a file of any size needs memory only for its custom_ids. A callable
        source opens its lines anew on each call (the same lines each time). `endpoint`: the OpenAI endpoint
        every OpenAI line's url must name (a batch of the Batch API). `model`: the one model lines may name
        (default: the first one a line names); a line naming another fails alone as `model_not_found`.
        `max_errors`: keep the first that many format errors, count the others (`num_errors_dropped`)."""
        checks = {"on_line": on_line, "endpoint": endpoint, "model": model, "max_errors": max_errors}
        if callable(source):
            return validate_lines(source(), reread=source, **checks)
        if isinstance(source, str | os.PathLike):
            path = source
            reread = lambda: _iter_lines(path)  # noqa: E731
            return validate_lines(reread(), reread=reread, **checks)
        return validate_lines(_iter_lines(source), **checks)

    def submit(
        self,
        source: Source | Reopen | ValidatedFile,
        *,
        name: str | None = None,
        chunk_size: int = settings.DEFAULT_CHUNK_SIZE,
        ttl_seconds: int = settings.DEFAULT_RESULT_TTL_SECONDS,
        strict: bool = False,
        skip_invalid: bool | None = None,
        return_token_ids: bool = False,
        retries: int = settings.DEFAULT_RETRIES,
        job_timeout_seconds: int = settings.NO_JOB_TIMEOUT,
        queue: str | None = None,
        on_progress: Callable[[int], None] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
        **defaults,
    ) -> Batch:
        """Validate `source` and enqueue it as one batch, atomically. Returns its handle.

        `defaults` are batch-level sampling fields (`max_new_tokens`, `temperature`, `top_p`, `top_k`, `seed`,
        `stop`, `ignore_eos`, ...); values on a line win. `chat_template_kwargs`: the chat template's extra
        variables for every chat line (`{"enable_thinking": False}` for Qwen3); a line's own win, name by name.

        A line whose request is invalid (a bad or unsupported field) fails alone: its result is OpenAI's status
        400 error, counted failed, and the other requests run; `strict=True` refuses the whole input instead.
        Raises `InvalidInput` for format errors (a line that is not a JSON object, a missing or duplicate
        custom_id, ...: nothing is enqueued), `NothingToSubmit` when no request is left to enqueue, `ValueError`
        for a bad default.
        """
        if skip_invalid is not None:
            raise TypeError(SKIP_INVALID_REMOVED)
        validated = source if isinstance(source, ValidatedFile) else self.validate(source)
        if validated.refusal(strict):
            raise InvalidInput(validated.refusal(strict))
        if not validated.requests:
            raise NothingToSubmit("no requests in the input")
        try:
            sampling = Sampling(**defaults)
        except ValidationError as exc:
            raise ValueError(f"invalid batch default: {exc}") from None
        model = validated.requests.model  # the batch goes to the queue of the model its lines name
        options = SubmitOptions(
            queue=keys.model_queue(queue or self.queue, model),
            model=model,
            name=name,
            chunk_size=chunk_size,
            ttl_seconds=ttl_seconds,
            defaults=sampling,
            chat_template_kwargs=chat_template_kwargs,
            return_token_ids=return_token_ids,
            retries=retries,
            job_timeout_seconds=job_timeout_seconds,
        )
        report = submit_batch(self.connection, validated.requests, options, on_progress=on_progress)
        if report.batch_id is None:
            raise NothingToSubmit(
                f"every request was already submitted under the name {name!r}", report.skipped_custom_ids
            )
        skipped = set(report.skipped_custom_ids)
        invalid = [e for e in validated.invalid if e.custom_id is None or e.custom_id not in skipped]
        submission = Submission(report.num_requests, report.num_chunks, report.skipped_custom_ids, invalid)
        return Batch(self, report.batch_id, submission)

    def batch(self, batch_id: str) -> Batch:
        """The handle of an existing batch (nothing is read until you ask)."""
        return Batch(self, batch_id)

    def batches(self, limit: int = 20) -> list[BatchStatus]:
        """The most recent batches first."""
        return store.list_batches(self.connection, limit)

    def workers(self) -> list[WorkerStats]:
        """Workers that published stats in the last minute."""
        return store.list_workers(self.connection)


class Batch:
    """One batch: `status()`, `wait()`, `results()`, `cancel()`. Cheap to create; holds no state but its id."""

    def __init__(self, client: Client, batch_id: str, submission: Submission | None = None):
        self.client = client
        self.id = batch_id
        self.submission = submission  # set when this handle came from `Client.submit`

    def __repr__(self) -> str:
        return f"Batch({self.id!r})"

    def status(self) -> BatchStatus:
        """Counts, tokens, GPU seconds, rates and ETA. Raises BatchNotFound."""
        return store.get_status(self.client.connection, self.id)

    def wait(
        self,
        progress: bool | Callable[[BatchStatus], None] = False,
        interval: float = 1.0,
        timeout: float | None = None,
        retry: OutageRetry | None = None,
    ) -> BatchStatus:
        """Poll until every request has finished; returns the final status.

        progress=True draws a bar on stderr; a callable gets every status read. Raises TimeoutError after
        `timeout` seconds (the batch keeps running). `retry`: each status read rides out a Redis outage through
        it (raising `RedisUnreachable` past its limit); without it, the first Redis error is raised.
        """
        read = self.status if retry is None else lambda: retry(self.status)
        deadline = None if timeout is None else time.monotonic() + timeout
        with _progress_reporter(progress, self.id, read()) as report:
            while True:
                st = read()
                report(st)
                if st.is_done:
                    return st
                if deadline is not None and time.monotonic() >= deadline:
                    raise TimeoutError(f"timed out: {st.num_total - st.num_finished} requests unfinished")
                time.sleep(interval)

    def results(self, format: OutputFormat = "cbq", partial: bool = False) -> Iterator[BaseModel]:
        """Results in input order: `ResultLine`s, or `OpenAIBatchOutputLine`s for format="openai".

        Raises BatchNotFinished right away (not on the first `next()`) unless the batch is done or `partial`.
        """
        if not partial:
            st = self.status()
            if not st.is_done:
                raise BatchNotFinished(st)
        return store.iter_results(self.client.connection, self.id, output_format=format, partial=partial)

    def cancel(self) -> CancelReport:
        """Queued requests never run; running ones stop at their worker's next check (about 0.5 s)."""
        return store.cancel_batch(self.client.connection, self.id)


def _iter_lines(source: Source) -> Iterator[str | bytes]:
    if isinstance(source, str | os.PathLike):
        with open(source, "rb") as f:
            # Split on newlines only: str.splitlines() would also split inside JSON strings at U+2028 etc.
            # Lines stay bytes: each is decoded when validated, so a bad UTF-8 byte fails its own line.
            for line in f:
                yield line.rstrip(b"\n")
        return
    for item in source:
        yield item if isinstance(item, str | bytes) else json.dumps(item)


class _progress_reporter:
    """Context manager giving a `report(status)` function: a click bar, a user callback, or nothing."""

    def __init__(self, progress, batch_id: str, first: BatchStatus):
        self._progress, self._batch_id, self._first = progress, batch_id, first
        self._bar: Any = None  # click's progress bar, when progress is True
        self._shown = 0

    def __enter__(self) -> Callable[[BatchStatus], None]:
        if self._progress is True:
            import click

            self._bar = click.progressbar(
                length=self._first.num_total, label=f"batch {self._batch_id}", file=sys.stderr
            )
            self._bar.__enter__()
        return self._report

    def _report(self, st: BatchStatus) -> None:
        if self._bar is not None:
            self._bar.update(st.num_finished - self._shown)
            self._shown = st.num_finished
        elif callable(self._progress):
            self._progress(st)

    def __exit__(self, *exc_info) -> None:
        if self._bar is not None:
            self._bar.__exit__(*exc_info)
