"""vLLM's run-batch files run unedited through `cbq run`: the input lines of vLLM's own
tests/entrypoints/openai/test_run_batch.py (tests/fixtures/vllm_run_batch.jsonl, Apache-2.0, the vLLM project),
an empty file, a token limit past the context, and vLLM's per-request fields."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from producer.cli import main

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "vllm_run_batch.jsonl"
VLLM_TEST_MODEL = "hmellor/tiny-random-LlamaForCausalLM"

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")  # rq installs its own


def run_cbq(*args):
    return CliRunner().invoke(main, ["run", *map(str, args)])


def output_lines(path: Path) -> dict[str, dict]:
    return {line["custom_id"]: line for line in map(json.loads, path.read_text().splitlines())}


def test_vllms_test_batch_runs_and_its_bad_lines_fail_alone(tmp_path):
    out = tmp_path / "out.jsonl"
    result = run_cbq("-i", FIXTURE, "-o", out, "--fake-engine", "--served-model-name", VLLM_TEST_MODEL, "--format", "openai")
    assert result.exit_code == 2, result.output  # cbq's status for a batch with failed requests
    lines = output_lines(out)
    assert list(lines) == [f"request-{i}" for i in range(1, 6)]
    status = {cid: line["response"]["status_code"] for cid, line in lines.items()}
    assert status == {"request-1": 200, "request-2": 200, "request-3": 400, "request-4": 400, "request-5": 400}
    bad_url = lines["request-4"]["response"]["body"]["error"]
    assert bad_url["param"] == "url" and "'/bad_url'" in bad_url["message"]
    assert lines["request-3"]["response"]["body"]["error"]["code"] == "model_not_found"
    assert lines["request-5"]["response"]["body"]["error"]["param"] == "stream"


def test_a_bad_url_still_refuses_a_file_for_an_endpoint(fake_redis):
    from producer.store.submit import validate_lines

    validated = validate_lines(FIXTURE.read_text().splitlines(), endpoint="/v1/chat/completions")
    assert [e.line_no for e in validated.errors] == [4]  # cbq serve's batches name their endpoint


def test_max_tokens_past_the_context_is_a_400_naming_the_context_length(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [
        {"custom_id": "long", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 100}},
        {"custom_id": "fits", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi", "max_tokens": 2}},
        {"custom_id": "none", "method": "POST", "url": "/v1/completions", "body": {"prompt": "hi"}},
        {"custom_id": "cbq-line", "prompt": "hi", "max_new_tokens": 100},  # cbq's own lines: capped, as before
    ]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = run_cbq(path, "-o", out, "--model", "tiny-llama", "--device", "cpu", "--max-model-len", "32")
    assert result.exit_code == 2, result.output
    by_id = output_lines(out)
    long = by_id["long"]
    assert long["finish_reason"] == "error" and long["error_code"] == "context_length_exceeded"
    assert "context length is 32 tokens" in long["error"] and "max_tokens 100" in long["error"]
    assert long["usage"]["prompt_tokens"] == 0
    assert by_id["fits"]["finish_reason"] in ("stop", "length") and by_id["fits"]["usage"]["completion_tokens"] <= 2
    assert by_id["none"]["finish_reason"] in ("stop", "length")
    assert by_id["cbq-line"]["finish_reason"] == "length"
    openai = tmp_path / "openai.jsonl"
    again = run_cbq(path, "-o", openai, "--model", "tiny-llama", "--device", "cpu", "--max-model-len", "32",
                    "--format", "openai")
    assert again.exit_code == 2, again.output
    response = output_lines(openai)["long"]["response"]
    assert response["status_code"] == 400 and response["body"]["error"]["code"] == "context_length_exceeded"


def test_vllms_per_request_fields_are_accepted(tmp_path):
    def chat(cid, **fields):
        body = {"model": "m", "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 3, **fields}
        return {"custom_id": cid, "method": "POST", "url": "/v1/chat/completions", "body": body}

    lines = [
        chat("so-choice", structured_outputs={"choice": ["yes", "no"]}),
        chat("guided-choice", guided_choice=["yes", "no"]),
        chat("guided-regex", guided_regex="[a-z]+"),
        chat("guided-json", guided_json={"type": "object"}),
        chat("effort", reasoning_effort="low"),
        chat("ids", return_token_ids=True),
        chat("misc", priority=5, cache_salt="tenant-a", request_id="mine-1"),
        chat("grammar", guided_grammar="root ::= 'a'"),
        chat("two", guided_regex="a", structured_outputs={"regex": "b"}),
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = run_cbq(path, "-o", out, "--fake-engine", "--served-model-name", "m", "--format", "openai")
    assert result.exit_code == 2, result.output
    by_id = output_lines(out)
    ok = {cid for cid, line in by_id.items() if line["response"]["status_code"] == 200}
    assert ok == {"so-choice", "guided-choice", "guided-regex", "guided-json", "effort", "ids", "misc"}
    assert by_id["ids"]["response"]["body"]["choices"][0]["token_ids"]
    assert "token_ids" not in by_id["misc"]["response"]["body"]["choices"][0]
    grammar = by_id["grammar"]["response"]["body"]["error"]
    assert grammar["code"] == "unsupported_parameter" and "guided_grammar" in grammar["message"]
    assert "give one output constraint" in by_id["two"]["response"]["body"]["error"]["message"]


def test_vllm_fields_map_onto_cbqs_constraints_and_template():
    from schemas.lines import parse_request_line

    def parsed(**fields):
        body = {"messages": [{"role": "user", "content": "Hi"}], **fields}
        line = {"custom_id": "x", "method": "POST", "url": "/v1/chat/completions", "body": body}
        return parse_request_line(json.dumps(line), 1)

    assert parsed(guided_choice=["a", "b"]).overrides.constraint.model_dump() == {"kind": "choice", "spec": '["a","b"]'}
    assert parsed(structured_outputs={"json": {"type": "object"}}).overrides.constraint.kind == "json_schema"
    assert parsed(structured_outputs={"json_object": True}).overrides.constraint.kind == "json_object"
    assert parsed(guided_json='{"type": "string"}').overrides.constraint.spec == '{"type": "string"}'
    assert parsed(structured_outputs={"regex": "[0-9]+"}).overrides.constraint.model_dump() == {
        "kind": "regex",
        "spec": "[0-9]+",
    }
    effort = parsed(reasoning_effort="high", chat_template_kwargs={"enable_thinking": False})
    assert effort.chat_template_kwargs == {"reasoning_effort": "high", "enable_thinking": False}
    assert parsed(reasoning_effort="low", chat_template_kwargs={"reasoning_effort": "high"}).chat_template_kwargs == {
        "reasoning_effort": "high"  # the body's own template variables win
    }
    salted = parsed(cache_salt="s", return_token_ids=True)
    request = salted.resolve(0)
    assert (request.cache_salt, request.return_token_ids) == ("s", True)
