"""The engine at --tensor-parallel-size 2 over gloo on the CPU, for the families whose layouts need more than
splitting separate q/k/v and gate/up linears (test_parallel_engine.py covers those): greedy output equals
`model.generate` (fp32) token for token, with chunked prefill, preemption and the prefix cache.

- tiny-phi3: q/k/v and gate/up shipped fused (each rank reads its rows of each block), Phi-4-mini's partial rotary.
- tiny-glm4: gate/up shipped fused, q/k/v biases, interleaved partial rotary.

The presets (random weights, the same seed on every rank) are the reference models; each (preset, mode) spawns one
helper process, so the cases are few and the requests small.
"""

from __future__ import annotations

import pytest
import torch

from worker.engine.engine_builder import build_engine
from worker.engine.models import load_model
from worker.engine.parallel.runner import ShardRunner

from .conftest import hf_generate
from .test_parallel_engine import CONFIG, make_requests

# A smaller cache than test_parallel_engine.py's: the presets' requests end sooner (the byte tokenizer's eos).
SMALL_CACHE = dict(CONFIG, num_kv_blocks=10)
CASES = [("tiny-phi3", "sync"), ("tiny-phi3", "async"), ("tiny-glm4", "async")]


@pytest.fixture(scope="module")
def references():
    """Per preset: the requests and `model.generate`'s greedy tokens for each."""
    built = {}
    requests = make_requests(None)
    for preset in sorted({preset for preset, _ in CASES}):
        model, tokenizer = load_model(preset, torch.device("cpu"), torch.float32)
        eos = sorted(tokenizer.eos_token_ids)
        built[preset] = {r.request_id: hf_generate(model, r, eos, eos[0]) for r in requests}
    return requests, built


@pytest.mark.parametrize(("preset", "mode"), CASES)
def test_greedy_equals_generate_at_tp2(references, preset, mode):
    requests, reference = references
    engine = build_engine(preset, mode=mode, tensor_parallel_size=2, **SMALL_CACHE)
    try:
        assert isinstance(engine.runner, ShardRunner) and engine.runner.state.world_size == 2
        results = engine.generate(requests)
        for request, result in zip(requests, results, strict=True):
            assert result.token_ids == reference[preset][request.request_id], request.request_id
        assert engine.scheduler.num_preemptions > 0, "the small cache was meant to force preemption"
        assert engine.blocks.num_cache_hits > 0, "the shared prefix was meant to be reused"
        engine.blocks.check_integrity([])
    finally:
        engine.close()
