"""`cbq`: the command line. The root group and the producer-side commands (nothing here imports torch).

Every command reads and writes batches through `producer.client`, like user code does. Other commands
(`worker`, `run`, `bench`) plug in through the `cbq.commands` entry points in pyproject.toml and
are imported only when used; this module names none of them.
"""

from __future__ import annotations

import collections
import contextlib
import signal
import sys
import threading
import time

import click
import redis

from producer import settings
from producer.cli_common import (
    format_status,
    reopenable_lines,
    status_json,
    warn_overridden_defaults,
    write_result_lines,
)
from producer.client import (
    BatchNotFinished,
    BatchNotFound,
    Client,
    NothingToSubmit,
    OutageRetry,
    RedisUnreachable,
    SourceChanged,
    SubmitConflict,
    SubmitInterrupted,
    one_line_error,
)
from producer.lazy_group import PluginGroup
from producer.options import (
    chat_template_kwargs_option,
    chunk_size_option,
    echo_json,
    errors_option,
    format_option,
    json_option,
    open_redis,
    queue_option,
    redis_url_option,
    report_validation,
    sampling_options,
    strict_option,
    ttl_option,
)
from schemas.sampling import Sampling

PROGRESS_MIN_LINES = 5000  # smaller files validate and store in a blink; no bar
PROGRESS_MIN_BYTES = 1 << 20  # the validation bar counts bytes
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as shells report a Ctrl-C
EXIT_REDIS_UNREACHABLE = 3  # `wait`, `status`, `results`: Redis stayed unreachable past --redis-outage-limit
# The reading commands' Redis timeouts: a paused Redis is noticed (and retried) after this, not waited on forever.
READ_SOCKET_TIMEOUT_S = 5.0
READ_CONNECT_TIMEOUT_S = 2.0


# `serve` is the producer's own (in producer/server, with the optional `server` extra), imported only when used.
@click.group(
    cls=PluginGroup,
    lazy_commands={"serve": "producer.server.cli:serve"},
    context_settings={"help_option_names": ["-h", "--help"]},
)
@click.version_option(package_name="cbq")
def main():
    """cbq: bulk LLM generation. Producers submit JSONL files to a Redis queue; GPU workers drain it into a
    continuous-batching engine and write results, token counts and GPU time back to Redis.

    Quick start without Redis: `cbq run examples/prompts.jsonl -o out.jsonl`.
    """


# --- submit --------------------------------------------------------------------------------------------------


@contextlib.contextmanager
def _exit_130_on_interrupt():
    """Ctrl-C: say what was (not) enqueued and exit 130, instead of click's "Aborted!" and exit 1."""
    try:
        yield
    except KeyboardInterrupt:
        click.echo("interrupted; nothing was enqueued", err=True)
        sys.exit(EXIT_INTERRUPTED)
    except SubmitInterrupted as exc:
        click.echo(str(exc), err=True)
        sys.exit(EXIT_INTERRUPTED)


