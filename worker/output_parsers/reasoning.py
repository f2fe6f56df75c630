"""Reasoning parsers: split a finished output into the model's reasoning and the rest (the answer, with any
tool calls still in it for the tool-call parser).

Owns nothing stateful; pure Python. Formats:
- `think` (Qwen3, DeepSeek-R1 distills, QwQ): `<think>reasoning</think>answer`. R1 distills' templates open
  `<think>` in the prompt, so their output is `reasoning</think>answer`: everything before the first `</think>`
  is reasoning. An output that opens `<think>` and never closes it was cut short while thinking: all of it is
  reasoning. Without either marker the output is all answer (Qwen3 with thinking switched off).
- `harmony` (gpt-oss): the `analysis` channel's messages are the reasoning; `final` messages are the answer;
  messages to a recipient (tool calls) stay as written for the harmony tool-call parser.
`think_markers` gives the grammar what may come before a constrained answer (schemas/constraint.py).
"""

from __future__ import annotations

from dataclasses import dataclass

from worker.output_parsers.harmony import harmony_segments


@dataclass(frozen=True)
class ReasoningSplit:
    reasoning: str | None  # None: the output has no reasoning part
    rest: str


class ThinkParser:
    name = "think"
    needs_special_tokens = False
    start: str | None = "<think>"
    end: str | None = "</think>"

    def split(self, text: str) -> ReasoningSplit:
        head, end, tail = text.partition("</think>")
        if end:
            return ReasoningSplit(head.strip().removeprefix("<think>").strip(), tail.strip())
        if text.lstrip().startswith("<think>"):
            return ReasoningSplit(text.lstrip().removeprefix("<think>").strip(), "")
        return ReasoningSplit(None, text)


class HarmonyReasoningParser:
    name = "harmony"
    needs_special_tokens = True
    # Its reasoning is a message of special tokens, not text before the answer: no constrained answer after it.
    start: str | None = None
    end: str | None = None

    def split(self, text: str) -> ReasoningSplit:
        segments = harmony_segments(text)
        reasoning = [s.body for s in segments if not isinstance(s, str) and s.channel == "analysis"]
        if not any(not isinstance(s, str) for s in segments):
            return ReasoningSplit(None, text)
        rest = [
            s if isinstance(s, str) else (s.raw if s.recipient else s.body)
            for s in segments
            if isinstance(s, str) or s.channel != "analysis"
        ]
        return ReasoningSplit("\n".join(r.strip() for r in reasoning) if reasoning else None, "".join(rest).strip())


REASONING_PARSERS = {p.name: p for p in (ThinkParser, HarmonyReasoningParser)}
