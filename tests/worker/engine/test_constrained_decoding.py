"""Constrained decoding end to end on a random-weight model: every output parses and validates, in sync
and async mode alike, alone or in a batch; a bad constraint fails only its own request. Random weights
make this a test of the constraint, not of the model."""

from __future__ import annotations

import json
import re

import jsonschema
import pytest
import torch

from worker.engine.api import Constraint, ConstraintKind, EngineRequest, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

from .json_schemas import SCHEMAS

MAX_NEW = 200  # every schema completes well within this (the longest output is about 130 byte tokens)


@pytest.fixture(scope="module")
def llama():
    """This module's own tiny-llama: an Engine switches its model's attention implementation."""
    return load_model("tiny-llama", torch.device("cpu"), torch.float32)


def json_request(tok, name: str, schema: dict, **sampling) -> EngineRequest:
    constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema))
    params = SamplingParams(**{"max_new_tokens": MAX_NEW, **sampling}, constraint=constraint)
    return EngineRequest(name, tok.encode(f"Reply with {name} as JSON:"), params)


def run(llama, mode: str, reqs: list[EngineRequest], **config):
    model, tok = llama
    engine = Engine(model, tok, EngineConfig(mode=mode, **{"num_kv_blocks": 512, **config}))
    return {r.request_id: r for r in engine.generate(reqs)}, engine


def strip_strings(text: str) -> str:
    return re.sub(r'"(\\.|[^"\\])*"', '""', text)


def test_json_schemas_parse_and_validate(llama):
    """23 schemas, half greedy and half seeded sampling, all in one async batch: 100% valid."""
    _, tok = llama
    assert len(SCHEMAS) >= 20
    reqs = [
        json_request(tok, name, schema, temperature=0.0 if i % 2 else 1.0, seed=i)
        for i, (name, schema) in enumerate(SCHEMAS.items())
    ]
    results, engine = run(llama, "async", reqs, max_num_seqs=32)
    for name, schema in SCHEMAS.items():
        r = results[name]
        assert r.finish_reason == FinishReason.STOP, (name, r.finish_reason, r.error, r.text)
        jsonschema.validate(json.loads(r.text), schema)
        # Compact: no whitespace between JSON tokens (only inside strings).
        assert not re.search(r"\s", strip_strings(r.text)), (name, r.text)
        assert r.token_ids[-1] in tok.eos_token_ids or engine.eos_token_ids.isdisjoint(r.token_ids)
    assert engine.stats().mask_seconds > 0


REGEXES = {
    "phone": r"[0-9]{3}-[0-9]{4}",
    "ident": r"[a-z][a-z0-9_]{2,7}",
    "date": r"(19|20)[0-9]{2}-(0[1-9]|1[0-2])-(0[1-9]|[12][0-9]|3[01])",
    "yes_no": r"(yes|no)( because [a-z]{1,5})?",
}
CHOICES = {
    "labels": ["positive", "negative", "neutral"],
    "unicode": ["été", "hiver", "日本"],
    "quote": ['a"b', "c\\d"],
}


def test_regex_and_choice_constraints(llama):
    _, tok = llama
    reqs = []
    for i, (name, pattern) in enumerate(REGEXES.items()):
        params = SamplingParams(
            40, temperature=1.0, seed=i, constraint=Constraint(ConstraintKind.REGEX, pattern)
        )
        reqs.append(EngineRequest(name, tok.encode(name), params))
    for name, choices in CHOICES.items():
        for temp in (0.0, 1.0):
            params = SamplingParams(
                40,
                temperature=temp,
                seed=3,
                constraint=Constraint(ConstraintKind.CHOICE, json.dumps(choices)),
            )
            reqs.append(EngineRequest(f"{name}-{temp}", tok.encode(name), params))
    results, _ = run(llama, "async", reqs)
    for name, pattern in REGEXES.items():
        assert results[name].finish_reason == FinishReason.STOP, results[name]
        assert re.fullmatch(pattern, results[name].text), (name, results[name].text)
    for name, choices in CHOICES.items():
        for temp in (0.0, 1.0):
            r = results[f"{name}-{temp}"]
            assert r.finish_reason == FinishReason.STOP and r.text in choices, (name, r.text)


MIXED = ["person", "tags", "refs", "shape"]


def mixed_batch(tok, sampled: bool) -> list[EngineRequest]:
    """Constrained requests interleaved with unconstrained ones of mixed lengths."""
    reqs = []
    for i, name in enumerate(MIXED):
        sampling = {"temperature": 0.9, "top_p": 0.9, "seed": 100 + i} if sampled else {}
        reqs.append(json_request(tok, name, SCHEMAS[name], **sampling))
        plain = SamplingParams(max_new_tokens=4 + 6 * i, temperature=1.0 if i % 2 else 0.0, seed=i)
        reqs.append(EngineRequest(f"plain{i}", tok.encode("x" * (3 + 15 * i)), plain))
    return reqs


def token_ids(results) -> dict[str, list[int]]:
    assert all(r.finish_reason != FinishReason.ERROR for r in results.values())
    return {rid: r.token_ids for rid, r in results.items()}


def test_greedy_constrained_output_is_identical_in_sync_and_async(llama):
    _, tok = llama
    reqs = mixed_batch(tok, sampled=False)
    sync, _ = run(llama, "sync", reqs)
    asyn, _ = run(llama, "async", reqs)
    assert token_ids(sync) == token_ids(asyn)
    for name in MIXED:
        jsonschema.validate(json.loads(sync[name].text), SCHEMAS[name])


