"""Forced tool calls in OpenAI chat bodies: `tools` with a `tool_choice` that leaves the model no choice.

Extraction pipelines written for OpenAI often force one function call (`tool_choice: {"type": "function",
"function": {"name": ...}}`, or `"required"` with a single tool) to get arguments that follow a schema. cbq
runs that as a JSON-schema constraint on the function's `parameters`, shows the tools to the chat template
(as transformers' `apply_chat_template(tools=...)`), and answers with OpenAI's `tool_calls` message.
A call the model would choose freely (`"auto"`, or `"required"` among several tools) needs each model's own
tool-call format and parser: refused with that reason. `"none"` shows the tools and generates text.
"""

from __future__ import annotations

import json
from typing import Any, Literal

from pydantic import Field, field_validator

from schemas.constraint import compile_error
from schemas.strict import StrictModel


class FunctionSpec(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema; none: any JSON object
    strict: bool | None = None  # cbq always enforces the parameters' schema

    @field_validator("parameters")
    @classmethod
    def _compiles(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        error = compile_error("json_schema", json.dumps(value or {}))
        if error:
            raise ValueError(f"does not compile: {error}")
        return value

    def arguments_schema(self) -> dict[str, Any]:
        return self.parameters if self.parameters is not None else {"type": "object"}


class Tool(StrictModel):
    type: Literal["function"]
    function: FunctionSpec


class _FunctionName(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: _FunctionName


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ForcedToolCall(StrictModel):
    """The stored request's call: which function (its arguments schema is already the request's constraint),
    and how OpenAI reports it (`finish_reason` "stop" for a named choice, "tool_calls" for "required")."""

    name: str
    named: bool


def forced_call(tools: list[Tool] | None, choice: ToolChoice | None) -> ForcedToolCall | None:
    """The call `tool_choice` forces, None when none is made ("none"); ValueError for what cbq cannot run."""
    if choice is not None and not tools:
        raise ValueError("tool_choice needs tools")
    if not tools or choice == "none":
        return None
    if choice is None or choice == "auto":
        raise ValueError(
            'cbq calls a tool only when tool_choice names it (or is "required" with one tool): letting the '
            "model choose needs its own tool-call format"
        )
    if choice == "required":
        if len(tools) > 1:
            raise ValueError('tool_choice "required" with several tools lets the model choose: name one')
        return ForcedToolCall(name=tools[0].function.name, named=False)
    assert isinstance(choice, NamedToolChoice)
    if all(tool.function.name != choice.function.name for tool in tools):
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
    return ForcedToolCall(name=choice.function.name, named=True)


def function_named(tools: list[Tool], name: str) -> FunctionSpec:
    return next(tool.function for tool in tools if tool.function.name == name)
