"""The message structure of OpenAI's harmony format (gpt-oss), as its generated text shows it with special
tokens kept: both harmony parsers (reasoning and tool calls) read it from here.

A message is `[<|start|>ROLE ...]<|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>json]<|message|>BODY`, ended by
`<|end|>`, `<|call|>` (a tool call), `<|return|>` (the final answer) or the end of the output. The
generation prompt ends with `<|start|>assistant`, so the output's first message begins at `<|channel|>`. The
recipient may sit in the role part instead (`<|start|>assistant to=functions.f<|channel|>commentary`).
Channels: `analysis` (reasoning), `commentary` (tool calls and preambles), `final` (the answer).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

_MESSAGE = re.compile(
    r"(?:<\|start\|>(?P<role>[^<]*))?<\|channel\|>(?P<header>[^<]*)(?:<\|constrain\|>[^<]*)?<\|message\|>"
    r"(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|\Z)",
    re.DOTALL,
)
_RECIPIENT = re.compile(r"\bto=(\S+)")


@dataclass(frozen=True)
class HarmonyMessage:
    channel: str
    recipient: str | None
    body: str
    raw: str


def harmony_segments(text: str) -> list[str | HarmonyMessage]:
    """`text` as plain text pieces (outside any message) and messages, in order."""
    segments: list[str | HarmonyMessage] = []
    last = 0
    for match in _MESSAGE.finditer(text):
        if match.start() > last:
            segments.append(text[last : match.start()])
        header = f"{match.group('role') or ''} {match.group('header')}"
        recipient = _RECIPIENT.search(header)
        channel = match.group("header").split()[0] if match.group("header").split() else ""
        segments.append(
            HarmonyMessage(channel, recipient.group(1) if recipient else None, match.group("body"), match.group(0))
        )
        last = match.end()
    if last < len(text):
        segments.append(text[last:])
    return segments
