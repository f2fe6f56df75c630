"""Mistral Small 3.1 with images on the CUDA path (decoder "hf", Triton attention, decode graphs, Pixtral's encoder on
the GPU): in fp32, greedy tokens equal `generate` on the same device. Run on the GPU machine; skipped without CUDA."""

from __future__ import annotations

import pytest
import torch

from worker.engine.engine import Engine

from .test_engine_mistral3_vision import (  # noqa: F401 - fixtures and helpers
    checkpoint,
    mixed_requests,
    processor_inputs,
    tokenizer,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def reference_cuda(checkpoint):  # noqa: F811 - the imported fixture
    from transformers import Mistral3ForConditionalGeneration

    return Mistral3ForConditionalGeneration.from_pretrained(checkpoint.path, dtype=torch.float32).cuda().eval()


@pytest.mark.parametrize("decoder", ["hf", "owned"])
@pytest.mark.parametrize(("mode", "budget"), [("sync", 8192), ("async", 8192), ("async", 7)])
def test_images_equal_generate_on_cuda(checkpoint, tokenizer, reference_cuda, mode, budget, decoder):  # noqa: F811
    reqs = mixed_requests(tokenizer)
    engine = Engine.from_model(
        str(checkpoint.path), device="cuda", dtype="float32", mode=mode, max_num_batched_tokens=budget,
        num_kv_blocks=256, decoder=decoder,
    )  # fmt: skip
    assert (engine.runner.decoder is not None) == (decoder == "owned") and engine.runner.images is not None
    assert len(engine.runner.graphs) > 0  # decode steps replay graphs at the positions the batch builder wrote
    results = engine.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        inputs = {k: v.cuda() for k, v in processor_inputs(checkpoint, tokenizer, req).items()}
        out = reference_cuda.generate(
            **inputs, attention_mask=torch.ones_like(inputs["input_ids"]), max_new_tokens=req.sampling.max_new_tokens,
            do_sample=False, repetition_penalty=1.0,
        )  # fmt: skip
        assert result.token_ids == out[0, inputs["input_ids"].shape[1] :].tolist(), req.request_id
