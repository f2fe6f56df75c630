"""Qwen2.5-VL and Qwen3-VL with images on the CUDA path (Triton attention, streams, decode steps padded to the graph
buckets, the vision tower and Qwen3-VL's DeepStack mergers on the GPU): in fp32, greedy tokens equal `generate` on the
same device, with chunked prefill through the images too. Run on the H200 by benchmarks/run_gpu.sh; skipped without
CUDA."""

from __future__ import annotations

import pytest
import torch

from worker.engine.engine import Engine

from .test_engine_vision import checkpoint, generate, mixed_requests, reference_class  # noqa: F401 - fixtures, helpers

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def reference_cuda(checkpoint):  # noqa: F811 - the imported fixture
    return reference_class(checkpoint).from_pretrained(checkpoint.path, dtype=torch.float32).cuda().eval()


def generate_cuda(checkpoint, model, req) -> list[int]:  # noqa: F811
    """`generate` on the GPU: the test module's reference with its inputs moved there."""
    original = model.generate

    def on_device(**inputs):
        return original(**{k: v.cuda() if torch.is_tensor(v) else v for k, v in inputs.items()})

    model.generate = on_device
    try:
        return generate(checkpoint, model, req)
    finally:
        del model.generate


@pytest.mark.parametrize("decoder", ["hf", "owned"])
@pytest.mark.parametrize(("mode", "budget"), [("sync", 8192), ("async", 8192), ("async", 7)])
def test_images_equal_generate_on_cuda(checkpoint, reference_cuda, mode, budget, decoder):  # noqa: F811
    reqs = mixed_requests(checkpoint)
    engine = Engine.from_model(
        str(checkpoint.path), device="cuda", dtype="float32", mode=mode, max_num_batched_tokens=budget,
        num_kv_blocks=256, decoder=decoder,
    )  # fmt: skip
    assert (engine.runner.decoder is not None) == (decoder == "owned") and engine.runner.images is not None
    assert len(engine.runner.graphs) > 0  # decode steps replay graphs at the positions the batch builder wrote
    results = engine.generate(reqs)
    for req, result in zip(reqs, results, strict=True):
        assert result.token_ids == generate_cuda(checkpoint, reference_cuda, req), req.request_id
    assert engine.runner.images.encode_seconds > 0
