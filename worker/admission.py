"""Expanding one chunk job into engine requests. Owns the read of a chunk's requests and their tokenization.

A chunk is loaded through `producer.store.chunks` in two round trips (the batch fields its payload is checked
against, then the cancel flag, its stored requests and their existing results).
Requests that already have a result are skipped, so a retried chunk never redoes finished work. Anything
wrong with one request (unreadable stored JSON, a tokenizer error) becomes an error result for that request
only; a chunk whose batch is gone raises `BatchGone`, which fails that one job.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any

import redis
from pydantic import ValidationError

from producer.store.chunks import read_chunk_batch, read_chunk_requests
from schemas import keys
from schemas.chunk import CHUNK_FUNC, ChunkPayload
from schemas.lines import Request
from schemas.media import image_refs
from schemas.openai_body import OPENAI_SAMPLING_DEFAULTS
from schemas.output_parts import TopLogprob
from schemas.prompt import PromptOptions
from schemas.result import (
    EchoedPrompt,
    PromptToken,
    PromptTokenLogprob,
    PromptTopLogprob,
    ResultLine,
    Sample,
    TokenLogprob,
    Usage,
)
from schemas.sampling import NEUTRAL_VALUES, OutputConstraint, Sampling
from worker.embedding.admission import ModelTask, embedding_result_line, kind_refusal, to_embedding_request
from worker.engine.api import (
    ChatOptions,
    Constraint,
    ConstraintKind,
    EngineRequest,
    EngineResult,
    SamplingParams,
    TokenizerProtocol,
)
from worker.engine.api import PromptLogprob as EnginePromptLogprob
from worker.engine.api import TokenLogprob as EngineTokenLogprob
from worker.engine.tokenizer import NoChatTemplate
from worker.media.load import ImageAdmission
from worker.media.policy import MediaError
from worker.output_parsers import (
    CallsMode,
    ConstraintAfterReasoningError,
    OutputParsing,
    result_fields,
    text_with_special_tokens,
)

_NO_DEFAULTS: Mapping[str, Any] = MappingProxyType({})
_TEXT_ONLY = ImageAdmission()
_UNSET = object()


class BatchGone(LookupError):
    """The chunk's batch no longer exists (expired or deleted): the job fails, nothing else does."""


@dataclass
class ChunkWork:
    payload: ChunkPayload
    created_at: float
    ttl_seconds: int
    is_cancelled: bool
    to_run: list[tuple[Request, EngineRequest]] = field(default_factory=list)
    finished_now: list[ResultLine] = field(default_factory=list)  # settled without the engine
    num_skipped: int = 0  # already had a result (a retried chunk)


def load_chunk_job(
    conn: redis.Redis,
    job_id: str,
    func_name: str | None,
    kwargs: Any,
    tokenizer: TokenizerProtocol,
    model_defaults: Mapping[str, Any] = _NO_DEFAULTS,
    parsing: OutputParsing | None = None,
    task: ModelTask = ModelTask(),
    media: ImageAdmission = _TEXT_ONLY,
) -> ChunkWork:
    """`load_chunk` for rq job `job_id`, once its function and arguments (rq's `func_name`, `kwargs`) are
    checked to be a cbq chunk's. Raises ValueError (or pydantic's) for anything else: that job fails."""
    if func_name != CHUNK_FUNC:
        raise ValueError(f"not a cbq chunk job: it calls {func_name!r}, expected {CHUNK_FUNC!r}")
    payload = ChunkPayload.model_validate(kwargs)
    return load_chunk(
        conn, payload, tokenizer, job_id=job_id, model_defaults=model_defaults, parsing=parsing, task=task, media=media
    )


