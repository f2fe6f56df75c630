"""Output parsing: a finished chat output split into content, reasoning and tool calls, by the parsers the
worker's model needs. Owns the parser registry, the choice of parsers (`--tool-call-parser`,
`--reasoning-parser`, vLLM's flags: a name, `auto` from the chat template's text, or `none`) and the order they
run in: reasoning first, then tool calls in what follows it.

Pure Python (no torch, no pydantic): the worker turns a `ParsedOutput` into result-line fields.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol

from schemas.constraint import after_reasoning
from worker.engine.api import Constraint, ConstraintKind, SamplingParams
from worker.output_parsers.reasoning import REASONING_PARSERS, ReasoningSplit
from worker.output_parsers.tool_calls import (
    TOOL_CALL_PARSERS,
    ParsedCall,
    ToolCallSplit,
    calls_from_json_array,
)

__all__ = [
    "PARSER_CHOICES",
    "CallsMode",
    "ConstraintAfterReasoningError",
    "OutputParsing",
    "ParsedCall",
    "ParsedOutput",
    "result_fields",
    "chat_template_text",
    "text_with_special_tokens",
]

AUTO, NONE = "auto", "none"
CallsMode = Literal["none", "model", "array"]


class ToolCallParser(Protocol):
    name: str
    needs_special_tokens: bool

    def split(self, text: str) -> ToolCallSplit: ...


class ReasoningParser(Protocol):
    name: str
    needs_special_tokens: bool
    start: str | None  # the markers around the reasoning, when it is plain text before the answer
    end: str | None

    def split(self, text: str) -> ReasoningSplit: ...


PARSER_CHOICES = {
    "tool_call_parser": (AUTO, NONE, *TOOL_CALL_PARSERS),
    "reasoning_parser": (AUTO, NONE, *REASONING_PARSERS),
}

# What a chat template's text shows of its model's formats, most specific first: (marker, parser name).
_TOOL_CALL_MARKERS = (
    ("<|channel|>", "harmony"),
    ("[TOOL_CALLS]", "mistral"),
    ("<tool_call>", "hermes"),
    ("<|python_tag|>", "llama3_json"),
    ('"parameters"', "llama3_json"),  # Llama 3.x templates describe the call as {"name", "parameters"}
)
_REASONING_MARKERS = (("<|channel|>", "harmony"), ("</think>", "think"), ("<think>", "think"))


def _detect(markers: Sequence[tuple[str, str]], template: str | None) -> str | None:
    return next((name for marker, name in markers if template and marker in template), None)


@dataclass(frozen=True)
class ParsedOutput:
    content: str | None  # what remains for the user (None: nothing)
    reasoning_content: str | None = None
    tool_calls: list[ParsedCall] = field(default_factory=list)


@dataclass(frozen=True)
class OutputParsing:
    """The parsers a worker applies to chat outputs (none: outputs stay as generated)."""

    tool_call_parser: ToolCallParser | None = None
    reasoning_parser: ReasoningParser | None = None

    @classmethod
    def choose(cls, tool_call_parser: str, reasoning_parser: str, chat_template: str | None) -> OutputParsing:
        """The parsers named, `auto` ones detected from the chat template's text (none found: none)."""
        tool_name = _detect(_TOOL_CALL_MARKERS, chat_template) if tool_call_parser == AUTO else tool_call_parser
        reasoning_name = _detect(_REASONING_MARKERS, chat_template) if reasoning_parser == AUTO else reasoning_parser
        for name, registry, flag in (
            (tool_name, TOOL_CALL_PARSERS, "--tool-call-parser"),
            (reasoning_name, REASONING_PARSERS, "--reasoning-parser"),
        ):
            if name not in (None, NONE) and name not in registry:
                raise ValueError(f"{flag}: unknown parser {name!r} (one of {', '.join(registry)})")
        return cls(
            TOOL_CALL_PARSERS[tool_name]() if tool_name in TOOL_CALL_PARSERS else None,
            REASONING_PARSERS[reasoning_name]() if reasoning_name in REASONING_PARSERS else None,
        )

    def describe(self) -> str:
        return (
            f"tool calls: {self.tool_call_parser.name if self.tool_call_parser else NONE}, "
            f"reasoning: {self.reasoning_parser.name if self.reasoning_parser else NONE}"
        )

    def needs_special_tokens(self, calls: CallsMode) -> bool:
        parsers = [self.reasoning_parser, self.tool_call_parser if calls == "model" else None]
        return any(p is not None and p.needs_special_tokens for p in parsers)

    def parse(self, text: str, calls: CallsMode) -> ParsedOutput | None:
        """`text` split by the active parsers; None when nothing was found, so the output stays `text`.
        `calls`: "model" parses the model's own call format (the request offered tools, `tool_choice` "auto"),
        "array" a JSON array of calls (`"required"` among several tools), "none" no calls. Give the text decoded
        with special tokens kept when `needs_special_tokens` says so."""
        reasoning, rest = None, text
        if self.reasoning_parser is not None:
            split = self.reasoning_parser.split(text)
            reasoning, rest = split.reasoning, split.rest
        calls_made: list[ParsedCall] = []
        if calls == "model" and self.tool_call_parser is not None:
            tool_split = self.tool_call_parser.split(rest)
            if tool_split.calls:
                rest, calls_made = tool_split.content or "", tool_split.calls
        elif calls == "array":
            calls_made = calls_from_json_array(rest) or []
            rest = "" if calls_made else rest
        if reasoning is None and not calls_made:
            return None
        return ParsedOutput(rest or None, reasoning, calls_made)

    def constrain_after_reasoning(self, params: SamplingParams, prompt_ids: Sequence[int], tokenizer: Any) -> SamplingParams:
        """A chat request's output constraint moved after the reasoning block, when this worker parses reasoning:
        the model thinks freely, then its answer is constrained (schemas/constraint.py `after_reasoning`).
        Nothing changes when the prompt already closed the reasoning (Qwen3's `enable_thinking: false`)."""
        parser, constraint = self.reasoning_parser, params.constraint
        if parser is None or constraint is None:
            return params
        if parser.start is None or parser.end is None:
            raise ConstraintAfterReasoningError(
                f"the {parser.name} reasoning format cannot be followed by a constrained answer in cbq yet: run "
                "this request without response_format or a forced tool call"
            )
        prompt_tail = text_with_special_tokens(prompt_ids[-16:], tokenizer, drop_final_specials=False).rstrip()
        if prompt_tail.endswith(parser.end):
            return params
        token_ids = {m: i for m in (parser.start, parser.end) if (i := _single_token_id(tokenizer, m)) is not None}
        kind, spec = after_reasoning(
            constraint.kind.value, constraint.spec, parser.start, parser.end,
            opened=prompt_tail.endswith(parser.start), token_ids=token_ids, eos_ids=tokenizer.eos_token_ids,
        )  # fmt: skip
        return dataclasses.replace(params, constraint=Constraint(ConstraintKind(kind), spec))


