"""Embedding lines (`{"input": ...}` and OpenAI's `/v1/embeddings`), their refusals, and their OpenAI output."""

from __future__ import annotations

import json
import struct

import pytest

from schemas.embeddings import decode_embedding, encode_embedding
from schemas.errors import InvalidRequest, RequestLineError
from schemas.lines import parse_request_line
from schemas.result import ResultLine, Usage, merge_choice_group, to_openai_output


def _openai(body: dict, custom_id: str = "e1") -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": body})


def _stored(line: str) -> list:
    parsed = parse_request_line(line, 1)
    assert parsed is not None
    return [member.resolve(i) for i, member in enumerate(parsed.members())]


@pytest.mark.parametrize(
    "given, prompts, token_ids",
    [
        ("hello", ["hello"], [None]),
        (["a", "b c"], ["a", "b c"], [None, None]),
        ([5, 6, 7], [None], [[5, 6, 7]]),
        ([[5], [6, 7]], [None, None], [[5], [6, 7]]),
    ],
)
def test_every_input_form_is_one_request_per_input(given, prompts, token_ids):
    for line in (_openai({"model": "m", "input": given}), json.dumps({"input": given})):
        stored = _stored(line)
        assert [r.prompt for r in stored] == prompts and [r.prompt_token_ids for r in stored] == token_ids
        assert all(r.is_embedding for r in stored)
        groups = [r.choice_group for r in stored]
        assert groups == [None] if len(stored) == 1 else [(g.position, g.size) for g in groups if g] == [
            (i, len(stored)) for i in range(len(stored))
        ]


def test_options_and_accepted_fields():
    [request] = _stored(_openai({"model": "m", "input": "x", "dimensions": 8, "encoding_format": "base64", "user": "u"}))
    assert request.embedding.dimensions == 8 and request.embedding.encoding_format == "base64"
    assert request.url == "/v1/embeddings" and request.model == "m"
    [native] = _stored(json.dumps({"custom_id": "n", "input": "x", "encoding_format": "float"}))
    assert native.custom_id == "n" and native.embedding.encoding_format == "float" and native.url is None


@pytest.mark.parametrize(
    "body, field",
    [
        ({"input": ""}, "body.input"),
        ({"input": []}, "body.input"),
        ({"input": [[]]}, "body.input"),
        ({"input": [-1]}, "body.input"),
        ({"input": "x", "dimensions": 0}, "body.dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "body.encoding_format"),
        ({"input": "x", "max_tokens": 4}, "body.max_tokens"),  # a generation field
        ({"input": ["x"] * 2049}, "body.input"),  # OpenAI's 2,048 inputs
        ({"model": "m"}, "body.input"),
    ],
)
def test_invalid_bodies_fail_alone(body, field):
    with pytest.raises(InvalidRequest) as info:
        parse_request_line(_openai(body), 1)
    assert info.value.field.startswith(field), str(info.value)


def test_a_native_line_with_input_and_prompt_is_a_format_error():
    with pytest.raises(RequestLineError):
        parse_request_line(json.dumps({"input": "x", "prompt": "y", "max_new_tokens": 2}), 1)


def test_base64_is_little_endian_float32():
    values = [0.1, -2.5, 3.0]
    encoded = encode_embedding(values, "base64")
    assert isinstance(encoded, str)
    import base64

    assert struct.unpack("<3f", base64.b64decode(encoded)) == tuple(decode_embedding(encoded))
    assert decode_embedding(encoded) == pytest.approx(values, rel=1e-7)
    assert encode_embedding(values, "float") == values == encode_embedding(values, None)


def test_openai_output_of_several_inputs_is_one_list():
    stored = _stored(_openai({"model": "m", "input": ["a", "b"]}))
    lines = [
        to_openai_output(
            ResultLine(custom_id="e1", index=i, finish_reason="stop", usage=Usage(prompt_tokens=3 + i), embedding=[i, 1.0]),
            request, "b1", "served", 0,
        )
        for i, request in enumerate(stored)
    ]
    merged = merge_choice_group(lines, 1)
    assert merged.response is not None
    assert merged.response.body == {
        "object": "list",
        "data": [{"object": "embedding", "index": 0, "embedding": [0, 1.0]},
                 {"object": "embedding", "index": 1, "embedding": [1, 1.0]}],
        "model": "served",
        "usage": {"prompt_tokens": 7, "total_tokens": 7},
    }