def load_chunk(
    conn: redis.Redis,
    payload: ChunkPayload,
    tokenizer: TokenizerProtocol,
    job_id: str | None = None,
    model_defaults: Mapping[str, Any] = _NO_DEFAULTS,
    parsing: OutputParsing | None = None,
    task: ModelTask = ModelTask(),
    media: ImageAdmission = _TEXT_ONLY,
) -> ChunkWork:
    """Read a chunk's requests and expand them. The payload is checked against its batch first (its range
    inside the batch and, given `job_id`, equal to the range submit recorded for that job), so a forged
    payload fails its job before anything is read or allocated for its range. `model_defaults`: the
    engine's `sampling_defaults` (what the checkpoint's generation_config sets); `parsing`: the worker's output
    parsers (a constraint then applies after the reasoning); `task`: the served model's kind (a line of the
    other kind fails alone, worker/embedding/admission.py); `media`: how a chat's images are read (or refused)."""
    batch = read_chunk_batch(conn, payload.batch_id, job_id)
    if batch is None:
        raise BatchGone(f"batch {payload.batch_id} not found (expired or deleted)")
    if payload.stop > batch.num_requests:
        raise ValueError(
            f"chunk [{payload.start}, {payload.stop}) is past the batch's {batch.num_requests} requests"
        )
    if job_id is not None and batch.recorded_range != f"{payload.start}:{payload.stop}":
        raise ValueError(
            f"job {job_id} carries [{payload.start}, {payload.stop}), but the batch recorded "
            f"{batch.recorded_range or 'none'} for it"
        )

    indices = list(payload.indices)
    stored = read_chunk_requests(conn, payload.batch_id, indices)
    work = ChunkWork(payload, batch.created_at, batch.ttl_seconds, stored.is_cancelled)
    for index, raw_request, raw_result in zip(indices, stored.raw_requests, stored.raw_results, strict=True):
        if raw_result is not None:
            work.num_skipped += 1
        elif raw_request is None:
            work.finished_now.append(error_line(index, None, "stored request is missing"))
        elif work.is_cancelled:
            work.finished_now.append(
                ResultLine(custom_id=_custom_id(raw_request), index=index, finish_reason="cancelled")
            )
        else:
            _expand_one(work, index, raw_request, tokenizer, model_defaults, parsing, task, media)
    return work


def _expand_one(
    work: ChunkWork,
    index: int,
    raw_request: bytes,
    tokenizer: TokenizerProtocol,
    model_defaults: Mapping[str, Any],
    parsing: OutputParsing | None = None,
    task: ModelTask = ModelTask(),
    media: ImageAdmission = _TEXT_ONLY,
) -> None:
    try:
        request = Request.model_validate_json(raw_request)
    except ValidationError as exc:
        work.finished_now.append(
            error_line(index, None, f"stored request is invalid: {exc.errors()[0]['msg']}")
        )
        return
    if request.index != index:
        work.finished_now.append(
            error_line(index, request.custom_id, f"stored request has index {request.index}")
        )
        return
    refused = kind_refusal(request, task)
    if refused is not None:
        work.finished_now.append(refused)
        return
    try:
        if request.is_embedding:
            engine_request = to_embedding_request(request, tokenizer, task, work.payload.batch_id, work.created_at)
        else:
            engine_request = to_engine_request(
                request, tokenizer, work.payload.batch_id, work.created_at, model_defaults, parsing, media
            )
    except (UnsupportedField, ConstraintAfterReasoningError, NoChatTemplate, MediaError) as exc:  # what this worker cannot do: a 400
        if isinstance(exc, NoChatTemplate):
            code, param = "invalid_value", "messages"
        elif isinstance(exc, MediaError):  # an image this worker cannot read or its model cannot take
            code, param = "invalid_value", exc.param
        else:
            code, param = "unsupported_parameter", exc.field
        work.finished_now.append(
            ResultLine(
                custom_id=request.custom_id,
                index=index,
                finish_reason="error",
                error=str(exc),
                error_code=code,
                error_param=param,
            )
        )
        return
    except Exception as exc:  # a tokenizer failure fails this request, not the chunk
        work.finished_now.append(error_line(index, request.custom_id, f"tokenization failed: {exc!r}"))
        return
    work.to_run.append((request, engine_request))


class UnsupportedField(ValueError):
    """A request asks for a field this worker's engine cannot honour yet: it fails, never runs without it."""

    def __init__(self, field: str, value: Any):
        self.field = field
        super().__init__(f"{field}={value!r} is not supported by this worker's engine yet")


