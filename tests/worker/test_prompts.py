"""Issue 29 item 7: prompts as vLLM takes them. Completions prompts as token ids, `add_special_tokens`,
`continue_final_message` / `add_generation_prompt`, and a chat for a tokenizer without a chat template fails
its request (unless `--chat-template FILE` gives one), checked against transformers' own rendering."""

from __future__ import annotations

import json

import pytest
from click.testing import CliRunner

from schemas.chunk import ChunkPayload
from schemas.lines import parse_request_line
from tests.fixtures.checkpoints import FAMILIES, train_tokenizer
from worker.admission import ChunkWork, _expand_one, to_engine_request
from worker.cli import build_engine
from worker.engine.tokenizer import HFTokenizer, NoChatTemplate

CHAT = [{"role": "user", "content": "what is the water?"}, {"role": "assistant", "content": "The water is"}]


@pytest.fixture(scope="module")
def hf():
    return train_tokenizer(FAMILIES["llama3"])  # a template and a BOS from the post-processor


def template_ids(hf, messages, **kwargs) -> list[int]:
    """transformers' own rendering and tokenization (some versions return a BatchEncoding)."""
    ids = hf.apply_chat_template(messages, tokenize=True, **kwargs)
    return list(ids["input_ids"] if hasattr(ids, "keys") else ids)


def engine_prompt(line: dict, tokenizer) -> list[int]:
    return to_engine_request(parse_request_line(json.dumps(line), 1).resolve(0), tokenizer, "b", 0.0).prompt_ids


def body(fields: dict, url: str = "/v1/completions") -> dict:
    return {"custom_id": "c", "method": "POST", "url": url, "body": fields}


def test_completion_prompts_as_text_or_token_ids_and_add_special_tokens(hf):
    tok = HFTokenizer(hf)
    text = "the water is long"
    assert engine_prompt(body({"prompt": text}), tok) == hf(text)["input_ids"]
    rendered = hf.bos_token + text  # a prompt rendered with its BOS already: no second one
    assert engine_prompt(body({"prompt": rendered, "add_special_tokens": False}), tok) == hf(text)["input_ids"]
    assert engine_prompt({"prompt": rendered, "add_special_tokens": False}, tok) == hf(text)["input_ids"]
    assert engine_prompt(body({"prompt": [5, 6, 7]}), tok) == [5, 6, 7]
    assert engine_prompt(body({"prompt": [[5, 6]]}), tok) == [5, 6]
    assert engine_prompt(body({"prompt": [text]}), tok) == hf(text)["input_ids"]


def test_chats_render_as_transformers_renders_them(hf):
    tok = HFTokenizer(hf)
    chat_url = "/v1/chat/completions"
    opened = template_ids(hf, CHAT[:1], add_generation_prompt=True)
    assert engine_prompt(body({"messages": CHAT[:1]}, chat_url), tok) == opened
    continued = template_ids(hf, CHAT, continue_final_message=True)
    assert engine_prompt(body({"messages": CHAT, "continue_final_message": True}, chat_url), tok) == continued
    assert engine_prompt({"messages": CHAT, "continue_final_message": True}, tok) == continued
    closed = template_ids(hf, CHAT, add_generation_prompt=False)
    assert engine_prompt(body({"messages": CHAT, "add_generation_prompt": False}, chat_url), tok) == closed
    with_bos = engine_prompt(body({"messages": CHAT[:1], "add_special_tokens": True}, chat_url), tok)
    assert with_bos == [hf.bos_token_id, *opened]  # as vLLM: asked for, the BOS comes on top of the template's


def test_a_chat_without_a_template_fails_its_request_unless_one_is_given(hf, tmp_path):
    plain = train_tokenizer(FAMILIES["llama3"])
    plain.chat_template = None
    tok = HFTokenizer(plain)
    with pytest.raises(NoChatTemplate):
        tok.encode_chat(CHAT[:1])
    request = parse_request_line(json.dumps({"custom_id": "q", "messages": CHAT[:1]}), 1).resolve(0)
    work = ChunkWork(ChunkPayload(batch_id="b", start=0, stop=1), 0.0, 60, False)
    _expand_one(work, 0, request.model_dump_json().encode(), tok, {})
    (result,) = work.finished_now
    assert (result.custom_id, result.error_code, result.error_param) == ("q", "invalid_value", "messages")
    assert "--chat-template FILE" in result.error

    tok.use_chat_template(hf.chat_template)
    assert tok.encode_chat(CHAT[:1]) == template_ids(hf, CHAT[:1], add_generation_prompt=True)


def test_chat_template_flag_needs_a_tokenizer_that_takes_one():
    import click

    with pytest.raises(click.ClickException, match="fixed template"):
        build_engine("fake", "sync", None, True, {"chat_template": "{{ messages }}"})


def test_bad_prompt_options_fail_their_request():
    chat_url = "/v1/chat/completions"
    cases = {
        "give add_generation_prompt or continue_final_message, not both": {
            "messages": CHAT,
            "continue_final_message": True,
            "add_generation_prompt": True,
        },
        "continue_final_message needs the last message to be the assistant's": {
            "messages": CHAT[:1],
            "continue_final_message": True,
        },
    }
    for message, fields in cases.items():
        with pytest.raises(ValueError, match=message):
            parse_request_line(json.dumps(body(fields, chat_url)), 1)


def test_a_list_of_prompts_gives_one_line_with_a_choice_group_per_prompt(tmp_path):
    """As OpenAI: `prompt: [a, b]` gives one output line whose choice 0 answers a and choice 1 answers b (the
    fake engine echoes its prompt), with the usage of both; cbq's own format has a line per prompt."""
    from producer.cli import main

    lines = [
        body({"prompt": ["alpha", [98, 101, 116, 97]], "max_tokens": 5}) | {"custom_id": "two"},
        body({"prompt": "gamma", "max_tokens": 5}) | {"custom_id": "one"},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    out = tmp_path / "out.jsonl"
    ran = CliRunner().invoke(main, ["run", str(path), "-o", str(out), "--fake-engine", "--format", "openai"])
    assert ran.exit_code == 0, ran.output
    two, one = (json.loads(line) for line in out.read_text().splitlines())
    assert (two["custom_id"], one["custom_id"]) == ("two", "one")
    choices = two["response"]["body"]["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert [c["text"][:4] for c in choices] == ["alph", "beta"]
    usage = two["response"]["body"]["usage"]
    assert usage["prompt_tokens"] == len("alpha") + 4
    assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    assert one["response"]["body"]["choices"][0]["text"].startswith("gamm")

    cbq_out = tmp_path / "cbq.jsonl"
    ran = CliRunner().invoke(main, ["run", str(path), "-o", str(cbq_out), "--fake-engine"])
    assert [json.loads(line)["custom_id"] for line in cbq_out.read_text().splitlines()] == ["two", "two", "one"]
