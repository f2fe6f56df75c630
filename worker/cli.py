"""`cbq worker` and `cbq run`, plugged into `cbq` through the `cbq.commands` entry points (pyproject.toml).

Imported only when one of them runs (or `cbq --help` lists them); the engine (torch) only when one is built.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import time
from collections.abc import Iterator
from typing import Any, cast

import click
from click.core import ParameterSource

from producer.cli_common import (
    check_output_path,
    format_status,
    reopenable_lines,
    warn_overridden_defaults,
    write_result_lines,
)
from producer.client import Client, SourceChanged
from producer.options import (
    chat_template_kwargs_option,
    chunk_size_option,
    errors_option,
    format_option,
    open_redis,
    queue_option,
    redis_url_option,
    report_validation,
    sampling_options,
    strict_option,
)
from producer.settings import (
    DEFAULT_REDIS_WAIT_TIMEOUT_SECONDS,
    DEFAULT_RESULT_TTL_SECONDS,
    REDIS_WAIT_REPLICAS_ENV,
    REDIS_WAIT_TIMEOUT_ENV,
    in_process_redis,
)
from producer.store import queue_results
from schemas import keys
from schemas.result import OpenAIBatchOutputLine, ResultLine
from worker import queue_worker
from worker.cli_options import (
    DEFAULT_MODEL,
    MODEL_ENV,
    engine_options,
    media_options,
    output_parser_options,
    served_model_name,
)
from worker.maintenance import RedisUnavailable
from worker.queue_worker import CbqWorker
from worker.replica_wait import ReplicaWait
from worker.run_journal import JOURNAL_SUFFIX, Journal, JournalMismatch, input_sha256, journal_path
from worker.run_progress import DEFAULT_PLAIN_INTERVAL_SECONDS, RunProgress
from worker.worker_log import (
    DEFAULT_SUMMARY_INTERVAL_SECONDS,
    PeriodicSummary,
    demote_per_chunk_lines,
    describe_engine,
)


def build_engine(
    model: str,
    mode: str,
    device: str | None,
    fake_engine: bool,
    engine_config: dict | None = None,
    fake_latency: float = 0.0,
):
    """The real engine for `model` (a preset name, local path or hub id), or the instant FakeEngine. A model
    name that cannot name a model, a checkpoint that cannot load and settings the engine refuses (e.g. a KV
    cache that does not fit) are click errors: one line, exit 1."""
    engine_config = dict(engine_config or {})
    chat_template = engine_config.pop("chat_template", None)  # --chat-template's text
    engine: Any
    if fake_engine:
        from worker.fake_engine import FakeEngine

        engine = FakeEngine(
            latency_seconds=fake_latency,
            max_num_running=engine_config.get("max_num_seqs", FakeEngine().max_num_running),
        )
    else:
        from worker.engine.engine_builder import build_engine  # imports torch: only here
        from worker.engine.models import ModelLoadError
        from worker.engine.parallel.group import RankFailure

        check_model(model)
        overrides = {"mode": mode, **engine_config}
        if device:
            overrides["device"] = device
        try:
            engine = build_engine(model, **overrides)
        except ModelLoadError as exc:
            raise click.ClickException(str(exc)) from None
        except ValueError as exc:  # EngineConfig's checks, KV cache sizing
            raise click.ClickException(f"cannot start the engine: {exc}") from None
        except RankFailure as exc:  # a tensor-parallel helper failed to start (its traceback is above)
            raise click.ClickException(f"cannot start the engine: {exc}") from None
    if chat_template is not None:
        use_chat_template = getattr(engine.tokenizer, "use_chat_template", None)
        if use_chat_template is None:
            raise click.ClickException(
                "--chat-template: this model's tokenizer renders chats with cbq's fixed template (a preset or the "
                "fake engine), which cannot be replaced"
            )
        use_chat_template(chat_template)
    return engine


def choose_output_parsing(engine, tool_call_parser: str, reasoning_parser: str):
    """The chat-output parsers the flags name for this engine's model (`auto`: from its chat template); the
    choice is printed when any parser is active."""
    from worker.output_parsers import OutputParsing, chat_template_text

    try:
        parsing = OutputParsing.choose(tool_call_parser, reasoning_parser, chat_template_text(engine.tokenizer))
    except ValueError as exc:
        raise click.ClickException(str(exc)) from None
    if parsing.tool_call_parser or parsing.reasoning_parser:
        click.echo(f"output parsers: {parsing.describe()}", err=True)
    return parsing


def check_model(model: str) -> None:
    """A click error at once for a model name that names nothing (see `worker.model_names`)."""
    from worker.engine.models import PRESETS  # imports torch
    from worker.model_names import UnknownModel, check_model_name

    try:
        check_model_name(model, list(PRESETS))
    except UnknownModel as exc:
        raise click.ClickException(str(exc)) from None


LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
EXIT_INTERRUPTED = 128 + signal.SIGINT  # as shells report a Ctrl-C
DEMO_MODEL_NOTE = f"random-weight {DEFAULT_MODEL!r} demo preset: outputs are noise"


def log_level_option(default: str, help_text: str):
    return click.option(
        "--log-level",
        type=click.Choice(LOG_LEVELS, case_sensitive=False),
        default=default,
        show_default=True,
        help=help_text,
    )


def warn_if_demo_model(fake_engine: bool) -> bool:
    """One stderr line when --model was left to its default (no --model, no CBQ_MODEL): the engine is the
    random-weight demo preset, whose outputs are noise. Returns whether it was."""
    if fake_engine or click.get_current_context().get_parameter_source("model") is not ParameterSource.DEFAULT:
        return False
    click.echo(
        f"warning: no --model and no {MODEL_ENV}: running the {DEMO_MODEL_NOTE} (give --model PATH-OR-HUB-ID "
        "for a real model)",
        err=True,
    )
    return True


def recovery_options(f):
    """How fast a dead worker's chunks come back, how long a Redis outage is ridden out, and whether result
    writes wait for Redis replicas."""
    f = click.option(
        "--redis-wait-timeout",
        envvar=REDIS_WAIT_TIMEOUT_ENV,
        type=click.FloatRange(min=0.001, max=30),
        default=DEFAULT_REDIS_WAIT_TIMEOUT_SECONDS,
        show_default=True,
        help="Seconds a result write waits at most for --redis-wait-replicas; short of them, the worker logs it "
        f"and goes on. Env: {REDIS_WAIT_TIMEOUT_ENV}.",
    )(f)
    f = click.option(
        "--redis-wait-replicas",
        envvar=REDIS_WAIT_REPLICAS_ENV,
        type=click.IntRange(min=0),
        default=0,
        show_default=True,
        help="Durable result writes: each waits (Redis WAIT) until this many replicas have it before the worker "
        "counts it as written, so a failover to one of them keeps it (docs/operations.md). 0: Redis's "
        f"asynchronous replication alone. Env: {REDIS_WAIT_REPLICAS_ENV}.",
    )(f)
    f = click.option(
        "--redis-outage-limit",
        type=click.FloatRange(min=1),
        default=queue_worker.DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS,
        show_default=True,
        help="Seconds without Redis before the worker gives up (exit 1); until then it keeps generating and "
        "writes the buffered results once Redis is back. A worker starting before Redis answers waits as long.",
    )(f)
    f = click.option(
        "--maintenance-interval",
        type=click.FloatRange(min=0.5),
        default=queue_worker.DEFAULT_MAINTENANCE_INTERVAL_SECONDS,
        show_default=True,
        help="Seconds between rq registry cleanups (they re-enqueue the chunks of dead workers).",
    )(f)
    f = click.option(
        "--stale-after",
        type=click.IntRange(min=2),
        default=queue_worker.DEFAULT_STALE_AFTER_SECONDS,
        show_default=True,
        help="Seconds without a heartbeat after which a chunk counts as abandoned (at least 2 heartbeats).",
    )(f)
    f = click.option(
        "--heartbeat-interval",
        type=click.IntRange(min=1),
        default=queue_worker.DEFAULT_HEARTBEAT_INTERVAL_SECONDS,
        show_default=True,
        help="Seconds between heartbeats of the chunks in flight.",
    )(f)
    return f


@click.command()
@engine_options
@output_parser_options
@media_options
@redis_url_option
@queue_option
@click.option("--burst", is_flag=True, help="Exit once the queue is empty and nothing is in flight.")
@click.option("--name", help="Worker name (default: a random one).")
@log_level_option("INFO", "Logging level.")
@click.option(
    "--metrics-port",
    type=click.IntRange(1, 65535),
    default=None,
    help="Serve Prometheus metrics on this port (all interfaces, path /metrics).",
)
@recovery_options
@click.option(
    "--health-file",
    envvar="CBQ_HEALTH_FILE",
    type=click.Path(dir_okay=False),
    help="Touch this file every few seconds while the worker loop turns (for container healthchecks). "
    "Env: CBQ_HEALTH_FILE.",
)
@click.option(
    "--summary-interval",
    type=click.FloatRange(min=0),
    default=DEFAULT_SUMMARY_INTERVAL_SECONDS,
    show_default=True,
    help="Seconds between INFO lines summing up the requests finished, tok/s and the engine's load (0: none). "
    "The line per finished chunk is at DEBUG.",
)
@click.option("--fake-latency", type=click.FloatRange(min=0), default=0.0, hidden=True)
def worker(
    model,
    mode,
    device,
    fake_engine,
    engine_config,
    served_model_name_,
    tool_call_parser,
    reasoning_parser,
    media_policy,
    redis_url,
    queue,
    burst,
    name,
    log_level,
    metrics_port,
    heartbeat_interval,
    stale_after,
    maintenance_interval,
    redis_outage_limit,
    redis_wait_replicas,
    redis_wait_timeout,
    health_file,
    summary_interval,
    fake_latency,
):
    """Run a worker: drain QUEUE into one continuous-batching engine and write results to Redis.

    Many chunk jobs are in flight at once. SIGINT/SIGTERM stops admitting and drains what is in flight;
    a second signal stops at once and exits 1 (unfinished chunks are retried by rq, finished requests are not
    redone). A worker that dies without either has its chunks re-enqueued by the other workers' cleanup within
    about --stale-after + --maintenance-interval seconds.
    """
    if stale_after < 2 * heartbeat_interval:
        raise click.BadParameter("must be at least twice --heartbeat-interval", param_hint="--stale-after")
    if not fake_engine:
        check_model(model)  # before anything waits for Redis
    is_demo = warn_if_demo_model(fake_engine)
    conn = open_redis(redis_url, wait_s=redis_outage_limit)
    engine = build_engine(model, mode, device, fake_engine, engine_config, fake_latency=fake_latency)
    served_name = served_model_name(model, served_model_name_)
    click.echo(describe_engine(engine, model, served_name) + (f" ({DEMO_MODEL_NOTE})" if is_demo else ""), err=True)
    cbq_worker = CbqWorker(
        [keys.model_queue(queue, served_name), queue],  # its model's batches first, then those naming none
        engine,
        output_parsing=choose_output_parsing(engine, tool_call_parser, reasoning_parser),
        media_policy=media_policy,
        connection=conn,
        model_name=served_name,
        mode=mode,
        name=name,
        heartbeat_interval_seconds=heartbeat_interval,
        stale_after_seconds=stale_after,
        maintenance_interval_seconds=maintenance_interval,
        redis_outage_limit_seconds=redis_outage_limit,
        replica_wait=ReplicaWait(redis_wait_replicas, redis_wait_timeout) if redis_wait_replicas else None,
        health_file=health_file,
    )
    if metrics_port is not None:
        from worker.metrics import serve_metrics

        serve_metrics(cbq_worker, metrics_port)
    demote_per_chunk_lines()
    summary = (
        PeriodicSummary(cbq_worker, summary_interval) if summary_interval > 0 else contextlib.nullcontext()
    )
    try:
        with summary:
            cbq_worker.work(burst=burst, logging_level=log_level)
    except RedisUnavailable as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.argument("file", type=click.File("rb"), required=False)
@click.option(
    "-i",
    "--input-file",
    type=click.File("rb"),
    help="The input file, as vLLM's run-batch names it: the same as FILE.",
)
@click.option(
    "-o",
    "--output",
    required=True,
    type=click.Path(dir_okay=False, allow_dash=True),
    help="Results file, written at the end (to a temporary file beside it, then renamed): a run stopped early "
    f"leaves it unwritten. Results are journaled to OUTPUT{JOURNAL_SUFFIX} as they "
    "finish, so a run that was killed resumes when run again.",
)
@click.option(
    "--fresh",
    is_flag=True,
    help="Start over: discard the results an interrupted run left in the journal.",
)
@engine_options
@output_parser_options
@media_options
@click.option(
    "--redis-url",
    default=None,
    help="Use this Redis instead of an in-process one (CBQ_REDIS_URL is ignored here: run is self-contained).",
)
@queue_option
@format_option
@errors_option
@chunk_size_option
@click.option("--token-ids", "return_token_ids", is_flag=True, help="Also return generated token ids.")
@log_level_option("WARNING", "Worker logging level.")
@click.option(
    "--progress-interval",
    type=click.FloatRange(min=0.1),
    default=DEFAULT_PLAIN_INTERVAL_SECONDS,
    show_default=True,
    help="Seconds between progress lines when stderr is not a terminal (on one, the line is redrawn).",
)
@strict_option
@sampling_options
@chat_template_kwargs_option
@click.option("--fake-latency", type=click.FloatRange(min=0), default=0.0, hidden=True)
def run(
    file,
    input_file,
    output,
    fresh,
    model,
    mode,
    device,
    fake_engine,
    engine_config,
    served_model_name_,
    tool_call_parser,
    reasoning_parser,
    media_policy,
    redis_url,
    queue,
    output_format,
    errors,
    chunk_size,
    return_token_ids,
    log_level,
    progress_interval,
    strict,
    defaults,
    chat_template_kwargs,
    fake_latency,
):
    """Submit FILE, run it with an in-process worker, and write the results to OUTPUT, in input order.

    Producer and worker share one process and, unless --redis-url is given, an in-process Redis (fakeredis):
    the whole pipeline with one command and nothing to set up. A run that is killed (or stopped with Ctrl-C:
    exit 130) keeps its finished results in OUTPUT.cbq-journal and leaves OUTPUT unwritten: the same command
    again runs only the rest. If FILE changed meanwhile it refuses, unless --fresh.

    Sampling flags (--max-new-tokens, --temperature, ...) are defaults, as in vLLM: a line's own value wins
    (the run says so when lines override a flag). vLLM's flags are taken where they mean the same.
    """
    if (file is None) == (input_file is None):
        raise click.UsageError("give the input file once: FILE or -i/--input-file")
    file = file or input_file
    try:
        _run(file, output, fresh, model, mode, device, fake_engine, engine_config, served_model_name_,
             tool_call_parser, reasoning_parser, media_policy, redis_url, queue, output_format, errors, chunk_size,
             return_token_ids, log_level, progress_interval, strict, defaults, chat_template_kwargs, fake_latency)
    except KeyboardInterrupt:  # before the worker's own handlers are in place (loading, validating)
        click.echo("interrupted", err=True)
        sys.exit(EXIT_INTERRUPTED)


def _run(file, output, fresh, model, mode, device, fake_engine, engine_config, served_model_name_,
         tool_call_parser, reasoning_parser, media_policy, redis_url, queue, output_format, errors, chunk_size,
         return_token_ids, log_level, progress_interval, strict, defaults, chat_template_kwargs, fake_latency):
    started_at = time.monotonic()
    input_name = getattr(file, "name", None)
    for path, hint in ((output, "-o/--output"), (errors, "--errors")):
        if path is not None:
            check_output_path(path, hint, input_name if isinstance(input_name, str) else None)
    is_demo = warn_if_demo_model(fake_engine)
    client = Client(connection=open_redis(redis_url) if redis_url else in_process_redis(), queue=queue)
    reopen, _ = click.get_current_context().with_resource(reopenable_lines(file))
    served_name = served_model_name(model, served_model_name_)
    validated = client.validate(reopen, model=served_name)  # a line naming another model fails: model_not_found
    report_validation(validated, strict, "run")
    if not validated.requests:  # as vLLM's run-batch: an empty output, exit 0
        write_result_lines(output, iter(()), output_format, errors)
        click.echo(f"no requests in the input: {output} is empty", err=True)
        return
    warn_overridden_defaults(validated, defaults)
    settings = {
        "model": served_name,
        "sampling": defaults.given(),
        "chat_template_kwargs": chat_template_kwargs,
        "return_token_ids": return_token_ids,
        "tool_call_parser": tool_call_parser,
        "reasoning_parser": reasoning_parser,
        **{k: engine_config.get(k) for k in OUTPUT_SETTINGS},
    }
    if not fake_engine:
        check_model(model)  # before a journal is started for it
    journal = None if output == "-" else _open_journal(output, input_sha256(reopen()), settings, fresh)

    click.echo(f"loading {'the fake engine' if fake_engine else model}", err=True)
    try:  # first, so queue times do not include loading
        engine = build_engine(model, mode, device, fake_engine, engine_config, fake_latency=fake_latency)
    except BaseException:
        if journal is not None and not journal.is_resumed:
            journal.remove()  # it holds nothing yet
        raise
    click.echo(describe_engine(engine, model, served_name) + (f" ({DEMO_MODEL_NOTE})" if is_demo else ""), err=True)
    output_parsing = choose_output_parsing(engine, tool_call_parser, reasoning_parser)
    try:
        batch = client.submit(
            validated,
            chunk_size=chunk_size,
            return_token_ids=return_token_ids,
            retries=0,
            strict=strict,
            chat_template_kwargs=chat_template_kwargs,
            **defaults.given(),
        )
    except SourceChanged as exc:  # FILE was edited while the model loaded
        raise click.ClickException(str(exc)) from None
    assert batch.submission is not None, "Client.submit returns the batch with its submission"
    num_total = batch.submission.num_requests
    num_resumed = 0 if journal is None else journal.replay(_store_results(client, batch.id, num_total))
    resumed = f", {num_resumed} done by the interrupted run ({journal.path})" if journal and num_resumed else ""
    click.echo(f"batch {batch.id}: {num_total} requests{resumed}", err=True)

    progress = RunProgress(num_total, num_resumed, interval_seconds=progress_interval)

    def on_results_written(results):
        if journal is not None:
            journal.append(results)
        progress.update(results)

    cbq_worker = CbqWorker(
        [keys.model_queue(queue, served_name), queue],
        engine,
        connection=client.connection,
        model_name=served_name,
        mode=mode,
        name=f"cbq-run-{os.getpid()}",
        on_results_written=on_results_written,
        output_parsing=output_parsing,
        media_policy=media_policy,
    )
    demote_per_chunk_lines()
    try:
        cbq_worker.work(burst=True, logging_level=log_level)
    except SystemExit:  # a second signal: cold stop (the chunks in flight were handed back)
        if cbq_worker.stop_signum is None:
            raise
    finally:
        progress.finish()
        if journal is not None:
            journal.close()

    def summary() -> str:  # this run's rates over this run's time (not the journaled results')
        status = batch.status()
        seconds = max(progress.elapsed_seconds(), 1e-9)
        this_run = status.model_copy(
            update={
                "requests_per_second": progress.num_done_here / seconds,
                "completion_tokens_per_second": progress.num_output_tokens / seconds,
            }
        )
        return format_status(this_run, _device_name(engine), wall_seconds=time.monotonic() - started_at)

    status = batch.status()
    if not status.is_done and journal is not None:  # OUTPUT stays unwritten: the journal has what finished
        click.echo(summary(), err=True)
        _stopped_early(
            cbq_worker.stop_signum,
            f"{journal.num_finished} of {num_total} results are kept in {journal.path} and {output} was not "
            "written: run the same command to resume",
        )
    lines = cast("Iterator[ResultLine | OpenAIBatchOutputLine]", batch.results(format=output_format, partial=True))
    write_result_lines(output, lines, output_format, errors)
    status = batch.status()
    click.echo(summary(), err=True)
    if is_demo:
        click.echo(f"({DEMO_MODEL_NOTE})", err=True)
    if not status.is_done:  # only to stdout (-o -): there is no journal to resume from
        _stopped_early(cbq_worker.stop_signum, "partial results written")
    if journal is not None:
        journal.remove()
    if status.num_failed:
        sys.exit(2)


def _device_name(engine: Any) -> str:
    """What ran the engine's steps, for the summary: "GPU" or "CPU" (the fake engine: "device")."""
    kind = getattr(getattr(engine, "device", None), "type", None)
    return {"cuda": "GPU", "cpu": "CPU"}.get(kind or "", "device")