@main.command()
@click.argument("file", type=click.File("rb"))
@redis_url_option
@queue_option
@click.option(
    "--name", help="Batch name; resubmitting under the same name skips custom_ids already submitted."
)
@chunk_size_option
@ttl_option
@strict_option
@click.option("--token-ids", "return_token_ids", is_flag=True, help="Also return generated token ids.")
@click.option(
    "--retries",
    type=click.IntRange(min=0),
    default=settings.DEFAULT_RETRIES,
    show_default=True,
    help="Times a chunk is retried when its worker dies or fails (finished requests are not redone).",
)
@click.option(
    "--job-timeout",
    type=int,
    default=settings.NO_JOB_TIMEOUT,
    show_default=True,
    help="Seconds a chunk may stay in a worker before it is aborted and retried; -1: no limit.",
)
@sampling_options
@chat_template_kwargs_option
@json_option
@_exit_130_on_interrupt()
def submit(
    file,
    redis_url,
    queue,
    name,
    chunk_size,
    ttl_seconds,
    strict,
    return_token_ids,
    retries,
    job_timeout,
    defaults: Sampling,
    chat_template_kwargs,
    as_json,
):
    """Validate FILE (JSONL; `-` for stdin) and enqueue it as one batch; prints the batch id.

    Each line is {"prompt": ...}, {"messages": [...]} or an OpenAI Batch line (custom_id, method, url, body).
    Every line is validated first. A format error (not JSON, not an object, a missing or duplicate custom_id)
    refuses the file: each bad line is reported and nothing is enqueued. A request that is invalid otherwise
    fails alone (status 400, counted failed) and the others run, unless --strict.
    Blank lines are skipped. Sampling flags are batch defaults; values on a line win, as in vLLM (a note says
    when lines override a flag).
    """
    if job_timeout != settings.NO_JOB_TIMEOUT and job_timeout < 1:
        raise click.BadParameter(
            "must be -1 (no limit) or a positive number of seconds", param_hint="--job-timeout"
        )
    client = _client(redis_url, queue)
    reopen, size = click.get_current_context().with_resource(reopenable_lines(file))
    validated = _validate_with_progress(client, reopen, size)
    if as_json and validated.refusal(strict):
        echo_json({"batch_id": None, "errors": [_error_json(e) for e in validated.refusal(strict)]})
    report_validation(validated, strict, "enqueued")
    if not validated.requests:
        raise click.ClickException("no requests in the input")
    warn_overridden_defaults(validated, defaults)

    batch = None
    interrupt = _DeferredInterrupt()
    try:
        with interrupt.installed(), _progress_bar(len(validated.requests), "storing") as update_bar:

            def on_progress(n: int) -> None:
                if update_bar is not None:
                    update_bar(n)
                interrupt.check()

            batch = client.submit(
                validated,
                name=name,
                chunk_size=chunk_size,
                ttl_seconds=ttl_seconds,
                strict=strict,
                return_token_ids=return_token_ids,
                retries=retries,
                job_timeout_seconds=job_timeout,
                on_progress=on_progress,
                chat_template_kwargs=chat_template_kwargs,
                **defaults.given(),
            )
        if interrupt.hit:  # during the commit, which went through
            raise SubmitInterrupted(batch.id)
        skipped = batch.submission.skipped_custom_ids
    except (SubmitConflict, SourceChanged) as exc:
        raise click.ClickException(str(exc)) from None
    except NothingToSubmit as exc:
        skipped = exc.skipped_custom_ids

    if skipped:
        shown = ", ".join(skipped[:10]) + (" ..." if len(skipped) > 10 else "")
        click.echo(f"skipped {len(skipped)} already submitted under --name {name}: {shown}", err=True)
    if batch is None:
        click.echo("nothing to submit: every request was already submitted under this name", err=True)
    elif not as_json:
        click.echo(
            f"submitted {batch.submission.num_requests} requests in {batch.submission.num_chunks} chunks "
            f"to queue {queue}"
            + (f" ({len(batch.submission.invalid)} invalid: failed with status 400)" if batch.submission.invalid else ""),
            err=True,
        )
        click.echo(batch.id)
    if as_json:
        echo_json(
            {
                "batch_id": batch.id if batch else None,
                "queue": queue,
                "num_requests": batch.submission.num_requests if batch else 0,
                "num_chunks": batch.submission.num_chunks if batch else 0,
                "num_invalid": len(batch.submission.invalid) if batch else 0,
                "skipped_custom_ids": skipped,
                "errors": [_error_json(e) for e in batch.submission.invalid] if batch else [],
            }
        )


def _validate_with_progress(client: Client, reopen, size: int):
    with _progress_bar(size, "validating", PROGRESS_MIN_BYTES) as on_progress:
        on_line = None if on_progress is None else lambda line: on_progress(len(line) + 1)
        return client.validate(reopen, on_line=on_line)


@contextlib.contextmanager
def _progress_bar(length: int, label: str, min_length: int = PROGRESS_MIN_LINES):
    """Yields `update(n)` for a bar on stderr, or None for inputs small enough to need none."""
    if length < min_length:
        yield None
        return
    with click.progressbar(length=length, label=label, file=sys.stderr) as bar:
        yield bar.update


