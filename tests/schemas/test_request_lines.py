import json

import pytest

from schemas.chat import ChatMessage
from schemas.lines import ParsedRequest, Request, parse_request_line
from schemas.sampling import Sampling


def parse(obj, line_no=7) -> ParsedRequest:
    return parse_request_line(json.dumps(obj), line_no)


def error_of(obj_or_text, line_no=7) -> str:
    text = obj_or_text if isinstance(obj_or_text, str) else json.dumps(obj_or_text)
    with pytest.raises(ValueError) as info:
        parse_request_line(text, line_no)
    return str(info.value)


# --- valid shapes --------------------------------------------------------------------------------------------


def test_simple_prompt_line_with_sampling_fields():
    p = parse(
        {
            "prompt": "hi",
            "custom_id": "a",
            "max_new_tokens": 5,
            "temperature": 0.5,
            "top_p": 0.9,
            "top_k": 3,
            "seed": 1,
            "stop": ["x", "y"],
            "stop_token_ids": [2],
            "ignore_eos": True,
        }
    )
    assert (p.shape, p.prompt, p.custom_id, p.line_no) == ("prompt", "hi", "a", 7)
    assert p.overrides.given() == {
        "max_new_tokens": 5,
        "temperature": 0.5,
        "top_p": 0.9,
        "top_k": 3,
        "seed": 1,
        "stop": ["x", "y"],
        "stop_token_ids": [2],
        "ignore_eos": True,
    }


def test_single_stop_string_becomes_a_list_and_int_temperature_is_a_float():
    p = parse({"prompt": "hi", "stop": "\n", "temperature": 1})
    assert p.overrides.stop == ["\n"]
    assert p.overrides.temperature == 1.0


def test_chat_line():
    p = parse({"messages": [{"role": "system", "content": "s"}, {"role": "user", "content": "u"}]})
    assert p.shape == "chat"
    assert p.messages == [ChatMessage(role="system", content="s"), ChatMessage(role="user", content="u")]
    assert p.custom_id is None


def test_openai_completion_line():
    p = parse(
        {
            "custom_id": "c1",
            "method": "POST",
            "url": "/v1/completions",
            "body": {"model": "m", "prompt": "p", "max_tokens": 9, "temperature": 0.2, "stop": "END", "n": 1},
        }
    )
    assert (p.shape, p.url, p.model, p.prompt, p.custom_id) == ("openai", "/v1/completions", "m", "p", "c1")
    assert p.overrides.given() == {"max_new_tokens": 9, "temperature": 0.2, "stop": ["END"]}


def test_openai_chat_line_with_max_completion_tokens_and_top_k():
    p = parse(
        {
            "custom_id": "c2",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"messages": [{"role": "user", "content": "q"}], "max_completion_tokens": 4, "top_k": 5},
        }
    )
    assert p.messages[0].content == "q"
    assert p.overrides.given() == {"max_new_tokens": 4, "top_k": 5}


def test_n_is_taken_from_every_line_shape_and_stored():
    chat = [{"role": "user", "content": "q"}]
    assert parse({"prompt": "p"}).resolve(0).n == 1
    assert parse({"prompt": "p", "n": 3}).resolve(0).n == 3
    assert parse({"messages": chat, "n": 128}).resolve(0).n == 128
    for url, body in [("/v1/completions", {"prompt": "p"}), ("/v1/chat/completions", {"messages": chat})]:
        line = {"custom_id": "c", "method": "POST", "url": url, "body": {**body, "n": 4}}
        stored = parse(line).resolve(0)
        assert stored.n == 4 and Request.model_validate_json(stored.model_dump_json()).n == 4


def test_blank_lines_are_skipped():
    assert parse_request_line("", 1) is None
    assert parse_request_line("   \t", 2) is None


def test_resolve_line_values_win_over_batch_defaults_which_win_over_builtins():
    p = parse({"prompt": "hi", "temperature": 0.3})
    r = p.resolve(index=4, defaults=Sampling(temperature=1.0, max_new_tokens=9))
    assert r.index == 4 and r.line_no == 7
    assert r.sampling == Sampling(temperature=0.3, max_new_tokens=9)
    assert p.resolve(0).sampling == Sampling(temperature=0.3)


