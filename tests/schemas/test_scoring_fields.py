"""Scoring fields at the edge (issue 29 item 6): `prompt_logprobs` on every shape, `echo` on completions bodies only,
a token limit of 0 only for a request that scores its prompt; each bad value fails its own request (a 400 naming
the field), and the stored request keeps what the output needs."""

from __future__ import annotations

import json

import pytest

from schemas.errors import InvalidRequest
from schemas.lines import parse_request_line
from schemas.result import (
    EchoedPrompt,
    PromptToken,
    PromptTokenLogprob,
    PromptTopLogprob,
    ResultLine,
    to_openai_output,
)


def openai(body: dict, url: str = "/v1/completions") -> str:
    return json.dumps({"custom_id": "c", "method": "POST", "url": url, "body": {"model": "m", **body}})


CHAT = {"messages": [{"role": "user", "content": "hi"}]}


@pytest.mark.parametrize(
    "line",
    [
        json.dumps({"prompt": "x", "prompt_logprobs": 3}),
        json.dumps({"prompt": "x", "prompt_logprobs": 0, "max_new_tokens": 0}),
        json.dumps({**CHAT, "prompt_logprobs": 20, "max_new_tokens": 0}),
        openai({"prompt": "x", "echo": True}),
        openai({"prompt": "x", "echo": True, "logprobs": 5, "max_tokens": 0}),
        openai({"prompt": "x", "prompt_logprobs": 1, "max_tokens": 0}),
        openai({**CHAT, "prompt_logprobs": 1, "max_completion_tokens": 0}, "/v1/chat/completions"),
    ],
)
def test_scoring_lines_are_accepted(line):
    request = parse_request_line(line, 1).resolve(0)
    assert request.sampling.prompt_logprobs is not None or request.echo


@pytest.mark.parametrize(
    ("line", "param", "message"),
    [
        (json.dumps({"prompt": "x", "max_new_tokens": 0}), None, "max_new_tokens 0 generates nothing"),
        (json.dumps({"prompt": "x", "prompt_logprobs": 21}), "prompt_logprobs", "less than or equal to 20"),
        (json.dumps({"prompt": "x", "echo": True}), "echo", "unknown or unsupported field"),  # bodies only
        (openai({"prompt": "x", "max_tokens": 0}), None, "with echo or prompt_logprobs"),
        (openai({"prompt": "x", "echo": True, "max_tokens": -1}), "max_tokens", "greater than or equal to 0"),
        (openai({"prompt": "x", "echo": "yes"}), "echo", "valid boolean"),
        (openai({"prompt": "x", "prompt_logprobs": True}), "prompt_logprobs", "valid integer"),  # a count, not a flag
        (openai({**CHAT, "echo": True}, "/v1/chat/completions"), "echo", "unknown or unsupported field"),
        (openai({**CHAT, "max_tokens": 0}, "/v1/chat/completions"), None, "with prompt_logprobs"),
    ],
)
def test_bad_scoring_values_fail_their_request(line, param, message):
    with pytest.raises(InvalidRequest) as info:
        parse_request_line(line, 7)
    assert info.value.param == param and message in str(info.value), str(info.value)


def prompt_entry(token_id: int, token: str, logprob: float, rank: int, top: list[tuple[int, str, float]]):
    return PromptTokenLogprob(
        token=token, bytes=list(token.encode()), token_id=token_id, logprob=logprob, rank=rank,
        top_logprobs=[
            PromptTopLogprob(token=t, bytes=list(t.encode()), token_id=i, logprob=v, rank=r)
            for r, (i, t, v) in enumerate(top, start=1)
        ],
    )  # fmt: skip


def test_echo_output_aligns_offsets_after_a_bos():
    """The prompt "ab cd" tokenized as <s>, "ab", " cd": the BOS leads at offset 0, the others point at their text;
    the output's tokens follow at the echoed prompt's length."""
    line = openai({"prompt": "ab cd", "echo": True, "logprobs": 1, "max_tokens": 1, "prompt_logprobs": 1})
    request = parse_request_line(line, 1).resolve(0)
    entries = [
        None,
        prompt_entry(10, "ab", -2.0, 3, [(5, "x", -0.5)]),
        prompt_entry(11, " cd", -0.25, 1, [(11, " cd", -0.25)]),
    ]
    result = ResultLine.model_validate(
        {
            "custom_id": "c", "index": 0, "text": "!", "finish_reason": "length",
            "usage": {"prompt_tokens": 3, "completion_tokens": 1},
            "logprobs": [{"token": "!", "logprob": -1.5, "bytes": [33], "top_logprobs": [{"token": "?", "logprob": -1.0, "bytes": [63]}]}],
            "prompt_logprobs": [None if e is None else e.model_dump() for e in entries],
            "echo": EchoedPrompt(text="ab cd", first_token=PromptToken(token="<s>", bytes=list(b"<s>"), token_id=1)).model_dump(),
        }
    )  # fmt: skip
    body = to_openai_output(result, request, "b", "m", 0).response.body
    [choice] = body["choices"]
    assert choice["text"] == "ab cd!"
    assert choice["logprobs"] == {
        "tokens": ["<s>", "ab", " cd", "!"],
        "token_logprobs": [None, -2.0, -0.25, -1.5],
        "top_logprobs": [None, {"x": -0.5, "ab": -2.0}, {" cd": -0.25}, {"?": -1.0}],
        "text_offset": [0, 0, 2, 5],
    }
    assert choice["prompt_logprobs"] == [
        None,
        {"5": {"logprob": -0.5, "rank": 1, "decoded_token": "x"}, "10": {"logprob": -2.0, "rank": 3, "decoded_token": "ab"}},
        {"11": {"logprob": -0.25, "rank": 1, "decoded_token": " cd"}},
    ]
    assert json.loads(result.model_dump_json())["prompt_logprobs"][0] is None  # the cbq line, as vLLM's