class _DeferredInterrupt:
    """While a batch is stored, Ctrl-C takes effect between staging slices, where `submit_batch` can remove
    what it staged. Raised at any point, it could arrive wrapped: inside pydantic's serializer it becomes a
    serialization error, and the user would see a traceback."""

    def __init__(self) -> None:
        self.hit = False

    @contextlib.contextmanager
    def installed(self):
        if threading.current_thread() is not threading.main_thread():
            yield  # signal handlers belong to the main thread; elsewhere Ctrl-C is not ours to handle
            return
        previous = signal.signal(signal.SIGINT, self._note)
        try:
            yield
        finally:
            signal.signal(signal.SIGINT, previous)

    def _note(self, signum, frame) -> None:
        self.hit = True

    def check(self) -> None:
        if self.hit:
            raise KeyboardInterrupt


def _error_json(error) -> dict:
    return {"line": error.line_no, "issues": [{"field": i.field, "message": i.message} for i in error.issues]}


# --- status / wait -------------------------------------------------------------------------------------------


redis_outage_limit_option = click.option(
    "--redis-outage-limit",
    type=click.FloatRange(min=0),
    default=settings.DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS,
    show_default=True,
    help="Seconds an unreachable Redis is retried (one notice on stderr) before the command gives up with exit "
    f"status {EXIT_REDIS_UNREACHABLE}.",
)


@main.command()
@click.argument("batch_id")
@redis_url_option
@redis_outage_limit_option
@json_option
def status(batch_id, redis_url, redis_outage_limit, as_json):
    """Counts, token totals, rates and ETA of a batch, and whether a live worker serves its queue."""
    with _riding_outages(redis_url, redis_outage_limit) as retry:
        client = _reading_client(redis_url, retry)
        with _batch_errors(batch_id):
            st = retry(client.batch(batch_id).status)
        num_workers = len(retry(_live_workers, client, st.queue))
    if as_json:
        echo_json({**status_json(st), "num_live_workers": num_workers})
        return
    click.echo(format_status(st))
    if not st.is_done and num_workers == 0:
        click.echo(f"  {_no_worker_message(st.queue)}")


@main.command()
@click.argument("batch_id")
@redis_url_option
@click.option(
    "--interval", type=click.FloatRange(min=0.05), default=1.0, show_default=True, help="Poll every N s."
)
@click.option(
    "--timeout", type=click.FloatRange(min=0), default=None, help="Give up after N seconds (exit 1)."
)
@redis_outage_limit_option
@json_option
def wait(batch_id, redis_url, interval, timeout, redis_outage_limit, as_json):
    """Show progress until BATCH_ID has finished, and say so while no live worker serves its queue.

    A Redis outage (a restart, a pause, a failover) is ridden out: one line on stderr, then the wait goes on.
    Exit status: 0 when every request completed, 2 when the batch finished with failed or cancelled
    requests, 3 when Redis stayed unreachable past --redis-outage-limit, 1 on another error or --timeout.
    Write the results whatever it returns: `cbq wait ID; cbq results ID -o out.jsonl --errors errors.jsonl`.
    """
    with _riding_outages(redis_url, redis_outage_limit) as retry:
        client = _reading_client(redis_url, retry)
        batch = client.batch(batch_id)
        with _batch_errors(batch_id):
            first = retry(batch.status)
            watch = _WorkerWatch(client, first.queue)
            with click.progressbar(length=first.num_total, label=f"batch {batch_id}", file=sys.stderr) as bar:

                def report(st) -> None:
                    bar.update(st.num_finished - bar.pos)
                    note = None if st.is_done else retry(watch.change)
                    if note:
                        click.echo(f"\n{note}", err=True)

                st = batch.wait(progress=report, interval=interval, timeout=timeout, retry=retry)
    if as_json:
        echo_json(status_json(st))
    else:
        click.echo(format_status(st))
    if st.num_failed or st.num_cancelled:
        sys.exit(2)


# A worker publishes its stats every 2 s; one silent this long is dead or stuck (its stats expire after 60 s).
LIVE_WORKER_SECONDS = 30.0
WORKER_CHECK_SECONDS = 5.0  # how often `wait` looks at the workers


def _live_workers(client: Client, queue: str) -> list[str]:
    """Names of the workers that serve `queue` and published stats recently (`cbq stats`' list)."""
    now = time.time()
    return [
        w.worker_name
        for w in client.workers()
        if queue in w.queues and w.state != "stopped" and now - w.updated_at < LIVE_WORKER_SECONDS
    ]


def _no_worker_message(queue: str) -> str:
    return (
        f"no live worker serves queue {queue}: nothing runs until one starts "
        f"(`cbq worker --queue {queue}`; a worker still loading its model is not counted)"
    )


