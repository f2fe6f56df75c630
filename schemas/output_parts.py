"""The parts of a finished request's output that every output form is built from: a sample (text, finish reason,
token logprobs, the parsed content, reasoning and tool calls) and the usage counts.

Both `schemas.result` (result lines, OpenAI Batch output lines) and `schemas.responses_output` (the Response
object of a `/v1/responses` line) read these, so they live below both and import neither.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field


class OutputModel(BaseModel):
    """The base of every output model: unknown fields are refused."""

    model_config = ConfigDict(extra="forbid")


class Usage(OutputModel):
    prompt_tokens: int = Field(0, ge=0)
    completion_tokens: int = Field(0, ge=0)
    cached_tokens: int = Field(0, ge=0)  # prompt tokens whose KV came from the prefix cache (OpenAI's
    # `usage.prompt_tokens_details.cached_tokens`, kept flat here like the other counts)
    reasoning_tokens: int = Field(0, ge=0)  # of the completion tokens, those of the reasoning the parser split off
    # (the reasoning text tokenized again; summed over samples)
    gpu_seconds: float = Field(0.0, ge=0)  # this request's share of the device time of the steps it was in
    queue_seconds: float = 0.0  # submitted -> first scheduled by the engine
    ttft_seconds: float = 0.0  # submitted -> first token known
    latency_seconds: float = 0.0  # submitted -> finished


class TopLogprob(OutputModel):
    """One token and its log-probability under the model's raw distribution."""

    token: str  # the token's text (its bytes decoded as UTF-8, a partial character as U+FFFD)
    logprob: float
    bytes: list[int]  # the token's exact UTF-8 bytes


class TokenLogprob(TopLogprob):
    """An output token, its log-probability and the most likely alternatives at its position: cbq's shape,
    which is also the shape of one item of OpenAI chat's `choices[].logprobs.content`."""

    top_logprobs: list[TopLogprob]  # most likely first; as many as the request asked for


class CalledFunction(OutputModel):
    name: str
    arguments: str  # JSON text of an object, as OpenAI's


class ToolCall(OutputModel):
    """A call the model made, parsed from its output: OpenAI's `tool_calls` item."""

    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ParsedParts(OutputModel):
    """A chat output split by the worker's output parsers (worker/output_parsers): set only when a parser found
    reasoning or tool calls, so readers of `text` keep working. The message's content is then `content` (None:
    nothing besides them), else the whole `text`."""

    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] | None = None

    @property
    def is_parsed(self) -> bool:
        return self.reasoning_content is not None or self.tool_calls is not None

    def message_content(self, text: str) -> str | None:
        return self.content if self.is_parsed else text


class Sample(ParsedParts):
    """One of a request's n samples (`ResultLine.samples`, only when n > 1)."""

    index: int = Field(ge=0)
    text: str
    token_ids: list[int] | None = None  # only when submitted with --token-ids
    finish_reason: Literal["stop", "length"]
    logprobs: list[TokenLogprob] | None = None  # when asked
