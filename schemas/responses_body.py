"""OpenAI's `/v1/responses` body, as a batch line gives it. Owns how a Responses body maps onto the chat path.

A Responses body is read in its own spelling (`input` items, `instructions`, `max_output_tokens`, `text.format`,
flat function tools, `reasoning`) and becomes the chat body it means (`ResponsesBody.chat_body`): the request is
stored and run as a chat, through the same messages, tools, tool-call plan, constraint and output parsers. What
the Response object repeats of the request (its instructions, tools, sampling values, ...) is kept beside it
(`ResponseEcho`), for `schemas/responses_output.py`.

- `input`: a string (one user message) or a list of items: messages (`user`, `system`, `developer`,
  `assistant`; content a string or `input_text` parts, an assistant's `output_text` parts too), `function_call`
  items (an assistant's tool calls) and `function_call_output` items (tool messages), and `reasoning` items, which
  are dropped (chat templates leave past turns' reasoning out). A user message's `input_image` parts become the
  chat's `image_url` parts, in place (their `image_url` string is the URL; `detail` is kept; a `file_id` is
  refused: cbq has no file store for images). `input_file` and `input_audio` parts are refused, as are
  `item_reference` and hosted tools' items.
- `instructions`: a system message before the input.
- `reasoning.effort`: given to the chat template as its `reasoning_effort` variable (gpt-oss's template reads
  it; templates that do not read it ignore it); `reasoning.summary` changes nothing (no summaries are written).
- `previous_response_id`, `conversation`, `prompt`: refused (a batch line carries its whole conversation);
  `background` and `stream` only at false, `truncation` only "disabled".
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import Field, PrivateAttr, ValidationError, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from schemas.chat import ChatTemplateKwargs
from schemas.limits import MAX_IMAGE_URL_CHARS, MAX_TOOLS
from schemas.openai_body import ChatCompletionBody, IgnoredBodyFields
from schemas.sampling import (
    MaxNewTokens,
    NumLogprobs,
    OutputConstraint,
    SharedSampling,
    check_min_tokens,
    check_scoring,
)
from schemas.strict import StrictModel
from schemas.tools import FunctionSpec, ToolCallPlan

RESPONSES_URL = "/v1/responses"

# `include` values cbq honours: the output text's logprobs, and the encrypted reasoning OpenAI returns for
# stateless conversations (cbq has none to give: the reasoning item carries its text in `content`).
OUTPUT_LOGPROBS = "message.output_text.logprobs"
_INCLUDABLE = (OUTPUT_LOGPROBS, "reasoning.encrypted_content")

# Fields that ask for what a batch line cannot have: refused with the reason, not as unknown.
_REFUSED_FIELDS = {
    "previous_response_id": "previous_response_id (a batch has no conversation state: give the whole "
    "conversation in input)",
    "conversation": "conversation (a batch has no conversation state: give the whole conversation in input)",
    "prompt": "prompt templates (give the prompt in input)",
    "max_tool_calls": "max_tool_calls",
    "prompt_logprobs": "prompt_logprobs on /v1/responses (a Response has no place for them)",
}
# Fields that change nothing at their accepted value.
_NO_OP_VALUES: dict[str, tuple[Any, str]] = {
    "stream": (False, "batch results are not streamed"),
    "background": (False, "a batch line already runs in the background"),
    "truncation": ("disabled", "cbq never drops input items: a conversation longer than the context fails"),
}
_UNSUPPORTED_PARTS = ("input_file", "input_audio")


def _unsupported(what: str) -> PydanticCustomError:
    return PydanticCustomError("unsupported_parameter", "cbq does not support {what} yet", {"what": what})


# --- input items ---------------------------------------------------------------------------------------------


class _TextPart(StrictModel):
    """`input_text` (any role) or `output_text` (an assistant's, as a previous Response gave it)."""

    type: Literal["input_text", "output_text"]
    text: str
    annotations: list[Any] | None = Field(None, max_length=0)  # what an output_text carries; empty only
    logprobs: list[Any] | None = None  # a previous Response's logprobs: not given to the template


class _ImagePart(StrictModel):
    """`input_image`: an image by URL (a data: URL, an http(s) URL or a file: URL, as chat's `image_url.url`)."""

    type: Literal["input_image"]
    image_url: str | None = Field(None, min_length=1, max_length=MAX_IMAGE_URL_CHARS)
    file_id: str | None = None
    detail: Literal["auto", "low", "high"] | None = None  # accepted; changes nothing (schemas/media.py ImageUrl)

    @model_validator(mode="after")
    def _by_url(self):
        if self.file_id is not None:
            raise _unsupported("input_image file_id (give the image as image_url: a data:, http(s) or file: URL)")
        if self.image_url is None:
            raise ValueError("an input_image part needs image_url")
        return self

    def as_chat_part(self) -> dict[str, Any]:
        image_url = {"url": self.image_url} | ({"detail": self.detail} if self.detail is not None else {})
        return {"type": "image_url", "image_url": image_url}


def _parts_checked(value: Any, images: bool = False) -> Any:
    """A string as one text part; file and audio parts (and image parts where `images` is False) refused in one
    line, before they are read as text."""
    if isinstance(value, str):
        return [{"type": "input_text", "text": value}]
    for part in value if isinstance(value, list) else ():
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in _UNSUPPORTED_PARTS or (kind == "input_image" and not images):
            where = "content" if kind != "input_image" else "content outside a message"
            raise _unsupported(f"{kind} {where} (cbq reads images in messages only: no file or audio input)")
    return value


MessagePart = Annotated[_TextPart | _ImagePart, Field(discriminator="type")]


class _MessageItem(StrictModel):
    type: Literal["message"] = "message"
    role: Literal["user", "system", "developer", "assistant"]
    content: list[MessagePart]  # a string is one input_text part
    id: str | None = None  # a previous Response's item: its id and status are not given to the template
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("content", mode="before")
    @classmethod
    def _no_media_parts(cls, value: Any) -> Any:
        return _parts_checked(value, images=True)

    @model_validator(mode="after")
    def _output_text_is_an_assistants(self):
        if self.role != "assistant" and any(part.type == "output_text" for part in self.content):
            raise ValueError("output_text parts are an assistant's: give input_text")
        return self

    def chat_content(self) -> str | list[dict[str, Any]]:
        """The chat message's content: the texts joined by newlines, or with images, text and image_url parts in
        their order (the chat body says which roles may hold images)."""
        if not any(isinstance(part, _ImagePart) for part in self.content):
            return "\n".join(part.text for part in self.content if isinstance(part, _TextPart))
        return [
            part.as_chat_part() if isinstance(part, _ImagePart) else {"type": "text", "text": part.text}
            for part in self.content
        ]


class _FunctionCallItem(StrictModel):
    """A call an earlier assistant turn made: it joins that turn's message as one of its `tool_calls`."""

    type: Literal["function_call"]
    call_id: str = Field(min_length=1, max_length=256)
    name: str = Field(min_length=1, max_length=64)
    arguments: str  # JSON text, as the Response gave it
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


class _InputTextPart(StrictModel):
    type: Literal["input_text"]
    text: str


class _FunctionCallOutputItem(StrictModel):
    """A tool's answer to a call (`call_id`): a tool message."""

    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1, max_length=256)
    output: list[_InputTextPart]  # a string is one input_text part
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None

    @field_validator("output", mode="before")
    @classmethod
    def _no_media_parts(cls, value: Any) -> Any:
        return _parts_checked(value)

    def text(self) -> str:
        return "\n".join(part.text for part in self.output)


