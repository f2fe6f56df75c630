"""The fields OpenAI bodies accept and ignore are declared once (`IgnoredBodyFields`) and change nothing."""

from __future__ import annotations

import pytest

from schemas.openai_body import ChatCompletionBody, CompletionBody, IgnoredBodyFields
from schemas.responses_body import ResponsesBody

IGNORED = {
    "store": True,
    "metadata": {"k": "v"},
    "user": "u",
    "service_tier": "flex",
    "prompt_cache_key": "p",
    "prompt_cache_retention": "24h",
    "safety_identifier": "s",
}
BODIES = {
    ChatCompletionBody: {"messages": [{"role": "user", "content": "hi"}]},
    CompletionBody: {"prompt": "hi"},
    ResponsesBody: {"input": "hi"},
}


def test_ignored_fields_are_declared_once() -> None:
    assert set(IgnoredBodyFields.model_fields) == set(IGNORED)
    for body in BODIES:
        assert issubclass(body, IgnoredBodyFields)
        redeclared = [
            cls.__name__
            for cls in body.__mro__
            if cls is not IgnoredBodyFields and set(vars(cls).get("__annotations__", {})) & set(IGNORED)
        ]
        assert redeclared == [], body.__name__


@pytest.mark.parametrize("body", BODIES, ids=lambda b: b.__name__)
def test_ignored_fields_change_no_request(body) -> None:
    plain = body.model_validate(BODIES[body])
    with_ignored = body.model_validate({**BODIES[body], **IGNORED})
    assert with_ignored.model_dump(exclude=set(IGNORED)) == plain.model_dump(exclude=set(IGNORED))