def test_stored_request_round_trips_through_json():
    r = parse({"messages": [{"role": "user", "content": "u"}], "stop": "x"}).resolve(3, return_token_ids=True)
    again = Request.model_validate_json(r.model_dump_json(exclude_defaults=True))
    assert again == r and again.is_chat


def test_chat_template_kwargs_on_chat_lines_and_bodies_are_stored_with_the_request():
    kwargs = {"enable_thinking": False, "reasoning": "low", "depth": 2, "temperature_hint": 0.5, "x": None}
    chat = {"messages": [{"role": "user", "content": "u"}], "chat_template_kwargs": kwargs}
    for obj in (chat, openai_line(chat, "/v1/chat/completions")):
        r = parse(obj).resolve(0)
        assert r.chat_template_kwargs == kwargs
        again = Request.model_validate_json(r.model_dump_json(exclude_defaults=True))
        assert again == r and again.chat_template_kwargs["enable_thinking"] is False


@pytest.mark.parametrize(
    "kwargs, expected",
    [
        ({"tokenize": True}, "tokenize cannot be set here (the chat template's own inputs)"),
        ({"1abc": True}, "chat_template_kwargs.1abc.[key]: String should match pattern"),
        ({"tools": {"a": 1}}, "chat_template_kwargs.tools.bool: Input should be a valid boolean"),
        ({f"k{i}": 1 for i in range(17)}, "chat_template_kwargs: Dictionary should have at most 16 items"),
    ],
)
def test_bad_chat_template_kwargs_name_line_and_field(kwargs, expected):
    message = error_of({"messages": [{"role": "user", "content": "u"}], "chat_template_kwargs": kwargs})
    assert message.startswith("line 7: ") and expected in message, message


def test_a_batchs_chat_template_kwargs_reach_its_chats_and_a_lines_own_win():
    chat = parse({"messages": [{"role": "user", "content": "u"}], "chat_template_kwargs": {"a": 1, "b": 2}})
    batch = {"b": 0, "c": True}
    assert chat.resolve(0, chat_template_kwargs=batch).chat_template_kwargs == {"a": 1, "b": 2, "c": True}
    assert parse({"prompt": "x"}).resolve(0, chat_template_kwargs=batch).chat_template_kwargs is None
    assert parse({"messages": [{"role": "user", "content": "u"}]}).resolve(0).chat_template_kwargs is None


def test_tool_use_transcripts_are_taken_and_given_to_templates_with_object_arguments():
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}}
    messages = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]
    parsed = parse(openai_line({"messages": messages}, "/v1/chat/completions")).resolve(0)
    templated = [m.for_template() for m in parsed.messages]
    assert templated[1] == {"role": "assistant", "tool_calls": [dict(call, function={"name": "f", "arguments": {"x": 1}})]}
    assert templated[2] == {"role": "tool", "content": "42", "tool_call_id": "c1"}
    assert Request.model_validate_json(parsed.model_dump_json()) == parsed


def test_unsupported_fields_at_their_empty_or_default_values_ask_for_nothing():
    body = {"prompt": "x", "logit_bias": {}, "functions": [], "modalities": ["text"], "web_search_options": None}
    assert parse(openai_line(body)).prompt == "x"
    assert "cbq does not support output modalities" in error_of(openai_line({"prompt": "x", "modalities": ["audio"]}))
    assert "cbq does not support web search" in error_of(openai_line({"prompt": "x", "web_search_options": {}}))


def test_a_message_copied_from_an_openai_response_and_participant_names_are_taken():
    reply = {"role": "assistant", "content": "hi", "refusal": None, "annotations": []}
    named = {"role": "user", "name": "alice", "content": "u"}
    parsed = parse(openai_line({"messages": [named, reply]}, "/v1/chat/completions")).resolve(0)
    assert [m.for_template() for m in parsed.messages] == [named, {"role": "assistant", "content": "hi"}]
    assert "messages[0].refusal: Input should be None" in error_of({"messages": [dict(reply, refusal="no")]})


