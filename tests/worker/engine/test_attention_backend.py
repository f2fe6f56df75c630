"""The transformers integration: an Engine adopts a model without breaking the model's own generate()."""

from __future__ import annotations

import torch

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.engine import Engine
from worker.engine.models import load_model

from .conftest import hf_greedy


def test_generate_still_works_after_an_engine_adopted_the_model():
    model, tok = load_model("tiny-llama", torch.device("cpu"), torch.float32)
    req = EngineRequest("a", tok.encode("hello paged world"), SamplingParams(max_new_tokens=12))
    before = hf_greedy(model, tok, req)
    engine = Engine(model, tok)
    assert model.config._attn_implementation == "cbq_paged"
    assert engine.generate([req])[0].token_ids == before
    assert hf_greedy(model, tok, req) == before  # plain forwards fall back to sdpa
