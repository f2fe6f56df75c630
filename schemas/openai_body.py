"""OpenAI Batch lines and the two bodies cbq runs: `/v1/completions` and `/v1/chat/completions`.

Owns how an OpenAI body maps onto cbq's fields: the sampling fields by their own name (`SharedSampling`),
`max_tokens`/`max_completion_tokens` as `max_new_tokens`, `response_format` and forced tool calls as the output
constraint, and each endpoint's spelling of logprobs. Scoring: completions' `echo` (with `logprobs`, the prompt's
tokens and logprobs lead the choice's, as OpenAI's legacy completions give them) and vLLM's `prompt_logprobs`
on both endpoints; a token limit of 0 only with one of them. Fields that cbq cannot honour are refused with the reason;
fields that change nothing at their accepted value are taken, so an unedited OpenAI batch file runs.
"""

from __future__ import annotations

import json
from typing import Annotated, Any, ClassVar, Literal

from pydantic import AfterValidator, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from schemas.chat import ChatMessage, ChatTemplateKwargs
from schemas.limits import MAX_CUSTOM_ID_CHARS, MAX_TOOLS
from schemas.media import at_most_images
from schemas.prompt import ChatSpelling, CompletionPrompt, PromptSpelling
from schemas.sampling import (
    N_DESCRIPTION,
    MaxNewTokens,
    NumLogprobs,
    NumSamples,
    OutputConstraint,
    Sampling,
    SharedSampling,
    check_min_tokens,
    check_scoring,
    json_text,
)
from schemas.strict import StrictModel
from schemas.tools import Tool, ToolCallPlan, ToolChoice, forced_call, function_named, required_calls_schema

COMPLETIONS_URL = "/v1/completions"
CHAT_COMPLETIONS_URL = "/v1/chat/completions"
OpenAIUrl = Literal["/v1/completions", "/v1/chat/completions", "/v1/responses", "/v1/embeddings"]  # responses: schemas/responses_body.py; embeddings: schemas/embeddings.py
CustomId = Annotated[str, Field(min_length=1, max_length=MAX_CUSTOM_ID_CHARS)]

# OpenAI body field -> the cbq sampling field it sets; every field of `SharedSampling` keeps its name.
OPENAI_RENAMES = {"max_tokens": "max_new_tokens", "max_completion_tokens": "max_new_tokens"}

