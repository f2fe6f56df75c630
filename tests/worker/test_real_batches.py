"""Real batch files on a real-shaped checkpoint, through `cbq run` and `cbq results`: an OpenAI Batch file
using every accepted body field runs unedited; its output parses with the `openai` package's own types;
failed requests go to `--errors`, a prompt longer than the context as an HTTP 400 with an error object;
a checkpoint that cannot be loaded ends the command with one clear line."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
import torch
from click.testing import CliRunner
from openai._models import construct_type
from openai.types import Completion
from openai.types.chat import ChatCompletion
from openai.types.shared import ErrorObject

from producer.cli import main
from schemas.openai_body import ChatCompletionBody, CompletionBody
from schemas.sampling import NEUTRAL_VALUES, Sampling
from tests.fixtures.checkpoints import build_checkpoint
from worker.engine.api import SamplingParams

OPENAI_BATCH = Path(__file__).resolve().parents[1] / "fixtures" / "openai_batch.jsonl"


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama3"), "llama3", eot_row_from=114)


def read_jsonl(path) -> list[dict]:
    return [json.loads(line) for line in Path(path).read_text().splitlines()]


def test_the_fixture_uses_every_accepted_body_field():
    used = {key for line in read_jsonl(OPENAI_BATCH) for key in line["body"]}
    accepted = {
        name
        for body in (CompletionBody, ChatCompletionBody)
        for name, info in body.model_fields.items()
        if not info.exclude  # the refused ones (tools, audio, ...)
    }
    # A field the engine cannot apply yet and that has no value asking for nothing would fail its request.
    engine_fields = {f.name for f in dataclasses.fields(SamplingParams)}
    not_yet = {n for n in Sampling.model_fields if n not in engine_fields and n not in NEUTRAL_VALUES} - {
        "truncate_prompt_tokens"  # the worker applies it itself
    }
    assert accepted - used - not_yet == set(), "add the new field to tests/fixtures/openai_batch.jsonl"
    roles = {m["role"] for line in read_jsonl(OPENAI_BATCH) for m in line["body"].get("messages", [])}
    assert roles == {"developer", "system", "user", "assistant"}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_an_openai_batch_file_runs_unedited_and_parses_with_openai_types(llama3, tmp_path, mode):
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    args = ["run", str(OPENAI_BATCH), "-o", str(out), "--errors", str(errors), "--format", "openai"]
    served = ["--served-model-name", "llama-3-instruct-like"]  # the model the file's lines name
    result = CliRunner().invoke(main, [*args, "--model", str(llama3.path), *served, "--mode", mode])
    assert result.exit_code == 2, result.output  # one request failed: the prompt is too long
    inputs = {line["custom_id"]: line for line in read_jsonl(OPENAI_BATCH)}

    lines = read_jsonl(out)
    assert [line["custom_id"] for line in lines] == [c for c in inputs if c != "completion-prompt-too-long"]
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        url = inputs[line["custom_id"]]["url"]
        if inputs[line["custom_id"]]["body"].get("echo"):  # the first token's null logprob: the SDK parses leniently
            check_echo(body, inputs[line["custom_id"]]["body"], llama3.path)
            parsed = construct_type(type_=Completion, value=body)
        else:
            parsed = (ChatCompletion if url == "/v1/chat/completions" else Completion).model_validate(body)
        [choice] = parsed.choices
        assert choice.finish_reason in ("stop", "length")
        assert parsed.model == "llama-3-instruct-like"
        assert parsed.usage.total_tokens == parsed.usage.prompt_tokens + parsed.usage.completion_tokens
        request = inputs[line["custom_id"]]["body"]
        if "tool_choice" in request:  # a forced call: its arguments follow the function's parameters
            [call] = choice.message.tool_calls
            assert choice.message.content is None and choice.finish_reason == "stop"  # named, as OpenAI
            assert call.function.name == request["tool_choice"]["function"]["name"] == "record_water"
            jsonschema.validate(json.loads(call.function.arguments), request["tools"][0]["function"]["parameters"])
            continue
        text = choice.message.content if isinstance(parsed, ChatCompletion) else choice.text
        assert "<|eot_id|>" not in text
        if request.get("logprobs"):  # real tokenizer pieces: the tokens' bytes spell the text
            records = choice.logprobs.content if isinstance(parsed, ChatCompletion) else choice.logprobs.tokens
            assert records and all(len(r.top_logprobs) == 2 for r in records if hasattr(r, "top_logprobs"))
            if isinstance(parsed, ChatCompletion):
                assert b"".join(bytes(r.bytes) for r in records).decode() == text
        if "structured_outputs" in request:  # vLLM's fields: its constraint, and the token ids it asked for
            assert text in request["structured_outputs"]["choice"] and choice.finish_reason == "stop"
            assert body["choices"][0]["token_ids"] and len(body["choices"][0]["token_ids"]) <= request["max_tokens"]
        if "json_schema" in request.get("response_format", {}):
            assert choice.finish_reason == "stop"
            jsonschema.validate(json.loads(text), request["response_format"]["json_schema"]["schema"])
        if "prompt_logprobs" in request:  # vLLM's: a null, then a map per prompt token (top k and the token)
            entries = body["prompt_logprobs"]
            assert len(entries) == parsed.usage.prompt_tokens and entries[0] is None
            assert all(1 <= len(e) <= request["prompt_logprobs"] + 1 for e in entries[1:])
            assert all(set(v) == {"logprob", "rank", "decoded_token"} for e in entries[1:] for v in e.values())
        limit = request.get("max_tokens", request.get("max_completion_tokens"))
        if limit is not None:
            assert parsed.usage.completion_tokens <= limit
        else:  # no limit: the end of the turn, or the rest of the 512-token context
            assert choice.finish_reason == "stop" or parsed.usage.prompt_tokens + parsed.usage.completion_tokens == 512

    [error_line] = read_jsonl(errors)
    assert error_line["custom_id"] == "completion-prompt-too-long" and error_line["error"] is None
    assert error_line["response"]["status_code"] == 400
    error = ErrorObject.model_validate(error_line["response"]["body"]["error"])
    assert (error.type, error.code) == ("invalid_request_error", "context_length_exceeded")
    assert "the context is 512 tokens" in error.message


def check_echo(body: dict, request: dict, checkpoint: Path) -> None:
    """OpenAI's legacy echo: the text is the prompt, the logprobs cover every prompt token (the first null), and
    their values equal a transformers forward over the prompt (fp32)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    [choice] = body["choices"]
    assert choice["text"] == request["prompt"] and choice["finish_reason"] == "length"
    logprobs = choice["logprobs"]
    ids = AutoTokenizer.from_pretrained(checkpoint)(request["prompt"])["input_ids"]
    assert len(logprobs["tokens"]) == len(ids) == body["usage"]["prompt_tokens"]
    assert logprobs["token_logprobs"][0] is None and logprobs["top_logprobs"][0] is None
    assert "".join(logprobs["tokens"][1:]) == request["prompt"]  # a BOS leads, at offset 0
    assert logprobs["text_offset"][:2] == [0, 0]
    offsets = logprobs["text_offset"]
    assert [len(t) for t in logprobs["tokens"][1:-1]] == [b - a for a, b in zip(offsets[1:-1], offsets[2:], strict=True)]
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    with torch.no_grad():
        expected = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    for p in range(1, len(ids)):
        assert abs(logprobs["token_logprobs"][p] - expected[p - 1, ids[p]].item()) < 1e-4, p
        top = logprobs["top_logprobs"][p]
        assert logprobs["tokens"][p] in top and len(top) <= request["logprobs"] + 1


