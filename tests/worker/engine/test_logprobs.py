"""Logprobs: the chosen token's log-probability and top-k alternatives equal log_softmax of the model's own
logits at that position (fp32, CPU), for greedy, sampled and constrained requests, in sync and async mode."""

from __future__ import annotations

import json

import pytest
import torch

from worker.engine.api import Constraint, ConstraintKind, EngineRequest, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 99}, "ok": {"type": "boolean"}},
    "required": ["n", "ok"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def llama():
    """The engine's own tiny-llama; the reference runs on the shared, untouched instance (same weights)."""
    return load_model("tiny-llama", torch.device("cpu"), torch.float32)


def requests(tok) -> list[EngineRequest]:
    json_constraint = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
    params = {
        "greedy5": SamplingParams(10, logprobs=5),
        "sampled20": SamplingParams(10, temperature=1.3, top_p=0.8, seed=3, logprobs=20),
        "chosen_only": SamplingParams(10, temperature=0.7, top_k=5, seed=4, logprobs=0),
        "constrained3": SamplingParams(30, logprobs=3, constraint=json_constraint),
        "no_logprobs": SamplingParams(10, temperature=1.0, seed=5),
    }
    return [
        EngineRequest(name, tok.encode(f"{name}: once upon a time" + "x" * 7 * i), p)
        for i, (name, p) in enumerate(params.items())
    ]


@pytest.fixture(scope="module")
def results(llama):
    model, tok = llama
    out = {}
    for mode in ("sync", "async"):
        engine = Engine(model, tok, EngineConfig(mode=mode, num_kv_blocks=256))
        out[mode] = {r.request_id: r for r in engine.generate(requests(tok))}
    return out


def test_logprobs_equal_log_softmax_of_the_model_logits(results, tiny_models, llama):
    ref_model, _ = tiny_models("tiny-llama")
    _, tok = llama
    for req in requests(tok):
        r = results["async"][req.request_id]
        assert r.finish_reason != FinishReason.ERROR, r.error
        k = req.sampling.logprobs
        if k is None:
            assert r.logprobs is None
            continue
        ends_on_eos = r.token_ids[-1] in tok.eos_token_ids  # a final EOS is no text and has no logprob
        assert [lp.token_id for lp in r.logprobs] == r.token_ids[: len(r.token_ids) - ends_on_eos]
        ids = torch.tensor([req.prompt_ids + r.token_ids])
        with torch.no_grad():
            logits = ref_model(ids).logits[0].float()
        expected = torch.log_softmax(logits, dim=-1)[len(req.prompt_ids) - 1 : -1]
        for i, lp in enumerate(r.logprobs):
            assert abs(lp.logprob - expected[i, lp.token_id].item()) < 1e-4, (req.request_id, i)
            assert len(lp.top) == k
            top_values, top_ids = expected[i].topk(k) if k else (torch.empty(0), torch.empty(0))
            assert [t for t, _ in lp.top] == top_ids.tolist(), (req.request_id, i)
            assert torch.allclose(torch.tensor([v for _, v in lp.top]), top_values, atol=1e-4)


def test_greedy_chosen_token_is_the_top_alternative(results):
    r = results["async"]["greedy5"]
    assert all(lp.top[0] == (lp.token_id, lp.logprob) for lp in r.logprobs)


def test_constrained_logprobs_are_from_the_raw_distribution(results):
    """The constrained output's tokens are often not the model's favourites: their raw logprobs show it."""
    r = results["async"]["constrained3"]
    assert json.loads(r.text)["ok"] in (True, False)
    assert any(lp.top[0][0] != lp.token_id for lp in r.logprobs)
    assert all(lp.logprob <= lp.top[0][1] + 1e-6 for lp in r.logprobs)


def test_logprobs_are_identical_in_sync_and_async(results):
    for name, r in results["sync"].items():
        assert r.token_ids == results["async"][name].token_ids
        assert r.logprobs == results["async"][name].logprobs, name


def test_logprobs_bound_is_checked():
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=21)
    with pytest.raises(ValueError, match="logprobs"):
        SamplingParams(logprobs=-1)
