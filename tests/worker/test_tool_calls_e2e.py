"""Tool calls and reasoning through `cbq run` on a tiny Qwen3-shaped checkpoint (its chat template renders tool
calls as `<tool_call>` blocks and has the `<think>` switch): the model's text is forced where the test needs a
given output (a `choice` constraint put on each request as the engine receives it), so the parse path runs
through the real engine, tokenizer and worker; the OpenAI output is read back with the `openai` package's types."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import jsonschema
import pytest
from click.testing import CliRunner
from openai.types.chat import ChatCompletion

import worker.cli
from producer.cli import main
from tests.fixtures.checkpoints import build_checkpoint
from worker.engine.api import Constraint, ConstraintKind, SamplingParams
from worker.engine.grammar import GrammarCompiler
from worker.engine.tokenizer import HFTokenizer

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 12}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "properties": {"utc_offset": {"type": "integer", "minimum": -12, "maximum": 14}},
            "required": ["utc_offset"],
            "additionalProperties": False,
        },
    },
}


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory):
    return build_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3", eot_row_from=114)


def chat_line(custom_id, content, **body):
    body = {"model": "qwen3-like", "messages": [{"role": "user", "content": content}], "max_tokens": 120, **body}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": body}


def force_texts(monkeypatch, canned: dict[str, str]) -> None:
    """Each request whose prompt contains a key of `canned` generates exactly that key's text."""
    build = worker.cli.build_engine

    def build_forcing(*args, **kwargs):
        engine = build(*args, **kwargs)
        add_request = engine.add_request

        def add_forced(request):
            prompt = engine.tokenizer.decode(request.prompt_ids)
            text = next(text for key, text in canned.items() if key in prompt)
            forced = Constraint(ConstraintKind.CHOICE, json.dumps([text]))
            add_request(dataclasses.replace(request, sampling=dataclasses.replace(request.sampling, constraint=forced)))

        engine.add_request = add_forced
        return engine

    monkeypatch.setattr(worker.cli, "build_engine", build_forcing)


def run(tmp_path: Path, checkpoint, lines, *flags, output_format="openai") -> tuple[list[dict], str]:
    source, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    source.write_text("".join(json.dumps(line) + "\n" for line in lines))
    args = ["run", str(source), "-o", str(out), "--format", output_format, "--model", str(checkpoint.path), "--served-model-name", "qwen3-like"]
    result = CliRunner().invoke(main, [*args, "--temperature", "0", *flags])
    assert result.exit_code in (0, 2), result.output
    return [json.loads(line) for line in out.read_text().splitlines()], result.output


def completions(lines) -> dict[str, ChatCompletion]:
    return {line["custom_id"]: ChatCompletion.model_validate(line["response"]["body"]) for line in lines}


CALL_TEXT = (
    "<think>\nThe user wants the weather in Oslo: call the tool.\n</think>\n\n"
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'
)


def test_auto_tool_calls_and_reasoning_are_parsed_through_the_worker(qwen3, tmp_path, monkeypatch):
    force_texts(
        monkeypatch,
        {
            "Weather in Oslo?": CALL_TEXT,
            "Say hello.": "<think>\nA greeting needs no tool.\n</think>\n\nHello there.",
            "No tools now.": CALL_TEXT,
            "Broken call.": '<tool_call>\n{"name": "get_weather", "arguments": {"city": \n</tool_call>',
        },
    )
    lines = [
        chat_line("call", "Weather in Oslo?", tools=[WEATHER, TIME]),  # tool_choice "auto" by default
        chat_line("answer", "Say hello.", tools=[WEATHER, TIME], tool_choice="auto"),
        chat_line("none", "No tools now.", tools=[WEATHER], tool_choice="none"),
        chat_line("broken", "Broken call.", tools=[WEATHER]),
    ]
    out, log = run(tmp_path, qwen3, lines, "--tool-call-parser", "hermes")
    assert "output parsers: tool calls: hermes, reasoning: think" in log  # think: from the template (auto)
    by_id = completions(out)

    [choice] = by_id["call"].choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "The user wants the weather in Oslo: call the tool."
    [call] = choice.message.tool_calls
    assert (call.type, call.function.name, json.loads(call.function.arguments)) == ("function", "get_weather", {"city": "Oslo"})
    assert call.id.startswith("call_")

    [choice] = by_id["answer"].choices
    assert (choice.finish_reason, choice.message.content, choice.message.tool_calls) == ("stop", "Hello there.", None)
    assert choice.message.reasoning_content == "A greeting needs no tool."

    [choice] = by_id["none"].choices  # tool_choice "none": a call written anyway is text
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content.startswith("<tool_call>")

    [choice] = by_id["broken"].choices  # a call that does not parse stays content, whole
    assert choice.message.tool_calls is None
    assert choice.message.content.startswith('<tool_call>\n{"name": "get_weather"')
    assert getattr(choice.message, "reasoning_content", None) is None


