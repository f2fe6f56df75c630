"""Request lines: the three accepted input shapes, sampling bounds, and the normalized request stored in Redis.

Owns the input contract of `cbq submit`:
- simple    `{"prompt": "...", "max_new_tokens": 32, ...}`
- chat      `{"messages": [{"role": "user", "content": "..."}], ...}`
- OpenAI Batch `{"custom_id": "...", "method": "POST", "url": "/v1/completions" | "/v1/chat/completions",
  "body": {"prompt" | "messages", "max_tokens", "temperature", ...}}`

An output constraint is spelled `json_schema`, `regex` or `choice` on simple and chat lines, and
`response_format` in OpenAI bodies; logprobs are `logprobs: k` on simple and chat lines and in completions
bodies, `logprobs: true` + `top_logprobs: k` in chat bodies. A constraint that does not compile fails its line.
A chat body that forces a tool call runs as a constraint on the function's arguments (schemas/tools.py).

`parse_request_line` turns one JSONL line into a `ParsedRequest` (sampling fields only where the line gave
them); `ParsedRequest.resolve` applies batch defaults and gives the `Request` that is stored and run.
Blank lines are skipped: `parse_request_line` returns None for them, so editors' trailing newlines are harmless.
"""

from __future__ import annotations

import json
import re
from typing import TYPE_CHECKING, Annotated, Any, Literal, Optional, cast

from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    create_model,
    field_validator,
    model_validator,
)

from schemas.constraint import compile_error
from schemas.errors import FieldIssue, RequestLineError, format_loc, issues_from_validation_error
from schemas.tools import MAX_TOOLS, ForcedToolCall, Tool, ToolChoice, forced_call, function_named

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"


class StrictModel(BaseModel):
    # strict: "0.5" is not a temperature and 1 is not `true`; NaN/inf never make sense here.
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


def _one_string_is_a_list(value: Any) -> Any:
    return [value] if isinstance(value, str) else value


# Bounds on every sampling value (listed in the README's "Input lines"): the engine packs these into int32 and
# float32 step buffers and scans stop strings every step, so one absurd value must fail its line, not a step.
MAX_NEW_TOKENS_LIMIT = 2**20
MAX_TEMPERATURE = 100.0
MAX_TOOL_CALLS = 128  # per assistant message in an input transcript
MAX_PENALTY = 2.0  # presence/frequency penalties: OpenAI's range is [-2, 2]
MAX_TOP_K = 1_000_000  # larger than any vocabulary: a top_k at or above the vocab size keeps every token
MAX_STOP_STRINGS = 16
MAX_STOP_STRING_CHARS = 256
MAX_STOP_TOKEN_IDS = 256
MAX_TOKEN_ID = 2**31 - 1  # fits the engine's int32 token buffers
MAX_LOGPROBS = 20  # top alternatives per token (OpenAI's chat bound; the engine's MAX_LOGPROBS)
MAX_CHOICES = 1024  # strings in a `choice` list
MAX_SAMPLES = 128  # `n`: parallel samples per request (OpenAI's bound; the engine's MAX_SAMPLES_PER_REQUEST)

StopString = Annotated[str, Field(min_length=1, max_length=MAX_STOP_STRING_CHARS)]
StopStrings = Annotated[
    list[StopString], Field(max_length=MAX_STOP_STRINGS), BeforeValidator(_one_string_is_a_list)
]
TokenId = Annotated[int, Field(ge=0, le=MAX_TOKEN_ID)]
StopTokenIds = Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)]
Seed = Annotated[int, Field(ge=0, lt=2**63)]
# Not a sampling field: the engine takes it on the request (`EngineRequest.n`), and batch flags do not set it.
NumSamples = Annotated[int, Field(ge=1, le=MAX_SAMPLES)]
_N_DESCRIPTION = "Independent samples of this prompt (they share its prefill); sample i of a seeded request draws from (seed, i)."


class _CalledFunction(StrictModel):
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as OpenAI writes it