# What a field an OpenAI body leaves out means when the model's generation_config does not set it either:
# OpenAI's defaults, which vLLM's server uses too (cbq's own lines keep the engine's: greedy).
OPENAI_SAMPLING_DEFAULTS = {"temperature": 1.0, "top_p": 1.0}

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
    "prediction": "predicted outputs",
    "web_search_options": "web search",
    "verbosity": "verbosity (an OpenAI model setting)",
}
# Values of those fields that ask for nothing (generated files often spell their defaults out). Not
# `web_search_options: {}`: that turns web search on.
_UNSUPPORTED_NO_OPS: dict[str, tuple[Any, ...]] = {
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
        OutputConstraint.checked("json_schema", json_text(value or {}))
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
            return OutputConstraint(kind="json_schema", spec=json_text(self.json_schema.schema_ or {}))
        return None


class _StructuredOutputs(StrictModel):
    """vLLM's `structured_outputs` (its `StructuredOutputsParams`), for the kinds cbq constrains: `json` (a
    schema, or its JSON text), `regex`, `choice`, `json_object`. A grammar or structural tag is refused."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    regex: str | None = Field(None, min_length=1)
    choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    json_object: bool | None = None
    grammar: str | None = None
    structural_tag: Any = None
    disable_any_whitespace: bool | None = None  # cbq's JSON is always compact
    disable_fallback: bool | None = None
    disable_additional_properties: bool | None = None
    whitespace_pattern: str | None = None

    def constraint(self) -> OutputConstraint | None:
        return vllm_constraint(self.json_, self.regex, self.choice, self.json_object, self.grammar,
                               self.structural_tag, "structured_outputs.")


def vllm_constraint(
    schema: dict[str, Any] | str | None,
    regex: str | None,
    choice: list[str] | None,
    json_object: bool | None,
    grammar: str | None,
    structural_tag: Any = None,
    prefix: str = "guided_",
) -> OutputConstraint | None:
    """The constraint vLLM's fields ask for (at most one), compiled; ValueError naming the field otherwise."""
    names = {"json": schema, "regex": regex, "choice": choice, "json_object": json_object or None,
             "grammar": grammar, "structural_tag": structural_tag}  # fmt: skip
    given = [name for name, value in names.items() if value is not None]
    if len(given) > 1:
        raise ValueError(f"give one constraint, not {' and '.join(prefix + name for name in given)}")
    if not given:
        return None
    if given[0] in ("grammar", "structural_tag"):
        raise PydanticCustomError(
            "unsupported_parameter",
            "cbq does not support {what} constraints yet (json, regex, choice and json_object are)",
            {"what": prefix + given[0]},
        )
    if schema is not None:
        spec = schema if isinstance(schema, str) else json_text(schema)
        try:
            json.loads(spec)
        except ValueError:
            raise ValueError(f"{prefix}json is not a JSON schema") from None
        return OutputConstraint.checked("json_schema", spec)
    if regex is not None:
        return OutputConstraint.checked("regex", regex)
    if choice is not None:
        return OutputConstraint.checked("choice", json_text(choice))
    return OutputConstraint(kind="json_object")


class IgnoredBodyFields(StrictModel):
    """The fields OpenAI's chat, completions and Responses bodies share that change no output: accepted (so that
    an unedited OpenAI batch file runs) and ignored. Declared once here, for `_OpenAIBody` and `ResponsesBody`
    (schemas/responses_body.py), which repeats some of them in its Response object."""

    user: str | None = None
    metadata: dict[str, str] | None = None
    # `store: true` (OpenAI's default) keeps nothing beyond the batch's own results (no stored completion or
    # Response to retrieve).
    store: bool | None = None
    service_tier: str | None = None
    # Identifiers and cache hints: cbq caches shared prefixes by itself.
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    safety_identifier: str | None = None


class _BodyFields(StrictModel):
    """The body fields every OpenAI endpoint shares besides sampling and the ignored ones (`IgnoredBodyFields`).
    Fields that do nothing at their accepted value are taken so that an unedited OpenAI batch file runs (see
    `_NO_OP_VALUES`); `parallel_tool_calls: false` allows one call where cbq constrains the calls
    (schemas/tools.py)."""

    model: str | None = None  # accepted and echoed in the output; the worker's model runs the request
    n: NumSamples | None = Field(None, description=N_DESCRIPTION)  # None: 1
    stream: bool | None = None
    response_format: _ResponseFormat | None = None
    parallel_tool_calls: bool | None = None
    stream_options: Any = None
    # Declared only to be refused with the reason (see `_UNSUPPORTED_FIELDS`); excluded from the fields
    # an error message lists as allowed.
    functions: Any = Field(None, exclude=True)
    function_call: Any = Field(None, exclude=True)
    audio: Any = Field(None, exclude=True)
    modalities: Any = Field(None, exclude=True)
    prediction: Any = Field(None, exclude=True)
    web_search_options: Any = Field(None, exclude=True)
    verbosity: Any = Field(None, exclude=True)
    # vLLM's request extensions. `request_id` and `priority` change no output: cbq names its requests (batch id
    # and index) and runs a batch in input order. `cache_salt`: only requests with the same salt share cached
    # prompt blocks. `return_token_ids`: the choices carry their token ids.
    request_id: str | None = Field(None, max_length=MAX_CUSTOM_ID_CHARS)
    priority: int | None = None
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CUSTOM_ID_CHARS)
    return_token_ids: bool | None = None
    # vLLM's output constraints: `structured_outputs`, and the older `guided_*` fields it replaced.
    structured_outputs: _StructuredOutputs | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = Field(None, min_length=1)
    guided_choice: list[Annotated[str, Field(min_length=1)]] | None = Field(None, min_length=1)
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # cbq's one backend is llguidance
    guided_whitespace_pattern: str | None = None  # ignored: cbq's JSON is compact