def test_cbq_result_lines_carry_the_parsed_parts_next_to_the_text(qwen3, tmp_path, monkeypatch):
    force_texts(monkeypatch, {"Weather in Oslo?": CALL_TEXT, "Plain.": "Just text."})
    lines = [chat_line("call", "Weather in Oslo?", tools=[WEATHER]), chat_line("plain", "Plain.", tools=[WEATHER])]
    out, _ = run(tmp_path, qwen3, lines, output_format="cbq")  # parsers from the template: hermes and think
    call, plain = out
    assert call["text"] == CALL_TEXT and "content" not in call
    assert call["reasoning_content"] == "The user wants the weather in Oslo: call the tool."
    assert call["tool_calls"] == [
        {"id": call["tool_calls"][0]["id"], "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}
    ]  # fmt: skip
    assert plain == {k: plain[k] for k in ("custom_id", "index", "text", "finish_reason", "usage")}  # nothing added


def test_parsers_off_leave_the_text_as_content(qwen3, tmp_path, monkeypatch):
    force_texts(monkeypatch, {"Weather in Oslo?": CALL_TEXT})
    out, _ = run(
        tmp_path, qwen3, [chat_line("call", "Weather in Oslo?", tools=[WEATHER])],
        "--tool-call-parser", "none", "--reasoning-parser", "none",
    )  # fmt: skip
    [choice] = completions(out)["call"].choices
    assert (choice.message.content, choice.message.tool_calls, choice.finish_reason) == (CALL_TEXT, None, "stop")


def test_required_among_several_tools_is_an_array_of_valid_calls(qwen3, tmp_path):
    line = chat_line("req", "What now?", tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    out, _ = run(tmp_path, qwen3, [line], "--reasoning-parser", "none", "--max-new-tokens", "200")
    [choice] = completions(out)["req"].choices
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    [call] = choice.message.tool_calls  # parallel_tool_calls false: one call
    jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


# --- a constraint after the reasoning ----------------------------------------------------------------------------

ANSWER_SCHEMA = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}},
    "required": ["city"],
    "additionalProperties": False,
}