def test_chat_template_kwargs_reach_the_template_of_a_qwen3_checkpoint(tmp_path):
    """vLLM's `chat_template_kwargs`: Qwen3's {"enable_thinking": false} opens the answer with an empty think
    block, as its template renders it; the same chat without it does not; a bad name fails its line."""
    from transformers import AutoTokenizer

    qwen3 = build_checkpoint(tmp_path / "qwen3", "qwen3")
    messages = [{"role": "user", "content": "say something about the water"}]
    body = {"model": "qwen3", "messages": messages, "max_tokens": 3}
    lines = [
        {"custom_id": c, "method": "POST", "url": "/v1/chat/completions", "body": body | extra}
        for c, extra in (("thinking", {}), ("no-thinking", {"chat_template_kwargs": {"enable_thinking": False}}))
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(path), "-o", str(out), "--format", "openai", "--model", str(qwen3.path)])
    assert result.exit_code == 0, result.output
    usage = {line["custom_id"]: line["response"]["body"]["usage"] for line in read_jsonl(out)}
    tok = AutoTokenizer.from_pretrained(qwen3.path)
    for custom_id, kwargs in (("thinking", {}), ("no-thinking", {"enable_thinking": False})):
        rendered = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **kwargs)
        assert usage[custom_id]["prompt_tokens"] == len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert usage["no-thinking"]["prompt_tokens"] > usage["thinking"]["prompt_tokens"]

    # the batch's variables (`--chat-template-kwargs`) reach every chat; a line's own win, name by name
    lines[1]["body"]["chat_template_kwargs"] = {"enable_thinking": True}
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["run", str(path), "-o", str(out), "--format", "openai", "--model", str(qwen3.path)]
    result = CliRunner().invoke(main, [*args, "--chat-template-kwargs", '{"enable_thinking": false}'])
    assert result.exit_code == 0, result.output
    flipped = {line["custom_id"]: line["response"]["body"]["usage"] for line in read_jsonl(out)}
    assert flipped["thinking"]["prompt_tokens"] == usage["no-thinking"]["prompt_tokens"]
    assert flipped["no-thinking"]["prompt_tokens"] == usage["thinking"]["prompt_tokens"]
    for value, message in (("{", "not JSON"), ('{"tokenize": true}', "tokenize cannot be set here")):
        result = CliRunner().invoke(main, [*args, "--chat-template-kwargs", value])
        assert result.exit_code == 2 and "--chat-template-kwargs" in result.output and message in result.output

    bad = dict(lines[1], body=body | {"chat_template_kwargs": {"messages": 1}})
    path.write_text(json.dumps(bad) + "\n")
    result = CliRunner().invoke(main, ["run", str(path), "-o", str(out), "--model", str(qwen3.path)])
    assert result.exit_code == 2  # the request failed alone (status 400)
    assert "line 1: body.chat_template_kwargs: messages cannot be set here" in result.output


