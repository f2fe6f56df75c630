"""Reusable click options, shared by the producer and worker commands. Owns flag names and their env vars."""

from __future__ import annotations

import functools
import json
import types
import typing
from collections.abc import Callable
from typing import Annotated, Any

import annotated_types
import click
import redis
from pydantic import BaseModel, ValidationError
from pydantic.fields import FieldInfo

from producer import settings
from producer.client import OutageRetry, RedisUnreachable, one_line_error
from producer.store.submit import ValidatedFile
from schemas.chat import checked_chat_template_kwargs
from schemas.result import OUTPUT_FORMATS
from schemas.sampling import Sampling


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


def chunk_size_option(f: Callable) -> Callable:
    return click.option(
        "--chunk-size",
        type=click.IntRange(min=1),
        default=settings.DEFAULT_CHUNK_SIZE,
        show_default=True,
        help="Requests per rq job.",
    )(f)


def errors_option(f: Callable) -> Callable:
    return click.option(
        "--errors",
        type=click.Path(dir_okay=False, allow_dash=True),
        default=None,
        help="Write failed and cancelled requests to this file instead (OpenAI's error file: with --format "
        "openai, errors and non-200 responses). Without it, every request goes to the output.",
    )(f)


def _skip_invalid_removed(_ctx, _param, value: bool) -> None:
    if value:
        raise click.UsageError(
            "--skip-invalid was removed: a line whose request is invalid now fails alone (status 400, in the "
            "errors output) and the others run; --strict refuses the whole file instead"
        )


def strict_option(f: Callable) -> Callable:
    """`--strict` (all or nothing), and the flag it replaced, which now says why it is gone."""
    f = click.option(
        "--skip-invalid", is_flag=True, hidden=True, expose_value=False, callback=_skip_invalid_removed
    )(f)
    return click.option(
        "--strict",
        is_flag=True,
        help="Refuse the whole file when any request is invalid. Without it, an invalid request fails alone "
        "(status 400 in the errors output, counted failed) and the others run; format errors (not JSON, a "
        "missing or duplicate custom_id, ...) always refuse the file.",
    )(f)


def report_validation(validated: ValidatedFile, strict: bool, what: str) -> None:
    """Print every bad line to stderr; raise a ClickException if the file is refused (`what`: 'enqueued')."""
    refused = validated.refusal(strict)
    for error in refused:
        click.echo(str(error), err=True)
    if refused:
        raise click.ClickException(f"{len(refused)} invalid line(s); nothing was {what}")
    for invalid in validated.invalid:
        click.echo(f"{invalid} (this request fails with status 400; the others run)", err=True)


def json_option(f: Callable) -> Callable:
    return click.option("--json", "as_json", is_flag=True, help="Print JSON instead of text.")(f)


def sampling_options(f: Callable, *, overrides: type[Sampling] = Sampling) -> Callable:
    """One flag per sampling field, as batch defaults (values on a line win). Adds a `defaults` kwarg.

    The flags are derived from `overrides` (by default from `schemas.sampling.Sampling`): `--top-k` for `top_k`,
    the field's description as help, numeric bounds as click ranges, a repeatable flag for a list field and a
    `--x/--no-x` pair for a bool. pydantic then checks every bound again and gives the error of the flag.
    A structured field (an output constraint, logit_bias) has no flag: lines set it.
    """
    names = [name for name, info in overrides.model_fields.items() if not _is_structured(info)]

    @functools.wraps(f)
    def wrapper(*args, **kwargs):
        given = {name: kwargs.pop(name) for name in names}
        given = {name: list(v) if isinstance(v, tuple) else v for name, v in given.items()}
        try:
            defaults = overrides(**{name: v for name, v in given.items() if v not in (None, [])})
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            raise click.BadParameter(error["msg"], param_hint=_flag(str(error["loc"][0]))) from None
        return f(*args, defaults=defaults, **kwargs)

    for name in reversed(names):
        wrapper = _sampling_option(name, overrides.model_fields[name])(wrapper)
    return wrapper