class _WorkerWatch:
    """Whether live workers serve a queue, looked up at most every WORKER_CHECK_SECONDS; `change()` gives a
    line when that flips (the first look counts as a flip only when there is none)."""

    def __init__(self, client: Client, queue: str):
        self.client, self.queue = client, queue
        self._has_workers: bool | None = None
        self._next_check = 0.0

    def change(self) -> str | None:
        if time.monotonic() < self._next_check:
            return None
        self._next_check = time.monotonic() + WORKER_CHECK_SECONDS
        names = _live_workers(self.client, self.queue)
        was, self._has_workers = self._has_workers, bool(names)
        if was is not False and not names:
            return _no_worker_message(self.queue)
        if was is False and names:
            return f"worker(s) on queue {self.queue}: {', '.join(names)}"
        return None


# --- results -------------------------------------------------------------------------------------------------


@main.command()
@click.argument("batch_id")
@redis_url_option
@click.option(
    "-o",
    "--output",
    type=click.Path(dir_okay=False, allow_dash=True),
    default="-",
    help="Output file (default: stdout). Written atomically.",
)
@format_option
@errors_option
@click.option("--partial", is_flag=True, help="Write the finished requests of an unfinished batch.")
@redis_outage_limit_option
def results(batch_id, redis_url, output, output_format, errors, partial, redis_outage_limit):
    """Write the results of BATCH_ID as JSONL, in input order, failed and cancelled requests included.

    Files are written atomically, so a Redis outage while they are written starts them again once it answers; on
    stdout, an outage past the first line ends the command (exit status 3)."""
    with _riding_outages(redis_url, redis_outage_limit) as retry:
        batch = _reading_client(redis_url, retry).batch(batch_id)

        def write() -> tuple[int, int]:
            lines = retry(batch.results, format=output_format, partial=partial)
            return write_result_lines(output, lines, output_format, errors)

        with _batch_errors(batch_id):
            is_restartable = output != "-" and errors != "-"  # nothing went out yet when a file is retried
            num_written, num_errors = retry(write) if is_restartable else write()
    if output != "-":
        click.echo(f"wrote {num_written} results to {output}", err=True)
    if errors is not None and errors != "-":
        click.echo(f"wrote {num_errors} failed requests to {errors}", err=True)


# --- cancel --------------------------------------------------------------------------------------------------


@main.command()
@click.argument("batch_id")
@redis_url_option
@json_option
def cancel(batch_id, redis_url, as_json):
    """Cancel BATCH_ID: queued requests never run, running ones are aborted by their workers. A batch that
    already finished is left as it is."""
    with _batch_errors(batch_id):
        report = _client(redis_url).batch(batch_id).cancel()
    if as_json:
        echo_json(
            {
                "batch_id": batch_id,
                "num_chunks_dequeued": report.num_chunks_dequeued,
                "num_requests_cancelled": report.num_requests_cancelled,
                "num_requests_aborting": report.num_requests_aborting,
                "already_finished": report.already_finished,
            }
        )
    elif report.already_finished:
        click.echo(f"batch {batch_id} had already finished: nothing to cancel (its status is unchanged)")
    else:
        num_queued = report.num_requests_cancelled - report.num_requests_aborting
        click.echo(
            f"cancelled batch {batch_id}: {report.num_requests_cancelled} requests cancelled ({num_queued} "
            f"queued, cancelled now; {report.num_requests_aborting} on workers, being aborted)"
        )


# --- stats ---------------------------------------------------------------------------------------------------


