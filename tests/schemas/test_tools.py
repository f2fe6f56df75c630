"""`tool_choice` as plans and constraints (schemas/tools.py), and the parsed parts of a chat result in the
OpenAI output (schemas/result.py)."""

import json

import llguidance
import pytest
from openai.types.chat import ChatCompletion

from schemas.constraint import AFTER_REASONING, compile_error, grammar_text
from schemas.lines import parse_request_line
from schemas.openai_body import ChatCompletionBody
from schemas.result import ResultLine, Sample, to_openai_output
from schemas.tools import Tool, forced_call, required_calls_schema

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: any object


def body(**fields):
    return {"messages": [{"role": "user", "content": "q"}], "tools": [WEATHER, TIME], **fields}


@pytest.mark.parametrize(
    "choice, mode, name",
    [
        (None, "auto", None),  # the default when tools are given
        ("auto", "auto", None),
        ("required", "required", None),  # several tools: an array of calls
        ({"type": "function", "function": {"name": "get_time"}}, "named", "get_time"),
    ],
)
def test_tool_choice_plans(choice, mode, name):
    plan = ChatCompletionBody.model_validate(body(**({} if choice is None else {"tool_choice": choice}))).tool_call()
    assert (plan.mode, plan.name) == (mode, name)
    assert plan.is_forced == (mode != "auto")


def test_none_shows_the_tools_and_plans_no_call():
    assert forced_call([Tool.model_validate(WEATHER)], "none") is None
    assert ChatCompletionBody.model_validate(body(tool_choice="none")).output_constraint() is None


def test_auto_constrains_nothing_and_takes_a_response_format():
    parsed = ChatCompletionBody.model_validate(body(response_format={"type": "json_object"}))
    assert parsed.output_constraint().kind == "json_object"


def matches(grammar: str, text: str) -> bool:
    """Whether `text` is a complete output of `grammar`, over a vocabulary of single bytes."""
    from worker.engine.grammar import _build_llg_tokenizer
    from worker.engine.tokenizer import ByteTokenizer

    tokenizer = ByteTokenizer(add_bos=False)
    matcher = llguidance.LLMatcher(
        _build_llg_tokenizer(tokenizer, tokenizer.vocab_size, [tokenizer.eos_token_id]), grammar, log_level=0
    )
    ok = matcher.consume_tokens(tokenizer.encode(text)) and not matcher.is_error()
    return ok and matcher.consume_token(tokenizer.eos_token_id) and not matcher.is_error()


@pytest.mark.parametrize("parallel", [True, False])
def test_required_among_several_tools_is_an_array_of_calls_to_those_tools(parallel):
    fields = {"tool_choice": "required", **({} if parallel else {"parallel_tool_calls": False})}
    constraint = ChatCompletionBody.model_validate(body(**fields)).output_constraint()
    tools = [Tool.model_validate(t) for t in (WEATHER, TIME)]
    assert json.loads(constraint.spec) == required_calls_schema(tools, parallel)
    grammar = grammar_text(llguidance, constraint.kind, constraint.spec)
    one = '{"name":"get_weather","parameters":{"city":"Oslo"}}'
    assert matches(grammar, f"[{one}]")
    assert matches(grammar, f'[{one},{{"name":"get_time","parameters":{{}}}}]') == parallel
    assert not matches(grammar, "[]")
    assert not matches(grammar, '[{"name":"get_news","parameters":{}}]')  # not a tool
    assert not matches(grammar, '[{"name":"get_weather","parameters":{"town":"Oslo"}}]')  # not its schema


def test_a_schema_may_not_use_the_worker_envelope_key():
    assert "reserved" in compile_error("json_schema", json.dumps({AFTER_REASONING: {}}))
    line = {
        "custom_id": "c",
        "method": "POST",
        "url": "/v1/chat/completions",
        "body": {
            "messages": [{"role": "user", "content": "q"}],
            "response_format": {"type": "json_schema", "json_schema": {"name": "n", "schema": {AFTER_REASONING: 1}}},
        },
    }
    with pytest.raises(ValueError, match="reserved"):
        parse_request_line(json.dumps(line), 1)


def chat_request(**fields):
    line = {"custom_id": "c", "method": "POST", "url": "/v1/chat/completions", "body": body(**fields)}
    return parse_request_line(json.dumps(line), 1).resolve(3)


CALL = {"id": "call_b1-3_0_0", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Oslo"}'}}


def openai_choices(result: ResultLine, request) -> list:
    out = to_openai_output(result, request, "b1", "m", 1)
    return ChatCompletion.model_validate(out.response.body).choices


def test_parsed_calls_and_reasoning_in_the_openai_message():
    result = ResultLine(
        index=3, text="<think>r</think><tool_call>...</tool_call>", finish_reason="stop",
        reasoning_content="r", tool_calls=[CALL],
    )  # fmt: skip
    [choice] = openai_choices(result, chat_request())
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    assert choice.message.reasoning_content == "r"
    assert [c.model_dump() for c in choice.message.tool_calls] == [CALL]
    # Cut short: the calls that parsed are given, the reason stays "length".
    [choice] = openai_choices(result.model_copy(update={"finish_reason": "length"}), chat_request())
    assert choice.finish_reason == "length" and len(choice.message.tool_calls) == 1


def test_reasoning_alone_and_nothing_parsed():
    result = ResultLine(index=3, text="<think>r</think>answer", finish_reason="stop", content="answer", reasoning_content="r")
    [choice] = openai_choices(result, chat_request())
    assert (choice.message.content, choice.message.reasoning_content, choice.finish_reason) == ("answer", "r", "stop")
    [choice] = openai_choices(ResultLine(index=3, text="plain", finish_reason="stop"), chat_request())
    assert choice.message.content == "plain" and "reasoning_content" not in choice.message.model_dump()


def test_a_named_call_after_reasoning_takes_the_answer_as_its_arguments():
    request = chat_request(tool_choice={"type": "function", "function": {"name": "get_weather"}})
    result = ResultLine(
        index=3, text='<think>r</think>{"city":"Oslo"}', finish_reason="stop", content='{"city":"Oslo"}',
        reasoning_content="r",
    )  # fmt: skip
    [choice] = openai_choices(result, request)
    assert choice.finish_reason == "stop" and choice.message.reasoning_content == "r"
    [call] = choice.message.tool_calls
    assert (call.id, call.function.arguments) == ("call_b1-3_0", '{"city":"Oslo"}')


def test_each_sample_has_its_own_parsed_parts():
    samples = [
        Sample(index=0, text="a", finish_reason="stop", tool_calls=[CALL]),
        Sample(index=1, text="plain", finish_reason="stop"),
    ]
    result = ResultLine(index=3, text="a", finish_reason="stop", tool_calls=[CALL], samples=samples)
    first, second = openai_choices(result, chat_request())
    assert first.finish_reason == "tool_calls" and first.message.tool_calls
    assert (second.finish_reason, second.message.content, second.message.tool_calls) == ("stop", "plain", None)
