"""`/v1/responses` batch lines through `cbq run`, and through `cbq submit` / `cbq results`: on tiny real-shaped
checkpoints, every output line's body parses as the `openai` package's `Response`, its fields as they were
dumped; greedy output equals the chat path's for the same conversation; reasoning and tool calls come out as their
own items (the Qwen3-shaped checkpoint's text forced where the test needs a given output)."""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner
from openai.types.responses import Response
from openai.types.shared import ErrorObject

from producer.cli import main
from schemas import keys
from tests.fixtures.checkpoints import build_checkpoint
from tests.worker.test_tool_calls_e2e import CALL_TEXT, force_texts

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string", "maxLength": 12}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


@pytest.fixture(scope="module")
def llama3(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("llama3"), "llama3", eot_row_from=114)


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", eot_row_from=114)


def responses_line(custom_id, body, model="tiny"):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": {"model": model, **body}}


def chat_line(custom_id, body, model="tiny"):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {"model": model, **body}}


def run(tmp_path: Path, checkpoint, lines, *flags, output_format="openai") -> tuple[list[dict], list[dict]]:
    source, out, errors = tmp_path / "in.jsonl", tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["run", str(source), "-o", str(out), "--errors", str(errors), "--format", output_format]
    result = CliRunner().invoke(main, [*args, "--model", str(checkpoint.path), "--served-model-name", "tiny", *flags])
    assert result.exit_code in (0, 2), result.output
    read = lambda path: [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []  # noqa: E731
    return read(out), read(errors)


def responses(lines: list[dict]) -> dict[str, Response]:
    """Each line's Response, checked: a 200 without error, and the SDK's model dumps back to the same body."""
    parsed = {}
    for line in lines:
        assert line["error"] is None and line["response"]["status_code"] == 200
        body = line["response"]["body"]
        response = Response.model_validate(body)
        assert response.model_dump(mode="json", exclude_unset=True, by_alias=True) == body
        assert response.id == "resp_" + line["response"]["request_id"] and response.model == "tiny"
        parsed[line["custom_id"]] = response
    return parsed


CONVERSATION = [
    {"role": "user", "content": "Name a river."},
    {"role": "assistant", "content": "The Nile."},
    {"role": "user", "content": "And another?"},
]


def test_greedy_output_equals_the_chat_paths_for_the_same_conversation(llama3, tmp_path):
    """The same conversation in each spelling: the Response's text and token counts are the chat completion's."""
    items = [
        {"role": "user", "content": [{"type": "input_text", "text": "Name a river."}]},
        {"type": "message", "role": "assistant", "id": "msg_0", "status": "completed",
         "content": [{"type": "output_text", "text": "The Nile.", "annotations": []}]},
        {"role": "user", "content": "And another?"},
    ]  # fmt: skip
    lines = [
        chat_line("chat", {"messages": [{"role": "system", "content": "Be brief."}, *CONVERSATION], "max_tokens": 12,
                           "temperature": 0}),
        responses_line("resp", {"instructions": "Be brief.", "input": items, "max_output_tokens": 12, "temperature": 0}),
        chat_line("chat-plain", {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 6, "temperature": 0}),
        responses_line("resp-plain", {"input": "Hi", "max_output_tokens": 6, "temperature": 0, "store": False}),
    ]  # fmt: skip
    out, errors = run(tmp_path, llama3, lines)
    assert errors == []
    by_id = {line["custom_id"]: line["response"]["body"] for line in out}
    got = responses([line for line in out if line["custom_id"].startswith("resp")])
    for chat_id, resp_id in (("chat", "resp"), ("chat-plain", "resp-plain")):
        [choice] = by_id[chat_id]["choices"]
        response, usage = got[resp_id], by_id[chat_id]["usage"]
        assert response.output_text == choice["message"]["content"]
        assert response.usage is not None
        assert (response.usage.input_tokens, response.usage.output_tokens) == (
            usage["prompt_tokens"], usage["completion_tokens"],
        )  # fmt: skip
        cut = choice["finish_reason"] == "length"
        assert response.status == ("incomplete" if cut else "completed")
        assert (response.incomplete_details is not None) == cut
    assert got["resp"].instructions == "Be brief." and got["resp"].max_output_tokens == 12
    assert got["resp"].usage is not None and got["resp"].usage.output_tokens_details.reasoning_tokens == 0


def test_reasoning_tool_calls_formats_and_refusals_through_cbq_run(qwen3, tmp_path, monkeypatch):
    force_texts(
        monkeypatch,
        {
            "Tool said": "<think>\nIt is sunny.\n</think>\n\nSunny in Oslo.",  # before the transcript's question
            "Weather in Oslo?": CALL_TEXT,
            "Say hello.": "<think>\nA greeting needs no tool.\n</think>\n\nHello there.",
            "Extract the city.": '{"city": "Oslo"}',
            "Record it.": '{"city": "Bergen"}',
        },
    )
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    transcript = [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "reasoning", "id": "rs_0", "summary": [], "content": [{"type": "reasoning_text", "text": "call"}]},
        {"type": "function_call", "call_id": "call_9", "name": "get_weather", "arguments": '{"city": "Oslo"}'},
        {"type": "function_call_output", "call_id": "call_9", "output": "Tool said: sunny"},
    ]
    lines = [
        responses_line("call", {"input": "Weather in Oslo?", "tools": [WEATHER], "max_output_tokens": 120}),
        responses_line("hello", {"input": "Say hello.", "tools": [WEATHER], "tool_choice": "auto",
                                 "reasoning": {"effort": "low", "summary": "auto"}}),
        responses_line("json", {"input": "Extract the city.", "max_output_tokens": 60,
                                "text": {"format": {"type": "json_schema", "name": "city", "schema": schema,
                                                    "strict": True}}}),
        responses_line("forced", {"input": "Record it.", "tools": [WEATHER],
                                  "tool_choice": {"type": "function", "name": "get_weather"}}),
        responses_line("after-tool", {"input": transcript, "tools": [WEATHER]}),
        responses_line("cut", {"input": "Say hello.", "max_output_tokens": 3}),
        responses_line("previous", {"input": "x", "previous_response_id": "resp_1"}),
        responses_line("image", {"input": [{"role": "user", "content": [
            {"type": "input_file", "file_id": "file_1"}]}]}),
    ]  # fmt: skip
    out, errors = run(tmp_path, qwen3, lines, "--tool-call-parser", "hermes")
    got = responses(out)
    assert list(got) == ["call", "hello", "json", "forced", "after-tool", "cut"]

    reasoning, call = got["call"].output
    assert reasoning.type == "reasoning" and reasoning.content is not None
    assert reasoning.content[0].text == "The user wants the weather in Oslo: call the tool."
    assert call.type == "function_call" and call.name == "get_weather" and json.loads(call.arguments) == {"city": "Oslo"}
    assert call.call_id.startswith("call_") and call.status == "completed" and got["call"].status == "completed"
    usage = got["call"].usage
    assert usage is not None and 0 < usage.output_tokens_details.reasoning_tokens < usage.output_tokens

    reasoning, message = got["hello"].output
    assert reasoning.type == "reasoning" and message.type == "message" and got["hello"].output_text == "Hello there."
    assert got["hello"].reasoning is not None and got["hello"].reasoning.effort == "low"

    assert got["json"].output_text == '{"city": "Oslo"}' and got["json"].text is not None
    jsonschema.validate(json.loads(got["json"].output_text), schema)

    [forced] = got["forced"].output
    assert forced.type == "function_call" and (forced.name, forced.arguments) == ("get_weather", '{"city": "Bergen"}')

    assert got["after-tool"].output_text == "Sunny in Oslo."

    assert got["cut"].status == "incomplete" and got["cut"].incomplete_details is not None
    assert got["cut"].incomplete_details.reason == "max_output_tokens" and got["cut"].usage.output_tokens == 3

    by_id = {line["custom_id"]: line for line in errors}
    assert list(by_id) == ["previous", "image"]
    for custom_id, param in (("previous", "previous_response_id"), ("image", "input[0].message.content")):
        response = by_id[custom_id]["response"]
        assert response["status_code"] == 400
        error = ErrorObject.model_validate(response["body"]["error"])
        assert (error.type, error.code, error.param) == ("invalid_request_error", "unsupported_parameter", param)


