"""`/v1/responses` lines (schemas/responses_body.py) and their Response objects (schemas/responses_output.py):
each field maps onto the chat request it means, each refusal names its line and field, and every Response parses
with the `openai` package's own type, its fields as the request gave them."""

from __future__ import annotations

import json

import pytest
from openai.types.responses import Response

from schemas.errors import InvalidRequest
from schemas.lines import Request, parse_request_line
from schemas.media import image_refs
from schemas.output_parts import ToolCall
from schemas.result import ResultLine, Usage, to_openai_output
from schemas.sampling import OutputConstraint

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}
TIME = {"type": "function", "name": "get_time", "parameters": {"type": "object"}}


def line(body, custom_id="r1"):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": {"model": "m", **body}}


def request_of(body, line_no=3) -> Request:
    parsed = parse_request_line(json.dumps(line(body)), line_no)
    assert parsed is not None
    return parsed.resolve(0)


def refusal(body, line_no=7) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        parse_request_line(json.dumps(line(body)), line_no)
    assert info.value.custom_id == "r1" and info.value.url == "/v1/responses"  # it fails alone
    return info.value


# --- input -----------------------------------------------------------------------------------------------------


def test_a_string_input_is_one_user_message_and_instructions_a_system_message_before_it():
    request = request_of({"input": "Hi", "instructions": "Be brief."})
    assert [m.for_template() for m in request.messages or ()] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    assert (request.shape, request.url, request.model, request.is_chat) == ("openai", "/v1/responses", "m", True)


def test_message_items_in_every_form_map_to_chat_messages():
    items = [
        {"role": "developer", "content": "Rules."},
        {"type": "message", "role": "system", "content": [{"type": "input_text", "text": "More rules."}]},
        {"role": "user", "content": [{"type": "input_text", "text": "a"}, {"type": "input_text", "text": "b"}]},
        {  # a previous Response's message item, appended as it came
            "type": "message",
            "id": "msg_1",
            "role": "assistant",
            "status": "completed",
            "content": [{"type": "output_text", "text": "Hello.", "annotations": []}],
        },
        {"role": "assistant", "content": "Plain."},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        {"role": "user", "content": "Again"},
    ]
    messages = [m.for_template() for m in request_of({"input": items}).messages or ()]
    assert messages == [
        {"role": "system", "content": "Rules."},
        {"role": "system", "content": "More rules."},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "Hello."},
        {"role": "assistant", "content": "Plain."},
        {"role": "user", "content": "Again"},  # the reasoning item is left out, as chat templates leave it
    ]


def test_input_image_parts_are_the_chats_image_url_parts_in_place():
    image = "data:image/png;base64,iVBORw0KGgo="
    items = [
        {"role": "user", "content": [
            {"type": "input_text", "text": "Compare"},
            {"type": "input_image", "image_url": image, "detail": "high"},
            {"type": "input_image", "image_url": "https://example.com/b.png"},
            {"type": "input_text", "text": "which is brighter?"},
        ]},
        {"role": "user", "content": "and no image here"},
    ]  # fmt: skip
    request = request_of({"input": items, "instructions": "Be brief."})
    body = request.messages or ()
    assert [m.model_dump(exclude_none=True) for m in body][1]["content"] == [
        {"type": "text", "text": "Compare"},
        {"type": "image_url", "image_url": {"url": image, "detail": "high"}},
        {"type": "image_url", "image_url": {"url": "https://example.com/b.png"}},
        {"type": "text", "text": "which is brighter?"},
    ]
    assert [m.for_template()["content"] for m in body][1] == [
        {"type": "text", "text": "Compare"}, {"type": "image"}, {"type": "image"},
        {"type": "text", "text": "which is brighter?"},
    ]  # fmt: skip
    assert body[2].content == "and no image here"
    assert [(ref.param, ref.url) for ref in image_refs(request.messages)] == [
        ("messages[1].content[1].image_url.url", image),
        ("messages[1].content[2].image_url.url", "https://example.com/b.png"),
    ]