class _ReasoningItem(StrictModel):
    """An earlier turn's reasoning: accepted and left out of the prompt, as chat templates leave it out."""

    type: Literal["reasoning"]
    id: str | None = None
    summary: list[dict[str, Any]] = Field(default_factory=list)
    content: list[dict[str, Any]] | None = None
    encrypted_content: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None


InputItem = Annotated[
    _MessageItem | _FunctionCallItem | _FunctionCallOutputItem | _ReasoningItem, Field(discriminator="type")
]
_KNOWN_ITEMS = ("message", "function_call", "function_call_output", "reasoning")


def _items_checked(value: Any) -> Any:
    """A string is one user message; items without a type are messages (OpenAI's easy form); other item types
    are refused by name."""
    if isinstance(value, str):
        return [{"type": "message", "role": "user", "content": value}]
    if not isinstance(value, list):
        return value
    items = []
    for item in value:
        if isinstance(item, dict) and "type" not in item and "role" in item:
            item = {**item, "type": "message"}
        kind = item.get("type") if isinstance(item, dict) else None
        if isinstance(kind, str) and kind not in _KNOWN_ITEMS:
            raise _unsupported(f"{kind} input items (cbq takes messages, function calls and their outputs)")
        items.append(item)
    return items


def _messages_of(instructions: str | None, items: list[Any]) -> list[dict[str, Any]]:
    """The chat messages an input means: the instructions first, consecutive function calls (and the assistant
    text before them) as one assistant message, each function call output as a tool message."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": instructions}] if instructions is not None else []
    for item in items:
        if isinstance(item, _MessageItem):
            messages.append({"role": item.role, "content": item.chat_content()})
        elif isinstance(item, _FunctionCallItem):
            call = {"id": item.call_id, "type": "function", "function": {"name": item.name, "arguments": item.arguments}}
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif isinstance(item, _FunctionCallOutputItem):
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": item.text()})
    return messages


# --- tools, text format, reasoning ---------------------------------------------------------------------------


class FunctionTool(FunctionSpec):
    """Responses' flat function tool: `{"type": "function", "name", "description", "parameters", "strict"}`."""

    type: Literal["function"]

    def as_chat_tool(self) -> dict[str, Any]:
        return {"type": "function", "function": self.model_dump(exclude={"type"}, exclude_none=True)}


