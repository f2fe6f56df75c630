"""Request lines: the three accepted input shapes, sampling bounds, and the normalized request stored in Redis.

Owns the input contract of `cbq submit`:
- simple    `{"prompt": "...", "max_new_tokens": 32, ...}`
- chat      `{"messages": [{"role": "user", "content": "..."}], ...}`
- OpenAI Batch `{"custom_id": "...", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
  "body": {"prompt" | "messages", "max_tokens", "temperature", ...}}`

`parse_request_line` turns one JSONL line into a `ParsedRequest` (sampling fields only where the line gave
them); `ParsedRequest.resolve` applies batch defaults and gives the `Request` that is stored and run.
Blank lines are skipped: `parse_request_line` returns None for them, so editors' trailing newlines are harmless.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, model_validator

from schemas.errors import FieldIssue, RequestLineError, issues_from_validation_error

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
DEFAULT_MAX_NEW_TOKENS = 16  # same default as the engine's SamplingParams


class StrictModel(BaseModel):
    # strict: "0.5" is not a temperature and 1 is not `true`; NaN/inf never make sense here.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _one_string_is_a_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


StopStrings = Annotated[list[Annotated[str, Field(min_length=1)]], BeforeValidator(_one_string_is_a_list)]
TokenId = Annotated[int, Field(ge=0)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]


class ChatMessage(StrictModel):
    role: Literal["system", "user", "assistant"]
    content: str


class SamplingOverrides(StrictModel):
    """Sampling fields as given on a line or by batch flags; None means "not given here"."""

    max_new_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: Seed | None = None
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None

    def given(self) -> dict[str, Any]:
        return {name: value for name, value in self if value is not None}


class Sampling(StrictModel):
    """Resolved sampling parameters of one request (mirrors the engine's SamplingParams)."""

    max_new_tokens: int = Field(DEFAULT_MAX_NEW_TOKENS, ge=1)
    temperature: float = Field(0.0, ge=0)  # 0 means greedy
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0 means no top-k cut
    seed: Seed | None = None
    stop: StopStrings = []
    stop_token_ids: list[TokenId] = []
    ignore_eos: bool = False


CustomId = Annotated[str, Field(min_length=1, max_length=512)]


class PromptLine(SamplingOverrides):
    custom_id: CustomId | None = None
    prompt: str


class ChatLine(SamplingOverrides):
    custom_id: CustomId | None = None
    messages: list[ChatMessage] = Field(min_length=1)


class _OpenAIBody(StrictModel):
    model: str | None = None  # accepted and echoed in the output; the worker's model runs the request
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    seed: Seed | None = None
    stop: StopStrings | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: bool | None = None
    n: Literal[1] | None = None  # one completion per request
    stream: Literal[False] | None = None

    @model_validator(mode="after")
    def _one_length_limit(self):
        if self.max_tokens is not None and self.max_completion_tokens is not None:
            raise ValueError("give max_tokens or max_completion_tokens, not both")
        return self

    def overrides(self) -> SamplingOverrides:
        return SamplingOverrides(
            max_new_tokens=self.max_completion_tokens or self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            seed=self.seed,
            stop=self.stop,
            stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos,
        )


class CompletionBody(_OpenAIBody):
    prompt: str


class ChatCompletionBody(_OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)


class OpenAIBatchLine(StrictModel):
    custom_id: CustomId
    method: Literal["POST"]
    url: Literal["/v1/completions", "/v1/chat/completions"]
    body: dict[str, Any]  # validated separately against the model that `url` selects


Shape = Literal["prompt", "chat", "openai"]


class Request(StrictModel):
    """One request as stored in Redis (`cbq:batch:{id}:requests`) and read back by the worker."""

    index: int = Field(ge=0)  # position in the batch: results come back in this order
    line_no: int = Field(ge=1)
    custom_id: CustomId | None = None
    shape: Shape
    url: Literal["/v1/completions", "/v1/chat/completions"] | None = None  # OpenAI Batch lines only
    model: str | None = None  # OpenAI Batch lines only: body.model, echoed in the output
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    sampling: Sampling = Sampling()
    return_token_ids: bool = False

    @model_validator(mode="after")
    def _prompt_xor_messages(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("a request has exactly one of prompt or messages")
        return self

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


class ParsedRequest(StrictModel):
    """A validated line before batch defaults are applied."""

    line_no: int
    custom_id: str | None
    shape: Shape
    url: Literal["/v1/completions", "/v1/chat/completions"] | None = None
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    overrides: SamplingOverrides = SamplingOverrides()

    def resolve(
        self, index: int, defaults: SamplingOverrides | None = None, return_token_ids: bool = False
    ) -> Request:
        """The stored request: line values win over batch defaults, which win over the built-in ones."""
        merged = (defaults.given() if defaults else {}) | self.overrides.given()
        return Request(
            index=index,
            line_no=self.line_no,
            custom_id=self.custom_id,
            shape=self.shape,
            url=self.url,
            model=self.model,
            prompt=self.prompt,
            messages=self.messages,
            sampling=Sampling(**merged),
            return_token_ids=return_token_ids,
        )


_SHAPE_HINT = (
    'expected {"prompt": ...}, {"messages": [...]}, or an OpenAI Batch line '
    '{"custom_id", "method", "url", "body"}'
)
_OPENAI_KEYS = {"method", "url", "body"}


def parse_request_line(text: str, line_no: int) -> ParsedRequest | None:
    """Validate one JSONL line. Returns None for a blank line; raises RequestLineError naming line and field."""
    if not text.strip():
        return None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise RequestLineError(
            line_no, [FieldIssue("", f"invalid JSON: {exc.msg} at column {exc.colno}")]
        ) from None
    if not isinstance(obj, dict):
        raise RequestLineError(
            line_no, [FieldIssue("", f"a line must be a JSON object, got {type(obj).__name__}")]
        )

    if _OPENAI_KEYS & obj.keys():
        return _parse_openai_line(obj, line_no)
    if "prompt" in obj and "messages" in obj:
        raise RequestLineError(line_no, [FieldIssue("", "give either prompt or messages, not both")])
    if "messages" in obj:
        line = _validate(ChatLine, obj, line_no)
        return ParsedRequest(
            line_no=line_no,
            custom_id=line.custom_id,
            shape="chat",
            messages=line.messages,
            overrides=_overrides_of(line),
        )
    if "prompt" in obj:
        line = _validate(PromptLine, obj, line_no)
        return ParsedRequest(
            line_no=line_no,
            custom_id=line.custom_id,
            shape="prompt",
            prompt=line.prompt,
            overrides=_overrides_of(line),
        )
    raise RequestLineError(line_no, [FieldIssue("", _SHAPE_HINT)])


def _overrides_of(line: SamplingOverrides) -> SamplingOverrides:
    return SamplingOverrides(**{name: getattr(line, name) for name in SamplingOverrides.model_fields})


def _parse_openai_line(obj: dict[str, Any], line_no: int) -> ParsedRequest:
    envelope = _validate(OpenAIBatchLine, obj, line_no)
    body_model = CompletionBody if envelope.url == COMPLETIONS_URL else ChatCompletionBody
    body = _validate(body_model, envelope.body, line_no, prefix=("body",))
    return ParsedRequest(
        line_no=line_no,
        custom_id=envelope.custom_id,
        shape="openai",
        url=envelope.url,
        model=body.model,
        prompt=getattr(body, "prompt", None),
        messages=getattr(body, "messages", None),
        overrides=body.overrides(),
    )


def _validate(model: type[StrictModel], obj: Any, line_no: int, prefix: tuple[str, ...] = ()):
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise RequestLineError(line_no, issues_from_validation_error(exc, model, prefix)) from None
