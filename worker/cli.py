"""`cbq worker` and `cbq run`, plugged into `cbq` through the `cbq.commands` entry points (pyproject.toml).

Imported only when one of them runs (or `cbq --help` lists them); the engine (torch) only when one is built.
"""

from __future__ import annotations

import functools
import os
import sys
from typing import Any

import click

from producer.cli_common import format_status, reopenable_lines, write_result_lines
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
from producer.settings import in_process_redis
from schemas import keys
from worker import queue_worker
from worker.engine.config import MODES, EngineConfig
from worker.queue_worker import CbqWorker, RedisUnavailable

MODEL_ENV = "CBQ_MODEL"
DEFAULT_MODEL = "tiny-llama"
ENGINE_DEFAULTS = EngineConfig()  # help texts show these; options left unset keep them


def build_engine(
    model: str,
    mode: str,
    device: str | None,
    fake_engine: bool,
    engine_config: dict | None = None,
    fake_latency: float = 0.0,
):
    """The real engine for `model` (a preset name, local path or hub name), or the instant FakeEngine.
    `engine_config["chat_template"]` (from --chat-template) replaces the tokenizer's chat template."""
    engine_config = dict(engine_config or {})
    chat_template = engine_config.pop("chat_template", None)
    if fake_engine:
        from worker.fake_engine import FakeEngine

        engine: Any = FakeEngine(
            latency_seconds=fake_latency,
            max_num_running=engine_config.get("max_num_seqs", FakeEngine().max_num_running),
        )
    else:
        from worker.engine.engine import Engine  # imports torch: only here
        from worker.engine.models import ModelLoadError

        overrides = {"mode": mode, **engine_config}
        if device:
            overrides["device"] = device
        try:
            engine = Engine.from_model(model, **overrides)
        except ModelLoadError as exc:
            raise click.ClickException(str(exc)) from None
    if chat_template is not None:
        use_chat_template = getattr(engine.tokenizer, "use_chat_template", None)
        if use_chat_template is None:
            raise click.ClickException(
                "--chat-template: this model's tokenizer renders chats with cbq's fixed template (a preset or the "
                "fake engine), which cannot be replaced"
            )
        use_chat_template(chat_template)
    return engine


def engine_tuning_options(f):
    """--max-num-seqs, --max-num-batched-tokens, --dtype, --no-prefix-caching, --no-generation-config-defaults,
    gathered into one `engine_config` dict argument."""

    @functools.wraps(f)
    def wrapper(
        *args,
        max_num_seqs,
        max_num_batched_tokens,
        dtype,
        no_prefix_caching,
        generation_config_defaults,
        chat_template,
        **kwargs,
    ):
        given = {
            "chat_template": chat_template.read() if chat_template is not None else None,
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "dtype": dtype,
            "enable_prefix_caching": False if no_prefix_caching else None,
            "generation_config_defaults": generation_config_defaults,
        }
        return f(*args, engine_config={k: v for k, v in given.items() if v is not None}, **kwargs)

    wrapper = click.option(
        "--chat-template",
        type=click.File("r", encoding="utf-8"),
        default=None,
        help="A Jinja chat template file, used instead of the tokenizer's (needed for chat lines when the "
        "checkpoint has none: they fail otherwise).",
    )(wrapper)
    wrapper = click.option(
        "--no-prefix-caching",
        is_flag=True,
        help="Compute every prompt whole instead of reusing the KV blocks of shared prefixes.",
    )(wrapper)

    wrapper = click.option(
        "--generation-config-defaults/--no-generation-config-defaults",
        default=None,
        help="Sampling fields a request leaves unset (temperature, top_p, top_k, max tokens) take the "
        "checkpoint's generation_config.json values (default), or cbq's built-in ones (greedy, the rest of "
        "the context). Its eos tokens apply either way.",
    )(wrapper)
    wrapper = click.option(
        "--dtype",
        type=click.Choice(["auto", "bfloat16", "float16", "float32"]),
        default=None,
        help=f"Model dtype (default: {ENGINE_DEFAULTS.dtype}, i.e. bfloat16 on CUDA, float32 on CPU).",
    )(wrapper)
    wrapper = click.option(
        "--max-num-batched-tokens",
        type=click.IntRange(min=1),
        default=None,
        help=f"Token budget per engine step (default {ENGINE_DEFAULTS.max_num_batched_tokens}).",
    )(wrapper)
    wrapper = click.option(
        "--max-num-seqs",
        type=click.IntRange(min=1),
        default=None,
        help=f"Running requests at most (default {ENGINE_DEFAULTS.max_num_seqs}).",
    )(wrapper)
    return wrapper


def served_model_name(model: str, given: str | None = None) -> str:
    """The model name a worker serves (vLLM's --served-model-name): `given`, else the checkpoint folder's name
    for a local path, else the preset or hub name as given (the fake engine stands in for --model too)."""
    if given:
        return given
    return os.path.basename(os.path.normpath(model)) if os.path.isdir(model) else model