@pytest.mark.parametrize(
    "message, expected",
    [
        ({"role": "user", "content": "u", "tool_calls": []}, "tool_calls: List should have at least 1 item"),
        (
            {"role": "user", "content": "u", "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            "messages[0]: only an assistant message has tool_calls",
        ),
        ({"role": "tool", "content": "42"}, "messages[0]: a tool message has a tool_call_id, and only a tool message"),
        ({"role": "assistant", "content": None}, "messages[0]: content is required (it may be null only beside tool_calls)"),
    ],
)
def test_bad_tool_use_messages_name_the_message(message, expected):
    assert expected in error_of({"messages": [message]})


def test_completion_lines_take_no_chat_template_kwargs():
    assert "unknown or unsupported field" in error_of({"prompt": "x", "chat_template_kwargs": {"a": 1}})
    body = {"prompt": "x", "chat_template_kwargs": {"a": 1}}
    assert "body.chat_template_kwargs: unknown or unsupported field" in error_of(openai_line(body))


# --- invalid lines: every error names the line and the field -------------------------------------------------


@pytest.mark.parametrize(
    "obj, expected",
    [
        (
            {"prompt": "x", "temperature": -1},
            "line 7: temperature: Input should be greater than or equal to 0",
        ),
        (
            {"prompt": "x", "max_new_tokens": 0},
            "line 7: max_new_tokens 0 generates nothing: it is for scoring the prompt, with prompt_logprobs",
        ),
        ({"prompt": "x", "top_p": 0}, "line 7: top_p: Input should be greater than 0"),
        ({"prompt": "x", "top_p": 1.5}, "line 7: top_p: Input should be less than or equal to 1"),
        ({"prompt": "x", "top_k": -2}, "line 7: top_k: Input should be greater than or equal to 0"),
        ({"prompt": "x", "temperature": "0.5"}, "line 7: temperature: Input should be a valid number"),
        ({"prompt": "x", "ignore_eos": 1}, "line 7: ignore_eos: Input should be a valid boolean"),
        ({"prompt": "x", "n": 0}, "line 7: n: Input should be greater than or equal to 1"),
        ({"messages": [{"role": "user", "content": "x"}], "n": 129}, "line 7: n: Input should be less than or equal to 128"),
        ({"prompt": "x", "stop": [1]}, "line 7: stop[0]: Input should be a valid string"),
        (
            {"prompt": "x", "stop_token_ids": [-1]},
            "line 7: stop_token_ids[0]: Input should be greater than or equal to 0",
        ),
        ({"prompt": 3}, "line 7: prompt: Input should be a valid string"),
        ({"prompt": "x", "custom_id": ""}, "line 7: custom_id: String should have at least 1 character"),
        ({"messages": []}, "line 7: messages: List should have at least 1 item after validation, not 0"),
        (
            {"messages": [{"role": "bot", "content": "x"}]},
            "line 7: messages[0].role: Input should be 'system', 'user', 'assistant' or 'tool'",
        ),
        ({"messages": [{"role": "user"}]}, "line 7: messages[0]: content is required (it may be null only beside tool_calls)"),
        ({"prompt": "x", "messages": []}, "line 7: give either prompt or messages, not both"),
        ({"text": "x"}, 'line 7: expected {"prompt": ...}, {"messages": [...]}, {"input": ...} (embeddings), or an OpenAI Batch line'),
    ],
)
def test_simple_and_chat_errors(obj, expected):
    assert error_of(obj).startswith(expected)


def test_unknown_field_lists_the_allowed_ones():
    message = error_of({"prompt": "x", "temprature": 1})
    assert message.startswith("line 7: temprature: unknown or unsupported field (allowed: ")
    assert "temperature" in message


def test_invalid_json_and_non_objects():
    assert error_of("{bad", 3).startswith("line 3: invalid JSON: Expecting property name")
    assert error_of("[1, 2]", 4) == "line 4: a line must be a JSON object, got list"
    assert error_of("null", 5) == "line 5: a line must be a JSON object, got NoneType"
    assert error_of('{"prompt": "x", "temperature": NaN}').startswith(
        "line 7: temperature: Input should be a finite"
    )


TOOLS = [
    {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}},
    {"type": "function", "function": {"name": "g"}},
]


