"""Output constraints as llguidance grammars: the one mapping from a constraint (kind + spec) to its grammar.

Owns nothing stateful. Plain Python (no pydantic, no torch), so both sides use it: `schemas.sampling` checks at
submit time that a line's schema, regex or choice list compiles (llguidance validates a grammar without a
tokenizer), and the engine's `worker.engine.grammar` compiles the same grammar text against its tokenizer.

Kinds and specs (the engine's `ConstraintKind` values): `json_schema` (the schema as JSON text), `json_object`
(any JSON object; no spec), `regex` (a pattern in Rust `regex` syntax, matched against the whole output),
`choice` (a JSON list of non-empty strings; the output is exactly one of them).

JSON is compact: `whitespace_flexible` is off, so no whitespace may appear between JSON tokens and a weak or
random model cannot loop on spaces until its token limit.
"""

from __future__ import annotations

import functools
import json
from typing import Any

KINDS = ("json_schema", "json_object", "regex", "choice")
_JSON_OPTIONS = {"whitespace_flexible": False}  # compact: "," and ":" with nothing around them


def grammar_text(llguidance: Any, kind: str, spec: str) -> str:
    """llguidance grammar text for a constraint; raises ValueError if the spec is not valid."""
    matcher = llguidance.LLMatcher
    if kind == "json_schema":
        return matcher.grammar_from_json_schema(json.loads(spec), defaults=_JSON_OPTIONS)
    if kind == "json_object":
        return matcher.grammar_from_json_schema({"type": "object"}, defaults=_JSON_OPTIONS)
    if kind == "regex":
        return matcher.grammar_from_regex(spec)
    if kind == "choice":
        choices = json.loads(spec)
        if not (isinstance(choices, list) and choices and all(isinstance(c, str) and c for c in choices)):
            raise ValueError("a choice constraint needs a JSON list of non-empty strings")
        return matcher.grammar_from_lark("start: " + " | ".join(json.dumps(c) for c in choices))  # JSON escapes
    raise ValueError(f"unknown constraint kind {kind!r} (one of {', '.join(KINDS)})")


@functools.lru_cache(maxsize=256)  # a file often repeats one schema on every line
def compile_error(kind: str, spec: str) -> str | None:
    """Why the constraint does not compile, or None. Needs no tokenizer: what only a tokenizer can reject
    (nothing the vocabulary can spell) is found by the worker and fails that request alone."""
    import llguidance

    try:
        error = llguidance.LLMatcher.validate_grammar(grammar_text(llguidance, kind, spec), None)
    except ValueError as exc:  # json.JSONDecodeError included
        return str(exc)
    return error or None