def engine_options(f):
    f = engine_tuning_options(f)
    f = click.option(
        "--served-model-name",
        "served_model_name_",
        default=None,
        help="The model name this worker serves (default: the checkpoint folder's name, or the preset or hub "
        "name). Batches whose lines name a model go to that model's queue; outputs carry this name.",
    )(f)
    f = click.option(
        "--fake-engine",
        is_flag=True,
        help="Use the instant echo engine (no model, no torch), to try the queue.",
    )(f)
    f = click.option(
        "--device",
        default=None,
        help=f"Engine device, e.g. cuda:0 or cpu (default: {ENGINE_DEFAULTS.device}, CUDA when there is one).",
    )(f)
    f = click.option(
        "--mode",
        type=click.Choice(MODES),
        default=ENGINE_DEFAULTS.mode,
        show_default=True,
        help="Engine step loop: async overlaps CPU batch preparation with GPU compute.",
    )(f)
    f = click.option(
        "--model",
        envvar=MODEL_ENV,
        default=DEFAULT_MODEL,
        show_default=True,
        help=f"Engine preset name, local checkpoint path or hub name. Env: {MODEL_ENV}.",
    )(f)
    return f


def recovery_options(f):
    """How fast a dead worker's chunks come back, and how long a Redis outage is ridden out."""
    f = click.option(
        "--redis-outage-limit",
        type=click.FloatRange(min=1),
        default=queue_worker.DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS,
        show_default=True,
        help="Seconds without Redis before the worker gives up (exit 1); until then it keeps generating and "
        "writes the buffered results once Redis is back.",
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
@redis_url_option
@queue_option
@click.option("--burst", is_flag=True, help="Exit once the queue is empty and nothing is in flight.")
@click.option("--name", help="Worker name (default: a random one).")
@click.option("--log-level", default="INFO", show_default=True, help="Logging level.")
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
@click.option("--fake-latency", type=click.FloatRange(min=0), default=0.0, hidden=True)
def worker(
    model,
    mode,
    device,
    fake_engine,
    engine_config,
    served_model_name_,
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
    health_file,
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
    conn = open_redis(redis_url)
    engine = build_engine(model, mode, device, fake_engine, engine_config, fake_latency=fake_latency)
    served = served_model_name(model, served_model_name_)
    cbq_worker = CbqWorker(
        [keys.model_queue(queue, served), queue],  # its model's batches first, then those naming none
        engine,
        connection=conn,
        model_name=served,
        mode=mode,
        name=name,
        heartbeat_interval_seconds=heartbeat_interval,
        stale_after_seconds=stale_after,
        maintenance_interval_seconds=maintenance_interval,
        redis_outage_limit_seconds=redis_outage_limit,
        health_file=health_file,
    )
    if metrics_port is not None:
        from worker.metrics import serve_metrics

        serve_metrics(cbq_worker, metrics_port)
    try:
        cbq_worker.work(burst=burst, logging_level=log_level)
    except RedisUnavailable as exc:
        raise click.ClickException(str(exc)) from None


@click.command()
@click.argument("file", type=click.File("rb"))
@click.option(
    "-o", "--output", required=True, type=click.Path(dir_okay=False, allow_dash=True), help="Results file."
)
@engine_options
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
@click.option("--log-level", default="WARNING", show_default=True, help="Worker logging level.")
@strict_option
@sampling_options
@chat_template_kwargs_option
def run(
    file,
    output,
    model,
    mode,
    device,
    fake_engine,
    engine_config,
    served_model_name_,
    redis_url,
    queue,
    output_format,
    errors,
    chunk_size,
    return_token_ids,
    log_level,
    strict,
    defaults,
    chat_template_kwargs,
):
    """Submit FILE, run it with an in-process worker, and write the results to OUTPUT, in input order.

    Producer and worker share one process and, unless --redis-url is given, an in-process Redis (fakeredis):
    the whole pipeline with one command and nothing to set up.
    """
    client = Client(connection=open_redis(redis_url) if redis_url else in_process_redis(), queue=queue)
    reopen, _ = click.get_current_context().with_resource(reopenable_lines(file))
    served = served_model_name(model, served_model_name_)
    validated = client.validate(reopen, model=served)  # a line naming another model fails: model_not_found
    report_validation(validated, strict, "run")
    if not validated.requests:
        raise click.ClickException("no requests in the input")

    click.echo(f"loading {'the fake engine' if fake_engine else model}", err=True)
    engine = build_engine(
        model, mode, device, fake_engine, engine_config
    )  # first, so queue times do not include loading
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
    click.echo(f"batch {batch.id}: {batch.submission.num_requests} requests", err=True)
    cbq_worker = CbqWorker(
        [keys.model_queue(queue, served), queue],
        engine,
        connection=client.connection,
        model_name=served,
        mode=mode,
        name=f"cbq-run-{os.getpid()}",
    )
    cbq_worker.work(burst=True, logging_level=log_level)

    write_result_lines(output, batch.results(format=output_format, partial=True), output_format, errors)
    status = batch.status()
    click.echo(format_status(status), err=True)
    if not status.is_done:
        raise click.ClickException("the worker stopped before the batch finished; partial results written")
    if status.num_failed:
        sys.exit(2)