# NOTE: pydantic lists a base's fields before its subclass's, the last base's first: `_BodyFields` then stays
# first in an unknown field's "allowed:" list (model, n, stream, ...).
class _OpenAIBody(SharedSampling, IgnoredBodyFields, _BodyFields):
    """What both endpoints' bodies accept: `_BodyFields`, the ignored fields, the shared sampling fields, and the
    token limit."""

    max_tokens: MaxNewTokens | None = None
    max_completion_tokens: MaxNewTokens | None = None

    @field_validator(*_UNSUPPORTED_FIELDS)
    @classmethod
    def _unsupported(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None or value in _UNSUPPORTED_NO_OPS.get(info.field_name or "", ()):
            return value
        what = _UNSUPPORTED_FIELDS[info.field_name or ""]
        raise PydanticCustomError("unsupported_parameter", "cbq does not support {what} yet", {"what": what})

    @field_validator(*_NO_OP_VALUES)
    @classmethod
    def _no_op_value(cls, value: Any, info: ValidationInfo) -> Any:
        accepted, why = _NO_OP_VALUES[info.field_name or ""]
        if value is not None and value != accepted:
            raise ValueError(f"only {json.dumps(accepted)} is accepted ({why})")
        return value

    @model_validator(mode="after")
    def _min_tokens_within_max(self):
        check_min_tokens(self.min_tokens, self.max_tokens or self.max_completion_tokens, "max_tokens")
        return self

    @model_validator(mode="after")
    def _zero_tokens_only_to_score(self):
        for name in OPENAI_RENAMES:
            check_scoring(getattr(self, name), self.scores_prompt(), name, self._scoring_fields)
        return self

    _scoring_fields: ClassVar[str] = "prompt_logprobs"

    def scores_prompt(self) -> bool:
        """Whether the body asks for its prompt's logprobs (or, completions, its echo)."""
        return self.prompt_logprobs is not None

    @model_validator(mode="after")
    def _one_name_per_field(self):
        for target in set(OPENAI_RENAMES.values()):
            given = [name for name, to in OPENAI_RENAMES.items() if to == target and getattr(self, name) is not None]
            if len(given) > 1:
                raise ValueError(f"give {' or '.join(given)}, not both")
        return self

    def overrides(self) -> Sampling:
        """The sampling fields this body gives, under cbq's names."""
        fields = {name: getattr(self, name) for name in SharedSampling.model_fields}
        fields |= {to: getattr(self, name) for name, to in OPENAI_RENAMES.items() if getattr(self, name) is not None}
        return Sampling(**fields, logprobs=self.num_logprobs(), constraint=self.output_constraint())

    def num_logprobs(self) -> int | None:
        """Top alternatives per token, or None for no logprobs (each endpoint spells it its own way)."""
        return None

    def output_constraint(self) -> OutputConstraint | None:
        if self.response_format and self.response_format.output_constraint():
            return self.response_format.output_constraint()
        return self._vllm_constraint()

    def _vllm_constraint(self) -> OutputConstraint | None:
        if self.structured_outputs is not None:
            return self.structured_outputs.constraint()
        return vllm_constraint(self.guided_json, self.guided_regex, self.guided_choice, None, self.guided_grammar)

    @model_validator(mode="after")
    def _one_constraint_field(self):
        guided = [n for n in ("guided_json", "guided_regex", "guided_choice", "guided_grammar") if getattr(self, n)]
        spelled = [*(["response_format"] if self.response_format and self.response_format.type != "text" else []),
                   *(["structured_outputs"] if self.structured_outputs is not None else []), *guided]  # fmt: skip
        if len(spelled) > 1:
            raise ValueError(f"give one output constraint, not {' and '.join(spelled)}")
        self._vllm_constraint()  # compiles, or names the field that does not
        return self


class CompletionBody(CompletionPrompt, PromptSpelling, _OpenAIBody):
    logprobs: NumLogprobs | None = None  # top alternatives per token (OpenAI allows 5; cbq up to 20)
    # The choice's text starts with the prompt; with `logprobs`, so do its logprobs (the first token's is null).
    echo: bool | None = None

    _scoring_fields: ClassVar[str] = "echo or prompt_logprobs"

    def scores_prompt(self) -> bool:
        return bool(self.echo) or super().scores_prompt()

    def num_logprobs(self) -> int | None:
        return self.logprobs


class ChatCompletionBody(ChatSpelling, _OpenAIBody):
    messages: Annotated[list[ChatMessage], Field(min_length=1), AfterValidator(at_most_images)]
    chat_template_kwargs: ChatTemplateKwargs | None = None  # a vLLM extension, not OpenAI's
    tools: list[Tool] | None = Field(None, max_length=MAX_TOOLS)  # see schemas/tools.py
    tool_choice: ToolChoice | None = None
    logprobs: bool | None = None
    top_logprobs: NumLogprobs | None = None
    # OpenAI's (and gpt-oss's) knob: handed to the chat template as the variable `reasoning_effort`, as vLLM
    # does; a template that does not read it ignores it.
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None

    @model_validator(mode="after")
    def _one_output_constraint(self):
        call = forced_call(self.tools, self.tool_choice)
        if call is None or not call.is_forced:
            return self
        if self.response_format and self.response_format.output_constraint():
            raise ValueError("give response_format or a forced tool call, not both")
        if self._vllm_constraint():
            raise ValueError("give structured_outputs (or guided_*) or a forced tool call, not both")
        return self

    def template_kwargs(self) -> dict[str, Any] | None:
        """The chat template's variables: `reasoning_effort`, then the body's chat_template_kwargs (which win)."""
        effort = {"reasoning_effort": self.reasoning_effort} if self.reasoning_effort is not None else {}
        merged = effort | (self.chat_template_kwargs or {})
        return merged or None

    def tool_call(self) -> ToolCallPlan | None:
        return forced_call(self.tools, self.tool_choice)

    def output_constraint(self) -> OutputConstraint | None:
        call = self.tool_call()
        if call is not None and call.is_forced and self.tools:
            if call.name is None:  # "required" among several tools: an array of calls
                schema = required_calls_schema(self.tools, parallel=self.parallel_tool_calls is not False)
            else:  # the arguments follow the function's parameters
                schema = function_named(self.tools, call.name).arguments_schema()
            return OutputConstraint(kind="json_schema", spec=json_text(schema))
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
    url: OpenAIUrl
    body: dict[str, Any]  # validated separately against the model that `url` selects