def _single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of the one token that is `text` in this vocabulary (an added token such as `<think>`), if any."""
    return next((i for i in tokenizer.encode(text) if tokenizer.token_bytes(i) == text.encode()), None)


class ConstraintAfterReasoningError(ValueError):
    """A constrained request this worker cannot let reason first: it fails rather than constraining the
    reasoning. `field` names the request field, as admission's `UnsupportedField` does."""

    field = "response_format"


def result_fields(parsed: ParsedOutput | None, call_id_prefix: str) -> dict[str, Any]:
    """The result line's parsed fields (`schemas.result.ParsedParts`) for one output: nothing when nothing was
    parsed. Call ids are `{call_id_prefix}_{k}`, unique within the batch."""
    if parsed is None:
        return {}
    calls = [
        {"id": f"{call_id_prefix}_{k}", "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for k, c in enumerate(parsed.tool_calls)
    ]
    return {"content": parsed.content, "reasoning_content": parsed.reasoning_content, "tool_calls": calls or None}


def chat_template_text(tokenizer: Any) -> str | None:
    """The chat template(s) of a Hugging Face tokenizer (`HFTokenizer.backend`), as text to detect formats in;
    None without one (cbq's byte tokenizer)."""
    template = getattr(getattr(tokenizer, "backend", None), "chat_template", None)
    if isinstance(template, dict):  # named templates ("default", "tool_use")
        return "\n".join(str(t) for t in template.values())
    return template if isinstance(template, str) else None


def text_with_special_tokens(token_ids: Sequence[int], tokenizer: Any, drop_final_specials: bool = True) -> str:
    """The tokens decoded with their special tokens kept, as their names (harmony's, Mistral's and Llama's
    markers are special tokens, which the ordinary decode skips). `drop_final_specials`: an output's closing
    special tokens (end of turn, end of sequence) are not part of what the model said."""
    ids = list(token_ids)

    def is_special(token_id: int) -> bool:
        name = tokenizer.token_bytes(token_id).decode("utf-8", errors="replace")
        return token_id in tokenizer.eos_token_ids or tokenizer.special_token_id(name) == token_id

    while drop_final_specials and ids and is_special(ids[-1]):
        ids.pop()
    return b"".join(tokenizer.token_bytes(i) for i in ids).decode("utf-8", errors="replace")