class _PastToolCall(StrictModel):
    """A call an earlier assistant turn made (agent transcripts replayed in a batch)."""

    id: str = Field(min_length=1, max_length=256)
    type: Literal["function"]
    function: _CalledFunction


class ChatMessage(StrictModel):
    """One chat message. OpenAI's forms are accepted and normalized: the `developer` role is `system`, and
    content given as a list of text parts is their texts joined by newlines (image, audio and file parts are
    rejected: cbq generates text from text). Transcripts of tool use are taken too: an assistant turn with
    `tool_calls` (its content may be null) and `tool` turns answering them by `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = Field(None, min_length=1, max_length=64)  # a participant's name, given to the template
    tool_calls: list[_PastToolCall] | None = Field(None, min_length=1, max_length=MAX_TOOL_CALLS)
    tool_call_id: str | None = Field(None, min_length=1, max_length=256)
    # What an OpenAI response message carries besides its content, so a conversation that appends the
    # previous response's message as it came runs: accepted when empty, and not given to the template.
    refusal: None = Field(None, exclude=True)
    annotations: list[Any] | None = Field(None, max_length=0, exclude=True)

    @model_validator(mode="after")
    def _fields_of_the_role(self):
        if self.tool_calls is not None and self.role != "assistant":
            raise ValueError("only an assistant message has tool_calls")
        if (self.tool_call_id is not None) != (self.role == "tool"):
            raise ValueError("a tool message has a tool_call_id, and only a tool message")
        if self.content is None and self.tool_calls is None:
            raise ValueError("content is required (it may be null only beside tool_calls)")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' convention): no unset fields, and tool-call
        arguments as objects where they are JSON objects."""
        message = self.model_dump(exclude_none=True)
        for call in message.get("tool_calls", []):
            try:
                arguments = json.loads(call["function"]["arguments"])
            except ValueError:
                continue
            if isinstance(arguments, dict):
                call["function"]["arguments"] = arguments
        return message

    @model_validator(mode="before")
    @classmethod
    def _openai_forms(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        data = dict(data)
        if data.get("role") == "developer":
            data["role"] = "system"
        if isinstance(data.get("content"), list):
            data["content"] = _text_of_parts(data["content"])
        return data


def _text_of_parts(parts: list[Any]) -> Any:
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind != "text":
            if kind in ("image_url", "input_image", "input_audio", "file"):
                raise ValueError(f"content parts of type {kind!r} are not supported: cbq takes text only")
            raise ValueError('content parts must be {"type": "text", "text": "..."}')
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise ValueError('a text part is {"type": "text", "text": "..."}')
        texts.append(part["text"])
    return "\n".join(texts)


class OutputConstraint(StrictModel):
    """What the output must match: the engine's `Constraint`. `spec` is the schema as JSON text (`json_schema`),
    the pattern (`regex`) or a JSON list of strings (`choice`); `json_object` has none (`schemas.constraint`)."""

    kind: Literal["json_schema", "json_object", "regex", "choice"]
    spec: str = ""

    @classmethod
    def checked(cls, kind: str, spec: str = "") -> OutputConstraint:
        """The constraint, if llguidance compiles it (no tokenizer needed); else ValueError with the reason."""
        error = compile_error(kind, spec)
        if error:
            raise ValueError(f"does not compile: {error}")
        return cls(kind=kind, spec=spec)  # type: ignore[arg-type]


def _json_text(value: Any) -> str:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False)


