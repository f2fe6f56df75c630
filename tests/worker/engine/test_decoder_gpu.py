"""GPU checks of the owned decoder against transformers' forward (the reference it is built from):
bf16 graphs + async vs HF eager + sync, seeded sampling through the in-graph greedy path, and fp32
against `model.generate` for the Llama, Qwen3 and Qwen2 shapes. Run on the H200; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from worker.engine.models import load_model

from .conftest import hf_greedy, make_requests
from .test_engine_gpu import run, token_agreement

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def small_bf16():
    return load_model("small-llama", torch.device("cuda"), torch.bfloat16)


@pytest.mark.parametrize("temperature", [0.0, 0.8])
def test_owned_graph_async_first_tokens_match_hf_eager_sync_bf16(small_bf16, temperature):
    """The owned decoder in bf16 against transformers' forward, the reference it is built from, on each
    request's first token (the prompt's forward, plus its seeded draw). Whole greedy continuations are not
    compared: since transformers' model runs its own unfused norms and rotary (fused_ops retired), the two round
    differently in bf16, and on random weights one flipped near-tie changes the rest of a sequence (64-token
    agreement fell from ~0.97 to ~0.47 when the swap was retired, while fp32 stays exact: below)."""
    model, tok = small_bf16
    reqs = make_requests(tok, 48, seed=3, max_prompt=600, max_new=1, temperature=temperature)
    hf, n0 = run(model, tok, reqs, mode="sync", use_cuda_graphs=False, decoder="hf")
    owned, n1 = run(model, tok, reqs, mode="async", use_cuda_graphs=True, decoder="owned")
    assert n0 == 0 and n1 > 0
    agreement = token_agreement(owned, hf)
    assert agreement >= 0.9, f"owned graph+async vs hf eager+sync agree on {agreement:.4f} of first tokens"


@pytest.mark.parametrize("name", ["small-llama", "tiny-qwen3", "tiny-qwen2"])
def test_owned_fp32_equals_generate(name):
    model, tok = load_model(name, torch.device("cuda"), torch.float32)
    reqs = make_requests(tok, 24, seed=5, max_prompt=400, max_new=32)
    ref = [hf_greedy(model, tok, r) for r in reqs]
    for mode in ("sync", "async"):
        out, _ = run(
            model, tok, reqs, mode=mode, dtype="float32", max_num_batched_tokens=256, decoder="owned"
        )
        agreement = token_agreement(out, ref)
        assert agreement >= 0.99, f"{name} {mode}: owned fp32 vs generate agree on {agreement:.4f} of tokens"