# Fields admission applies itself, whatever the engine knows.
_ADMISSION_FIELDS = frozenset({"truncate_prompt_tokens"})


def to_engine_request(
    request: Request,
    tokenizer: TokenizerProtocol,
    batch_id: str,
    arrival_time: float,
    model_defaults: Mapping[str, Any] = _NO_DEFAULTS,
    parsing: OutputParsing | None = None,
    media: ImageAdmission = _TEXT_ONLY,
) -> EngineRequest:
    """The engine's request for a stored one: its prompt tokenized, its images read (MediaError for a bad one,
    before anything is tokenized), its sampling resolved."""
    options = request.prompt_options or PromptOptions()
    images = media.images_of(image_refs(request.messages))
    if request.messages is not None:
        messages = [m.for_template() for m in request.messages]
        prompt_ids = tokenizer.encode_chat(messages, request.chat_template_kwargs, request.tools, chat_options(options))
    elif request.prompt_token_ids is not None:
        prompt_ids = request.prompt_token_ids
    else:
        assert request.prompt is not None, "a stored request has a prompt, token ids or messages"
        add_special_tokens = True if options.add_special_tokens is None else options.add_special_tokens
        prompt_ids = tokenizer.encode(request.prompt, add_special_tokens=add_special_tokens)
    if request.sampling.truncate_prompt_tokens is not None:  # vLLM's: keep the prompt's last k tokens
        prompt_ids = prompt_ids[-request.sampling.truncate_prompt_tokens :]
    sampling = to_sampling_params(with_echo(request, with_line_defaults(request, model_defaults)))
    if parsing is not None and request.is_chat:  # a reasoning model's answer is constrained, not its thinking
        sampling = parsing.constrain_after_reasoning(sampling, prompt_ids, tokenizer)
    return EngineRequest(
        request_id=keys.engine_request_id(batch_id, request.index),
        prompt_ids=list(prompt_ids),
        sampling=sampling,
        n=request.n,
        arrival_time=arrival_time,  # submission time: queue_seconds and latency include the wait in Redis
        # An OpenAI body's token limit is checked against the context, as OpenAI's and vLLM's servers do;
        # cbq's own lines keep theirs capped by it.
        max_tokens_within_context=request.shape == "openai" and request.sampling.max_new_tokens is not None,
        cache_salt=request.cache_salt,
        images=images,
    )


def chat_options(options: PromptOptions) -> ChatOptions:
    """The engine's chat rendering from a line's fields, with vLLM's defaults for those it leaves out."""
    continue_final = bool(options.continue_final_message)
    add_generation_prompt = options.add_generation_prompt
    return ChatOptions(
        add_generation_prompt=not continue_final if add_generation_prompt is None else add_generation_prompt,
        continue_final_message=continue_final,
        add_special_tokens=bool(options.add_special_tokens),
    )


def with_line_defaults(request: Request, model_defaults: Mapping[str, Any]) -> Sampling:
    """The request's sampling with its shape's defaults for what neither it nor the model sets: an OpenAI body
    gets OpenAI's (temperature 1, as vLLM); cbq's own lines leave the engine's (greedy)."""
    if request.shape != "openai":
        return request.sampling
    missing = {
        name: value
        for name, value in OPENAI_SAMPLING_DEFAULTS.items()
        if getattr(request.sampling, name) is None and name not in model_defaults
    }
    return request.sampling.model_copy(update=missing) if missing else request.sampling


def with_echo(request: Request, sampling: Sampling) -> Sampling:
    """A completions `echo` with `logprobs: k` scores the prompt too: its prompt logprobs, k alternatives each
    (at least: an explicit `prompt_logprobs` may ask for more)."""
    if not request.echo or sampling.logprobs is None:
        return sampling
    return sampling.model_copy(update={"prompt_logprobs": max(sampling.prompt_logprobs or 0, sampling.logprobs)})


