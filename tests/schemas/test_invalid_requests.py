"""Which bad lines refuse their file (format errors) and which fail alone (`InvalidRequest`), as OpenAI's Batch
API draws the line; and the result an invalid request gets."""

import json

import pytest

from schemas.errors import InvalidRequest, RequestLineError
from schemas.lines import Request, parse_request_line
from schemas.result import ResultLine, to_openai_output


def openai(body, url="/v1/chat/completions", **envelope):
    return {"custom_id": "c1", "method": "POST", "url": url, "body": body, **envelope}


CHAT = {"messages": [{"role": "user", "content": "hi"}]}

FORMAT_ERRORS = {
    "not JSON": "{oops",
    "not an object": "[1]",
    "no shape": {"text": "x"},
    "prompt and messages": {"prompt": "x", **CHAT},
    "no custom_id": {"method": "POST", "url": "/v1/completions", "body": {"prompt": "x"}},
    "empty custom_id": openai({"prompt": "x"}, "/v1/completions", custom_id=""),
    "a native custom_id too long": {"prompt": "x", "custom_id": "c" * 513},
    "wrong method": openai(CHAT, method="GET"),
    "wrong url and no custom_id": {"method": "POST", "url": "/v1/moderations", "body": CHAT},
    "body not an object": openai("x"),
    "unknown envelope key": openai(CHAT, extra=1),
}
# line -> (param, code) of the request's error
INVALID_REQUESTS = {
    "bad value": (openai({**CHAT, "temperature": -1}), "temperature", "invalid_value"),
    "unknown field": (openai({"prompt": "x", "best_of": 2}, "/v1/completions"), "best_of", "unknown_parameter"),
    "missing prompt": (openai({}, "/v1/completions"), "prompt", "missing_required_parameter"),
    "unsupported": (openai({**CHAT, "audio": {"voice": "x"}}), "audio", "unsupported_parameter"),
    "bad message": (openai({"messages": [{"role": "robot", "content": "x"}]}), "messages[0].role", "invalid_value"),
    "native line": ({"prompt": "x", "custom_id": "n1", "top_p": 0}, "top_p", "invalid_value"),
    "a url cbq does not serve": (openai(CHAT, url="/v1/moderations"), "url", "invalid_value"),  # as vLLM's run-batch
}


@pytest.mark.parametrize("case", list(FORMAT_ERRORS))
def test_a_format_error_refuses_the_file(case):
    line = FORMAT_ERRORS[case]
    with pytest.raises(RequestLineError) as info:
        parse_request_line(line if isinstance(line, str) else json.dumps(line), 3)
    assert not isinstance(info.value, InvalidRequest), str(info.value)
    assert str(info.value).startswith("line 3: ")


@pytest.mark.parametrize("case", list(INVALID_REQUESTS))
def test_an_invalid_body_fails_its_request_alone(case):
    line, param, code = INVALID_REQUESTS[case]
    with pytest.raises(InvalidRequest) as info:
        parse_request_line(json.dumps(line), 3)
    error = info.value
    assert (error.param, error.code) == (param, code)
    assert error.custom_id == line.get("custom_id") and error.url == line.get("url")


def test_the_result_of_an_invalid_request_is_openais_400():
    with pytest.raises(InvalidRequest) as info:
        parse_request_line(json.dumps(openai({**CHAT, "top_p": 2})), 5)
    result = ResultLine.of_invalid_request(4, info.value)
    assert (result.custom_id, result.index, result.finish_reason) == ("c1", 4, "error")
    assert result.error == "line 5: body.top_p: Input should be less than or equal to 1"
    assert (result.error_code, result.error_param) == ("invalid_value", "top_p")
    line = to_openai_output(result, Request(index=4, line_no=5, shape="prompt", prompt=""), "b", "m", 0)
    assert line.response is not None and line.response.status_code == 400 and line.is_failure
    assert line.response.body == {
        "error": {
            "message": "line 5: body.top_p: Input should be less than or equal to 1",
            "type": "invalid_request_error",
            "param": "top_p",
            "code": "invalid_value",
        }
    }


def test_the_prompts_of_a_request_merge_into_choice_groups():
    """OpenAI's order: with n = 2, choice i*2 + j is sample j of prompt i; usage sums; a failed prompt fails all."""
    from schemas.lines import ChoiceGroup
    from schemas.result import Sample, Usage, merge_choice_group

    def member(position: int, texts: list[str]):
        request = Request(
            index=position, line_no=1, custom_id="g", shape="openai", url="/v1/completions", prompt="p", n=2,
            choice_group=ChoiceGroup(position=position, size=2),
        )  # fmt: skip
        samples = [Sample(index=j, text=t, finish_reason="stop") for j, t in enumerate(texts)]
        result = ResultLine(
            custom_id="g", index=position, text=texts[0], finish_reason="stop", samples=samples,
            usage=Usage(prompt_tokens=3, completion_tokens=2 * (position + 1), cached_tokens=position),
        )  # fmt: skip
        return to_openai_output(result, request, "b", "m", 0)

    merged = merge_choice_group([member(0, ["a0", "a1"]), member(1, ["b0", "b1"])], num_samples=2)
    body = merged.response.body
    assert [(c["index"], c["text"]) for c in body["choices"]] == [(0, "a0"), (1, "a1"), (2, "b0"), (3, "b1")]
    assert body["usage"] == {
        "prompt_tokens": 6, "completion_tokens": 6, "total_tokens": 12, "prompt_tokens_details": {"cached_tokens": 1}
    }  # fmt: skip
    assert merged.id == "batch_req_b-0" and merged.custom_id == "g"

    failed = ResultLine(custom_id="g", index=1, finish_reason="error", error="boom")
    request = Request(index=1, line_no=1, custom_id="g", shape="openai", prompt="p", choice_group=ChoiceGroup(position=1, size=2))
    merged = merge_choice_group([member(0, ["a0", "a1"]), to_openai_output(failed, request, "b", "m", 0)], 2)
    assert merged.is_failure and merged.error.message == "boom" and merged.id == "batch_req_b-0"
