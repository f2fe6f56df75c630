"""Gemma 3 with images on the CUDA path (decoder "hf": transformers' layers, cbq's paged attention; "owned": the owned
decoder; steps holding an image's rows attend through the Triton prefill kernel with each row's key limit, the
others through the Triton kernels and decode graphs; the SigLIP tower on the GPU): in fp32, greedy tokens equal `generate` on the same device. Run on
the GPU machine; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from worker.engine.engine import Engine

from .test_engine_gemma3_vision import (  # noqa: F401 - fixtures and helpers
    checkpoint,
    mixed_requests,
    processor,
    processor_inputs,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def reference_cuda(checkpoint):  # noqa: F811 - the imported fixture
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(checkpoint.path, dtype=torch.float32).cuda().eval()


def generate_cuda(processor, model, req) -> list[int]:  # noqa: F811
    inputs = {k: v.cuda() for k, v in processor_inputs(processor, req).items()}
    out = model.generate(**inputs, max_new_tokens=req.sampling.max_new_tokens, do_sample=False, repetition_penalty=1.0)
    return out[0, inputs["input_ids"].shape[1] :].tolist()


@pytest.mark.parametrize("decoder", ["hf", "owned"])
@pytest.mark.parametrize(("mode", "budget"), [("sync", 8192), ("async", 8192), ("async", 270)])
def test_images_equal_generate_on_cuda(checkpoint, processor, reference_cuda, mode, budget, decoder):  # noqa: F811
    reqs = mixed_requests(processor)
    engine = Engine.from_model(
        str(checkpoint.path), device="cuda", dtype="float32", decoder=decoder, mode=mode,
        max_num_batched_tokens=budget, num_kv_blocks=256,
    )  # fmt: skip
    assert (engine.runner.decoder is not None) == (decoder == "owned") and engine.runner.images is not None
    assert len(engine.runner.graphs) > 0  # decode steps replay graphs
    results = engine.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        assert result.token_ids == generate_cuda(processor, reference_cuda, req), req.request_id
    assert engine.runner.images.encode_seconds > 0

