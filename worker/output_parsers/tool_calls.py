"""Tool-call parsers: one per format a model family writes its calls in. Each turns a finished output into
the text the user reads (`content`) and the calls it made, by name and JSON arguments.

Owns nothing stateful; pure Python (no torch, no pydantic). A call that does not parse (truncated, not JSON,
no name) is left in the content as the model wrote it, so nothing the model said is lost.

Formats (from each family's documentation):
- `hermes` (Hermes, Qwen2.5, Qwen3): `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, any number.
- `llama3_json` (Llama 3.1-3.3): `{"name": ..., "parameters": {...}}`, optionally after `<|python_tag|>`,
  several separated by `;`.
- `mistral`: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]`, or the newer
  `[TOOL_CALLS]name[ARGS]{...}` (optionally `[CALL_ID]id` before `[ARGS]`), repeated.
- `harmony` (gpt-oss): a message `<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{...}<|call|>`.
Mistral's, Llama's and harmony's markers are special tokens: those parsers read the output decoded with its
special tokens kept (`needs_special_tokens`); the others read the ordinary text.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from worker.output_parsers.harmony import harmony_segments


@dataclass(frozen=True)
class ParsedCall:
    name: str
    arguments: str  # JSON text of an object, as OpenAI's `function.arguments`


@dataclass(frozen=True)
class ToolCallSplit:
    content: str | None  # None: nothing but calls (or nothing at all)
    calls: list[ParsedCall]


def _call(name: Any, arguments: Any) -> ParsedCall | None:
    """A call from a decoded name and arguments (an object, or JSON text of one); None if malformed."""
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            return None
    if arguments is None:
        arguments = {}
    if not isinstance(name, str) or not name or not isinstance(arguments, dict):
        return None
    return ParsedCall(name, json.dumps(arguments, ensure_ascii=False))


def _content(*parts: str) -> str | None:
    text = "".join(parts).strip()
    return text or None


class HermesParser:
    name = "hermes"
    needs_special_tokens = False
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)

    def split(self, text: str) -> ToolCallSplit:
        calls, kept, last = [], [], 0
        for match in self._BLOCK.finditer(text):
            call = None
            try:
                body = json.loads(match.group(1))
                if isinstance(body, dict):
                    call = _call(body.get("name"), body.get("arguments", body.get("parameters")))
            except ValueError:
                pass
            if call is None:
                continue  # the block stays in the content as written
            calls.append(call)
            kept.append(text[last : match.start()])
            last = match.end()
        kept.append(text[last:])
        return ToolCallSplit(_content(*kept) if calls else text, calls)


def _json_sequence(text: str, separator: str | None = None) -> list[Any] | None:
    """The JSON values `text` consists of, `separator` between them (whitespace allowed; no separator: one
    value alone); None otherwise."""
    decoder, values, pos = json.JSONDecoder(), [], 0
    while True:
        while pos < len(text) and text[pos].isspace():
            pos += 1
        try:
            value, pos = decoder.raw_decode(text, pos)
        except ValueError:
            return None
        values.append(value)
        while pos < len(text) and text[pos].isspace():
            pos += 1
        if pos == len(text):
            return values
        if separator is None or not text.startswith(separator, pos):
            return None
        pos += len(separator)


class Llama3JsonParser:
    name = "llama3_json"
    needs_special_tokens = True
    _TAG = "<|python_tag|>"

    def split(self, text: str) -> ToolCallSplit:
        before, tag, calls_text = text.partition(self._TAG)
        if not tag:  # without the tag, the whole output must be the calls (Llama's JSON tool format)
            before, calls_text = "", text
        if not calls_text.lstrip().startswith("{"):
            return ToolCallSplit(text, [])
        values = _json_sequence(calls_text, ";")
        calls = [
            _call(v.get("name"), v.get("parameters", v.get("arguments"))) if isinstance(v, dict) else None
            for v in values or []
        ]
        if not calls or any(call is None for call in calls):
            return ToolCallSplit(text, [])
        return ToolCallSplit(_content(before), [c for c in calls if c is not None])


class MistralParser:
    name = "mistral"
    needs_special_tokens = True
    _MARK = "[TOOL_CALLS]"
    _NAMED = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(?:\[CALL_ID\]\s*[A-Za-z0-9]+\s*)?\[ARGS\]", re.DOTALL)

    def split(self, text: str) -> ToolCallSplit:
        before, mark, rest = text.partition(self._MARK)
        if not mark:
            return ToolCallSplit(text, [])
        calls = self._json_list(rest) if rest.lstrip().startswith("[") else self._named(rest)
        if not calls:
            return ToolCallSplit(text, [])
        return ToolCallSplit(_content(before), calls)

    @staticmethod
    def _json_list(rest: str) -> list[ParsedCall] | None:
        values = _json_sequence(rest)
        if not values or not isinstance(values[0], list) or not values[0]:
            return None
        calls = [_call(v.get("name"), v.get("arguments")) if isinstance(v, dict) else None for v in values[0]]
        return None if any(c is None for c in calls) else [c for c in calls if c is not None]

    def _named(self, rest: str) -> list[ParsedCall] | None:
        calls = []
        for part in rest.split(self._MARK):  # `[TOOL_CALLS]a[ARGS]{...}[TOOL_CALLS]b[ARGS]{...}`
            match = self._NAMED.match(part)
            if match is None:
                return None
            values = _json_sequence(part[match.end() :])
            call = _call(match.group(1), values[0]) if values else None
            if call is None:
                return None
            calls.append(call)
        return calls


class HarmonyParser:
    name = "harmony"
    needs_special_tokens = True

    def split(self, text: str) -> ToolCallSplit:
        calls, kept = [], []
        for segment in harmony_segments(text):
            if isinstance(segment, str):
                kept.append(segment)
                continue
            if segment.recipient and segment.recipient.startswith("functions."):
                call = _call(segment.recipient.removeprefix("functions."), segment.body)
                if call is not None:
                    calls.append(call)
                    continue
            kept.append(segment.body)
        if not calls:
            return ToolCallSplit(text, [])
        return ToolCallSplit(_content(*kept), calls)


def calls_from_json_array(text: str) -> list[ParsedCall] | None:
    """The calls of `tool_choice: "required"` among several tools: the output was constrained to a JSON array
    of `{"name": ..., "parameters": {...}}` (see schemas/tools.py); None if it is not (cut short)."""
    try:
        values = json.loads(text)
    except ValueError:
        return None
    if not isinstance(values, list) or not values:
        return None
    calls = [_call(v.get("name"), v.get("parameters")) if isinstance(v, dict) else None for v in values]
    return None if any(c is None for c in calls) else [c for c in calls if c is not None]


TOOL_CALL_PARSERS = {p.name: p for p in (HermesParser, Llama3JsonParser, MistralParser, HarmonyParser)}
