"""`cbq run` and `cbq worker` refuse what cannot work before doing any, in one line: an output that is the
input or that cannot be written, a bad --log-level; and say loudly when the model is the random-weight demo."""

from __future__ import annotations

import json
import os

import pytest
from click.testing import CliRunner

from producer.cli import main

pytestmark = pytest.mark.usefixtures("restore_signal_handlers")  # rq installs its own


@pytest.fixture
def input_file(tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"custom_id": "a", "prompt": "hello", "max_new_tokens": 2}) + "\n")
    return path


def run_cbq(*args, env=None):
    return CliRunner(env=env).invoke(main, ["run", *map(str, args)])


def one_line_error(result) -> str:
    assert result.exit_code != 0 and "Traceback" not in result.output, result.output
    lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(lines) == 1, result.stderr
    return lines[0]


def test_the_output_may_not_be_the_input(input_file, tmp_path, monkeypatch):
    before = input_file.read_bytes()
    same = run_cbq(input_file, "-o", input_file, "--fake-engine")
    assert "is the input file" in one_line_error(same)
    monkeypatch.chdir(tmp_path)
    (tmp_path / "link.jsonl").symlink_to(input_file)
    for output in ("./in.jsonl", "link.jsonl", f"../{tmp_path.name}/in.jsonl"):
        result = run_cbq("in.jsonl", "-o", output, "--fake-engine")
        assert "is the input file" in one_line_error(result), output
    errors_too = run_cbq("in.jsonl", "-o", "out.jsonl", "--errors", "link.jsonl", "--fake-engine")
    assert "--errors link.jsonl is the input file" in one_line_error(errors_too)
    assert input_file.read_bytes() == before and not (tmp_path / "out.jsonl").exists()


def test_an_output_folder_that_is_missing_or_not_writable_is_refused_before_any_work(
    input_file, tmp_path, monkeypatch
):
    missing = run_cbq(input_file, "-o", tmp_path / "nope" / "out.jsonl", "--fake-engine")
    assert "does not exist" in one_line_error(missing) and "batch" not in missing.stderr
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    if os.geteuid() == 0:  # root writes anywhere: the folder answers as it would to anyone else
        real_access = os.access
        monkeypatch.setattr(os, "access", lambda path, mode: str(path) != str(locked) and real_access(path, mode))
    try:
        result = run_cbq(input_file, "-o", locked / "out.jsonl", "--fake-engine")
        assert "is not writable" in one_line_error(result) and "batch" not in result.stderr
    finally:
        locked.chmod(0o700)


def test_a_bad_log_level_is_a_usage_error(input_file, tmp_path):
    for command in (["run", str(input_file), "-o", str(tmp_path / "o.jsonl")], ["worker"]):
        result = CliRunner().invoke(main, [*command, "--fake-engine", "--log-level", "bogus"])
        assert result.exit_code == 2 and "Traceback" not in result.output
        assert "Invalid value for '--log-level'" in result.stderr and "batch" not in result.stderr
    ok = run_cbq(input_file, "-o", tmp_path / "o.jsonl", "--fake-engine", "--log-level", "error")
    assert ok.exit_code == 0, ok.output


def test_the_random_weight_demo_model_is_announced(input_file, tmp_path):
    out = tmp_path / "out.jsonl"
    demo = run_cbq(input_file, "-o", out, env={"CBQ_MODEL": None})
    assert demo.exit_code == 0, demo.output  # the README's first command runs as it did
    warnings = [line for line in demo.stderr.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "random-weight 'tiny-llama' demo preset" in warnings[0]
    assert "outputs are noise" in warnings[0]
    assert demo.stderr.rstrip().endswith("(random-weight 'tiny-llama' demo preset: outputs are noise)")
    engine_line = next(line for line in demo.stderr.splitlines() if line.startswith("engine:"))
    assert engine_line.endswith("(random-weight 'tiny-llama' demo preset: outputs are noise)")
    named = run_cbq(input_file, "-o", out, "--model", "tiny-llama", env={"CBQ_MODEL": None})
    assert named.exit_code == 0 and "demo preset" not in named.stderr  # asked for by name
    fake = run_cbq(input_file, "-o", out, "--fake-engine", env={"CBQ_MODEL": None})
    assert fake.exit_code == 0 and "demo preset" not in fake.stderr


def test_the_worker_announces_the_demo_model_too(real_redis, private_redis_url):
    result = CliRunner(env={"CBQ_MODEL": None}).invoke(
        main, ["worker", "--burst", "--redis-url", private_redis_url, "--queue", "demo-announce"]
    )
    assert result.exit_code == 0, result.output
    assert "warning: no --model and no CBQ_MODEL: running the random-weight 'tiny-llama' demo preset" in result.stderr


def test_input_file_as_vllm_names_it_and_the_line_wins_over_the_flag(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [{"custom_id": "own", "prompt": "abcdefgh", "max_tokens": 3}, {"custom_id": "flag", "prompt": "abcdefgh"}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = run_cbq("-i", path, "-o", out, "--fake-engine", "--max-new-tokens", "5")
    assert result.exit_code == 0, result.output
    notes = [line for line in result.stderr.splitlines() if line.startswith("note:")]
    assert notes == [
        "note: --max-new-tokens 5 is a default: 1 line(s) give their own max_new_tokens (or max_tokens), which wins"
    ]
    by_id = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by_id["own"]["usage"]["completion_tokens"] == 3 and by_id["flag"]["usage"]["completion_tokens"] == 5
    same = run_cbq("-i", path, "-o", tmp_path / "o2.jsonl", "--fake-engine", "--max-new-tokens", "3", "--fresh")
    assert same.exit_code == 0 and "note:" not in same.stderr  # the line says what the flag says
    both = run_cbq(path, "-i", path, "-o", out, "--fake-engine")
    assert both.exit_code == 2 and "give the input file once" in both.stderr
    assert "-i, --input-file" in CliRunner().invoke(main, ["run", "--help"]).output


def test_an_empty_file_gives_an_empty_output_and_exit_0(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    out = tmp_path / "out.jsonl"
    out.write_text("old\n")
    result = run_cbq("-i", empty, "-o", out, "--fake-engine")
    assert result.exit_code == 0, result.output
    assert out.read_text() == "" and "no requests in the input" in result.stderr


def test_a_prompt_refused_for_its_length_adds_no_tokens_and_the_summary_names_the_device(tmp_path):
    path = tmp_path / "in.jsonl"
    lines = [{"custom_id": "ok", "prompt": "hi", "max_new_tokens": 2}, {"custom_id": "long", "prompt": "word " * 200}]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = run_cbq(path, "-o", out, "--model", "tiny-llama", "--device", "cpu", "--max-model-len", "32")
    assert result.exit_code == 2, result.output  # one request failed
    by_id = {r["custom_id"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert by_id["long"]["error_code"] == "context_length_exceeded" and "the context is 32 tokens" in by_id["long"]["error"]
    assert by_id["long"]["usage"]["prompt_tokens"] == 0  # it never ran
    tokens_line = next(line for line in result.stderr.splitlines() if line.startswith("  tokens: "))
    assert tokens_line.startswith(f"  tokens: prompt {by_id['ok']['usage']['prompt_tokens']}  completion 2  CPU ")
    assert " gpu " not in result.stderr
