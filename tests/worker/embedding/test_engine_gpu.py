"""The embedding engine on CUDA against sentence-transformers' `encode` on the same checkpoint and device: fp32 to
the CPU test's bound, bf16 to a looser one (run on the H200 by benchmarks/run_gpu.sh's `embedtests`)."""

from __future__ import annotations

import pytest
import torch

from tests.worker.embedding.test_engine import _run, _texts
from worker.embedding.engine import EmbeddingEngine, EmbeddingRequest

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]


@pytest.mark.parametrize("dtype, cosine_min", [("fp32", 0.99999), ("bf16", 0.99)])
@pytest.mark.parametrize("family", ["qwen3", "mistral", "bert", "xlm_roberta", "modernbert"])
def test_cuda_equals_sentence_transformers(family, dtype, cosine_min, embedding_checkpoints):
    from sentence_transformers import SentenceTransformer

    path = embedding_checkpoints[family]
    torch_dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[dtype]
    texts = _texts(64, seed=2)
    st = SentenceTransformer(str(path), device="cuda", model_kwargs={"dtype": torch_dtype})
    reference = st.encode(texts, convert_to_tensor=True, batch_size=16).float().cpu()
    engine = EmbeddingEngine.from_model(str(path), device="cuda", dtype=dtype, max_num_batched_tokens=2048)
    requests = [EmbeddingRequest(f"r{i}", engine.tokenizer.encode(engine.spec.prompt + t)) for i, t in enumerate(texts)]
    results = _run(engine, requests)
    got = torch.tensor([results[f"r{i}"].embedding for i in range(len(texts))])
    cosine = torch.nn.functional.cosine_similarity(got, reference, dim=-1)
    assert cosine.min().item() >= cosine_min, cosine


@pytest.mark.parametrize("family", ["qwen3", "mistral", "bert", "xlm_roberta"])
def test_cuda_packed_equals_the_transformers_forward_bf16(family, embedding_checkpoints):
    """The packed forward (the owned decoder's Triton kernels for decoders, transformers' modules with the packed
    attention for encoders) against transformers' padded forward on the same bf16 weights: what W7's before/after
    compares."""
    path = embedding_checkpoints[family]
    hf = EmbeddingEngine.from_model(str(path), device="cuda", dtype="bf16", decoder="hf", max_num_batched_tokens=4096)
    packed = EmbeddingEngine(hf.model, hf.tokenizer, hf.spec, hf.pad_token_id, hf.device, max_batch_tokens=4096)
    assert packed.forward == "packed" and packed._packed is not None
    assert not hf.spec.is_decoder or packed._packed.decoder.use_triton  # type: ignore[union-attr]
    batch = [hf.tokenizer.encode(hf.spec.prompt + t) for t in _texts(64, seed=3)]
    want = torch.tensor(hf.embed(batch))
    got = torch.tensor(packed.embed(batch))
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min().item() >= 0.999, cosine
