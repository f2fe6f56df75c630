"""Reusable click options, shared by the producer and worker commands. Owns flag names and their env vars."""

from __future__ import annotations

import functools
import json
from collections.abc import Callable

import click
import redis
from pydantic import ValidationError

from producer import settings
from schemas.request import SamplingOverrides
from schemas.result import OUTPUT_FORMATS


def redis_url_option(f: Callable) -> Callable:
    return click.option(
        "--redis-url",
        envvar=settings.REDIS_URL_ENV,
        default=settings.DEFAULT_REDIS_URL,
        show_default=True,
        help=f"Redis URL (redis://, rediss:// for TLS; a password may be in the URL). Env: {settings.REDIS_URL_ENV}.",
    )(f)


def queue_option(f: Callable) -> Callable:
    return click.option(
        "--queue",
        envvar=settings.QUEUE_ENV,
        default=settings.DEFAULT_QUEUE,
        show_default=True,
        help=f"rq queue name. Env: {settings.QUEUE_ENV}.",
    )(f)


def format_option(f: Callable) -> Callable:
    return click.option(
        "--format",
        "output_format",
        type=click.Choice(OUTPUT_FORMATS),
        default=OUTPUT_FORMATS[0],
        show_default=True,
        help="cbq result lines, or OpenAI Batch output lines.",
    )(f)


def json_option(f: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(f)


def sampling_options(f: Callable) -> Callable:
    """Batch-level sampling defaults; values given on a line win. Adds a `defaults: SamplingOverrides` kwarg."""
    options = [
        click.option("--max-new-tokens", type=int, help="Default max_new_tokens (>= 1)."),
        click.option("--temperature", type=float, help="Default temperature (>= 0; 0 is greedy)."),
        click.option("--top-p", type=float, help="Default top_p, in (0, 1]."),
        click.option("--top-k", type=int, help="Default top_k (>= 0; 0 means off)."),
        click.option("--seed", type=int, help="Default seed."),
        click.option("--stop", multiple=True, help="Default stop string (repeat for several)."),
        click.option("--ignore-eos/--no-ignore-eos", default=None, help="Default for ignore_eos."),
    ]

    @functools.wraps(f)
    def wrapper(*args, max_new_tokens, temperature, top_p, top_k, seed, stop, ignore_eos, **kwargs):
        given = {
            "max_new_tokens": max_new_tokens,
            "temperature": temperature,
            "top_p": top_p,
            "top_k": top_k,
            "seed": seed,
            "stop": list(stop) or None,
            "ignore_eos": ignore_eos,
        }
        try:
            defaults = SamplingOverrides(**given)
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            flag = "--" + str(error["loc"][0]).replace("_", "-")
            raise click.BadParameter(error["msg"], param_hint=flag) from None
        return f(*args, defaults=defaults, **kwargs)

    for option in reversed(options):
        wrapper = option(wrapper)
    return wrapper


def ttl_option(f: Callable) -> Callable:
    return click.option(
        "--ttl",
        "ttl_seconds",
        type=click.IntRange(min=1),
        envvar=settings.RESULT_TTL_ENV,
        default=settings.DEFAULT_RESULT_TTL_SECONDS,
        show_default=True,
        help=f"Seconds a batch's requests and results are kept after its last activity. Env: {settings.RESULT_TTL_ENV}.",
    )(f)


def open_redis(url: str) -> redis.Redis:
    """Connect and check that Redis answers, turning failures into a clear user error."""
    conn = settings.connect(url)
    try:
        conn.ping()
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, redis.ResponseError) as exc:
        raise click.ClickException(f"cannot reach Redis at {settings.redact_url(url)}: {exc}") from None
    return conn


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, sort_keys=False))
