"""Result lines: what `cbq results` writes, in cbq's own shape or as OpenAI Batch output lines.

Owns the output contract. The worker stores one `ResultLine` JSON per request in `cbq:batch:{id}:results`. A
sample's parts and the usage counts, which the Response object of `/v1/responses` lines reads too, are
`schemas.output_parts`'; `Usage`, `Sample` and the logprob records are importable from here as well.
"""

from __future__ import annotations

import codecs
from typing import Any, Literal, cast, get_args

from pydantic import Field, model_validator

from schemas.embeddings import embedding_list_body
from schemas.errors import InvalidRequest
from schemas.lines import Request
from schemas.openai_body import CHAT_COMPLETIONS_URL
from schemas.output_parts import OutputModel, ParsedParts, Sample, TokenLogprob, Usage
from schemas.responses_body import RESPONSES_URL
from schemas.responses_output import response_body

FinishReason = Literal["stop", "length", "error", "cancelled"]
# Why a request was refused before it ran: an invalid request, which the OpenAI output reports as an HTTP 400
# response, as OpenAI does. The engine's `ErrorCode` values, and those of a line refused at submit
# (`schemas.errors.InvalidRequest`: the codes `issues_from_validation_error` gives).
ErrorCode = Literal[
    "context_length_exceeded",
    "invalid_prompt",
    "invalid_value",
    "unknown_parameter",
    "missing_required_parameter",
    "unsupported_parameter",
    "model_not_found",  # the line names another model than its batch's (or than the one `cbq run` serves)
]
Outcome = Literal["completed", "failed", "cancelled"]  # what a batch counts: `num_{outcome}` fields
OUTPUT_FORMATS = ("cbq", "openai")  # `cbq results --format`: ResultLine, or OpenAI Batch output lines

# The one mapping from a request's finish reason to the batch counter it lands in.
OUTCOME_OF_REASON: dict[FinishReason, Outcome] = {
    "stop": "completed",
    "length": "completed",
    "error": "failed",
    "cancelled": "cancelled",
}
OUTCOMES: tuple[Outcome, ...] = get_args(Outcome)


class PromptToken(OutputModel):
    """A prompt token: its text (as `TopLogprob.token`), its exact bytes and its id."""

    token: str
    bytes: list[int]
    token_id: int


class PromptTopLogprob(PromptToken):
    """A token at a prompt position, with its log-probability there and its rank (1: the most likely)."""

    logprob: float
    rank: int


class PromptTokenLogprob(PromptTopLogprob):
    """A prompt token's entry of `prompt_logprobs` (vLLM's field): its log-probability given the tokens before
    it, its rank, and the most likely alternatives at its position (most likely first; ranks 1, 2, ...)."""

    top_logprobs: list[PromptTopLogprob]


class EchoedPrompt(OutputModel):
    """What a completions `echo` puts before the output: the prompt's text and, when logprobs were asked, its
    first token (which has no logprob; the others are `ResultLine.prompt_logprobs`)."""

    text: str
    first_token: PromptToken | None = None