def _is_structured(info: FieldInfo) -> bool:
    annotation, _ = _unwrap(info.annotation, info.metadata)
    if typing.get_origin(annotation) is dict:  # a mapping (logit_bias) has no flag: lines give it
        return True
    return isinstance(annotation, type) and issubclass(annotation, BaseModel)


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _sampling_option(name: str, info: FieldInfo) -> Callable:
    annotation, bounds = _unwrap(info.annotation, info.metadata)
    help_text = info.description or ""
    if annotation is bool:
        return click.option(f"{_flag(name)}/--no-{name.replace('_', '-')}", default=None, help=help_text)
    if typing.get_origin(annotation) is list:
        item, item_bounds = _unwrap(typing.get_args(annotation)[0], [])
        most = next((b.max_length for b in bounds if isinstance(b, annotated_types.MaxLen)), None)
        repeat = f" Repeat for several{f' (at most {most})' if most else ''}."
        return click.option(
            _flag(name), type=_click_type(item, item_bounds), multiple=True, help=help_text + repeat
        )
    return click.option(_flag(name), type=_click_type(annotation, bounds), help=help_text)


def _unwrap(annotation: Any, metadata: list[Any]) -> tuple[Any, list[Any]]:
    """(`int`, [Ge(1), Le(9)]) from `Annotated[int, Field(ge=1, le=9)] | None` and the field's own metadata."""
    bounds = list(metadata)
    while True:
        args = [a for a in typing.get_args(annotation) if a is not type(None)]
        if typing.get_origin(annotation) is Annotated:
            for extra in args[1:]:
                bounds += extra.metadata if isinstance(extra, FieldInfo) else [extra]
            annotation = args[0]
        elif typing.get_origin(annotation) in (typing.Union, types.UnionType) and len(args) == 1:
            annotation = args[0]
        else:
            return annotation, bounds


def _click_type(annotation: Any, bounds: list[Any]) -> Any:
    """`annotation` as a click type, a range when it has numeric bounds (click shows the range in --help)."""
    if annotation not in (int, float):
        return annotation
    lo = next((b for b in bounds if isinstance(b, (annotated_types.Ge, annotated_types.Gt))), None)
    hi = next((b for b in bounds if isinstance(b, (annotated_types.Le, annotated_types.Lt))), None)
    if lo is None and hi is None:
        return annotation
    range_type = click.IntRange if annotation is int else click.FloatRange
    return range_type(
        min=None if lo is None else getattr(lo, "ge", getattr(lo, "gt", None)),
        max=None if hi is None else getattr(hi, "le", getattr(hi, "lt", None)),
        min_open=isinstance(lo, annotated_types.Gt),
        max_open=isinstance(hi, annotated_types.Lt),
    )


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


def open_redis(url: str, wait_s: float = 0) -> redis.Redis:
    """Connect and check that Redis answers, turning failures into a clear user error. `wait_s`: a Redis that does not
    answer yet (a stack still starting, a restart, a paused server) is waited for up to that long, with one line on
    stderr, as a running worker rides out an outage (the worker's --redis-outage-limit); a malformed URL, a wrong
    password or a refused command fails at once."""
    try:
        conn = settings.connect(url)
    except ValueError as exc:  # a malformed URL
        raise click.BadParameter(str(exc), param_hint="--redis-url") from None
    where = settings.redact_url(url)

    def on_outage(exc: Exception) -> None:
        click.echo(f"Redis unreachable, waiting up to {wait_s:g} s: {where} ({one_line_error(exc)})", err=True)

    def on_recovery(seconds: float) -> None:
        click.echo(f"Redis answers after {seconds:.0f} s", err=True)

    try:
        if wait_s > 0:
            OutageRetry(wait_s, on_outage, on_recovery)(conn.ping)
        else:
            conn.ping()
    except (RedisUnreachable, redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, redis.ResponseError) as exc:
        raise click.ClickException(f"cannot reach Redis at {where}: {exc}") from None
    return conn


def echo_json(obj) -> None:
    click.echo(json.dumps(obj, sort_keys=False))


def _parse_chat_template_kwargs(_ctx, _param, value: str | None) -> dict | None:
    if value is None:
        return None
    try:
        return checked_chat_template_kwargs(json.loads(value))
    except json.JSONDecodeError as exc:
        raise click.BadParameter(f"not JSON: {exc.msg}") from None
    except ValueError as exc:
        raise click.BadParameter(str(exc)) from None


chat_template_kwargs_option = click.option(
    "--chat-template-kwargs",
    "chat_template_kwargs",
    callback=_parse_chat_template_kwargs,
    metavar="JSON",
    help='Extra chat-template variables for every chat line, e.g. \'{"enable_thinking": false}\' (Qwen3); '
    "a line's own chat_template_kwargs win, name by name.",
)
