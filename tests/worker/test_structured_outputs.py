"""Structured outputs and logprobs from request lines to result lines, through `cbq run` on a random-weight
model: random weights make every valid output a test of the constraint, not of the model."""

import json
import re

import jsonschema
import pytest
from click.testing import CliRunner
from openai.types import Completion
from openai.types.chat import ChatCompletion

from producer.cli import main

_STR = {"type": "string", "maxLength": 8}
SCHEMAS = [
    {"type": "object", "properties": {"name": _STR}, "required": ["name"]},
    {
        "type": "object",
        "properties": {"age": {"type": "integer", "minimum": 0, "maximum": 120}},
        "required": ["age"],
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]},
    {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}}, "required": ["color"]},
    {
        "type": "object",
        "properties": {"x": {"type": "number", "minimum": -1, "maximum": 1}},
        "required": ["x"],
    },
    {
        "type": "object",
        "properties": {"code": {"type": "string", "pattern": "^[A-Z]{2}[0-9]{3}$"}},
        "required": ["code"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer", "minimum": 1, "maximum": 99}, "tag": _STR},
                "required": ["id", "tag"],
            }
        },
        "required": ["user"],
    },
    {
        "type": "object",
        "properties": {
            "items": {
                "type": "array",
                "items": {"type": "object", "properties": {"k": _STR}, "required": ["k"]},
                "maxItems": 2,
            }
        },
        "required": ["items"],
    },
    {
        "type": "object",
        "properties": {"v": {"anyOf": [{"type": "null"}, {"type": "integer", "minimum": 0, "maximum": 5}]}},
        "required": ["v"],
    },
    {
        "type": "object",
        "properties": {"a": {"type": "integer", "minimum": 1, "maximum": 3}, "b": _STR},
        "required": ["a", "b"],
    },
    {
        "type": "object",
        "properties": {"date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"}},
        "required": ["date"],
    },
    {
        "type": "object",
        "properties": {"p": {"type": "number", "exclusiveMinimum": 0, "maximum": 100}},
        "required": ["p"],
    },
    {
        "type": "object",
        "properties": {
            "label": {"enum": ["spam", "ham"]},
            "score": {"type": "integer", "minimum": 0, "maximum": 10},
        },
        "required": ["label", "score"],
    },
    {"type": "string", "enum": ["yes", "no", "maybe"]},
    {"type": "integer", "minimum": 10, "maximum": 20},
    {
        "type": "object",
        "properties": {"tags": {"type": "array", "items": _STR, "minItems": 1, "maxItems": 2}},
        "required": ["tags"],
    },
    {
        "type": "object",
        "properties": {
            "m": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 1},
                    "maxItems": 2,
                },
                "maxItems": 2,
            }
        },
        "required": ["m"],
    },
    {
        "type": "object",
        "properties": {
            "kind": {"const": "point"},
            "xy": {
                "type": "array",
                "items": {"type": "integer", "minimum": -9, "maximum": 9},
                "minItems": 2,
                "maxItems": 2,
            },
        },
        "required": ["kind", "xy"],
    },
    {
        "type": "object",
        "properties": {"email": {"type": "string", "pattern": "^[a-z]{1,5}@[a-z]{1,5}\\.com$"}},
        "required": ["email"],
    },
    {
        "type": "object",
        "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 3}},
        "required": ["n"],
        "additionalProperties": False,
    },
]


def _closed(schema):
    """No properties beyond those listed (as OpenAI's strict mode asks): otherwise a random model may add
    keys until its token limit, valid JSON that never ends."""
    if isinstance(schema, dict):
        if schema.get("type") == "object":
            schema.setdefault("additionalProperties", False)
        for value in schema.values():
            _closed(value)
    elif isinstance(schema, list):
        for value in schema:
            _closed(value)
    return schema


SCHEMAS = _closed(SCHEMAS)
REGEX = "[a-z]{3}-[0-9]{2}"
CHOICES = ["positive", "negative", "neutral"]


def run(tmp_path, lines: list[dict], *args: str) -> list[dict]:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("".join(json.dumps(line) + "\n" for line in lines))
    result = CliRunner().invoke(main, ["run", str(src), "-o", str(out), "--device", "cpu", *args])
    assert result.exit_code == 0, result.output
    return [json.loads(line) for line in out.read_text().splitlines()]


def test_every_constrained_output_parses_and_validates(tmp_path):
    assert len(SCHEMAS) >= 20
    lines = [
        {"custom_id": f"s{i}", "prompt": f"record {i}:", "json_schema": schema, "seed": i}
        for i, schema in enumerate(SCHEMAS)
    ]
    lines.append(
        {"custom_id": "chat", "messages": [{"role": "user", "content": "json"}], "json_schema": SCHEMAS[8]}
    )
    lines.append({"custom_id": "regex", "prompt": "id:", "regex": REGEX, "temperature": 1.0, "seed": 1})
    lines.append(
        {"custom_id": "choice", "prompt": "sentiment:", "choice": CHOICES, "temperature": 1.0, "seed": 2}
    )
    results = run(tmp_path, lines, "--max-new-tokens", "200", "--temperature", "1.0")

    for line, result in zip(lines, results, strict=True):
        assert result["finish_reason"] == "stop", result  # the grammar completed within the token limit
        if "json_schema" in line:
            jsonschema.validate(json.loads(result["text"]), line["json_schema"])
    assert re.fullmatch(REGEX, results[-2]["text"])
    assert results[-1]["text"] in CHOICES


