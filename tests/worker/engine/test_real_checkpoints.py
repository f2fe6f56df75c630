"""Checkpoints shaped like the instruct releases (`tests/fixtures/checkpoints.py`): cbq's output equals
`generate()` with the checkpoint's own generation_config (its eos list, its max_new_tokens; greedy, since
the reference is asked for do_sample=False) in text, token ids, finish_reason and completion_tokens, in sync
and async mode, for plain prompts and chat messages, with and without max_new_tokens.

The end-of-turn row of each instruct fixture's output projection copies a frequent token's row
(`eot_row_from`), so greedy decoding reaches end-of-turn in some requests and the limit in others; the
Mistral-shaped one has a 24-token sliding window, far below the outputs' lengths.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from tests.fixtures.checkpoints import Checkpoint, build_checkpoint, corpus
from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

# Found by trying frequent greedy tokens: with these, some requests end their turn and some do not.
# The Mistral-shaped context is shorter, so running to it stays quick; it is still 6 windows long.
FAMILIES = {
    "llama3": dict(eot_row_from=114),
    "qwen3": dict(eot_row_from=392),
    "mistral": dict(max_position_embeddings=144),
    "gemma2": dict(eot_row_from=246),
    "qwen3_moe": dict(eot_row_from=473),
}
MAX_NEW_TOKENS = 40
NUM_PROMPTS, NUM_CHATS = 6, 4


@dataclass
class Loaded:
    checkpoint: Checkpoint
    model: object  # what the engine adopts
    tokenizer: object  # cbq's wrapper
    reference: object  # a second copy for generate(), never adopted by an engine
    hf_tokenizer: object


_LOADED: dict[str, Loaded] = {}


@pytest.fixture(scope="module")
def loaded(tmp_path_factory):
    def get(family: str, **build) -> Loaded:
        key = f"{family}-{sorted(build.items())}"
        if key not in _LOADED:
            from transformers import AutoModelForCausalLM, AutoTokenizer

            path = tmp_path_factory.mktemp(family)
            checkpoint = build_checkpoint(path, family, **{**FAMILIES[family], **build})
            model, tokenizer = load_model(str(path), torch.device("cpu"), torch.float32)
            reference = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
            _LOADED[key] = Loaded(checkpoint, model, tokenizer, reference, AutoTokenizer.from_pretrained(path))
        return _LOADED[key]

    return get


def prompts_of(lo: Loaded, num_prompts: int = NUM_PROMPTS, num_chats: int = NUM_CHATS) -> list[list[int]]:
    """Plain prompts through cbq's tokenizer, chats through the checkpoint's own chat template."""
    texts = corpus(num_prompts + num_chats, seed=5)
    prompts = [lo.tokenizer.encode(t) for t in texts[:num_prompts]]
    for text in texts[num_prompts:]:
        messages = [{"role": "user", "content": text}]
        ids = lo.tokenizer.encode_chat(messages)
        expected = lo.hf_tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        assert ids == list(getattr(expected, "input_ids", expected)), "cbq renders chats as the template does"
        prompts.append(ids)
    return prompts


_REFERENCES: dict[tuple, list[int]] = {}


def generate_reference(lo: Loaded, prompt_ids: list[int], max_new_tokens: int | None) -> list[int]:
    """`generate()` with the checkpoint's generation_config, greedy; without max_new_tokens, up to the context
    (what cbq defaults to when generation_config sets no max_new_tokens)."""
    key = (id(lo), tuple(prompt_ids), max_new_tokens)
    if key not in _REFERENCES:
        _REFERENCES[key] = _generate(lo, prompt_ids, max_new_tokens)
    return _REFERENCES[key]


def _generate(lo: Loaded, prompt_ids: list[int], max_new_tokens: int | None) -> list[int]:
    ids = torch.tensor([prompt_ids])
    limit = {"max_new_tokens": max_new_tokens} if max_new_tokens else {}
    if not max_new_tokens and lo.reference.generation_config.max_new_tokens is None:
        limit = {"max_length": lo.reference.config.max_position_embeddings}
    out = lo.reference.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False, **limit)
    return out[0, ids.shape[1] :].tolist()


def assert_equals_generate(lo: Loaded, prompts, results, max_new_tokens: int | None) -> list[str]:
    eos = set(lo.checkpoint.generation_eos_ids)
    reasons = []
    for i, (prompt_ids, result) in enumerate(zip(prompts, results, strict=True)):
        ref = generate_reference(lo, prompt_ids, max_new_tokens)
        reason = "stop" if ref[-1] in eos else "length"
        what = f"request {i} ({len(prompt_ids)} prompt tokens)"
        assert result.token_ids == ref, what
        assert result.finish_reason.value == reason, what
        assert result.usage.completion_tokens == len(ref), what
        assert result.text == lo.hf_tokenizer.decode(ref, skip_special_tokens=True), what
        reasons.append(reason)
    return reasons


def run(lo: Loaded, prompts, sampling: SamplingParams, **config) -> list:
    engine = Engine(lo.model, lo.tokenizer, EngineConfig(**{"max_num_batched_tokens": 64, **config}))
    return engine.generate([EngineRequest(f"r{i}", ids, sampling) for i, ids in enumerate(prompts)])


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_with_max_new_tokens_equals_generate(loaded, family, mode):
    lo = loaded(family)
    prompts = prompts_of(lo)
    results = run(lo, prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0), mode=mode)
    reasons = assert_equals_generate(lo, prompts, results, MAX_NEW_TOKENS)
    if family != "mistral":  # the end-of-turn token is in generation_config.json only
        assert "stop" in reasons and "length" in reasons, reasons
        assert any(r.token_ids[-1] == lo.checkpoint.end_of_turn_id for r in results), "no request ended its turn"
    else:  # far past the 24-token window
        window = lo.model.config.sliding_window
        beyond = [len(p) + len(r.token_ids) > 2 * window for p, r in zip(prompts, results, strict=True)]
        assert sum(beyond) >= len(prompts) // 2, beyond


@pytest.mark.parametrize("family", list(FAMILIES))
def test_the_owned_decoder_equals_generate(loaded, family):
    """The same checkpoints through cbq's own decoder (the CUDA default) instead of transformers' forward."""
    lo = loaded(family)
    prompts = prompts_of(lo)
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0)
    results = run(lo, prompts, sampling, mode="async", decoder="owned")
    assert_equals_generate(lo, prompts, results, MAX_NEW_TOKENS)


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_without_max_new_tokens_runs_to_the_end_of_turn_or_the_context(loaded, family, mode):
    lo = loaded(family)
    prompts = prompts_of(lo, num_prompts=2, num_chats=2)
    results = run(lo, prompts, SamplingParams(temperature=0), mode=mode)
    reasons = assert_equals_generate(lo, prompts, results, None)
    context = lo.model.config.max_position_embeddings
    for prompt_ids, result, reason in zip(prompts, results, reasons, strict=True):
        if reason == "length":
            assert len(prompt_ids) + len(result.token_ids) == context, "the default is the rest of the context"


def test_generation_config_max_new_tokens_is_the_default_and_a_request_value_wins(loaded):
    lo = loaded("llama3", generation={"max_new_tokens": 24})
    prompts = prompts_of(lo, num_prompts=3, num_chats=1)
    results = run(lo, prompts, SamplingParams(temperature=0))
    assert_equals_generate(lo, prompts, results, None)  # generate() also reads max_new_tokens from the file
    assert max(r.usage.completion_tokens for r in results) == 24
    results = run(lo, prompts, SamplingParams(temperature=0, max_new_tokens=30))
    assert_equals_generate(lo, prompts, results, 30)
    assert max(r.usage.completion_tokens for r in results) == 30


def test_generation_config_sampling_defaults_apply_unless_turned_off(loaded):
    lo = loaded("llama3")  # generation_config: do_sample, temperature 0.6, top_p 0.9
    prompts = prompts_of(lo, num_prompts=4, num_chats=0)
    unset = run(lo, prompts, SamplingParams(max_new_tokens=24, seed=7))
    explicit = run(lo, prompts, SamplingParams(max_new_tokens=24, seed=7, temperature=0.6, top_p=0.9))
    greedy = run(lo, prompts, SamplingParams(max_new_tokens=24, temperature=0))
    assert [r.token_ids for r in unset] == [r.token_ids for r in explicit]
    assert [r.token_ids for r in unset] != [r.token_ids for r in greedy]
    off = run(lo, prompts, SamplingParams(max_new_tokens=24, seed=7), generation_config_defaults=False)
    assert [r.token_ids for r in off] == [r.token_ids for r in greedy]


def test_a_stop_string_that_is_a_special_token_stops_on_it(loaded):
    lo = loaded("llama3")
    prompts = prompts_of(lo)
    plain = run(lo, prompts, SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0))
    ended = [(p, r) for p, r in zip(prompts, plain, strict=True) if r.token_ids[-1] == lo.checkpoint.end_of_turn_id]
    assert ended
    # ignore_eos: only the stop string can end these at the end-of-turn token
    sampling = SamplingParams(max_new_tokens=MAX_NEW_TOKENS, temperature=0, ignore_eos=True, stop=("<|eot_id|>",))
    results = run(lo, [p for p, _ in ended], sampling)
    for (_, expected), result in zip(ended, results, strict=True):
        assert (result.token_ids, result.finish_reason.value) == (expected.token_ids, "stop")
        assert result.text == expected.text and "<|eot_id|>" not in result.text


def test_eos_ids_merge_every_source(loaded):
    lo = loaded("llama3")
    engine = Engine(lo.model, lo.tokenizer, EngineConfig(num_kv_blocks=8))
    assert engine.eos_token_ids == set(lo.checkpoint.generation_eos_ids)  # config.json names one of them
    assert lo.model.config.eos_token_id == lo.checkpoint.token_ids["<|end_of_text|>"]