class Sampling(StrictModel):
    """The one definition of the sampling fields: names, types, bounds, defaults and descriptions.

    None means "not set": the worker's engine fills it from the checkpoint's generation_config.json, else
    from its built-in default (`SamplingParams.with_defaults`), so the model's own defaults apply.

    Everything else is derived from it: `SamplingOverrides` (every field optional, for lines and batch flags),
    the OpenAI body fields (through `OPENAI_RENAMES`), the `cbq submit`/`cbq run` flags
    (`producer.options.sampling_options`) and the engine's `SamplingParams` (`worker.admission`, by field
    name; a test checks both sides name the same fields with the same defaults). To add a field, add it here
    and to `SamplingParams`.
    """

    max_new_tokens: int | None = Field(
        None,
        ge=1,
        le=MAX_NEW_TOKENS_LIMIT,
        description="Most tokens to generate (default: the model's generation_config, else the rest of the context).",
    )
    temperature: float | None = Field(
        None,
        ge=0,
        le=MAX_TEMPERATURE,
        description="Sampling temperature; 0 is greedy (default: the model's generation_config, else 0).",
    )
    top_p: float | None = Field(
        None,
        gt=0,
        le=1,
        description="Keep the most likely tokens up to this total probability; 1 keeps all "
        "(default: the model's generation_config, else 1).",
    )
    top_k: int | None = Field(
        None,
        ge=0,
        le=MAX_TOP_K,
        description="Keep the k most likely tokens; 0 keeps all (default: the model's generation_config, else 0).",
    )
    seed: Seed | None = Field(None, description="Random seed; without one, the request id seeds the draws.")
    stop: StopStrings = Field([], description="Strings that end the output (the text is cut before them).")
    stop_token_ids: StopTokenIds = Field([], description="Token ids that end the output.")
    ignore_eos: bool = Field(False, description="Keep generating after the end-of-sequence token.")
    logprobs: int | None = Field(
        None,
        ge=0,
        le=MAX_LOGPROBS,
        description="Return each output token's log-probability and this many most likely alternatives.",
    )
    presence_penalty: float | None = Field(
        None,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="Subtracted from the logit of every token the output already contains, as OpenAI's "
        "(default 0).",
    )
    frequency_penalty: float | None = Field(
        None,
        ge=-MAX_PENALTY,
        le=MAX_PENALTY,
        description="Subtracted from a token's logit once per time the output already contains it, as "
        "OpenAI's (default 0).",
    )
    constraint: OutputConstraint | None = Field(
        None, description="What the output must match (lines give json_schema, regex or choice)."
    )


class _Overrides(StrictModel):
    def given(self) -> dict[str, Any]:
        return {name: value for name, value in self if value is not None}


def _all_optional(model: type[BaseModel], names: dict[str, str] | None = None) -> dict[str, Any]:
    """`create_model` field definitions: `model`'s fields with their bounds, each optional (None: not given).

    `names` maps a new field name to the `model` field it copies (default: every field under its own name).
    """
    fields = {}
    for name, source in (names or {n: n for n in model.model_fields}).items():
        info = model.model_fields[source]
        type_and_bounds = (info.annotation, *info.metadata)
        annotation: Any = Annotated[type_and_bounds] if info.metadata else info.annotation
        fields[name] = (Optional[annotation], Field(None, description=info.description))  # noqa: UP045
    return fields


def overrides_model(sampling: type[Sampling]) -> type[SamplingOverrides]:
    """The model of `sampling`'s fields as given on a line or by batch flags: same bounds, None = not given."""
    return create_model(
        "SamplingOverrides",
        __base__=cast("type[SamplingOverrides]", _Overrides),
        __module__=__name__,
        __doc__='Sampling fields as given on a line or by batch flags; None means "not given here".',
        **_all_optional(sampling),
    )


if TYPE_CHECKING:  # the type checker cannot see fields made by create_model; at runtime they are all there

    class SamplingOverrides(_Overrides): ...

else:
    SamplingOverrides = overrides_model(Sampling)


CustomId = Annotated[str, Field(min_length=1, max_length=512)]


# Sampling fields that lines spell their own way, not by their name: a constraint is `json_schema`, `regex`
# or `choice` on a cbq line and `response_format` in an OpenAI body; logprobs differ by OpenAI endpoint.
_SPELLED_BY_LINES = ("constraint",)
_SPELLED_BY_BODIES = ("constraint", "logprobs")
Choice = Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_CHOICES)]