def test_function_call_items_are_the_assistants_tool_calls_and_their_outputs_tool_messages():
    items = [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call", "call_id": "c2", "name": "get_weather", "arguments": '{"city": "Rome"}',
         "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "rain"}]},
        {"type": "function_call", "call_id": "c3", "name": "get_time", "arguments": "{}"},
    ]  # fmt: skip
    messages = [m.for_template() for m in request_of({"input": items, "tools": [WEATHER, TIME]}).messages or ()]
    call = lambda i, name, args: {"id": i, "type": "function", "function": {"name": name, "arguments": args}}  # noqa: E731
    assert messages == [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        {
            "role": "assistant",
            "content": "Checking.",
            "tool_calls": [call("c1", "get_weather", {"city": "Paris"}), call("c2", "get_weather", {"city": "Rome"})],
        },
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        {"role": "tool", "tool_call_id": "c2", "content": "rain"},
        {"role": "assistant", "tool_calls": [call("c3", "get_time", {})]},
    ]


# --- sampling, format, tools, reasoning ------------------------------------------------------------------------


def test_sampling_fields_and_the_token_limit():
    request = request_of(
        {"input": "x", "max_output_tokens": 40, "temperature": 0.3, "top_p": 0.8, "top_k": 5, "seed": 9}
    )
    assert request.sampling.given() == {"max_new_tokens": 40, "temperature": 0.3, "top_p": 0.8, "top_k": 5, "seed": 9}


@pytest.mark.parametrize(
    "text, constraint",
    [
        ({"format": {"type": "text"}}, None),
        ({}, None),
        ({"format": {"type": "json_object"}}, OutputConstraint(kind="json_object")),
        (
            {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}},
            OutputConstraint(kind="json_schema", spec='{"type":"object"}'),
        ),
    ],
)
def test_text_format_is_the_output_constraint(text, constraint):
    assert request_of({"input": "x", "text": text}).sampling.constraint == constraint


def test_function_tools_reach_the_template_in_chats_shape_and_tool_choice_plans_the_call():
    request = request_of({"input": "x", "tools": [WEATHER, TIME]})
    assert request.tools == [
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}},
        {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object"}}},
    ]
    assert request.tool_call is not None and request.tool_call.mode == "auto" and request.sampling.constraint is None
    assert request_of({"input": "x", "tools": [WEATHER], "tool_choice": "none"}).tool_call is None
    named = request_of({"input": "x", "tools": [WEATHER, TIME], "tool_choice": {"type": "function", "name": "get_weather"}})
    assert named.tool_call is not None and (named.tool_call.mode, named.tool_call.name) == ("named", "get_weather")
    assert named.sampling.constraint == OutputConstraint(kind="json_schema", spec=json.dumps(WEATHER["parameters"], separators=(",", ":")))
    required = request_of({"input": "x", "tools": [WEATHER, TIME], "tool_choice": "required", "parallel_tool_calls": False})
    assert required.tool_call is not None and (required.tool_call.mode, required.tool_call.name) == ("required", None)
    assert required.sampling.constraint is not None and '"maxItems":1' in required.sampling.constraint.spec


def test_reasoning_effort_is_the_templates_reasoning_effort_and_the_lines_template_kwargs_win():
    assert request_of({"input": "x", "reasoning": {"effort": "low", "summary": "auto"}}).chat_template_kwargs == {
        "reasoning_effort": "low"
    }
    both = {"input": "x", "reasoning": {"effort": "low"}, "chat_template_kwargs": {"reasoning_effort": "high", "t": 1}}
    assert request_of(both).chat_template_kwargs == {"reasoning_effort": "high", "t": 1}
    assert request_of({"input": "x", "reasoning": {"summary": "auto"}}).chat_template_kwargs is None


def test_fields_that_change_nothing_are_accepted():
    request = request_of(
        {
            "input": "x",
            "store": True,
            "metadata": {"k": "v"},
            "user": "u",
            "service_tier": "auto",
            "safety_identifier": "s",
            "prompt_cache_key": "p",
            "prompt_cache_retention": "24h",
            "stream": False,
            "background": False,
            "truncation": "disabled",
            "parallel_tool_calls": True,
            "include": ["reasoning.encrypted_content"],
            "text": {"verbosity": "medium"},
        }
    )
    assert request.sampling.given() == {} and request.responses is not None
    assert request_of({"input": "x", "store": False}).sampling.given() == {}


