"""Scoring from request lines to output lines (issue 29 item 6): `prompt_logprobs` on cbq lines and OpenAI bodies,
and completions `echo` with `logprobs` (max_tokens 0 included), through admission, the engine and the output
formats: the values equal a transformers forward over the prompt (fp32) with chunked prefill, sync and async;
the echoed text and offsets are OpenAI's legacy shape; a line that asks for none of it is unchanged."""

from __future__ import annotations

import json

import pytest
import torch

from schemas.lines import parse_request_line
from schemas.result import ResultLine, to_openai_output
from worker.engine.models import load_model
from worker.offline import LLM

PROMPT = "the water is long and the day is long, and the people of the water"


def body_line(custom_id: str, body: dict, url: str = "/v1/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": {"model": "m", **body}}


LINES = [
    {"custom_id": "native", "prompt": PROMPT, "max_new_tokens": 0, "prompt_logprobs": 2},
    body_line("echo-score", {"prompt": PROMPT, "max_tokens": 0, "echo": True, "logprobs": 3}),
    body_line("echo-generate", {"prompt": "1, 2, 3,", "max_tokens": 4, "echo": True, "logprobs": 1, "temperature": 0}),
    body_line("echo-ids", {"prompt": [1, 104, 105, 33], "max_tokens": 2, "echo": True, "temperature": 0}),
    body_line(
        "chat", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "prompt_logprobs": 0}, "/v1/chat/completions"
    ),
    body_line("plain", {"prompt": PROMPT, "max_tokens": 3, "temperature": 0, "logprobs": 1}),
]


@pytest.fixture(scope="module")
def reference():
    model, tok = load_model("tiny-llama", torch.device("cpu"), torch.float32)

    def log_softmax(ids: list[int]) -> torch.Tensor:
        with torch.no_grad():
            return torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)

    return log_softmax, tok


@pytest.fixture(scope="module", params=["sync", "async"])
def scored(request) -> dict[str, ResultLine]:
    llm = LLM("tiny-llama", device="cpu", mode=request.param, max_num_batched_tokens=16, num_kv_blocks=64)
    results = llm.generate(LINES, progress=False)
    return {r.custom_id: r for r in results}


def check_entries(result: ResultLine, ids: list[int], log_softmax, num_top: int) -> None:
    entries = result.prompt_logprobs
    assert entries is not None and len(entries) == len(ids) == result.usage.prompt_tokens
    assert entries[0] is None
    expected = log_softmax(ids)
    for p, entry in enumerate(entries[1:], start=1):
        assert entry is not None and entry.token_id == ids[p]
        assert abs(entry.logprob - expected[p - 1, ids[p]].item()) < 1e-4, (result.custom_id, p)
        assert [t.rank for t in entry.top_logprobs] == list(range(1, num_top + 1))
        assert [t.token_id for t in entry.top_logprobs] == expected[p - 1].topk(num_top).indices.tolist()


def test_prompt_logprobs_equal_a_transformers_forward(scored, reference):
    log_softmax, tok = reference
    ids = tok.encode(PROMPT)
    assert len(ids) > 16  # several chunks
    native = scored["native"]
    assert (native.finish_reason, native.text, native.usage.completion_tokens) == ("length", "", 0)
    check_entries(native, ids, log_softmax, 2)
    check_entries(scored["echo-score"], ids, log_softmax, 3)  # echo with logprobs scores the prompt too
    assert scored["chat"].prompt_logprobs is not None and scored["chat"].prompt_logprobs[0] is None
    assert scored["echo-ids"].prompt_logprobs is None  # echo without logprobs: the text only
    assert scored["plain"].prompt_logprobs is None and scored["plain"].echo is None


def openai_body(result: ResultLine, index: int) -> dict:
    request = parse_request_line(json.dumps(LINES[index]), index + 1).resolve(index)
    line = to_openai_output(result, request, "batch", "m", 0)
    assert line.response is not None and line.response.status_code == 200
    return line.response.body


def test_echo_is_openai_legacy_completions(scored, reference):
    _, tok = reference
    body = openai_body(scored["echo-score"], 1)
    [choice] = body["choices"]
    assert choice["text"] == PROMPT and "prompt_logprobs" not in choice  # not asked for by that name
    lp = choice["logprobs"]
    ids = tok.encode(PROMPT)
    assert len(lp["tokens"]) == len(lp["token_logprobs"]) == len(lp["text_offset"]) == len(ids)
    assert lp["token_logprobs"][0] is None and lp["top_logprobs"][0] is None
    entries = scored["echo-score"].prompt_logprobs
    assert lp["token_logprobs"][1:] == [e.logprob for e in entries[1:]]
    assert all(lp["tokens"][p] in lp["top_logprobs"][p] and len(lp["top_logprobs"][p]) <= 4 for p in range(1, len(ids)))
    # the BOS leads at offset 0; every other token's offset points at its text in the echoed prompt
    assert lp["text_offset"][0] == 0
    for p in range(1, len(ids)):
        assert PROMPT[lp["text_offset"][p] :].startswith(lp["tokens"][p]), p

    generated = scored["echo-generate"]
    [choice] = openai_body(generated, 2)["choices"]
    assert choice["text"] == "1, 2, 3," + generated.text
    lp = choice["logprobs"]
    num_prompt = generated.usage.prompt_tokens
    assert len(lp["tokens"]) == num_prompt + len(generated.logprobs)
    assert lp["tokens"][num_prompt:] == [t.token for t in generated.logprobs]
    assert lp["text_offset"][num_prompt] == len("1, 2, 3,")  # the output's offsets follow the echoed prompt


def test_echo_of_token_ids_and_without_logprobs(scored, reference):
    _, tok = reference
    result = scored["echo-ids"]
    [choice] = openai_body(result, 3)["choices"]
    assert choice["text"] == tok.decode([1, 104, 105, 33]) + result.text and choice["logprobs"] is None


def test_vllm_prompt_logprobs_in_openai_output(scored):
    body = openai_body(scored["chat"], 4)
    entries = body["prompt_logprobs"]
    assert entries[0] is None and len(entries) == body["usage"]["prompt_tokens"]
    for entry, record in zip(entries[1:], scored["chat"].prompt_logprobs[1:], strict=True):
        assert entry == {str(record.token_id): {"logprob": record.logprob, "rank": record.rank, "decoded_token": record.token}}
    assert "prompt_logprobs" not in openai_body(scored["plain"], 5)


def test_a_line_without_scoring_fields_is_unchanged(scored):
    """The same plain line alone, on an engine that never saw a scoring request, gives the same result."""
    llm = LLM("tiny-llama", device="cpu", max_num_batched_tokens=16, num_kv_blocks=64)
    [alone] = llm.generate([LINES[-1]], progress=False)
    mixed = scored["plain"]
    assert (alone.text, alone.token_ids) == (mixed.text, mixed.token_ids)
    # the values within float rounding: another batch composition may round the last bits otherwise
    assert [lp.token for lp in alone.logprobs] == [lp.token for lp in mixed.logprobs]
    assert all(abs(a.logprob - b.logprob) < 1e-5 for a, b in zip(alone.logprobs, mixed.logprobs, strict=True))
    dumped = json.loads(mixed.model_dump_json(exclude_none=True))
    assert "prompt_logprobs" not in dumped and "echo" not in dumped
