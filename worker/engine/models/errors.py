"""The one error loading raises (a leaf module: the loader, and parallel/ which builds shards below it, raise it)."""

from __future__ import annotations


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message is one line that says why (the CLI prints it as is)."""


def one_line(exc: BaseException) -> str:
    """`exc` as one line: its type and the first non-empty line of its message."""
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
