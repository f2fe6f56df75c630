"""Prompt logprobs on the CUDA path (owned decoder, Triton attention, CUDA graphs for the decodes beside them,
streams): the values equal a transformers forward over the prompt, in fp32 closely and in bf16 on a long prompt
whose rows span several steps (the row bound). Run on the H200; skipped without CUDA."""

from __future__ import annotations

import random

import pytest
import torch

from worker.engine.api import EngineRequest, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def prompt(seed: int, length: int) -> list[int]:
    rng = random.Random(seed)
    return [1] + [rng.randrange(3, 300) for _ in range(length - 1)]


def reference(model, ids: list[int]) -> torch.Tensor:
    """Before any engine registers its attention on `model`: transformers' own forward."""
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    return torch.log_softmax(logits, dim=-1).cpu()


def max_error(result, req: EngineRequest, expected: torch.Tensor) -> float:
    entries = result.prompt_logprobs
    assert entries is not None and len(entries) == len(req.prompt_ids) and entries[0] is None
    worst = 0.0
    for p, entry in enumerate(entries[1:], start=1):
        assert entry.token_id == req.prompt_ids[p] and len(entry.top) == req.sampling.prompt_logprobs
        worst = max(worst, abs(entry.logprob - expected[p - 1, entry.token_id].item()))
    return worst


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_fp32_prompt_logprobs_equal_transformers(mode):
    model, tok = load_model("small-llama", torch.device("cuda"), torch.float32)
    reqs = [
        EngineRequest(f"s{i}", prompt(i, 50 + 97 * i), SamplingParams(i % 3, ignore_eos=True, prompt_logprobs=i % 4))
        for i in range(8)
    ] + [EngineRequest(f"g{i}", prompt(100 + i, 40), SamplingParams(24, ignore_eos=True)) for i in range(16)]
    expected = {r.request_id: reference(model, r.prompt_ids) for r in reqs if r.sampling.prompt_logprobs is not None}
    engine = Engine(model, tok, EngineConfig(device="cuda", dtype="float32", mode=mode, max_num_batched_tokens=256))
    results = {r.request_id: r for r in engine.generate(reqs)}
    assert len(engine.runner.graphs) > 0  # the decodes beside the prefills replay graphs
    for req in reqs:
        r = results[req.request_id]
        assert r.finish_reason != FinishReason.ERROR, r.error
        if req.request_id in expected:
            assert max_error(r, req, expected[req.request_id]) < 1e-3, req.request_id
            if req.sampling.max_new_tokens == 0:
                assert r.token_ids == [] and r.finish_reason == FinishReason.LENGTH
        else:
            assert r.prompt_logprobs is None and len(r.token_ids) == 24


def test_bf16_long_prompt_across_steps():
    """3,000 prompt tokens, 20 alternatives each: rows over several steps (at most 1,024 a step), a prefix cache
    hit bypassed, and the values close to transformers' bf16 forward."""
    model, tok = load_model("small-llama", torch.device("cuda"), torch.bfloat16)
    ids = prompt(7, 3000)
    expected = reference(model, ids)
    engine = Engine(model, tok, EngineConfig(device="cuda", mode="async"))
    engine.generate([EngineRequest("warm", ids, SamplingParams(2))])  # caches the prompt's blocks
    req = EngineRequest("score", ids, SamplingParams(0, prompt_logprobs=20))
    [r] = engine.generate([req])
    assert r.usage.cached_tokens == 0
    errors = torch.tensor([abs(e.logprob - expected[p - 1, e.token_id].item()) for p, e in enumerate(r.prompt_logprobs[1:], 1)])
    assert errors.mean().item() < 0.1 and errors.max().item() < 1.0  # bf16 rounding, both sides, (errors.mean().item(), errors.max().item())