def test_cbq_result_lines_of_a_responses_line_are_the_chats(qwen3, tmp_path, monkeypatch):
    force_texts(monkeypatch, {"Weather in Oslo?": CALL_TEXT})
    out, _ = run(tmp_path, qwen3, [responses_line("call", {"input": "Weather in Oslo?", "tools": [WEATHER]})],
                 output_format="cbq")  # fmt: skip
    [line] = out
    assert line["text"] == CALL_TEXT and line["tool_calls"][0]["function"]["name"] == "get_weather"
    assert line["reasoning_content"] == "The user wants the weather in Oslo: call the tool."
    assert line["usage"]["reasoning_tokens"] > 0


def test_submit_and_results_give_responses(cbq, burst_worker, write_jsonl, tmp_path):
    """Through Redis (the fake engine echoes): a Responses batch's OpenAI output lines carry Responses."""
    lines = [
        responses_line("a", {"input": "hello there", "max_output_tokens": 4}, model="fake"),
        responses_line("b", {"input": "hi", "instructions": "Be brief.", "metadata": {"k": "v"}}, model="fake"),
        responses_line("c", {"input": "x", "stream": True}, model="fake"),
    ]
    submitted = cbq("submit", write_jsonl(lines), "--json")
    batch_id = json.loads(submitted.stdout.splitlines()[-1])["batch_id"]
    burst_worker(queue=keys.model_queue("cbq", "fake"), model_name="fake")  # the batch's model's queue
    out, errors = tmp_path / "out.jsonl", tmp_path / "errors.jsonl"
    result = cbq("results", batch_id, "-o", out, "--errors", errors, "--format", "openai")
    assert result.exit_code == 0, result.output
    rows = [json.loads(x) for x in out.read_text().splitlines()]
    for row in rows:
        Response.model_validate(row["response"]["body"])
    a, b = (Response.model_validate(row["response"]["body"]) for row in rows)
    assert a.status == "incomplete" and a.usage is not None and a.usage.output_tokens == 4
    assert b.instructions == "Be brief." and b.metadata == {"k": "v"}
    [refused] = [json.loads(x) for x in errors.read_text().splitlines()]
    assert refused["custom_id"] == "c" and refused["response"]["body"]["error"]["param"] == "stream"