class _NativeConstraint(_Overrides):
    """cbq's own constraint fields on simple and chat lines; at most one per line."""

    json_schema: dict[str, Any] | None = Field(None, description="A JSON schema the output must follow.")
    regex: str | None = Field(None, min_length=1, description="A regex the whole output must match.")
    choice: Choice | None = Field(None, description="The output is exactly one of these strings.")

    @model_validator(mode="after")
    def _at_most_one_constraint(self):
        given = [name for name in ("json_schema", "regex", "choice") if getattr(self, name) is not None]
        if len(given) > 1:
            raise ValueError(f"give at most one constraint per line, not {' and '.join(given)}")
        return self

    @field_validator("json_schema", "regex", "choice")
    @classmethod
    def _compiles(cls, value: Any, info: ValidationInfo) -> Any:
        if value is not None:
            _native_constraint(info.field_name or "", value)
        return value

    def output_constraint(self) -> OutputConstraint | None:
        for name in ("json_schema", "regex", "choice"):
            if getattr(self, name) is not None:
                return _native_constraint(name, getattr(self, name))
        return None


def _native_constraint(name: str, value: Any) -> OutputConstraint:
    return OutputConstraint.checked(name, value if isinstance(value, str) else _json_text(value))


if TYPE_CHECKING:

    class _NativeLine(_NativeConstraint, SamplingOverrides):
        n: int

else:
    _NativeLine = create_model(
        "_NativeLine",
        __base__=_NativeConstraint,
        __module__=__name__,
        n=(NumSamples, Field(1, description=_N_DESCRIPTION)),
        **_all_optional(Sampling, {n: n for n in Sampling.model_fields if n not in _SPELLED_BY_LINES}),
    )


# apply_chat_template's own parameters, and names its templates read from it: not template variables.
_RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
    }
)  # fmt: skip
TemplateName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
TemplateValue = StrictBool | StrictInt | StrictFloat | Annotated[str, Field(max_length=256)] | None


