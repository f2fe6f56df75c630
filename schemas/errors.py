"""Validation errors that name the input line and the field. Owns how a pydantic error becomes a message."""

from __future__ import annotations

from dataclasses import dataclass

from pydantic import BaseModel, ValidationError

# OpenAI's `code` for a request it refuses, by pydantic error type; any other type is "invalid_value".
_CODE_OF_ERROR_TYPE = {
    "extra_forbidden": "unknown_parameter",
    "missing": "missing_required_parameter",
    "unsupported_parameter": "unsupported_parameter",  # raised by cbq's own validators (schemas.openai_body)
}


@dataclass(frozen=True)
class FieldIssue:
    field: str  # dotted path such as "body.messages[0].role"; "" when the whole line is at fault
    message: str
    code: str = "invalid_value"  # OpenAI's error code for it, when it fails its request alone

    def __str__(self) -> str:
        return f"{self.field}: {self.message}" if self.field else self.message


class RequestLineError(ValueError):
    """A line that makes its file unacceptable (not JSON, not an object, no usable custom_id, ...): the whole
    file is refused. `str()` gives one `line N: field: message` line per issue."""

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


class InvalidRequest(RequestLineError):
    """A well-formed line whose request is invalid or unsupported: that request alone fails (OpenAI's status
    400 `invalid_request_error`), the others run (unless the submit is `--strict`)."""

    def __init__(self, line_no: int, issues: list[FieldIssue], custom_id: str | None, url: str | None = None):
        self.custom_id = custom_id
        self.url = url  # an OpenAI line's endpoint, checked against its batch's like a valid line's
        super().__init__(line_no, issues)

    @property
    def param(self) -> str | None:
        """The first issue's field as OpenAI names it (inside the body), None for the request as a whole."""
        field = self.issues[0].field.removeprefix("body").removeprefix(".")
        return field or None

    @property
    def code(self) -> str:
        return self.issues[0].code

    @property
    def reason(self) -> str:
        """What is wrong, without the line number (the result of the request says it)."""
        return "; ".join(str(issue) for issue in self.issues)


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
        code = _CODE_OF_ERROR_TYPE.get(error["type"], "invalid_value")
        issues.append(FieldIssue(format_loc(loc), message, code))
    return issues