@pytest.mark.parametrize("think_tokens", [False, True])
@pytest.mark.parametrize("opened", [False, True])
def test_the_grammar_lets_the_reasoning_through_then_forces_the_json(qwen3, opened, think_tokens):
    """The engine's own compiler on the checkpoint's tokenizer: a `<think>` block (opened by the prompt, as
    DeepSeek-R1's template does, or by the output) passes unconstrained, then only the schema's JSON. With
    `think_tokens` the vocabulary has `<think>` and `</think>` as added tokens, as Qwen3's does (llguidance
    treats those as special): the worker's wrapping lets the model write them as its one token."""
    from transformers import AutoTokenizer

    from worker.output_parsers import OutputParsing

    backend = AutoTokenizer.from_pretrained(str(qwen3.path))
    if think_tokens:
        backend.add_tokens(["<think>", "</think>"])
    tokenizer = HFTokenizer(backend)
    compiler = GrammarCompiler(tokenizer, -(-tokenizer.vocab_size // 64) * 64, tokenizer.eos_token_ids)
    opener = "" if opened else "<think>"
    prompt_ids = tokenizer.encode("<|im_start|>assistant\n" + ("<think>\n" if opened else ""))
    answer = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(ANSWER_SCHEMA))
    parsing = OutputParsing.choose("none", "think", None)
    wrapped = parsing.constrain_after_reasoning(SamplingParams(constraint=answer), prompt_ids, tokenizer).constraint
    assert wrapped != answer

    def accepts(text: str) -> bool:
        ids = tokenizer.encode(text)
        assert (backend.convert_tokens_to_ids("<think>") in ids) == (think_tokens and "<think>" in text)
        matcher = compiler.matcher_for(wrapped)
        ok = matcher.consume_tokens(ids) and not matcher.is_error()
        return ok and matcher.consume_token(sorted(tokenizer.eos_token_ids)[0]) and not matcher.is_error()

    assert accepts(opener + '\nIt is {"not": json} yet: any text.\n</think>\n\n{"city":"Oslo"}')
    assert not accepts(opener + "\nthinking\n</think>\n\n" + '{"town":"Oslo"}')  # the answer is constrained
    assert not accepts(opener + "\nthinking\n</think>\n\nOslo")
    assert not accepts(opener + "\nthinking never closed")
    assert accepts('{"city":"Oslo"}') != opened  # no reasoning: allowed unless the prompt opened it


def test_a_prompt_that_closed_the_reasoning_keeps_the_constraint_as_it_is(qwen3):
    from worker.output_parsers import OutputParsing

    tokenizer = HFTokenizer.from_pretrained(str(qwen3.path))
    answer = Constraint(ConstraintKind.JSON_OBJECT)
    closed = tokenizer.encode("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # enable_thinking: false
    parsing = OutputParsing.choose("none", "think", None)
    assert parsing.constrain_after_reasoning(SamplingParams(constraint=answer), closed, tokenizer).constraint == answer


def test_response_format_on_a_reasoning_model_constrains_the_answer(qwen3, tmp_path, monkeypatch):
    """The output forced to reason first: the reasoning is split off and the answer is the JSON. The real
    model, unforced: whatever it writes, the content after any reasoning follows the schema."""
    forced_text = '<think>\nOslo is the capital.\n</think>\n\n{"city":"Oslo"}'
    response_format = {"type": "json_schema", "json_schema": {"name": "city", "schema": ANSWER_SCHEMA}}
    force_texts(monkeypatch, {"Capital?": forced_text})
    out, _ = run(tmp_path, qwen3, [chat_line("forced", "Capital?", response_format=response_format)])
    [choice] = completions(out)["forced"].choices
    assert (choice.message.reasoning_content, choice.message.content) == ("Oslo is the capital.", '{"city":"Oslo"}')

    monkeypatch.undo()
    out, _ = run(tmp_path, qwen3, [chat_line("free", "Capital?", response_format=response_format, max_tokens=60)])
    [choice] = completions(out)["free"].choices
    assert choice.finish_reason == "stop"
    jsonschema.validate(json.loads(choice.message.content), ANSWER_SCHEMA)


def test_a_constraint_after_harmony_reasoning_fails_its_request_clearly(qwen3, tmp_path):
    response_format = {"type": "json_object"}
    out, _ = run(
        tmp_path, qwen3, [chat_line("h", "x", response_format=response_format), chat_line("ok", "y")],
        "--reasoning-parser", "harmony",
    )  # fmt: skip
    failed, ok = out
    assert failed["response"]["status_code"] == 400
    error = failed["response"]["body"]["error"]
    assert error["param"] == "response_format" and "harmony reasoning format cannot be followed" in error["message"]
    assert ok["response"]["status_code"] == 200