def NAMED(name):  # noqa: N802 - reads as the constant it builds
    return {"type": "function", "function": {"name": name}}


def openai_line(body, url="/v1/completions", **envelope):
    return {"custom_id": "c", "method": "POST", "url": url, "body": body, **envelope}


@pytest.mark.parametrize(
    "obj, expected",
    [
        (
            openai_line({"prompt": "x", "temperature": -1}),
            "line 7: body.temperature: Input should be greater than or equal to 0",
        ),
        (openai_line({"prompt": "x", "n": 129}), "line 7: body.n: Input should be less than or equal to 128"),
        (openai_line({"prompt": "x", "n": 0}), "line 7: body.n: Input should be greater than or equal to 1"),
        (openai_line({"prompt": "x", "stream": True}), "line 7: body.stream: only false is accepted"),
        (
            openai_line({"prompt": "x", "frequency_penalty": 2.5}),
            "line 7: body.frequency_penalty: Input should be less than or equal to 2",
        ),
        # completions take logprobs as a count of alternatives, chat as true + top_logprobs
        (openai_line({"prompt": "x", "logprobs": True}), "line 7: body.logprobs: Input should be a valid integer"),
        (
            openai_line({"messages": [{"role": "user", "content": "x"}], "top_logprobs": 2}, "/v1/chat/completions"),
            "line 7: body: top_logprobs needs logprobs: true",
        ),
        (
            openai_line({"prompt": "x", "response_format": {"type": "yaml"}}),
            "line 7: body.response_format.type: Input should be 'text', 'json_object' or 'json_schema'",
        ),
        (
            openai_line({"messages": [{"role": "user", "content": "x"}], "tool_choice": "none"}, "/v1/chat/completions"),
            "line 7: body: tool_choice needs tools",
        ),
        (
            openai_line(
                {"messages": [{"role": "user", "content": "x"}], "tools": TOOLS, "tool_choice": NAMED("h"), },
                "/v1/chat/completions",
            ),
            "line 7: body: tool_choice names 'h', which is not in tools",
        ),
        (
            openai_line(
                {
                    "messages": [{"role": "user", "content": "x"}],
                    "tools": TOOLS,
                    "tool_choice": NAMED("f"),
                    "response_format": {"type": "json_object"},
                },
                "/v1/chat/completions",
            ),
            "line 7: body: give response_format or a forced tool call, not both",
        ),
        (
            openai_line(
                {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function", "function": {"name": "a b"}}]},
                "/v1/chat/completions",
            ),
            "line 7: body.tools[0].function.name: String should match pattern",
        ),
        (
            openai_line(
                {
                    "messages": [{"role": "user", "content": "x"}],
                    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "objekt"}}}],
                },
                "/v1/chat/completions",
            ),
            "line 7: body.tools[0].function.parameters: does not compile: Invalid type: objekt",
        ),
        (openai_line({"prompt": "x", "tools": TOOLS}), "line 7: body.tools: unknown or unsupported field"),
        (
            openai_line({"messages": [{"role": "user", "content": "x"}], "reasoning_effort": "max"}, "/v1/chat/completions"),
            "line 7: body.reasoning_effort: Input should be 'none', 'minimal', 'low', 'medium' or 'high'",
        ),
        (
            openai_line({"prompt": "x", "reasoning_effort": "low"}),  # a chat template's variable: chats only
            "line 7: body.reasoning_effort: unknown or unsupported field",
        ),
        (
            openai_line(
                {
                    "messages": [{"role": "user", "content": "x"}],
                    "tools": TOOLS,
                    "tool_choice": NAMED("f"),
                    "guided_regex": "a+",
                },
                "/v1/chat/completions",
            ),
            "line 7: body: give structured_outputs (or guided_*) or a forced tool call, not both",
        ),
        (
            openai_line({"prompt": "x", "stream_options": {"include_usage": True}}),
            "line 7: body.stream_options: only null is accepted (batch results are not streamed)",
        ),
        (
            openai_line({"prompt": "x", "audio": {"voice": "alloy"}}),
            "line 7: body.audio: cbq does not support audio output yet",
        ),
        (
            openai_line({"prompt": "x", "logit_bias": {"50256": -101}}),
            "line 7: body.logit_bias[50256]: Input should be greater than or equal to -100",
        ),
        (
            openai_line(
                {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
                "/v1/chat/completions",
            ),
            "line 7: body.messages[0]: content[0].image_url.url: an image url is a data: URL (base64), an http(s) "
            "URL or a file: URL",
        ),
        (
            openai_line(
                {"messages": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
                "/v1/chat/completions",
            ),
            "line 7: body.messages[0]: content parts of type 'input_audio' are not supported: cbq takes text and "
            "image_url",
        ),
        (
            openai_line({"prompt": "x", "best_of": 2}),
            "line 7: body.best_of: unknown or unsupported field (allowed: model, n, stream,",
        ),
        (
            openai_line({"prompt": ["a", 5]}),
            "line 7: body.prompt: each prompt of a list is a string or a non-empty list of token ids",
        ),
        (
            openai_line({"messages": [{"role": "user", "content": "x"}]}),
            "line 7: body.prompt: Field required",
        ),
        (
            openai_line({"prompt": "x"}, url="/v1/chat/completions"),
            "line 7: body.messages: Field required",
        ),
        (
            openai_line({"prompt": "x", "max_tokens": 3, "max_completion_tokens": 3}),
            "line 7: body: give max_tokens or max_completion_tokens, not both",
        ),
        (
            openai_line({"prompt": "x"}, url="/v1/moderations"),  # fails alone (InvalidRequest), as in vLLM
            "line 7: url: cbq serves /v1/completions, /v1/chat/completions, /v1/responses and /v1/embeddings, not '/v1/moderations'",
        ),
        (openai_line({"prompt": "x"}, method="GET"), "line 7: method: Input should be 'POST'"),
        (
            {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
            "line 7: custom_id: Field required",
        ),
        (openai_line("not an object"), "line 7: body: Input should be a valid dictionary"),
    ],
)
def test_openai_errors(obj, expected):
    assert error_of(obj).startswith(expected)


def test_error_carries_line_field_and_all_issues():
    with pytest.raises(ValueError) as info:
        parse_request_line(json.dumps({"prompt": "x", "temperature": -1, "top_p": 2}), 12)
    error = info.value
    assert error.line_no == 12
    assert error.field == "temperature"
    assert error.message == "Input should be greater than or equal to 0"
    assert [i.field for i in error.issues] == ["temperature", "top_p"]
    assert str(error).splitlines()[1] == "line 12: top_p: Input should be less than or equal to 1"


def test_vllm_spellings_on_cbq_lines():
    from schemas.errors import InvalidRequest
    from schemas.lines import parse_request_line

    line = parse_request_line('{"prompt": "a", "max_tokens": 3, "top_k": -1}', 1)
    assert line.overrides.given() == {"max_new_tokens": 3, "top_k": 0}  # -1: no top-k, as vLLM's
    chat = parse_request_line('{"messages": [{"role": "user", "content": "a"}], "max_tokens": 0, "prompt_logprobs": 1}', 1)
    assert chat.overrides.max_new_tokens == 0
    body = '{"custom_id": "x", "method": "POST", "url": "/v1/completions", "body": {"prompt": "a", "top_k": -1}}'
    assert parse_request_line(body, 1).overrides.top_k == 0
    for bad in ('{"prompt": "a", "max_tokens": 3, "max_new_tokens": 3}', '{"prompt": "a", "top_k": -2}'):
        with pytest.raises(InvalidRequest):
            parse_request_line(bad, 1)
