"""Issue 29 item 1: an invalid request fails alone, as OpenAI's Batch API fails it (status 400 with an
`invalid_request_error`, in the error file), and the valid requests of the same file run. Read back through
`cbq run` and `cbq results`, with unedited batch files written for OpenAI and for vLLM."""

import json
import re
from pathlib import Path

import pytest
from click.testing import CliRunner

from producer import settings
from producer.cli import main

FIXTURES = Path(__file__).parents[1] / "fixtures"
# file -> (custom_ids that run, {custom_id of a bad line: (param, code)}); the model its lines name is served
# under that name (`--served-model-name`, as vLLM's run_batch needs it)
FILES = {
    "openai_mixed_batch.jsonl": (
        ["request-1", "request-3", "request-6"],
        {
            "request-2": ("functions", "unsupported_parameter"),
            "request-4": ("messages[0]", "invalid_value"),
            "request-5": ("messages", "invalid_value"),
        },
    ),
    "vllm_mixed_batch.jsonl": (
        ["vllm-1", "vllm-3", "vllm-6"],
        {
            "vllm-2": ("use_beam_search", "unknown_parameter"),
            "vllm-4": ("top_p", "invalid_value"),
            "vllm-5": ("skip_special_tokens", None),  # before the field existed: unknown; after: a bad value
            "vllm-7": (None, "invalid_value"),  # max_tokens 0 without echo or prompt_logprobs
            "vllm-8": ("prompt_logprobs", "invalid_value"),  # above vLLM's 20
        },
    ),
}


@pytest.fixture
def cbq(fake_redis, monkeypatch):
    monkeypatch.setattr(settings, "connect", lambda url, **options: fake_redis)

    def invoke(*args):
        return CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)

    return invoke


def serve(name: str) -> list[str]:
    """`cbq run` flags: the fake engine, serving the model the file's lines name."""
    model = json.loads((FIXTURES / name).read_text().splitlines()[0])["body"]["model"]
    return ["--fake-engine", "--served-model-name", model]


def read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def check_openai_error_file(errors: list[dict], bad: dict) -> None:
    assert [line["custom_id"] for line in errors] == list(bad)
    for line in errors:
        assert line["error"] is None and line["response"]["status_code"] == 400
        error = line["response"]["body"]["error"]
        param, code = bad[line["custom_id"]]
        assert error["type"] == "invalid_request_error" and error["param"] == param, error
        assert code is None or error["code"] == code, error
        assert error["message"].startswith("line "), error


@pytest.mark.parametrize("name", list(FILES))
def test_cbq_run_runs_the_valid_requests_and_writes_the_invalid_to_the_error_file(cbq, tmp_path, name):
    good, bad = FILES[name]
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    ran = cbq("run", FIXTURES / name, "-o", out, "--errors", err, "--format", "openai", *serve(name), "--redis-url", "x")
    assert ran.exit_code == 2, ran.output  # some requests failed
    served = read_jsonl(out)
    assert [line["custom_id"] for line in served] == good
    assert all(line["response"]["status_code"] == 200 for line in served)
    check_openai_error_file(read_jsonl(err), bad)

    strict = cbq("run", FIXTURES / name, "-o", out, "--strict", *serve(name))
    assert strict.exit_code == 1 and f"{len(bad)} invalid line(s); nothing was run" in strict.stderr


@pytest.mark.parametrize("name", list(FILES))
def test_cbq_results_reads_the_failures_back_in_both_formats(cbq, tmp_path, name):
    good, bad = FILES[name]
    ran = cbq("run", FIXTURES / name, "-o", tmp_path / "run.jsonl", *serve(name), "--redis-url", "x")
    batch_id = re.search(r"batch ([0-9a-f]{16}): ", ran.stderr).group(1)

    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    assert cbq("results", batch_id, "-o", out, "--errors", err).exit_code == 0
    assert [line["custom_id"] for line in read_jsonl(out)] == good
    failed = read_jsonl(err)
    assert [line["custom_id"] for line in failed] == list(bad)
    for line in failed:
        param, code = bad[line["custom_id"]]
        assert line["finish_reason"] == "error" and line.get("error_param") == param  # None: left out
        assert code is None or line["error_code"] == code

    assert cbq("results", batch_id, "-o", out, "--errors", err, "--format", "openai").exit_code == 0
    check_openai_error_file(read_jsonl(err), bad)
    status = json.loads(cbq("status", batch_id, "--json").stdout)
    assert (status["num_completed"], status["num_failed"]) == (len(good), len(bad))


def test_a_format_error_refuses_the_file_with_every_error_listed(cbq, tmp_path):
    lines = (FIXTURES / "openai_mixed_batch.jsonl").read_text().splitlines()
    no_id = json.loads(lines[0])
    del no_id["custom_id"]
    wrong_method = {**json.loads(lines[2]), "custom_id": "m", "method": "GET"}
    path = tmp_path / "in.jsonl"
    path.write_text("\n".join([*lines, json.dumps(no_id), "[1, 2]", json.dumps(wrong_method), lines[0]]) + "\n")
    ran = cbq("submit", path, "--redis-url", "x")
    assert ran.exit_code == 1
    assert "line 7: custom_id: Field required" in ran.stderr
    assert "line 8: a line must be a JSON object, got list" in ran.stderr
    assert "line 9: method: Input should be 'POST'" in ran.stderr
    assert "line 10: custom_id: duplicate custom_id 'request-1' (first on line 1)" in ran.stderr
    assert "4 invalid line(s); nothing was enqueued" in ran.stderr


def test_a_line_naming_another_model_fails_alone_and_outputs_carry_the_served_name(cbq, tmp_path):
    out, err = tmp_path / "out.jsonl", tmp_path / "err.jsonl"
    ran = cbq("run", FIXTURES / "openai_mixed_batch.jsonl", "-o", out, "--errors", err, "--format", "openai", "--fake-engine")
    assert ran.exit_code == 2  # the fake engine serves tiny-llama (the default --model): every line names another
    assert read_jsonl(out) == []
    errors = [line["response"]["body"]["error"] for line in read_jsonl(err)]
    assert {e["code"] for e in errors} == {"model_not_found", "unsupported_parameter", "invalid_value"}
    assert sum(e["code"] == "model_not_found" for e in errors) == 3 and all(
        "'gpt-4o-mini' is not this batch's 'tiny-llama'" in e["message"] for e in errors if e["code"] == "model_not_found"
    )
    ran = cbq("run", FIXTURES / "openai_mixed_batch.jsonl", "-o", out, "--format", "openai", *serve("openai_mixed_batch.jsonl"))
    assert {line["response"]["body"]["model"] for line in read_jsonl(out) if line["response"]["status_code"] == 200} == {
        "gpt-4o-mini"
    }
