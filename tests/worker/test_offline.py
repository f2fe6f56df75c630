"""The offline API (`worker.offline.LLM`): the README's example as written, every input shape, line defaults,
results in input order, validation before anything runs, and refusals as error results."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from worker.offline import LLM, InvalidRequests

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.fixture(scope="module")
def llm():
    return LLM("tiny-llama", device="cpu", max_model_len=64)


def readme_block(heading: str) -> str:
    section = README.read_text().split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


def test_the_readme_example_runs_as_written(capsys):
    code = readme_block("Offline, in Python (no Redis)")
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    printed = capsys.readouterr().out.splitlines()
    assert len(printed) == 3 and printed[1].startswith("q2 ")
    results = namespace["results"]
    assert [r.index for r in results] == [0, 1, 2] and results[2].custom_id is None
    assert results[0].usage.completion_tokens <= 8 and results[2].usage.completion_tokens <= 4
    assert results[2].logprobs is not None and namespace["reply"].finish_reason in ("stop", "length")


def test_every_input_shape_in_order_with_line_defaults(llm):
    inputs = [
        "plain prompt",
        {"prompt": "own length", "max_new_tokens": 3},
        {"messages": [{"role": "user", "content": "hi"}]},
        {"custom_id": "b", "method": "POST", "url": "/v1/completions", "body": {"model": "m", "prompt": "x"}},
        {"model": "m", "prompt": "a bare body", "max_tokens": 2, "logprobs": 2},
    ]
    results = llm.generate(inputs, sampling={"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}, progress=False)
    assert [r.index for r in results] == list(range(5))
    assert [r.custom_id for r in results] == [None, None, None, "b", None]
    assert [r.usage.completion_tokens for r in results] == [5, 3, 5, 5, 2]
    assert all(len(r.token_ids) == r.usage.completion_tokens for r in results)
    assert len(results[4].logprobs) == 2 and len(results[4].logprobs[0].top_logprobs) == 2
    again = llm.generate(inputs, sampling={"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}, progress=False)
    assert [r.text for r in again] == [r.text for r in results]  # greedy (OpenAI bodies default to temperature 1 otherwise): the same text every time

    chats = llm.chat(
        [[{"role": "user", "content": "hi"}]] * 2, sampling={"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}
    )
    assert [r.token_ids for r in chats] == [results[2].token_ids] * 2
    [one] = llm.chat([{"role": "user", "content": "hi"}], sampling={"max_new_tokens": 5, "ignore_eos": True, "temperature": 0})
    assert one.token_ids == results[2].token_ids


def test_invalid_inputs_are_named_before_anything_runs(llm):
    with pytest.raises(InvalidRequests) as info:
        llm.generate(["fine", {"prompt": "x", "top_p": 0}, {"messages": []}], progress=False)
    text = str(info.value)
    assert (
        text.startswith("2 invalid input(s); nothing ran") and "line 2: top_p" in text and "line 3:" in text
    )
    with pytest.raises(ValueError):
        llm.generate("x", sampling={"temperature": -1})


def test_a_refused_request_is_an_error_result_and_the_others_run(llm):
    results = llm.generate(
        ["short", "y" * 100], sampling={"max_new_tokens": 2, "ignore_eos": True}, progress=False
    )
    assert results[0].finish_reason == "length" and results[0].usage.completion_tokens == 2
    assert results[1].finish_reason == "error" and "context" in results[1].error
    assert llm.generate("after a refusal", progress=False)[0].finish_reason in ("stop", "length")


def test_a_bare_responses_body_runs_as_the_chat_it_means(llm):
    sampling = {"max_new_tokens": 5, "ignore_eos": True, "temperature": 0}
    inputs = [
        {"model": "m", "input": "hi", "max_output_tokens": 4},
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4},
    ]
    responses, chat = llm.generate(inputs, sampling=sampling, progress=False)
    assert responses.finish_reason == chat.finish_reason and responses.token_ids == chat.token_ids
    assert responses.usage.completion_tokens == 4


def test_inputs_are_fed_while_the_engine_has_capacity_not_all_at_once():
    """A file of many image requests must not hold every picture at once: `generate` turns an input into an engine
    request only while the engine has capacity (2 x max_num_seqs unfinished samples), as the worker does."""
    small = LLM("tiny-llama", device="cpu", max_model_len=64, max_num_seqs=2)
    engine = small.engine
    most = 0
    add = engine.add_request

    def counting_add(req):
        nonlocal most
        add(req)
        most = max(most, engine._num_unfinished)

    engine.add_request = counting_add
    results = small.generate([f"prompt {i}" for i in range(12)], sampling={"max_new_tokens": 3, "ignore_eos": True}, progress=False)
    assert [r.index for r in results] == list(range(12)) and all(r.usage.completion_tokens == 3 for r in results)
    assert most <= 2 * 2, f"{most} requests held at once"


def test_an_image_model_holds_a_bounded_number_of_image_requests_unstarted(tmp_path, monkeypatch):
    """Pixels are made when a request is admitted and held until the tower runs: `generate` on an image-taking
    model keeps at most IMAGE_REQUESTS_WAITING requests unstarted, whatever the engine's capacity."""
    import base64
    import io

    from PIL import Image

    from tests.fixtures.vision_checkpoints import build_qwen2_5_vl
    from worker import offline

    checkpoint = build_qwen2_5_vl(tmp_path / "qwen2_5_vl")
    vlm = LLM(str(checkpoint.path), device="cpu", dtype="float32", max_num_seqs=8)
    monkeypatch.setattr(offline, "IMAGE_REQUESTS_WAITING", 2)
    engine, add, most = vlm.engine, vlm.engine.add_request, 0

    def counting_add(req):
        nonlocal most
        add(req)
        most = max(most, engine.num_unstarted())

    engine.add_request = counting_add

    def url(shade: int) -> str:
        out = io.BytesIO()
        Image.new("RGB", (56, 56), (shade, 255 - shade, 90)).save(out, format="PNG")
        return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()

    chats = [
        [{"role": "user", "content": [{"type": "text", "text": "what is it?"}, {"type": "image_url", "image_url": {"url": url(20 * i)}}]}]
        for i in range(8)
    ]
    results = vlm.chat(chats, sampling={"max_new_tokens": 2, "ignore_eos": True, "temperature": 0})
    assert [r.usage.completion_tokens for r in results] == [2] * 8 and all(r.error is None for r in results)
    assert most <= 2, f"{most} image requests waited unstarted at once"