# --- refusals: the line and the field, in one line -------------------------------------------------------------


@pytest.mark.parametrize(
    "body, field, code, words",
    [
        ({"input": "x", "previous_response_id": "resp_1"}, "body.previous_response_id", "unsupported_parameter",
         "a batch has no conversation state"),
        ({"input": "x", "conversation": "conv_1"}, "body.conversation", "unsupported_parameter", "conversation state"),
        ({"input": "x", "prompt": {"id": "pmpt_1"}}, "body.prompt", "unsupported_parameter", "prompt templates"),
        ({"input": "x", "max_tool_calls": 2}, "body.max_tool_calls", "unsupported_parameter", "max_tool_calls"),
        ({"input": "x", "stream": True}, "body.stream", "invalid_value", "not streamed"),
        ({"input": "x", "background": True}, "body.background", "invalid_value", "already runs in the background"),
        ({"input": "x", "truncation": "auto"}, "body.truncation", "invalid_value", "never drops input items"),
        ({"input": "x", "prompt_logprobs": 1}, "body.prompt_logprobs", "unsupported_parameter", "no place for them"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "file_id": "file_1"}]}]},
         "body.input[0].message.content[0].input_image", "unsupported_parameter", "input_image file_id (give the image"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "detail": "low"}]}]},
         "body.input[0].message.content[0].input_image", "invalid_value", "an input_image part needs image_url"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "ftp://x/y.png"}]}]},
         "body", "invalid_value", "an image url is a data: URL"),
        ({"input": [{"role": "system", "content": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
         "body", "invalid_value", "only a user message may hold image_url parts"),
        ({"input": [{"type": "function_call_output", "call_id": "c",
                     "output": [{"type": "input_image", "image_url": "https://x/y.png"}]}]},
         "body.input[0].function_call_output.output", "unsupported_parameter", "input_image content outside a message"),
        ({"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
         "body.input[0].message.content", "unsupported_parameter", "input_file content"),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file", "file_id": "f"}]}]},
         "body.input[0].function_call_output.output", "unsupported_parameter", "input_file"),
        ({"input": [{"type": "item_reference", "id": "msg_1"}]}, "body.input", "unsupported_parameter",
         "item_reference input items"),
        ({"input": [{"role": "user", "content": [{"type": "output_text", "text": "a"}]}]}, "body.input[0].message",
         "invalid_value", "output_text parts are an assistant's"),
        ({"input": [{"role": "tool", "content": "a"}]}, "body.input[0].message.role", "invalid_value", "Input should be"),
        ({"input": []}, "body.input", "invalid_value", "at least one message"),
        ({"instructions": "x"}, "body.input", "missing_required_parameter", "Field required"),
        ({"input": "x", "tools": [{"type": "web_search"}]}, "body.tools", "unsupported_parameter",
         "web_search tools (cbq runs function tools)"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "file_search"}}, "body.tool_choice",
         "unsupported_parameter", "tool_choice of type file_search"),
        ({"input": "x", "tool_choice": "required"}, "body", "invalid_value", "tool_choice needs tools"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "body",
         "invalid_value", "'nope', which is not in tools"),
        ({"input": "x", "tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
         "body", "invalid_value", "give text.format or a forced tool call, not both"),
        ({"input": "x", "text": {"format": {"type": "json_schema", "name": "a", "schema": {"type": "nope"}}}},
         "body.text.format.json_schema.schema", "invalid_value", ""),
        ({"input": "x", "text": {"verbosity": "low"}}, "body.text.verbosity", "invalid_value", "'medium'"),
        ({"input": "x", "max_output_tokens": 0}, "body", "invalid_value", "max_output_tokens"),
        ({"input": "x", "max_output_tokens": 4, "min_tokens": 5}, "body", "invalid_value", "max_output_tokens"),
        ({"input": "x", "include": ["file_search_call.results"]}, "body.include[0]", "invalid_value", "Input should be"),
        ({"input": "x", "n": 2}, "body.n", "unknown_parameter", "unknown or unsupported field"),
        ({"input": "x", "max_tokens": 2}, "body.max_tokens", "unknown_parameter", "unknown or unsupported field"),
    ],
)  # fmt: skip
def test_each_refusal_names_the_line_and_the_field(body, field, code, words):
    error = refusal(body)
    assert str(error).startswith(f"line 7: {field}: "), str(error)
    assert words in str(error) and "\n" not in str(error)
    assert error.code == code