def to_sampling_params(sampling: Sampling, params_type: type[SamplingParams] = SamplingParams) -> SamplingParams:
    """The engine's SamplingParams, field by field under the same names (lists become tuples, the output
    constraint the engine's `Constraint`); a field not given keeps the engine's default. A field the engine
    does not know yet raises `UnsupportedField`, unless it is at the value that asks for nothing."""
    known = {f.name for f in dataclasses.fields(params_type)}
    given = sampling.given()
    for name, value in given.items():
        if name not in known and name not in _ADMISSION_FIELDS and value != NEUTRAL_VALUES.get(name, _UNSET):
            raise UnsupportedField(name, value)
    return params_type(**{name: _engine_value(v) for name, v in given.items() if name in known})


def _engine_value(value: Any) -> Any:
    if isinstance(value, list):
        return tuple(value)
    if isinstance(value, OutputConstraint):
        return Constraint(ConstraintKind(value.kind), value.spec)
    return value


MAX_ERROR_CHARS = 300  # of a result line's `error`


def one_line(message: str) -> str:
    """`message` on one line of at most MAX_ERROR_CHARS (grammar engines report errors as multi-line dumps)."""
    flat = " ".join(message.split())
    return flat if len(flat) <= MAX_ERROR_CHARS else flat[: MAX_ERROR_CHARS - 1] + "…"


def to_result_line(
    request: Request, result: EngineResult, tokenizer: TokenizerProtocol, parsing: OutputParsing | None = None
) -> ResultLine:
    """The result line of one engine result. A failed request reports no completion tokens: it returns no text
    (the engine counts the token a grammar rejected, the one that failed it); one refused before it ran (an
    `error_code`) no prompt tokens either, its error names the prompt's length."""
    if request.is_embedding:
        return embedding_result_line(request, result, one_line)
    reason = result.finish_reason.value
    succeeded = reason in ("stop", "length")
    usage = dataclasses.asdict(result.usage)
    if reason == "error":
        usage["completion_tokens"] = 0
        if result.error_code is not None:  # refused before it ran (a prompt too long for the context): it
            usage["prompt_tokens"] = 0  # processed no tokens, so none count in the batch's totals

    def parsed(index: int, text: str, token_ids: list[int]) -> dict[str, Any]:  # a chat output's parsed parts
        if parsing is None or not request.is_chat or reason not in ("stop", "length"):
            return {}
        calls = _calls_mode(request)
        if parsing.needs_special_tokens(calls):
            text = text_with_special_tokens(token_ids, tokenizer)
        call_id = "call_{}-{}_{}".format(*keys.split_engine_request_id(result.request_id), index)
        return result_fields(parsing.parse(text, calls), call_id)

    parts_of = {0: parsed(0, result.text, result.token_ids)}  # sample 0's is the line's own
    samples = None
    if request.n > 1 and succeeded:
        parts_of |= {s.index: parsed(s.index, s.text, s.token_ids) for s in result.all_samples if s.index}
        samples = [
            Sample(
                index=sample.index,
                text=sample.text,
                token_ids=list(sample.token_ids) if request.return_token_ids else None,
                finish_reason=sample.finish_reason.value,
                logprobs=_logprob_lines(sample.logprobs, tokenizer),
                **parts_of[sample.index],
            )
            for sample in result.all_samples
        ]
    reasoning_texts = [parts.get("reasoning_content") for parts in parts_of.values()]
    usage["reasoning_tokens"] = min(_num_reasoning_tokens(reasoning_texts, tokenizer), usage["completion_tokens"])
    return ResultLine(
        custom_id=request.custom_id,
        index=request.index,
        text=result.text,
        token_ids=list(result.token_ids) if request.return_token_ids else None,
        finish_reason=reason,
        usage=Usage(**{k: v for k, v in usage.items() if k in Usage.model_fields}),
        error=one_line(result.error or "the engine reported an error") if reason == "error" else None,
        error_code=result.error_code.value if result.error_code and reason == "error" else None,
        logprobs=_logprob_lines(result.logprobs, tokenizer) if reason != "error" else None,
        samples=samples,
        prompt_logprobs=_prompt_logprob_lines(result.prompt_logprobs, tokenizer) if succeeded else None,
        echo=_echoed_prompt(request, result, tokenizer) if succeeded and request.echo else None,
        **parts_of[0],
    )