def _tools_checked(value: Any) -> Any:
    for tool in value if isinstance(value, list) else ():
        kind = tool.get("type") if isinstance(tool, dict) else None
        if isinstance(kind, str) and kind != "function":
            raise _unsupported(f"{kind} tools (cbq runs function tools)")
    return value


class _ToolChoiceFunction(StrictModel):
    type: Literal["function"]
    name: str


ResponsesToolChoice = Literal["none", "auto", "required"] | _ToolChoiceFunction


def _tool_choice_checked(value: Any) -> Any:
    kind = value.get("type") if isinstance(value, dict) else None
    if isinstance(kind, str) and kind != "function":
        raise _unsupported(f"tool_choice of type {kind} (cbq runs function tools)")
    return value


class _JsonSchemaFormat(StrictModel):
    """`text.format` for a JSON schema, flat as Responses spells it (chat nests it under `json_schema`)."""

    type: Literal["json_schema"]
    name: str = Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")  # OpenAI requires it; unused
    schema_: dict[str, Any] = Field(alias="schema")
    description: str | None = None
    strict: bool | None = None  # cbq always enforces the schema

    @field_validator("schema_")
    @classmethod
    def _compiles(cls, value: dict[str, Any]) -> dict[str, Any]:
        OutputConstraint.checked("json_schema", json.dumps(value))
        return value


class _PlainFormat(StrictModel):
    type: Literal["text", "json_object"]


class TextConfig(StrictModel):
    format: Annotated[_JsonSchemaFormat | _PlainFormat, Field(discriminator="type")] | None = None
    verbosity: Literal["medium"] | None = None  # an OpenAI model setting: only its default, which asks nothing

    def response_format(self) -> dict[str, Any] | None:
        """The chat body's `response_format` that this format means."""
        if self.format is None or self.format.type == "text":
            return None
        if isinstance(self.format, _JsonSchemaFormat):
            spec = {"name": self.format.name, "schema": self.format.schema_}
            return {"type": "json_schema", "json_schema": spec}
        return {"type": "json_object"}


class ReasoningConfig(StrictModel):
    effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    summary: Literal["auto", "concise", "detailed"] | None = None  # no summaries are written: summary stays []
    generate_summary: Literal["auto", "concise", "detailed"] | None = None  # the older name of summary


# --- the body ------------------------------------------------------------------------------------------------


class ResponseEcho(StrictModel):
    """What a Response object repeats of its request, stored with it (`Request.responses`)."""

    instructions: str | None = None
    max_output_tokens: int | None = None
    metadata: dict[str, str] | None = None
    parallel_tool_calls: bool = True
    reasoning: dict[str, Any] | None = None
    temperature: float | None = None  # as given (the model's generation_config or OpenAI's 1 apply otherwise)
    top_p: float | None = None
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    top_logprobs: int | None = None
    truncation: str | None = None
    user: str | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    background: bool | None = None
    output_logprobs: bool = False  # `include` asks for the output text's logprobs


