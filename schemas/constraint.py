"""Output constraints as llguidance grammars: the one mapping from a constraint (kind + spec) to its grammar.

Owns nothing stateful. Plain Python (no pydantic, no torch), so both sides use it: `schemas.sampling` checks at
submit time that a line's schema, regex or choice list compiles (llguidance validates a grammar without a
tokenizer), and the engine's `worker.engine.grammar` compiles the same grammar text against its tokenizer.

Kinds and specs (the engine's `ConstraintKind` values): `json_schema` (the schema as JSON text), `json_object`
(any JSON object; no spec), `regex` (a pattern in Rust `regex` syntax, matched against the whole output),
`choice` (a JSON list of non-empty strings; the output is exactly one of them).

JSON is compact: `whitespace_flexible` is off, so no whitespace may appear between JSON tokens and a weak or
random model cannot loop on spaces until its token limit.

After reasoning: a reasoning model's answer is constrained, not its thinking. The worker wraps such a request's
constraint with `after_reasoning` (its reasoning parser knows the markers); the result is a `json_schema`
constraint whose spec is an envelope (`AFTER_REASONING`, a key no schema submitted may use at its top level),
compiled into a lark grammar `start: think? answer`: an optional reasoning block (the opening marker optional
too, as DeepSeek-R1 distills open it in the prompt), whatever comes before the closing marker, then the
original constraint. The engine's token limit counts both parts.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Iterable
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice")
AFTER_REASONING = "x-cbq-after-reasoning"  # the envelope's key (see the module docstring)
_JSON_OPTIONS = {"whitespace_flexible": False}  # compact: "," and ":" with nothing around them


def grammar_text(llguidance: Any, kind: str, spec: str) -> str:
    """llguidance grammar text for a constraint; raises ValueError if the spec is not valid."""
    matcher = llguidance.LLMatcher
    if kind == "json_schema" and AFTER_REASONING in (envelope := json.loads(spec)):
        return matcher.grammar_from_lark(_after_reasoning_grammar(envelope[AFTER_REASONING]))
    if kind == "json_schema":
        return matcher.grammar_from_json_schema(json.loads(spec), defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(spec)
    if kind == "choice":  # JSON escapes are lark's
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in _choices(spec)))
    raise ValueError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


def _choices(spec: str) -> list[str]:
    choices = json.loads(spec)
    if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
        raise ValueError("a choice constraint needs a JSON list of non-empty strings")
    return choices


def after_reasoning(
    kind: str,
    spec: str,
    start: str,
    end: str,
    *,
    opened: bool = False,
    token_ids: dict[str, int] | None = None,
    eos_ids: Iterable[int] = (),
) -> tuple[str, str]:
    """The constraint (kind, spec) that lets a reasoning block `start ... end` come first, then `kind`/`spec`.
    `opened`: the prompt ends with `start` (DeepSeek-R1 distills), so the output is `reasoning end answer` and
    the block is required. `token_ids`: markers the vocabulary has as one token (Qwen3's `<think>`), which
    llguidance treats as special: text would not match them. `eos_ids`: tokens the reasoning may not contain."""
    inner = {
        "kind": kind,
        "spec": spec,
        "start": start,
        "end": end,
        "opened": opened,
        "token_ids": token_ids or {},
        "eos_ids": sorted(eos_ids),
    }
    return "json_schema", json.dumps({AFTER_REASONING: inner})


def _after_reasoning_grammar(inner: dict[str, Any]) -> str:
    """A lark grammar `start: think? answer`, the answer being the original constraint inline.

    The reasoning ends at the first closing marker. A marker the vocabulary has as one token (Qwen3's
    `</think>`) is matched as that token (llguidance keeps such tokens out of text terminals), and the reasoning
    is any tokens but it and end-of-sequence; a marker spelled as text closes a lazy text terminal instead."""
    token_ids = {text: int(i) for text, i in inner["token_ids"].items()}
    start, end = inner["start"], inner["end"]
    opener = f"<[{token_ids[start]}]> " if start in token_ids else f"{json.dumps(start)} "
    if end in token_ids:
        excluded = ",".join(str(i) for i in sorted({token_ids[end], *map(int, inner["eos_ids"])}))
        body = f"think_body <[{token_ids[end]}]>\nthink_body: <[^{excluded}]>*"
    else:
        body = f"think_body\nthink_body[lazy]: /(?s:.*)/ {json.dumps(end)}"
    kind, spec = inner["kind"], inner["spec"]
    if kind in ("json_schema", "json_object"):
        schema = json.loads(spec) if kind == "json_schema" else {"type": "object"}
        if not isinstance(schema, dict):
            schema = {"anyOf": [schema]} if schema is not True else {}
        answer = "%json " + json.dumps({**schema, "x-guidance": _JSON_OPTIONS})
    elif kind == "regex":
        answer = "/" + spec.replace("/", "\\/") + "/"
    elif kind == "choice":
        answer = " | ".join(json.dumps(c) for c in _choices(spec))
    else:
        raise ValueError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")
    if inner["opened"]:  # the prompt opened the block: it must be closed before the answer
        return f"start: think ws? answer\nthink: {body}\nws: /[ \\t\\r\\n]+/\nanswer: {answer}\n"
    return f"start: (think ws?)? answer\nthink: {opener}{body}\nws: /[ \\t\\r\\n]+/\nanswer: {answer}\n"


@functools.lru_cache(maxsize=256)  # a file often repeats one schema on every line
def compile_error(kind: str, spec: str) -> str | None:
    """Why the constraint does not compile, or None. Needs no tokenizer: what only a tokenizer can reject
    (nothing the vocabulary can spell) is found by the worker and fails that request alone."""
    import llguidance

    if kind == "json_schema" and _is_envelope(spec):
        return f"{AFTER_REASONING} is reserved (a top-level key cbq's worker uses)"
    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(llguidance, kind, spec), None)
    except ValueError as exc:  # json.JSONDecodeError included
        return str(exc)
    return error or None


def _is_envelope(spec: str) -> bool:
    try:
        value = json.loads(spec)
    except ValueError:
        return False
    return isinstance(value, dict) and AFTER_REASONING in value