def test_an_unknown_field_lists_the_accepted_ones_but_not_the_refused():
    message = str(refusal({"input": "x", "frobnicate": 1}))
    assert "max_output_tokens" in message and "instructions" in message and "previous_response_id" not in message


# --- the Response --------------------------------------------------------------------------------------------


def render(request: Request, **result) -> dict:
    fields = {"custom_id": "r1", "index": 0, "finish_reason": "stop", "usage": Usage(prompt_tokens=7, completion_tokens=5, cached_tokens=2)}
    out = to_openai_output(ResultLine(**(fields | result)), request, "b1", "served-name", 1700000000)
    assert out.response is not None and out.error is None and out.response.status_code == 200
    assert (out.id, out.custom_id, out.response.request_id) == ("batch_req_b1-0", "r1", "b1-0")
    return out.response.body


def sdk(body: dict) -> Response:
    """The body as the openai package's Response, strictly: dumping it back gives the same fields."""
    parsed = Response.model_validate(body)
    assert parsed.model_dump(mode="json", exclude_unset=True, by_alias=True) == body
    return parsed


def test_a_message_response_parses_with_the_sdk_and_repeats_the_request():
    body = {
        "input": "x",
        "instructions": "Be brief.",
        "max_output_tokens": 30,
        "temperature": 0.2,
        "top_p": 0.9,
        "metadata": {"k": "v"},
        "user": "u",
        "tools": [WEATHER],
        "tool_choice": "none",
        "text": {"format": {"type": "json_schema", "name": "p", "schema": {"type": "object"}, "strict": True}},
        "reasoning": {"effort": "low"},
        "parallel_tool_calls": False,
    }
    response = sdk(render(request_of(body), text='{"a": 1}'))
    assert (response.id, response.object, response.status, response.model) == ("resp_b1-0", "response", "completed", "served-name")
    assert response.created_at == 1700000000 and response.error is None and response.incomplete_details is None
    [message] = response.output
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert response.output_text == '{"a": 1}' and message.content[0].annotations == []
    assert (response.instructions, response.max_output_tokens, response.temperature, response.top_p) == (
        "Be brief.", 30, 0.2, 0.9,
    )  # fmt: skip
    assert response.metadata == {"k": "v"} and response.user == "u" and response.parallel_tool_calls is False
    assert response.tool_choice == "none" and response.reasoning is not None and response.reasoning.effort == "low"
    assert [t.model_dump(exclude_unset=True) for t in response.tools] == [WEATHER]
    assert response.text is not None and response.text.format is not None
    assert response.text.format.model_dump(by_alias=True, exclude_unset=True) == body["text"]["format"]
    usage = response.usage
    assert usage is not None
    assert (usage.input_tokens, usage.output_tokens, usage.total_tokens) == (7, 5, 12)
    assert usage.input_tokens_details.cached_tokens == 2 and usage.output_tokens_details.reasoning_tokens == 0


def test_defaults_are_repeated_as_openai_states_them():
    response = sdk(render(request_of({"input": "x"}), text="hi"))
    assert (response.tool_choice, response.tools, response.parallel_tool_calls) == ("auto", [], True)
    assert response.text is not None and response.text.format is not None and response.text.format.type == "text"
    assert response.temperature is None and response.instructions is None and response.reasoning is None


def test_a_response_cut_by_its_token_limit_is_incomplete():
    response = sdk(render(request_of({"input": "x", "max_output_tokens": 5}), text="abc", finish_reason="length"))
    assert response.status == "incomplete" and response.incomplete_details is not None
    assert response.incomplete_details.reason == "max_output_tokens"
    assert response.output[0].status == "incomplete"