def _stopped_early(signum: int | None, what: str) -> None:
    """End a run whose batch did not finish: exit 128 + the signal that stopped it (130 for Ctrl-C), else 1."""
    if signum is None:
        raise click.ClickException(f"the worker stopped before the batch finished; {what}")
    click.echo(f"interrupted by {signal.Signals(signum).name} before the batch finished; {what}", err=True)
    sys.exit(128 + signum)


# EngineConfig fields that change what a run outputs: a journal written under other values is not resumed.
OUTPUT_SETTINGS = ("dtype", "max_model_len", "generation_config_defaults")


def _open_journal(output: str, input_hash: str, settings: dict, fresh: bool) -> Journal:
    try:
        return Journal.open(journal_path(output), input_hash, json.loads(json.dumps(settings)), fresh)
    except JournalMismatch as exc:
        raise click.ClickException(str(exc)) from None


def _store_results(client: Client, batch_id: str, num_total: int):
    """Where a journal's results go when a run resumes: into the batch, as if its worker had written them, so
    the worker skips those requests and the output has them in their place."""

    def store(results: list[ResultLine]) -> None:
        if any(r.index >= num_total for r in results):
            raise click.ClickException(
                f"the journal holds a result past the input's {num_total} requests; pass --fresh to start over"
            )
        with client.connection.pipeline(transaction=True) as pipe:
            queue_results(pipe, batch_id, DEFAULT_RESULT_TTL_SECONDS, results)
            pipe.execute()

    return store
