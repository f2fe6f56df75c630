"""Validation errors that name the input line and the field. Owns how a pydantic error becomes a message."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ValidationError


@dataclass(frozen=True)
class FieldIssue:
    field: str  # dotted path such as "body.messages[0].role"; "" when the whole line is at fault
    message: str

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class RequestLineError(ValueError):
    """A request line that cannot be accepted. `str()` gives one `line N: field: message` line per issue."""

    def __init__(self, line_no: int, issues: list[FieldIssue]):
        assert issues, "a RequestLineError needs at least one issue"
        self.line_no = line_no
        self.issues = issues
        super().__init__(str(self))

    @property
    def field(self) -> str:
        return self.issues[0].field

    @property
    def message(self) -> str:
        return self.issues[0].message

    def __str__(self) -> str:
        return "\n".join(f"line {self.line_no}: {issue}" for issue in self.issues)


def format_loc(loc: tuple[str | int, ...]) -> str:
    """('body', 'messages', 0, 'role') -> 'body.messages[0].role'."""
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            path += f".{part}" if path else str(part)
    return path


def issues_from_validation_error(
    exc: ValidationError, model: type[BaseModel], prefix: tuple[str | int, ...] = ()
) -> list[FieldIssue]:
    """Turn pydantic's errors into FieldIssues, with a clearer message for unknown fields."""
    issues = []
    for error in exc.errors(include_url=False):
        loc = prefix + tuple(error["loc"])
        message = error["msg"]
        if error["type"] == "extra_forbidden" and len(error["loc"]) == 1:
            allowed = ", ".join(name for name, info in model.model_fields.items() if not info.exclude)
            message = f"unknown or unsupported field (allowed: {allowed})"
        elif error["type"] == "extra_forbidden":
            message = "unknown or unsupported field"
        elif error["type"] == "value_error":
            # Our own validators raise ValueError; pydantic prefixes "Value error, ".
            message = message.removeprefix("Value error, ")
        issues.append(FieldIssue(format_loc(loc), message))
    return issues