class ResponsesBody(IgnoredBodyFields, SharedSampling):
    """A `/v1/responses` body: every field OpenAI documents, taken, refused with its reason, or at the value
    that changes nothing (`IgnoredBodyFields`: store, metadata, user, ...); the sampling fields vLLM adds
    (`top_k`, `seed`, ...) by their names, as on chat."""

    model: str | None = None  # accepted and echoed in the output; the worker's model runs the request
    input: list[InputItem]  # a string is one user message
    instructions: str | None = None
    max_output_tokens: MaxNewTokens | None = None
    text: TextConfig | None = None
    tools: list[FunctionTool] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: ResponsesToolChoice | None = None
    parallel_tool_calls: bool | None = None
    reasoning: ReasoningConfig | None = None
    include: list[Literal["message.output_text.logprobs", "reasoning.encrypted_content"]] | None = None
    top_logprobs: NumLogprobs | None = None
    chat_template_kwargs: ChatTemplateKwargs | None = None  # a vLLM extension, as on chat bodies
    stream_options: None = None
    stream: bool | None = None
    background: bool | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # Declared only to be refused with the reason (`_REFUSED_FIELDS`); not listed as allowed.
    previous_response_id: Any = Field(None, exclude=True)
    conversation: Any = Field(None, exclude=True)
    prompt: Any = Field(None, exclude=True)
    max_tool_calls: Any = Field(None, exclude=True)

    _chat: ChatCompletionBody = PrivateAttr()

    @field_validator("input", mode="before")
    @classmethod
    def _known_items(cls, value: Any) -> Any:
        return _items_checked(value)

    @field_validator("tools", mode="before")
    @classmethod
    def _function_tools(cls, value: Any) -> Any:
        return _tools_checked(value)

    @field_validator("tool_choice", mode="before")
    @classmethod
    def _function_choice(cls, value: Any) -> Any:
        return _tool_choice_checked(value)

    @field_validator(*_REFUSED_FIELDS)
    @classmethod
    def _refuse(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return value
        raise _unsupported(_REFUSED_FIELDS[info.field_name or ""])

    @field_validator(*_NO_OP_VALUES)
    @classmethod
    def _no_op_value(cls, value: Any, info: ValidationInfo) -> Any:
        accepted, why = _NO_OP_VALUES[info.field_name or ""]
        if value is not None and value != accepted:
            raise ValueError(f"only {json.dumps(accepted)} is accepted ({why})")
        return value

    @field_validator("input")
    @classmethod
    def _not_empty(cls, value: list[Any]) -> list[Any]:
        if not any(not isinstance(item, _ReasoningItem) for item in value):
            raise ValueError("give at least one message")
        return value

    @model_validator(mode="after")
    def _token_limits(self):
        check_min_tokens(self.min_tokens, self.max_output_tokens, "max_output_tokens")
        check_scoring(self.max_output_tokens, False, "max_output_tokens", "prompt_logprobs")
        return self

    @model_validator(mode="after")
    def _as_chat(self):
        """Build the chat body this means; a cross-field problem is named with Responses' fields."""
        response_format = self.text.response_format() if self.text else None
        choice = self.tool_choice
        if isinstance(choice, _ToolChoiceFunction):
            choice_fields: Any = {"type": "function", "function": {"name": choice.name}}
        else:
            choice_fields = choice
        given = {name: getattr(self, name) for name in SharedSampling.model_fields if getattr(self, name) is not None}
        chat_fields = {
            "model": self.model,
            "messages": _messages_of(self.instructions, self.input),
            "tools": [tool.as_chat_tool() for tool in self.tools] if self.tools else None,
            "tool_choice": choice_fields,
            "parallel_tool_calls": self.parallel_tool_calls,
            "response_format": response_format,
            "max_completion_tokens": self.max_output_tokens,
            "chat_template_kwargs": self._template_kwargs(),
            "logprobs": True if self.output_logprobs() else None,
            "top_logprobs": self.top_logprobs if self.output_logprobs() else None,
            **given,
        }
        try:
            self._chat = ChatCompletionBody.model_validate({k: v for k, v in chat_fields.items() if v is not None})
        except ValidationError as exc:
            error = exc.errors(include_url=False)[0]
            message = error["msg"].removeprefix("Value error, ")
            raise ValueError(message.replace("response_format", "text.format")) from None
        return self

    def _template_kwargs(self) -> dict[str, Any] | None:
        effort = self.reasoning.effort if self.reasoning else None
        if effort is None:
            return self.chat_template_kwargs
        return {"reasoning_effort": effort, **(self.chat_template_kwargs or {})}

    def output_logprobs(self) -> bool:
        return OUTPUT_LOGPROBS in (self.include or ())

    def chat_body(self) -> ChatCompletionBody:
        """The chat body this Responses body means: what is stored and run."""
        return self._chat

    def tool_call(self) -> ToolCallPlan | None:
        return self._chat.tool_call()

    def echo(self) -> ResponseEcho:
        """The fields the Response repeats, in Responses' own spelling."""
        reasoning = self.reasoning.model_dump(exclude={"generate_summary"}) if self.reasoning else None
        if reasoning is not None and self.reasoning and self.reasoning.summary is None:
            reasoning["summary"] = self.reasoning.generate_summary
        choice = self.tool_choice
        return ResponseEcho(
            instructions=self.instructions,
            max_output_tokens=self.max_output_tokens,
            metadata=self.metadata,
            parallel_tool_calls=self.parallel_tool_calls is not False,
            reasoning=reasoning,
            temperature=self.temperature,
            top_p=self.top_p,
            text=self.text.model_dump(by_alias=True, exclude_none=True) if self.text and self.text.format else
            {"format": {"type": "text"}},
            tool_choice=choice.model_dump() if isinstance(choice, _ToolChoiceFunction) else choice or "auto",
            tools=[tool.model_dump(exclude_none=True) | {"parameters": tool.parameters, "strict": tool.strict}
                   for tool in self.tools or ()],
            top_logprobs=self.top_logprobs,
            truncation=self.truncation,
            user=self.user,
            service_tier=self.service_tier,
            safety_identifier=self.safety_identifier,
            prompt_cache_key=self.prompt_cache_key,
            background=self.background,
            output_logprobs=self.output_logprobs(),
        )
