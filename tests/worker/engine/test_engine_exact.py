"""The engine's greedy output equals `model.generate` token for token (fp32, CPU), in sync and async mode,
with chunked prefill, forced preemption and requests arriving mid-generation, through transformers'
forward ("hf") and through cbq's owned decoder ("owned")."""

from __future__ import annotations

import zlib

import pytest

from worker.engine.config import EngineConfig
from worker.engine.engine import Engine

from .conftest import FAMILY_DECODERS, generate_with_late_arrivals, hf_greedy, make_requests

NUM_REQUESTS = 32
DECODERS = ["hf", "owned"]
SCENARIOS = {
    "default": dict(),
    "chunked_prefill": dict(max_num_batched_tokens=48),
    "preemption": dict(num_kv_blocks=40, max_num_batched_tokens=256),
}

_REFERENCES: dict[str, tuple[list, dict]] = {}


def references(tiny_models, name: str):
    if name not in _REFERENCES:
        model, tok = tiny_models(name)
        # NOTE: not hash(name): str hashes change per process (PYTHONHASHSEED), and so would the requests
        reqs = make_requests(tok, NUM_REQUESTS, seed=zlib.crc32(name.encode()) % 1000)
        _REFERENCES[name] = (reqs, {r.request_id: hf_greedy(model, tok, r) for r in reqs})
    return _REFERENCES[name]


def assert_diverse(ref: dict[str, list[int]]) -> None:
    """Random weights must give varied text, or token-for-token equality would prove little."""
    all_tokens = [t for ids in ref.values() for t in ids]
    assert len(set(all_tokens)) >= 40, f"only {len(set(all_tokens))} distinct tokens in the references"
    long_outputs = [ids for ids in ref.values() if len(ids) >= 10]
    assert long_outputs and all(len(set(ids)) >= 3 for ids in long_outputs), "a reference repeats one token"


@pytest.mark.parametrize("mode", ["sync", "async"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize(("name", "decoder"), FAMILY_DECODERS)
def test_greedy_equals_generate(tiny_models, name, scenario, mode, decoder):
    model, tok = tiny_models(name)
    reqs, ref = references(tiny_models, name)
    assert_diverse(ref)
    engine = Engine(model, tok, EngineConfig(mode=mode, decoder=decoder, **SCENARIOS[scenario]))
    assert (engine.runner.decoder is not None) == (decoder == "owned")
    results = engine.generate(reqs)
    for req, res in zip(reqs, results, strict=True):
        assert res.token_ids == ref[req.request_id], f"{req.request_id} (prompt {len(req.prompt_ids)} tokens)"
        assert res.usage.completion_tokens == len(res.token_ids)
    if scenario == "preemption":
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
    if scenario == "chunked_prefill":
        assert max(len(r.prompt_ids) for r in reqs) > 48
    engine.blocks.check_integrity([])
    assert engine.blocks.num_free_blocks == engine.blocks.num_usable_blocks


@pytest.mark.parametrize("decoder", DECODERS)
@pytest.mark.parametrize("mode", ["sync", "async"])
def test_requests_arriving_mid_generation(tiny_models, mode, decoder):
    """Half the requests are added while the loop thread is generating for the other half."""
    model, tok = tiny_models("tiny-llama")
    reqs, ref = references(tiny_models, "tiny-llama")
    config = EngineConfig(mode=mode, decoder=decoder, max_num_batched_tokens=96, num_kv_blocks=80)
    results = generate_with_late_arrivals(Engine(model, tok, config), reqs, 16)
    by_id = {r.request_id: r for r in results}
    assert sorted(by_id) == sorted(r.request_id for r in reqs)
    for req in reqs:
        assert by_id[req.request_id].token_ids == ref[req.request_id], req.request_id
