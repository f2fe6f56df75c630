"""Tool calls in OpenAI chat bodies: which tools the chat template is shown, and what `tool_choice` asks of the
output. Owns the mapping from (`tools`, `tool_choice`) to a `ToolCallPlan` and the constraint it implies.

- `"auto"` (the default when tools are given): the template shows the tools and the model answers or calls in
  its own format; the worker's tool-call parser (worker/output_parsers) turns its calls into `tool_calls`.
- a named function, or `"required"` with one tool: the output is that function's arguments, constrained to its
  `parameters` schema (extraction pipelines written for OpenAI force one call this way).
- `"required"` with several tools: the output is constrained to a JSON array of
  `{"name": one of the tools, "parameters": its arguments}` objects (`required_calls_schema`), each a call.
- `"none"`: the template shows the tools and the model writes text.
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


class ToolCallPlan(StrictModel):
    """The stored request's tool use. `mode`: "auto" (the model's own format, parsed), "named" or "required"
    (a call is forced). `name`: the forced function, whose arguments are the output (its schema is already the
    request's constraint); None with "required": several tools, the output a JSON array of calls. OpenAI ends a
    call forced by name with `finish_reason` "stop", the others with "tool_calls"."""

    mode: Literal["auto", "named", "required"]
    name: str | None = None

    @property
    def named(self) -> bool:
        return self.mode == "named"

    @property
    def is_forced(self) -> bool:
        """The output is constrained to a call (not the model's own choice)."""
        return self.mode != "auto"


ForcedToolCall = ToolCallPlan  # the name the request models import


def forced_call(tools: list[Tool] | None, choice: ToolChoice | None) -> ToolCallPlan | None:
    """The tool use `tool_choice` asks for, None when no call can be made ("none", or no tools); ValueError for
    a choice that cannot be met."""
    if choice is not None and not tools:
        raise ValueError("tool_choice needs tools")
    if not tools or choice == "none":
        return None
    if choice is None or choice == "auto":
        return ToolCallPlan(mode="auto")
    if choice == "required":
        return ToolCallPlan(mode="required", name=tools[0].function.name if len(tools) == 1 else None)
    assert isinstance(choice, NamedToolChoice)
    if all(tool.function.name != choice.function.name for tool in tools):
        raise ValueError(f"tool_choice names {choice.function.name!r}, which is not in tools")
    return ToolCallPlan(mode="named", name=choice.function.name)


def required_calls_schema(tools: list[Tool], parallel: bool = True) -> dict[str, Any]:
    """`"required"` among several tools: a non-empty JSON array of calls, each `{"name", "parameters"}` with the
    name one of the tools' and the parameters that tool's schema (one `anyOf` branch per tool); one call only
    when `parallel` is off (`parallel_tool_calls: false`)."""
    calls = [
        {
            "type": "object",
            "properties": {"name": {"const": t.function.name}, "parameters": t.function.arguments_schema()},
            "required": ["name", "parameters"],
            "additionalProperties": False,
        }
        for t in tools
    ]
    return {"type": "array", "items": {"anyOf": calls}, "minItems": 1, **({} if parallel else {"maxItems": 1})}


def function_named(tools: list[Tool], name: str) -> FunctionSpec:
    return next(tool.function for tool in tools if tool.function.name == name)