def _num_reasoning_tokens(texts: list[str | None], tokenizer: TokenizerProtocol) -> int:
    """The outputs' reasoning in tokens: the split-off text tokenized again (its markers not counted)."""
    return sum(len(tokenizer.encode(text, add_special_tokens=False)) for text in texts if text)


def _calls_mode(request: Request) -> CallsMode:
    """Which calls a chat output may hold (schemas/tools.py): the model's own format when it may choose, a JSON
    array for "required" among several tools; a call forced to one function is its arguments (no parsing)."""
    plan = request.tool_call
    if plan is None:
        return "none"
    if not plan.is_forced:
        return "model"
    return "array" if plan.name is None else "none"


# JSON has no -inf: a token the model gives no probability at all reports OpenAI's floor instead.
_MIN_LOGPROB = -9999.0


def _logprob_lines(
    logprobs: list[EngineTokenLogprob] | None, tokenizer: TokenizerProtocol
) -> list[TokenLogprob] | None:
    """A result line's logprobs (the engine gives one per token of the text), with each token's text and
    bytes from the tokenizer."""
    if logprobs is None:
        return None

    def top(token_id: int, logprob: float) -> dict[str, Any]:
        raw = tokenizer.token_bytes(token_id)
        text = raw.decode("utf-8", errors="replace")
        return {"token": text, "logprob": max(logprob, _MIN_LOGPROB), "bytes": list(raw)}

    return [
        TokenLogprob(**top(lp.token_id, lp.logprob), top_logprobs=[TopLogprob(**top(*t)) for t in lp.top])
        for lp in logprobs
    ]


def _token_fields(token_id: int, tokenizer: TokenizerProtocol) -> dict[str, Any]:
    raw = tokenizer.token_bytes(token_id)
    return {"token": raw.decode("utf-8", errors="replace"), "bytes": list(raw), "token_id": token_id}


def _prompt_logprob_lines(
    entries: list[EnginePromptLogprob | None] | None, tokenizer: TokenizerProtocol
) -> list[PromptTokenLogprob | None] | None:
    """A result line's prompt logprobs (null for the first token), each token with its text, bytes and id."""
    if entries is None:
        return None

    def line(e: EnginePromptLogprob) -> PromptTokenLogprob:
        top = [
            PromptTopLogprob(**_token_fields(token_id, tokenizer), logprob=max(value, _MIN_LOGPROB), rank=rank)
            for rank, (token_id, value) in enumerate(e.top, start=1)
        ]
        return PromptTokenLogprob(
            **_token_fields(e.token_id, tokenizer), logprob=max(e.logprob, _MIN_LOGPROB), rank=e.rank, top_logprobs=top
        )

    return [None if e is None else line(e) for e in entries]


def _echoed_prompt(request: Request, result: EngineResult, tokenizer: TokenizerProtocol) -> EchoedPrompt:
    """The prompt a completions `echo` puts first: as the body gave it (token ids: decoded), and its first token
    when the engine scored the prompt (echo with logprobs)."""
    if request.prompt is not None:
        text = request.prompt
    else:
        assert request.prompt_token_ids is not None, "an echo is for a completions prompt"
        text = tokenizer.decode(request.prompt_token_ids)
    first = _token_fields(result.prompt_ids[0], tokenizer) if result.prompt_ids else None
    return EchoedPrompt(text=text, first_token=PromptToken(**first) if first else None)


def error_line(index: int, custom_id: str | None, message: str) -> ResultLine:
    """A failed request's result line, its message on one line."""
    return ResultLine(custom_id=custom_id, index=index, finish_reason="error", error=one_line(message))


def _custom_id(raw_request: bytes) -> str | None:
    try:
        return Request.model_validate_json(raw_request).custom_id
    except ValidationError:
        return None