def _no_reserved_names(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = sorted(set(value or ()) & _RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise ValueError(f"{', '.join(reserved)} cannot be set here (the chat template's own inputs)")
    return value


# Extra variables for the model's chat template, as vLLM's `chat_template_kwargs`: Qwen3's
# {"enable_thinking": false} turns its thinking off. Without a template they change nothing.
ChatTemplateKwargs = Annotated[
    dict[TemplateName, TemplateValue], Field(max_length=16), AfterValidator(_no_reserved_names)
]
_chat_template_kwargs_adapter: TypeAdapter[dict[str, Any]] = TypeAdapter(ChatTemplateKwargs)


def checked_chat_template_kwargs(value: Any) -> dict[str, Any]:
    """`value` as a batch's chat_template_kwargs, under a line's bounds; ValueError naming the first problem."""
    try:
        return _chat_template_kwargs_adapter.validate_python(value)
    except ValidationError as exc:
        first = exc.errors()[0]
        where = ".".join(str(part) for part in first["loc"])
        raise ValueError(f"{where + ': ' if where else ''}{first['msg']}") from None


class PromptLine(_NativeLine):
    custom_id: CustomId | None = None
    prompt: str


class ChatLine(_NativeLine):
    custom_id: CustomId | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: ChatTemplateKwargs | None = None


# OpenAI body field -> the cbq sampling field it sets; every other sampling field keeps its name.
OPENAI_RENAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}


# OpenAI body fields that cbq accepts only at the value that changes nothing, and why it cannot do more.
_NO_OP_VALUES: dict[str, tuple[Any, str]] = {
    "stream": (False, "batch results are not streamed"),
    "stream_options": (None, "batch results are not streamed"),
}
# Fields that ask for what cbq cannot do yet: rejected with the reason, not as unknown.
_UNSUPPORTED_FIELDS = {
    "functions": "function calling",
    "function_call": "function calling",
    "audio": "audio output",
    "modalities": "output modalities other than text",
    # Its keys are token ids of OpenAI's tokenizer, which name other tokens in another model's vocabulary.
    "logit_bias": "logit_bias (its token ids belong to OpenAI's tokenizer, not to the model that runs here)",
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "reasoning_effort": "reasoning_effort (an open model's thinking is a switch in its chat template: give "
    'chat_template_kwargs, e.g. {"enable_thinking": false} for Qwen3)',
    "verbosity": "verbosity (an OpenAI model setting)",
}
# Values of those fields that ask for nothing (generated files often spell their defaults out). Not
# `web_search_options: {}`: that turns web search on.
_UNSUPPORTED_NO_OPS: dict[str, tuple[Any, ...]] = {
    "logit_bias": ({},),
    "functions": ([],),
    "modalities": (["text"],),
}


class _JsonSchemaSpec(StrictModel):
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI requires it; unused
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")  # none: any JSON value
    strict: bool | None = None  # cbq always enforces the schema

    @field_validator("schema_")
    @classmethod
    def _compiles(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        OutputConstraint.checked("json_schema", _json_text(value or {}))
        return value


class _ResponseFormat(StrictModel):
    """OpenAI's `response_format`: `text` (no constraint), `json_object`, or `json_schema` with its spec."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: _JsonSchemaSpec | None = None

    @model_validator(mode="after")
    def _spec_iff_json_schema(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError('json_schema is given exactly when type is "json_schema"')
        return self

    def output_constraint(self) -> OutputConstraint | None:
        if self.type == "json_object":
            return OutputConstraint(kind="json_object")
        if self.json_schema is not None:
            return OutputConstraint(kind="json_schema", spec=_json_text(self.json_schema.schema_ or {}))
        return None


class _OpenAIBodyBase(StrictModel):
    """The body fields every OpenAI endpoint shares. Fields that do nothing at their accepted value are taken
    so that an unedited OpenAI batch file runs (see `_NO_OP_VALUES`); `user`, `metadata`, `store`,
    `service_tier`, `parallel_tool_calls`, `prompt_cache_key`, `prompt_cache_retention` and
    `safety_identifier` are accepted and ignored."""

    model: str | None = None  # accepted and echoed in the output; the worker's model runs the request
    n: NumSamples | None = Field(None, description=_N_DESCRIPTION)  # None: 1
    stream: bool | None = None
    response_format: _ResponseFormat | None = None
    user: str | None = None
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: str | None = None
    parallel_tool_calls: bool | None = None
    # Identifiers and cache hints: they change no output (cbq caches shared prefixes by itself).
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None
    stream_options: Any = None
    # Declared only to be refused with the reason (see `_UNSUPPORTED_FIELDS`); excluded from the fields
    # an error message lists as allowed.
    functions: Any = Field(None, exclude=True)
    function_call: Any = Field(None, exclude=True)
    audio: Any = Field(None, exclude=True)
    modalities: Any = Field(None, exclude=True)
    logit_bias: Any = Field(None, exclude=True)
    prediction: Any = Field(None, exclude=True)
    web_search_options: Any = Field(None, exclude=True)
    reasoning_effort: Any = Field(None, exclude=True)
    verbosity: Any = Field(None, exclude=True)

    @field_validator(*_UNSUPPORTED_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value in _UNSUPPORTED_NO_OPS.get(info.field_name or "", ()):
            return value
        raise ValueError(f"cbq does not support {_UNSUPPORTED_FIELDS[info.field_name or '']} yet")

    @field_validator(*_NO_OP_VALUES)
    @classmethod
    def _no_op_value(cls, value: Any, info: ValidationInfo) -> Any:
        accepted, why = _NO_OP_VALUES[info.field_name or ""]
        if value is not None and value != accepted:
            raise ValueError(f"only {json.dumps(accepted)} is accepted ({why})")
        return value

    @model_validator(mode="after")
    def _one_name_per_field(self):
        for target in set(OPENAI_RENAMES.values()):
            given = [
                name
                for name, to in OPENAI_RENAMES.items()
                if to == target and getattr(self, name) is not None
            ]
            if len(given) > 1:
                raise ValueError(f"give {' or '.join(given)}, not both")
        return self

    def overrides(self) -> SamplingOverrides:
        given = {name: getattr(self, name) for name in _OPENAI_SAMPLING_NAMES}
        fields = {_OPENAI_SAMPLING_NAMES[name]: value for name, value in given.items() if value is not None}
        fields |= {"logprobs": self.num_logprobs(), "constraint": self.output_constraint()}
        return SamplingOverrides(**fields)

    def num_logprobs(self) -> int | None:
        """Top alternatives per token, or None for no logprobs (each endpoint spells it its own way)."""
        return None

    def output_constraint(self) -> OutputConstraint | None:
        return self.response_format.output_constraint() if self.response_format else None


# Every sampling field a body accepts under its name or a rename -> the cbq field it sets.
_OPENAI_SAMPLING_NAMES = OPENAI_RENAMES | {
    n: n for n in Sampling.model_fields if n not in OPENAI_RENAMES.values() and n not in _SPELLED_BY_BODIES
}

if TYPE_CHECKING:

    class _OpenAIBody(_OpenAIBodyBase): ...

else:
    _OpenAIBody = create_model(
        "_OpenAIBody",
        __base__=_OpenAIBodyBase,
        __module__=__name__,
        **_all_optional(Sampling, _OPENAI_SAMPLING_NAMES),
    )


NumLogprobs = Annotated[int, Field(ge=0, le=MAX_LOGPROBS)]


class CompletionBody(_OpenAIBody):
    prompt: str
    logprobs: NumLogprobs | None = None  # top alternatives per token (OpenAI allows 5; cbq up to 20)

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionBody(_OpenAIBody):
    messages: list[ChatMessage] = Field(min_length=1)
    chat_template_kwargs: ChatTemplateKwargs | None = None  # a vLLM extension, not OpenAI's
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # see schemas/tools.py
    tool_choice: ToolChoice | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None

    @model_validator(mode="after")
    def _tool_call_is_forced_or_none(self):
        call = forced_call(self.tools, self.tool_choice)
        if call is not None and self.response_format and self.response_format.output_constraint():
            raise ValueError("give response_format or a forced tool call, not both")
        return self

    def tool_call(self) -> ForcedToolCall | None:
        return forced_call(self.tools, self.tool_choice)

    def output_constraint(self) -> OutputConstraint | None:
        call = self.tool_call()
        if call is not None and self.tools:  # the arguments follow the function's parameters
            schema = function_named(self.tools, call.name).arguments_schema()
            return OutputConstraint(kind="json_schema", spec=_json_text(schema))
        return super().output_constraint()

    @model_validator(mode="after")
    def _top_logprobs_need_logprobs(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


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
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[dict[str, Any]] | None = None  # OpenAI chat bodies: shown to the chat template
    tool_call: ForcedToolCall | None = None  # the call the body forces: the output is its arguments
    sampling: Sampling = Sampling()
    n: NumSamples = 1
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
    chat_template_kwargs: ChatTemplateKwargs | None = None
    tools: list[dict[str, Any]] | None = None
    tool_call: ForcedToolCall | None = None
    overrides: SamplingOverrides = SamplingOverrides()
    n: NumSamples = 1

    def resolve(
        self,
        index: int,
        defaults: SamplingOverrides | None = None,
        return_token_ids: bool = False,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> Request:
        """The stored request: line values win over batch defaults, which win over the built-in ones.
        `chat_template_kwargs` are the batch's template variables, for chats; the line's win, name by name."""
        merged = (defaults.given() if defaults else {}) | self.overrides.given()
        template_kwargs = None
        if self.messages is not None and (chat_template_kwargs or self.chat_template_kwargs):
            template_kwargs = (chat_template_kwargs or {}) | (self.chat_template_kwargs or {})
        return Request(
            index=index,
            line_no=self.line_no,
            custom_id=self.custom_id,
            shape=self.shape,
            url=self.url,
            model=self.model,
            prompt=self.prompt,
            messages=self.messages,
            chat_template_kwargs=template_kwargs,
            tools=self.tools,
            tool_call=self.tool_call,
            sampling=Sampling(**merged),
            n=self.n,
            return_token_ids=return_token_ids,
        )


_SHAPE_HINT = (
    'expected {"prompt": ...}, {"messages": [...]}, or an OpenAI Batch line '
    '{"custom_id", "method", "url", "body"}'
)
_OPENAI_KEYS = {"method", "url", "body"}


def parse_request_line(text: str | bytes, line_no: int) -> ParsedRequest | None:
    """Validate one JSONL line (bytes are decoded as UTF-8 here, so a bad byte is an error of its line).
    Returns None for a blank line; raises RequestLineError naming line and field."""
    obj = _load_json_line(text, line_no)
    if obj is _BLANK:
        return None
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
            chat_template_kwargs=line.chat_template_kwargs,
            overrides=_overrides_of(line),
            n=line.n,
        )
    if "prompt" in obj:
        line = _validate(PromptLine, obj, line_no)
        return ParsedRequest(
            line_no=line_no,
            custom_id=line.custom_id,
            shape="prompt",
            prompt=line.prompt,
            overrides=_overrides_of(line),
            n=line.n,
        )
    raise RequestLineError(line_no, [FieldIssue("", _SHAPE_HINT)])


_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate (pairs combine)
_SURROGATE = re.compile("[\ud800-\udfff]")


_BLANK = object()


def _load_json_line(text: str | bytes, line_no: int) -> Any:
    """The line's JSON value (`_BLANK` for a blank line). Every way the text can fail is a RequestLineError:
    bad UTF-8, bad JSON, a number too long to convert, nesting too deep, a lone surrogate (`"\\ud800"` parses,
    but no UTF-8 text can hold it, so the request could never be stored)."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestLineError(
                line_no, [FieldIssue("", f"invalid UTF-8 at byte {exc.start + 1}")]
            ) from None
    if not text.strip():
        return _BLANK
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        message = f"invalid JSON: {exc.msg} at column {exc.colno}"
    except ValueError:  # int("...") past sys.get_int_max_str_digits()
        message = "invalid JSON: a number has too many digits"
    except RecursionError:
        message = "invalid JSON: nested too deeply"
    else:
        if _SURROGATE_ESCAPE.search(text):
            field = _lone_surrogate_field(obj, ())
            if field is not None:
                raise RequestLineError(
                    line_no,
                    [
                        FieldIssue(
                            field, "contains a lone UTF-16 surrogate (\\ud800-\\udfff), not valid Unicode"
                        )
                    ],
                )
        return obj
    raise RequestLineError(line_no, [FieldIssue("", message)])


def _lone_surrogate_field(value: Any, loc: tuple[str | int, ...]) -> str | None:
    """The dotted path of the first string (or key) in `value` holding a surrogate, else None."""
    if isinstance(value, str):
        return format_loc(loc) if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                return format_loc(loc) or "(a key)"
            found = _lone_surrogate_field(item, (*loc, key))
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_field(item, (*loc, i))
            if found is not None:
                return found
    return None


def _overrides_of(line: _NativeLine) -> SamplingOverrides:
    given = {name: getattr(line, name) for name in SamplingOverrides.model_fields if name not in _SPELLED_BY_LINES}
    return SamplingOverrides(**given | {"constraint": line.output_constraint()})


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
        chat_template_kwargs=getattr(body, "chat_template_kwargs", None),
        tools=[t.model_dump(exclude_none=True) for t in body.tools] if getattr(body, "tools", None) else None,
        tool_call=body.tool_call() if isinstance(body, ChatCompletionBody) else None,
        overrides=body.overrides(),
        n=body.n or 1,
    )


def _validate(model: type[StrictModel], obj: Any, line_no: int, prefix: tuple[str, ...] = ()):
    try:
        return model.model_validate(obj)
    except ValidationError as exc:
        raise RequestLineError(line_no, issues_from_validation_error(exc, model, prefix)) from None
