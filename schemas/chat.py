"""Chat messages and chat-template variables, as chat lines and OpenAI chat bodies give them.

Owns how OpenAI's message forms are normalized for a chat template (`ChatMessage.for_template`) and which
template variables a line may set (`ChatTemplateKwargs`).
"""

from __future__ import annotations

import json
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    Field,
    StrictBool,
    StrictFloat,
    StrictInt,
    TypeAdapter,
    ValidationError,
    model_validator,
)

from schemas.limits import MAX_TEMPLATE_KWARGS, MAX_TEMPLATE_STRING_CHARS, MAX_TOOL_CALLS
from schemas.media import ContentPart, ImageUrlPart
from schemas.strict import StrictModel


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
    content given as a list of text parts is their texts joined by newlines. A user message's content with
    `image_url` parts stays a list of text and image parts (`schemas/media.py`; the worker fetches the images);
    audio and file parts are rejected. Transcripts of tool use are taken too: an assistant turn with
    `tool_calls` (its content may be null) and `tool` turns answering them by `tool_call_id`."""

    role: Literal["system", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None  # a list only when it holds an image
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
        if isinstance(self.content, list) and self.role != "user":
            raise ValueError("only a user message may hold image_url parts")
        return self

    def for_template(self) -> dict[str, Any]:
        """The message as chat templates take it (transformers' convention): no unset fields, and tool-call
        arguments as objects where they are JSON objects."""
        message = self.model_dump(exclude_none=True)
        if isinstance(self.content, list):  # the templates' convention for an image: {"type": "image"}
            message["content"] = [
                {"type": "image"} if isinstance(part, ImageUrlPart) else {"type": "text", "text": part.text}
                for part in self.content
            ]
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
    """Text parts joined into one string; parts with an image are left as they are, for their own model."""
    texts = []
    for part in parts:
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url":
            return _checked_parts(parts)
        if kind != "text":
            if kind in ("input_image", "input_audio", "file"):
                raise ValueError(f"content parts of type {kind!r} are not supported: cbq takes text and image_url")
            raise ValueError('content parts must be {"type": "text", "text": "..."} or {"type": "image_url", ...}')
        if set(part) != {"type", "text"} or not isinstance(part["text"], str):
            raise ValueError('a text part is {"type": "text", "text": "..."}')
        texts.append(part["text"])
    return "\n".join(texts)


_parts_adapter: TypeAdapter[list[Any]] = TypeAdapter(list[ContentPart])


def _checked_parts(parts: list[Any]) -> list[Any]:
    """Text and image parts, each checked here so that an error names the part rather than the union's arms."""
    try:
        return _parts_adapter.validate_python(parts, strict=True)
    except ValidationError as exc:
        first = exc.errors()[0]
        index, _tag, *inside = first["loc"]  # (part index, the union's tag, the field inside the part)
        where = ".".join([f"content[{index}]", *map(str, inside)])
        raise ValueError(f"{where}: {first['msg'].removeprefix('Value error, ')}") from None


# apply_chat_template's own parameters, and names its templates read from it: not template variables.
_RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages", "conversation", "tools", "documents", "chat_template", "add_generation_prompt",
        "continue_final_message", "tokenize", "padding", "truncation", "max_length", "return_tensors",
        "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs", "bos_token", "eos_token",
    }
)  # fmt: skip
TemplateName = Annotated[str, Field(pattern=r"^[A-Za-z_][A-Za-z0-9_]{0,63}$")]
TemplateValue = (
    StrictBool | StrictInt | StrictFloat | Annotated[str, Field(max_length=MAX_TEMPLATE_STRING_CHARS)] | None
)


def _no_reserved_names(value: dict[str, Any] | None) -> dict[str, Any] | None:
    reserved = sorted(set(value or ()) & _RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise ValueError(f"{', '.join(reserved)} cannot be set here (the chat template's own inputs)")
    return value


# Extra variables for the model's chat template, as vLLM's `chat_template_kwargs`: Qwen3's
# {"enable_thinking": false} turns its thinking off. Without a template they change nothing.
ChatTemplateKwargs = Annotated[
    dict[TemplateName, TemplateValue], Field(max_length=MAX_TEMPLATE_KWARGS), AfterValidator(_no_reserved_names)
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