class ResultLine(ParsedParts):
    custom_id: str | None = None
    index: int = Field(ge=0)  # position in the batch (input order)
    text: str = ""
    token_ids: list[int] | None = None  # only when submitted with --token-ids
    finish_reason: FinishReason
    usage: Usage = Usage()
    error: str | None = None  # set exactly when finish_reason is "error"
    error_code: ErrorCode | None = None  # only for errors: the request was invalid (not a failure)
    error_param: str | None = None  # with an error_code: the body field at fault, as OpenAI's `param`
    logprobs: list[TokenLogprob] | None = None  # when asked: one per token of the text (not a final EOS)
    # Only for a request with n > 1 that did not fail: every sample in index order. `text`, `token_ids`,
    # `finish_reason` and `logprobs` above are sample 0's, so n = 1 readers keep working.
    samples: list[Sample] | None = None
    # When asked (`prompt_logprobs`, or `echo` with `logprobs`) and the request did not fail: one per prompt token,
    # null for the first (nothing precedes it), as vLLM's `prompt_logprobs`.
    prompt_logprobs: list[PromptTokenLogprob | None] | None = None
    echo: EchoedPrompt | None = None  # completions bodies with `echo`, when the request did not fail
    # An embedding request that did not fail: floats, or the base64 of their little-endian float32 bytes when the
    # request asked `encoding_format: "base64"` (schemas/embeddings.py).
    embedding: list[float] | str | None = None

    @model_validator(mode="after")
    def _error_iff_failed(self):
        if (self.finish_reason == "error") != (self.error is not None):
            raise ValueError("error is set exactly when finish_reason is 'error'")
        if self.error_code is not None and self.error is None:
            raise ValueError("error_code is set only with an error")
        if self.error_param is not None and self.error_code is None:
            raise ValueError("error_param is set only with an error_code")
        return self

    @classmethod
    def of_invalid_request(cls, index: int, error: InvalidRequest) -> ResultLine:
        """The result of a request refused at submit: it failed alone, as OpenAI's 400 for that line."""
        return cls(
            custom_id=error.custom_id,
            index=index,
            finish_reason="error",
            error=f"line {error.line_no}: {error.reason}",
            error_code=cast(ErrorCode, error.code),
            error_param=error.param,
        )

    @property
    def is_failure(self) -> bool:
        """Failed or cancelled: what `--errors FILE` receives."""
        return self.finish_reason in ("error", "cancelled")

    @property
    def all_samples(self) -> list[Sample]:
        """Every sample, sample 0 alone for n = 1 (only for a request that finished, stop or length)."""
        if self.samples:
            return self.samples
        assert self.finish_reason in ("stop", "length"), "a failed request has no samples"
        parts = {name: getattr(self, name) for name in ParsedParts.model_fields}
        return [Sample(index=0, text=self.text, token_ids=self.token_ids, finish_reason=self.finish_reason,
                       logprobs=self.logprobs, **parts)]


# --- OpenAI Batch output -------------------------------------------------------------------------------------


class OpenAIPromptTokensDetails(OutputModel):
    cached_tokens: int


class OpenAIUsage(OutputModel):
    """The prompt counts once however many choices share it; completion tokens are summed over choices."""

    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: OpenAIPromptTokensDetails


class OpenAIResponse(OutputModel):
    status_code: int
    request_id: str
    body: dict[str, Any]  # a `text_completion`, `chat.completion` or `response` object


class OpenAIError(OutputModel):
    code: str
    message: str


class OpenAIBatchOutputLine(OutputModel):
    id: str
    custom_id: str
    response: OpenAIResponse | None = None
    error: OpenAIError | None = None

    @property
    def is_failure(self) -> bool:
        """An error, or a response other than 200: what OpenAI puts in a batch's error file."""
        return self.error is not None or self.response is None or self.response.status_code != 200