def test_reasoning_and_parsed_calls_are_their_own_items():
    request = request_of({"input": "x", "tools": [WEATHER]})
    call = ToolCall(id="call_b1-0_0_0", function={"name": "get_weather", "arguments": '{"city": "Oslo"}'})
    body = render(request, text="<think>hm</think>...", reasoning_content="hm", content=None, tool_calls=[call],
                  usage=Usage(prompt_tokens=3, completion_tokens=9, reasoning_tokens=2))  # fmt: skip
    response = sdk(body)
    reasoning, function_call = response.output
    assert reasoning.type == "reasoning" and reasoning.summary == []
    assert reasoning.content is not None and [(c.type, c.text) for c in reasoning.content] == [("reasoning_text", "hm")]
    assert function_call.type == "function_call" and function_call.id == "fc_b1-0_0"
    assert (function_call.call_id, function_call.name, function_call.arguments) == (
        "call_b1-0_0_0", "get_weather", '{"city": "Oslo"}',
    )  # fmt: skip
    assert response.usage is not None and response.usage.output_tokens_details.reasoning_tokens == 2
    with_text = sdk(render(request, text="t", content="Sure.", tool_calls=[call]))
    assert [item.type for item in with_text.output] == ["message", "function_call"] and with_text.output_text == "Sure."


def test_a_forced_call_is_a_function_call_item_with_the_output_as_its_arguments():
    request = request_of({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "get_weather"}})
    response = sdk(render(request, text='{"city": "Oslo"}'))
    [item] = response.output
    assert item.type == "function_call" and (item.name, item.arguments) == ("get_weather", '{"city": "Oslo"}')
    assert item.call_id == "call_b1-0_0" and response.tool_choice.model_dump() == {"type": "function", "name": "get_weather"}


def test_output_logprobs_when_include_asks_for_them():
    request = request_of({"input": "x", "include": ["message.output_text.logprobs"], "top_logprobs": 1})
    assert request.sampling.logprobs == 1
    lp = {"token": "h", "logprob": -0.5, "bytes": [104], "top_logprobs": [{"token": "h", "logprob": -0.5, "bytes": [104]}]}
    response = sdk(render(request, text="h", logprobs=[lp]))
    [text] = response.output[0].content
    assert text.logprobs is not None and [t.model_dump() for t in text.logprobs] == [lp]
    assert response.top_logprobs == 1
    assert request_of({"input": "x", "top_logprobs": 1}).sampling.logprobs is None  # not included: not computed


def test_an_invalid_line_and_a_failed_request_give_openai_error_lines():
    with pytest.raises(InvalidRequest) as info:
        parse_request_line(json.dumps(line({"input": "x", "previous_response_id": "resp_1"})), 4)
    failed = ResultLine.of_invalid_request(0, info.value)
    out = to_openai_output(failed, request_of({"input": "x"}), "b1", "m", 1)
    assert out.response is not None and out.response.status_code == 400
    assert out.response.body["error"]["param"] == "previous_response_id"
    assert out.response.body["error"]["code"] == "unsupported_parameter"
    errored = to_openai_output(ResultLine(index=0, finish_reason="error", error="boom"), request_of({"input": "x"}), "b1", "m", 1)
    assert errored.response is None and errored.error is not None and errored.error.message == "boom"


def test_a_responses_output_items_appended_as_they_came_run_as_the_next_turns_input():
    request = request_of({"input": "x", "tools": [WEATHER]})
    call = ToolCall(id="call_b1-0_0_0", function={"name": "get_weather", "arguments": '{"city": "Oslo"}'})
    first = render(request, text="...", reasoning_content="hm", content="Checking.", tool_calls=[call])
    output = first["output"]
    assert [item["type"] for item in output] == ["reasoning", "message", "function_call"]
    items = [{"role": "user", "content": "x"}, *output, {"type": "function_call_output", "call_id": call.id, "output": "sunny"}]
    messages = [m.for_template() for m in request_of({"input": items, "tools": [WEATHER]}).messages or ()]
    assert messages == [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": "Checking.",
         "tool_calls": [{"id": call.id, "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "tool_call_id": call.id, "content": "sunny"},
    ]  # fmt: skip