def test_a_tool_use_transcript_renders_through_the_qwen3_template(tmp_path):
    """An agent transcript replayed in a batch: an assistant turn with tool_calls (content null) and the tool's
    answer. The template gets the calls' arguments as objects (transformers' convention) and renders them."""
    from transformers import AutoTokenizer

    qwen3 = build_checkpoint(tmp_path / "qwen3", "qwen3")
    call = {"id": "call_1", "type": "function", "function": {"name": "lookup", "arguments": '{"city": "Oslo"}'}}
    messages = [
        {"role": "user", "content": "how is the water in Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "call_1", "content": "the water is long"},
    ]
    line = {"custom_id": "t", "method": "POST", "url": "/v1/chat/completions", "body": {"messages": messages, "max_tokens": 2}}
    path, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    path.write_text(json.dumps(line) + "\n")
    result = CliRunner().invoke(main, ["run", str(path), "-o", str(out), "--format", "openai", "--model", str(qwen3.path)])
    assert result.exit_code == 0, result.output
    [answer] = read_jsonl(out)
    tok = AutoTokenizer.from_pretrained(qwen3.path)
    templated = [messages[0], {"role": "assistant", "tool_calls": [dict(call, function={"name": "lookup", "arguments": {"city": "Oslo"}})]}, messages[2]]
    rendered = tok.apply_chat_template(templated, add_generation_prompt=True, tokenize=False)
    assert '<tool_call>\n{"name": "lookup", "arguments": {"city": "Oslo"}}\n</tool_call>' in rendered
    assert "<tool_response>\nthe water is long\n</tool_response>" in rendered
    expected = len(tok(rendered, add_special_tokens=False)["input_ids"])
    assert answer["response"]["body"]["usage"]["prompt_tokens"] == expected


def test_results_errors_file_takes_failed_requests(cbq, burst_worker, write_jsonl, tmp_path):
    too_long = "x" * 5000  # the fake engine's context is 4,096 bytes
    path = write_jsonl([{"prompt": "hello", "custom_id": "ok"}, {"prompt": too_long, "custom_id": "long"}])
    batch_id = json.loads(cbq("submit", path, "--json").stdout.splitlines()[-1])["batch_id"]
    burst_worker()
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    result = cbq("results", batch_id, "-o", out, "--errors", errors, "--format", "openai")
    assert result.exit_code == 0, result.output
    assert [line["custom_id"] for line in read_jsonl(out)] == ["ok"]
    [failed] = read_jsonl(errors)
    assert failed["response"]["status_code"] == 400
    assert failed["response"]["body"]["error"]["code"] == "context_length_exceeded"
    assert "wrote 1 failed requests to" in result.stderr

    cbq("results", batch_id, "-o", out, "--errors", errors)  # cbq lines: the same split
    assert [line["custom_id"] for line in read_jsonl(out)] == ["ok"]
    assert read_jsonl(errors)[0]["error_code"] == "context_length_exceeded"
    cbq("results", batch_id, "-o", out)  # without --errors: everything in one file, as before
    assert [line["custom_id"] for line in read_jsonl(out)] == ["ok", "long"]


def _corrupt_shard(checkpoint_dir: Path, tmp_path: Path) -> Path:
    target = tmp_path / "corrupt"
    target.mkdir()
    for f in checkpoint_dir.iterdir():
        (target / f.name).write_bytes(f.read_bytes())
    shard = sorted(target.glob("model-*.safetensors"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # truncated
    return target


@pytest.mark.parametrize("case", ["missing", "not_a_checkpoint", "unsupported", "corrupt_shard"])
def test_a_model_that_cannot_load_ends_with_one_clear_line(llama3, tmp_path, case):
    if case == "missing":
        model, expected = tmp_path / "nope", f"no such checkpoint folder: {tmp_path / 'nope'}"
    elif case == "not_a_checkpoint":
        model, expected = tmp_path, f"{tmp_path} is not a checkpoint folder: it has no config.json"
    elif case == "unsupported":
        model = tmp_path / "gpt2"
        model.mkdir()
        (model / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
        expected = "model type 'gpt2' is not supported; cbq runs llama, mistral, qwen2, qwen3"
    else:
        model = _corrupt_shard(llama3.path, tmp_path)
        expected = f"cannot load the checkpoint {model}: "
    prompts = tmp_path / "in.jsonl"
    prompts.write_text('{"prompt": "hi"}\n')
    result = CliRunner().invoke(main, ["run", str(prompts), "-o", str(tmp_path / "o"), "--model", str(model)])
    assert result.exit_code == 1, result.output
    assert isinstance(result.exception, SystemExit) and "Traceback" not in result.output
    error_lines = [line for line in result.stderr.splitlines() if line.startswith("Error:")]
    assert len(error_lines) == 1 and error_lines[0].startswith(f"Error: {expected}"), result.stderr


def test_the_worker_command_reports_a_missing_model_in_one_line(cbq, tmp_path):
    result = CliRunner().invoke(main, ["worker", "--burst", "--model", str(tmp_path / "nope")])
    assert result.exit_code == 1
    assert result.stderr.strip().splitlines()[-1] == f"Error: no such checkpoint folder: {tmp_path / 'nope'}"