def to_openai_output(
    result: ResultLine, request: Request, batch_id: str, model: str, created_at: int
) -> OpenAIBatchOutputLine:
    """OpenAI Batch output for one request. `/v1/responses` requests give `response` bodies
    (schemas/responses_output.py), other chat requests (any input shape) `chat.completion` bodies, prompt requests
    `text_completion`; failed and cancelled requests give `error` and no response."""
    request_id = f"{batch_id}-{result.index}"
    custom_id = result.custom_id or f"request-{result.index}"
    line_id = f"batch_req_{request_id}"
    if result.error_code is not None:  # an invalid request: OpenAI answers it with a 400 and an error object
        error = {
            "message": result.error,
            "type": "invalid_request_error",
            "param": result.error_param,
            "code": result.error_code,
        }
        response = OpenAIResponse(status_code=400, request_id=request_id, body={"error": error})
        return OpenAIBatchOutputLine(id=line_id, custom_id=custom_id, response=response)
    if result.finish_reason in ("error", "cancelled"):
        code = "generation_error" if result.finish_reason == "error" else "cancelled"
        message = result.error or "the request was cancelled before it finished"
        return OpenAIBatchOutputLine(
            id=line_id, custom_id=custom_id, error=OpenAIError(code=code, message=message)
        )

    if request.url == RESPONSES_URL:
        body = response_body(result.all_samples, result.usage, request, request_id, model, created_at)
        return OpenAIBatchOutputLine(
            id=line_id, custom_id=custom_id, response=OpenAIResponse(status_code=200, request_id=request_id, body=body)
        )
    if request.is_embedding:
        assert result.embedding is not None, "a finished embedding request has its embedding"
        body = embedding_list_body([result.embedding], model, result.usage.prompt_tokens)
        response = OpenAIResponse(status_code=200, request_id=request_id, body=body)
        return OpenAIBatchOutputLine(id=line_id, custom_id=custom_id, response=response)
    usage = OpenAIUsage(
        prompt_tokens=result.usage.prompt_tokens,
        completion_tokens=result.usage.completion_tokens,
        total_tokens=result.usage.prompt_tokens + result.usage.completion_tokens,
        prompt_tokens_details=OpenAIPromptTokensDetails(cached_tokens=result.usage.cached_tokens),
    ).model_dump()
    is_chat = request.is_chat or request.url == CHAT_COMPLETIONS_URL
    common = {"created": created_at, "model": model, "usage": usage}  # the served name, not the line's
    choices: list[dict[str, Any]]
    if is_chat:
        choices = [
            {
                "index": sample.index,
                "message": _chat_message(sample, request, request_id),
                "logprobs": _chat_logprobs(sample.logprobs),
                "finish_reason": _chat_finish_reason(sample, request),
            }
            for sample in result.all_samples
        ]
        body = {"id": f"chatcmpl-{request_id}", "object": "chat.completion", "choices": choices, **common}
        if request.sampling.prompt_logprobs is not None:  # vLLM's chat responses carry them beside the choices
            body["prompt_logprobs"] = _vllm_prompt_logprobs(result.prompt_logprobs)
    else:
        echo = _echo_logprobs(result, request) if result.echo is not None else None
        prefix = result.echo.text if result.echo is not None else ""
        choices = [
            {
                "index": sample.index,
                "text": prefix + sample.text,
                "logprobs": _completion_logprobs(sample.logprobs, echo, len(prefix)),
                "finish_reason": sample.finish_reason,
            }
            for sample in result.all_samples
        ]
        if request.sampling.prompt_logprobs is not None:  # vLLM's completions give them on each choice
            for choice in choices:
                choice["prompt_logprobs"] = _vllm_prompt_logprobs(result.prompt_logprobs)
        body = {"id": f"cmpl-{request_id}", "object": "text_completion", "choices": choices, **common}
    if request.return_token_ids:  # vLLM's return_token_ids: each choice's generated ids
        for choice, sample in zip(choices, result.all_samples, strict=True):
            choice["token_ids"] = sample.token_ids
    response = OpenAIResponse(status_code=200, request_id=request_id, body=body)
    return OpenAIBatchOutputLine(id=line_id, custom_id=custom_id, response=response)


def merge_choice_group(members: list[OpenAIBatchOutputLine], num_samples: int) -> OpenAIBatchOutputLine:
    """One OpenAI output line for a completions request with several prompts (`schemas.lines.ChoiceGroup`),
    from its prompts' lines in order: choice i*n + j is sample j of prompt i, usage is summed. If a prompt
    failed, the request did: its first failing line stands for it."""
    first = members[0]
    failed = next((line for line in members if line.is_failure), None)
    if failed is not None:
        return failed.model_copy(update={"id": first.id})
    bodies = [line.response.body for line in members if line.response is not None]
    if bodies[0].get("object") == "list":  # an embeddings request's inputs: data[i] is input i
        embeddings = [item["embedding"] for body in bodies for item in body["data"]]
        merged = embedding_list_body(embeddings, bodies[0]["model"], sum(b["usage"]["prompt_tokens"] for b in bodies))
        assert first.response is not None
        return first.model_copy(update={"response": first.response.model_copy(update={"body": merged})})
    choices = [
        {**choice, "index": position * num_samples + choice["index"]}
        for position, body in enumerate(bodies)
        for choice in body["choices"]
    ]
    usage = {
        key: sum(body["usage"][key] for body in bodies) for key in ("prompt_tokens", "completion_tokens", "total_tokens")
    }
    cached = sum(body["usage"]["prompt_tokens_details"]["cached_tokens"] for body in bodies)
    usage["prompt_tokens_details"] = {"cached_tokens": cached}
    assert first.response is not None
    response = first.response.model_copy(update={"body": {**bodies[0], "choices": choices, "usage": usage}})
    return first.model_copy(update={"response": response})


def _chat_message(sample: Sample, request: Request, request_id: str) -> dict[str, Any]:
    """The assistant's message: its content, the reasoning and the calls the worker's parsers found (schemas/
    tools.py), or for a call forced to one function, that call with the output as its arguments."""
    content = sample.message_content(sample.text)
    calls = [call.model_dump() for call in sample.tool_calls or ()]
    plan = request.tool_call
    if not calls and plan is not None and plan.is_forced and plan.name is not None:
        function = {"name": plan.name, "arguments": content or ""}
        calls, content = [{"id": f"call_{request_id}_{sample.index}", "type": "function", "function": function}], None
    message: dict[str, Any] = {"role": "assistant", "content": content}
    if sample.reasoning_content is not None:
        message["reasoning"] = sample.reasoning_content  # vLLM's field for it
        message["reasoning_content"] = sample.reasoning_content  # its older name, as vLLM kept it for a while
    if calls:
        message["tool_calls"] = calls
    return message


