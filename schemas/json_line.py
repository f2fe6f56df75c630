"""Reading one JSONL line into a JSON value: every way the text itself can be unreadable, as a line error."""

from __future__ import annotations

import json
import re
from typing import Any

from schemas.errors import FieldIssue, RequestLineError, format_loc

_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")  # a JSON escape of a UTF-16 surrogate (pairs combine)
_SURROGATE = re.compile("[\ud800-\udfff]")

BLANK = object()  # what `load_json_line` gives for a blank line

# Characters that JSON may leave raw in a string but that Python's str.splitlines() (and some JSONL readers) treat as
# line ends: written as escapes, an output line is one line for every reader, and decodes to the same value.
_LINE_SEPARATORS = {"\x85": "\\u0085", "\u2028": "\\u2028", "\u2029": "\\u2029"}
_LINE_SEPARATOR = re.compile("[\x85\u2028\u2029]")


def jsonl_safe(json_text: str) -> str:
    """`json_text` (one JSON document) with the raw line separators JSON allows in strings escaped: the same value,
    one line under any line splitting (sampled text from a byte-level vocabulary can hold them)."""
    return _LINE_SEPARATOR.sub(lambda m: _LINE_SEPARATORS[m.group()], json_text)


def load_json_line(text: str | bytes, line_no: int) -> tuple[Any, str | None]:
    """The line's JSON value (`BLANK` for a blank line), and the path of a string holding a lone surrogate
    (`"\\ud800"` parses, but no UTF-8 text can hold it, so that string could never be stored), else None.
    Every way the text itself can fail is a RequestLineError: bad UTF-8, bad JSON, a number too long to
    convert, nesting too deep."""
    if isinstance(text, bytes):
        try:
            text = text.decode("utf-8")
        except UnicodeDecodeError as exc:
            raise RequestLineError(
                line_no, [FieldIssue("", f"invalid UTF-8 at byte {exc.start + 1}")]
            ) from None
    if not text.strip():
        return BLANK, None
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        message = f"invalid JSON: {exc.msg} at column {exc.colno}"
    except ValueError:  # int("...") past sys.get_int_max_str_digits()
        message = "invalid JSON: a number has too many digits"
    except RecursionError:
        message = "invalid JSON: nested too deeply"
    else:
        return obj, _lone_surrogate_field(obj, ()) if _SURROGATE_ESCAPE.search(text) else None
    raise RequestLineError(line_no, [FieldIssue("", message)])


LONE_SURROGATE = "contains a lone UTF-16 surrogate (\\ud800-\\udfff), not valid Unicode"


def _lone_surrogate_field(value: Any, loc: tuple[str | int, ...]) -> str | None:
    """The dotted path of the first string (or key) in `value` holding a surrogate, else None."""
    if isinstance(value, str):
        return format_loc(loc) if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            if _SURROGATE.search(key):
                return format_loc(loc) or "(a key)"
            found = _lone_surrogate_field(item, (*loc, key))
            if found is not None:
                return found
    if isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_field(item, (*loc, i))
            if found is not None:
                return found
    return None