def test_seeded_constrained_request_is_the_same_alone_and_in_a_batch(llama):
    """In a busy batch (chunked prefill, preemption) and in either mode, a seeded constrained request
    samples the same tokens as alone."""
    _, tok = llama
    target = json_request(tok, "target", SCHEMAS["nested_user"], temperature=1.0, top_k=50, seed=77)
    alone, _ = run(llama, "sync", [target])
    assert alone["target"].finish_reason == FinishReason.STOP
    others = mixed_batch(tok, sampled=True)
    for mode in ("sync", "async"):
        busy, engine = run(
            llama, mode, others[:5] + [target] + others[5:], max_num_batched_tokens=48, num_kv_blocks=20
        )
        assert busy["target"].token_ids == alone["target"].token_ids, mode
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"


def test_a_bad_constraint_fails_only_its_request(llama):
    _, tok = llama
    bad = {
        "regex": Constraint(ConstraintKind.REGEX, "a(b"),
        "schema_json": Constraint(ConstraintKind.JSON_SCHEMA, "{not json"),
        "schema_type": Constraint(ConstraintKind.JSON_SCHEMA, '{"type": "no-such-type"}'),
        "choice_empty": Constraint(ConstraintKind.CHOICE, "[]"),
        "choice_not_list": Constraint(ConstraintKind.CHOICE, '"a"'),
    }
    reqs = [EngineRequest(name, tok.encode("x"), SamplingParams(8, constraint=c)) for name, c in bad.items()]
    reqs.append(json_request(tok, "good", SCHEMAS["person"]))
    results, engine = run(llama, "async", reqs)
    for name in bad:
        assert results[name].finish_reason == FinishReason.ERROR and "constraint" in results[name].error, name
    assert results["good"].finish_reason == FinishReason.STOP
    jsonschema.validate(json.loads(results["good"].text), SCHEMAS["person"])
    assert engine.num_unfinished() == 0


def test_json_object_is_compact(llama):
    _, tok = llama
    params = SamplingParams(12, constraint=Constraint(ConstraintKind.JSON_OBJECT))
    [r] = run(llama, "sync", [EngineRequest("o", tok.encode("{"), params)])[0].values()
    assert r.text.startswith("{") and not re.search(r"\s", strip_strings(r.text)), r.text


def test_unconstrained_requests_pay_nothing(llama):
    """No mask buffer, no logprob buffer, no deferred sampling when no request asks."""
    _, tok = llama
    reqs = [
        EngineRequest(f"r{i}", tok.encode("hello" * i), SamplingParams(6, temperature=i * 0.5))
        for i in range(4)
    ]
    results, engine = run(llama, "async", reqs)
    assert all(r.finish_reason == FinishReason.LENGTH and r.logprobs is None for r in results.values())
    assert engine._token_masks._buffers == [None, None]
    assert engine.runner._logprob_buffers == [None, None]
    assert engine.grammar._ll_tokenizer is None, "llguidance's tokenizer is built only when needed"


# -- a Hugging Face tokenizer (byte-level BPE trained here) --------------------------------------------------
@pytest.fixture(scope="module")
def bpe_llama():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedTokenizerFast

    from worker.engine.models import PRESETS
    from worker.engine.tokenizer import HFTokenizer

    corpus = [
        json.dumps({"name": w, "age": i, "tags": [w[:3], "x"]})
        for i, w in enumerate(["alpha", "beta", "gamma", "delta", "epsilon"] * 40)
    ]
    corpus += ["the quick brown fox jumps over the lazy dog " * 3] * 50
    bpe = Tokenizer(models.BPE())
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=446,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|begin_of_text|>", "<|end_of_text|>"],
        show_progress=False,
    )
    bpe.train_from_iterator(corpus, trainer)
    hf = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<|begin_of_text|>", eos_token="<|end_of_text|>"
    )
    tok = HFTokenizer(hf)
    _, kwargs = PRESETS["tiny-llama"]
    config = AutoConfig.for_model(
        "llama", **{**kwargs, "vocab_size": 448}, bos_token_id=hf.bos_token_id, eos_token_id=hf.eos_token_id
    )
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval().requires_grad_(False)
    return model, tok


def test_hf_tokenizer_json_schemas(bpe_llama):
    model, tok = bpe_llama
    assert len(tok.backend) < model.config.vocab_size, "the model pads its vocabulary past the tokenizer's"
    names = ["person", "nested_user", "scores", "shape", "words"]
    reqs = [
        json_request(tok, name, SCHEMAS[name], temperature=1.0 if i % 2 else 0.0, seed=i)
        for i, name in enumerate(names)
    ]
    engine = Engine(model, tok, EngineConfig(mode="async", num_kv_blocks=512))
    results = {r.request_id: r for r in engine.generate(reqs)}
    for name in names:
        r = results[name]
        assert r.finish_reason == FinishReason.STOP, (name, r.finish_reason, r.error, r.text)
        jsonschema.validate(json.loads(r.text), SCHEMAS[name])
    assert any(len(tok.decode([t])) > 1 for r in results.values() for t in r.token_ids), (
        "multi-byte tokens used"
    )