@main.command()
@redis_url_option
@click.option(
    "--limit", type=click.IntRange(min=1), default=10, show_default=True, help="Recent batches shown."
)
@json_option
def stats(redis_url, limit, as_json):
    """Per-worker throughput and GPU use, and per-batch token and GPU-time accounting."""
    client = _client(redis_url)
    workers = client.workers()
    recent = client.batches(limit)
    models = collections.Counter(w.model for w in workers)  # the models live workers serve
    if as_json:
        echo_json(
            {
                "models": [{"id": m, "num_workers": k} for m, k in sorted(models.items())],
                "workers": [w.model_dump() for w in workers],
                "batches": [status_json(b) for b in recent],
            }
        )
        return
    click.echo("models: " + (", ".join(f"{m} ({k} worker{'s' * (k > 1)})" for m, k in sorted(models.items())) or "none"))
    click.echo(f"workers ({len(workers)})")
    click.echo(
        f"  {'name':<24} {'state':<9} {'model':<16} {'kind':<8} {'in flight':>9} {'tok/s':>9} {'busy':>8} {'prep ms':>8} {'cache hit':>9} {'done':>8}"
    )
    for w in workers:  # tok/s: output tokens of a generation model, prompt tokens of an embedding model
        rate = w.prompt_tokens_per_second if w.model_kind == "embed" else w.output_tokens_per_second
        click.echo(
            f"  {w.worker_name:<24} {w.state:<9} {w.model[:16]:<16} {w.model_kind:<8} {w.num_in_flight_requests:>9} "
            f"{rate:>9.1f} {w.busy_fraction:>8.0%} {w.cpu_prep_ms_per_step:>8.2f} "
            f"{w.prefix_cache_hit_rate:>9.0%} {w.num_requests_finished:>8}"
        )
    click.echo(f"batches (latest {len(recent)})")
    click.echo(
        f"  {'batch':<18} {'state':<10} {'done/total':>13} {'failed':>7} {'prompt tok':>11} {'compl tok':>10} {'device s':>8}"
    )
    for b in recent:
        click.echo(
            f"  {b.batch_id:<18} {b.state:<10} {f'{b.num_finished}/{b.num_total}':>13} {b.num_failed:>7} "
            f"{b.prompt_tokens:>11} {b.completion_tokens:>10} {b.gpu_seconds:>8.2f}"
        )


# --- helpers -------------------------------------------------------------------------------------------------


def _client(redis_url: str, queue: str | None = None) -> Client:
    return Client(connection=open_redis(redis_url), queue=queue)


@contextlib.contextmanager
def _riding_outages(redis_url: str, limit_s: float):
    """An `OutageRetry` that says once per outage, on stderr, that Redis is being retried; past `limit_s`, a
    one-line error and exit status EXIT_REDIS_UNREACHABLE (a Redis error no retry covers gets the same)."""
    where = settings.redact_url(redis_url)

    def on_outage(exc: Exception) -> None:
        click.echo(f"\nRedis unreachable, retrying for up to {limit_s:g} s: {where} ({one_line_error(exc)})", err=True)

    def on_recovery(seconds: float) -> None:
        click.echo(f"Redis answers again after {seconds:.0f} s", err=True)

    try:
        yield OutageRetry(limit_s, on_outage, on_recovery)
    except (RedisUnreachable, redis.ConnectionError, redis.TimeoutError) as exc:
        detail = str(exc) if isinstance(exc, RedisUnreachable) else one_line_error(exc)
        click.echo(f"Error: cannot reach Redis at {where}: {detail}", err=True)
        sys.exit(EXIT_REDIS_UNREACHABLE)


def _reading_client(redis_url: str, retry: OutageRetry) -> Client:
    """A client whose first PING rides out an outage (`open_redis` fails at once), and whose reads time out after
    READ_SOCKET_TIMEOUT_S, so that a paused Redis is noticed and retried too."""
    try:
        conn = settings.connect(
            redis_url, socket_timeout=READ_SOCKET_TIMEOUT_S, socket_connect_timeout=READ_CONNECT_TIMEOUT_S
        )
    except ValueError as exc:  # a malformed URL
        raise click.BadParameter(str(exc), param_hint="--redis-url") from None
    try:
        retry(conn.ping)
    except (redis.AuthenticationError, redis.ResponseError) as exc:
        raise click.ClickException(f"cannot use Redis at {settings.redact_url(redis_url)}: {exc}") from None
    return Client(connection=conn)


@contextlib.contextmanager
def _batch_errors(batch_id: str):
    """The client's errors about a batch, as click errors (exit status 1)."""
    try:
        yield
    except BatchNotFound as exc:
        raise click.ClickException(str(exc)) from None
    except BatchNotFinished as exc:
        raise click.ClickException(f"{exc}; wait with `cbq wait {batch_id}` or pass --partial") from None
    except TimeoutError as exc:
        raise click.ClickException(str(exc)) from None


if __name__ == "__main__":
    main()