def test_logprobs_in_cbq_and_openai_output(tmp_path):
    body = {"max_tokens": 6, "temperature": 1.0, "seed": 3}
    chat = {"messages": [{"role": "user", "content": "hi"}], "logprobs": True, "top_logprobs": 3, **body}
    chat_json = chat | {
        "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS[1]}}
    }
    lines = [
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions", "body": chat},
        {
            "custom_id": "chat-json",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": chat_json | {"max_tokens": 40},
        },
        {
            "custom_id": "cmpl",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"prompt": "a", "logprobs": 2, **body},
        },
        {"custom_id": "plain", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", **body}},
        {"custom_id": "native", "prompt": "b", "logprobs": 0, "max_new_tokens": 5},
    ]
    cbq_lines = run(tmp_path, lines)
    for result in cbq_lines[:3] + cbq_lines[4:]:
        logprobs = result["logprobs"]
        # one per token of the text: a final EOS has none
        assert 0 < result["usage"]["completion_tokens"] - len(logprobs) + 1 <= 2
        assert "".join(bytes(lp["bytes"]).decode("utf-8", "replace") for lp in logprobs) == result["text"]
        assert all(
            lp["logprob"] <= 0
            and len(lp["top_logprobs"]) == {"chat": 3, "chat-json": 3, "cmpl": 2}.get(result["custom_id"], 0)
            for lp in logprobs
        )
        assert all(
            lp["top_logprobs"] == sorted(lp["top_logprobs"], key=lambda t: -t["logprob"]) for lp in logprobs
        )
    assert "logprobs" not in cbq_lines[3]

    out = run(tmp_path, lines, "--format", "openai")
    chat_out = ChatCompletion.model_validate(out[0]["response"]["body"])
    content = chat_out.choices[0].logprobs.content
    # the same records (a second run: logprobs equal to float noise, as the batch shapes may differ)
    got, want = _flat([c.model_dump() for c in content]), _flat(cbq_lines[0]["logprobs"])
    assert [g[:2] for g in got] == [w[:2] for w in want]
    assert [g[2] for g in got] == pytest.approx([w[2] for w in want], abs=1e-4)
    json_out = ChatCompletion.model_validate(out[1]["response"]["body"])
    jsonschema.validate(json.loads(json_out.choices[0].message.content), SCHEMAS[1])
    cmpl = Completion.model_validate(out[2]["response"]["body"]).choices[0]
    assert cmpl.logprobs.tokens == [lp["token"] for lp in cbq_lines[2]["logprobs"]]
    assert cmpl.logprobs.token_logprobs == pytest.approx(
        [lp["logprob"] for lp in cbq_lines[2]["logprobs"]], abs=1e-4
    )
    assert all(len(top) <= 2 for top in cmpl.logprobs.top_logprobs)
    assert cmpl.logprobs.text_offset[0] == 0 and cmpl.logprobs.text_offset == sorted(
        cmpl.logprobs.text_offset
    )
    assert Completion.model_validate(out[3]["response"]["body"]).choices[0].logprobs is None


def _flat(records: list[dict]) -> list:
    """Token, bytes and logprob of every record and its alternatives, in order."""
    out = []
    for record in records:
        for r in [record, *record["top_logprobs"]]:
            out.append((r["token"], r["bytes"], r["logprob"]))
    return out


@pytest.mark.parametrize(
    ("line", "expected"),
    [
        (
            {"prompt": "x", "json_schema": {"type": "nope"}},
            "line 1: json_schema: does not compile: Invalid type: nope",
        ),
        ({"prompt": "x", "regex": "[a-"}, "line 1: regex: does not compile:"),
        (
            {"prompt": "x", "regex": "a", "choice": ["a"]},
            "line 1: give at most one constraint per line, not regex and choice",
        ),
        (
            {
                "custom_id": "c",
                "method": "POST",
                "url": "/v1/chat/completions",
                "body": {
                    "messages": [{"role": "user", "content": "x"}],
                    "response_format": {
                        "type": "json_schema",
                        "json_schema": {"name": "n", "schema": {"$ref": "#/nope"}},
                    },
                },
            },
            "line 1: body.response_format.json_schema.schema: does not compile: Pointer '/nope' does not exist",
        ),
    ],
)
def test_a_constraint_that_does_not_compile_fails_its_request_at_submit(tmp_path, line, expected):
    src = tmp_path / "in.jsonl"
    src.write_text(json.dumps(line) + "\n")
    args = ["run", str(src), "-o", str(tmp_path / "out.jsonl"), "--device", "cpu"]
    result = CliRunner().invoke(main, args)  # the line fails alone (issue 29): exit 2, some requests failed
    assert result.exit_code == 2 and expected in result.output, result.output
    strict = CliRunner().invoke(main, [*args, "--strict"])
    assert strict.exit_code == 1 and expected in strict.output, strict.output


def test_a_stored_constraint_that_does_not_compile_fails_that_request_alone(
    cbq, conn, burst_worker, write_jsonl
):
    """What submit cannot check (here: a stored request edited after submit) fails its request, not the worker."""
    from schemas import keys
    from worker.engine.engine import Engine

    submitted = cbq(
        "submit",
        write_jsonl([{"prompt": "x", "regex": "a+"}, {"prompt": "y", "choice": ["a", "b"]}]),
        "--json",
    )
    batch_id = json.loads(submitted.stdout.splitlines()[-1])["batch_id"]
    stored = json.loads(conn.hget(keys.batch_requests(batch_id), 0))
    stored["sampling"]["constraint"]["spec"] = "(unclosed"
    conn.hset(keys.batch_requests(batch_id), 0, json.dumps(stored))

    burst_worker(Engine.from_model("tiny-llama", device="cpu"))
    results = [json.loads(line) for line in cbq("results", batch_id).stdout.splitlines()]
    assert (
        results[0]["finish_reason"] == "error" and "regex constraint does not compile" in results[0]["error"]
    )
    assert results[1]["finish_reason"] == "stop" and results[1]["text"] in ("a", "b")
