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
    kind: str, spec: str, start: str, end: str, *, opened: bool = False, special_ids: dict[str, int] | None = None
) -> tuple[str, str]:
    """The constraint (kind, spec) that lets a reasoning block `start ... end` come first, then `kind`/`spec`.
    `opened`: the prompt ends with `start` (DeepSeek-R1 distills), so the output is `reasoning end answer` and
    the block is required. `special_ids`: those markers that are special tokens of the model (matched as that
    token, not as text)."""
    inner = {"kind": kind, "spec": spec, "start": start, "end": end, "opened": opened, "special_ids": special_ids or {}}
    return "json_schema", json.dumps({AFTER_REASONING: inner})


def _after_reasoning_grammar(inner: dict[str, Any]) -> str:
    """A lark grammar `start: think? answer`, the answer being the original constraint inline; the reasoning
    stops at the first closing marker (a lazy rule)."""

    def marker(text: str) -> str:
        token_id = inner["special_ids"].get(text)
        return f"<[{int(token_id)}]>" if token_id is not None else json.dumps(text)

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
        start, opener = "start: think ws? answer", ""
    else:
        start, opener = "start: (think ws?)? answer", marker(inner["start"]) + " "
    return (
        f"{start}\nthink[lazy]: {opener}/(?s:.*)/ {marker(inner['end'])}\n"
        f"ws: /[ \\t\\r\\n]+/\nanswer: {answer}\n"
    )


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