RESPONSES_BATCH = Path(__file__).resolve().parents[1] / "fixtures" / "responses_batch.jsonl"


def test_the_responses_fixture_uses_every_field_of_responses_own():
    from schemas.responses_body import ResponsesBody
    from schemas.sampling import SharedSampling

    used = {key for line in map(json.loads, RESPONSES_BATCH.read_text().splitlines()) for key in line["body"]}
    own = {name for name, info in ResponsesBody.model_fields.items() if not info.exclude}
    own -= set(SharedSampling.model_fields)  # the vLLM fields: tests/fixtures/openai_batch.jsonl has them
    assert own | {"temperature", "top_p", "seed"} <= used, "add the new field to tests/fixtures/responses_batch.jsonl"


def test_an_unedited_responses_batch_file_runs_and_parses_with_the_sdk(llama3, tmp_path):
    lines = [json.loads(x) for x in RESPONSES_BATCH.read_text().splitlines()]
    lines = [{**line, "body": {**line["body"], "model": "tiny"}} for line in lines]  # the name `run` serves here
    out, errors = run(tmp_path, llama3, lines)
    assert errors == []
    got = responses(out)
    requests = {line["custom_id"]: line["body"] for line in lines}
    for custom_id, response in got.items():
        request = requests[custom_id]
        assert response.usage is not None and response.usage.output_tokens <= request["max_output_tokens"]
        assert response.instructions == request.get("instructions") and response.metadata == request.get("metadata")
    [message] = got["responses-string-input"].output
    assert message.type == "message" and message.content[0].logprobs is not None
    num_tokens = got["responses-string-input"].usage.output_tokens
    assert len(message.content[0].logprobs) in (num_tokens, num_tokens - 1)  # a final EOS has none
    assert all(len(lp.top_logprobs) == 2 for lp in message.content[0].logprobs)
    assert got["responses-json-schema"].status == "completed"
    schema = requests["responses-json-schema"]["text"]["format"]["schema"]
    jsonschema.validate(json.loads(got["responses-json-schema"].output_text), schema)
    [call] = got["responses-forced-call"].output
    assert call.type == "function_call" and call.name == "record_water"
    jsonschema.validate(json.loads(call.arguments), requests["responses-forced-call"]["tools"][0]["parameters"])