def _chat_finish_reason(sample: Sample, request: Request) -> str:
    """As OpenAI: a call forced by name ends with "stop", any other call made with "tool_calls"."""
    plan = request.tool_call
    made_calls = bool(sample.tool_calls) or (plan is not None and plan.is_forced and plan.name is not None)
    if sample.finish_reason != "stop" or not made_calls or (plan is not None and plan.named):
        return sample.finish_reason
    return "tool_calls"


def _chat_logprobs(logprobs: list[TokenLogprob] | None) -> dict[str, Any] | None:
    """Chat's `choices[].logprobs`: cbq's records are already its `content` items."""
    if logprobs is None:
        return None
    return {"content": [lp.model_dump() for lp in logprobs], "refusal": None}


def _char_offsets(token_bytes: list[list[int]], start: int) -> tuple[list[int], int]:
    """Characters of text before each token, from `start` (a character may span tokens), and after the last."""
    offsets, num_chars = [], start
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    for raw in token_bytes:
        offsets.append(num_chars)
        num_chars += len(decoder.decode(bytes(raw)))
    return offsets, num_chars + len(decoder.decode(b"", final=True))


def _completion_logprobs(
    logprobs: list[TokenLogprob] | None, echo: dict[str, list[Any]] | None = None, prompt_chars: int = 0
) -> dict[str, Any] | None:
    """Completions' `choices[].logprobs`: parallel lists; `text_offset` counts characters of the choice's text
    before each token. With `echo` (the prompt's lists, `_echo_logprobs`) they lead, and the output's offsets
    start after the `prompt_chars` characters of the echoed prompt."""
    if logprobs is None:
        return None
    out: dict[str, list[Any]] = {
        "tokens": [lp.token for lp in logprobs],
        "token_logprobs": [lp.logprob for lp in logprobs],
        "top_logprobs": [{top.token: top.logprob for top in lp.top_logprobs} for lp in logprobs],
        "text_offset": _char_offsets([lp.bytes for lp in logprobs], prompt_chars)[0],
    }
    return {name: echo[name] + values for name, values in out.items()} if echo else out


def _echo_logprobs(result: ResultLine, request: Request) -> dict[str, list[Any]] | None:
    """The prompt's part of an echoed choice's logprobs, as OpenAI's legacy completions give it: every prompt
    token, the first with a null logprob and null alternatives; each alternatives' dict holds the token itself
    too (OpenAI: up to logprobs + 1 entries). Offsets index the choice's text: they are aligned at the end of the
    echoed prompt, so that a token the tokenizer added in front (BOS) gets offset 0."""
    echo, entries = result.echo, result.prompt_logprobs
    if echo is None or echo.first_token is None or entries is None or request.sampling.logprobs is None:
        return None
    num_top = request.sampling.logprobs
    tokens: list[PromptToken] = [echo.first_token, *(e for e in entries[1:] if e is not None)]
    offsets, num_chars = _char_offsets([t.bytes for t in tokens], 0)
    shift = len(echo.text) - num_chars
    tops: list[dict[str, float] | None] = [None]
    for e in entries[1:]:
        assert e is not None, "only the first prompt token has no entry"
        tops.append({top.token: top.logprob for top in e.top_logprobs[:num_top]} | {e.token: e.logprob})
    return {
        "tokens": [t.token for t in tokens],
        "token_logprobs": [None, *(e.logprob for e in entries[1:] if e is not None)],
        "top_logprobs": tops,
        "text_offset": [max(0, offset + shift) for offset in offsets],
    }


def _vllm_prompt_logprobs(entries: list[PromptTokenLogprob | None] | None) -> list[dict[str, Any] | None] | None:
    """vLLM's `prompt_logprobs` in its OpenAI server's responses: null for the first token, then per token a map
    from token id to its logprob, rank and text, for the top alternatives and the prompt's token itself."""
    if entries is None:
        return None

    def item(t: PromptTopLogprob) -> tuple[str, dict[str, Any]]:
        return str(t.token_id), {"logprob": t.logprob, "rank": t.rank, "decoded_token": t.token}

    return [None if e is None else dict(map(item, [*e.top_logprobs, e])) for e in entries]
