"""GPU checks of constrained decoding and logprobs on the CUDA path (streams, deferred masked sampling after
a graph replay, pinned bitmask and logprob buffers). Run on the H200 by benchmarks/run_gpu.sh; skipped
without CUDA."""

from __future__ import annotations

import json

import jsonschema
import pytest
import torch

from worker.engine.api import Constraint, ConstraintKind, EngineRequest, FinishReason, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

from .json_schemas import SCHEMAS

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def batch(tok) -> list[EngineRequest]:
    reqs = []
    for i, (name, schema) in enumerate(SCHEMAS.items()):
        for temp in (0.0, 1.0):
            params = SamplingParams(
                200,
                temperature=temp,
                seed=i,
                logprobs=3 if i % 3 == 0 else None,
                constraint=Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(schema)),
            )
            reqs.append(EngineRequest(f"{name}-{temp}", tok.encode(f"{name}:"), params))
    for i in range(24):  # unconstrained neighbours, some with logprobs
        params = SamplingParams(
            8 + 5 * i, temperature=0.8 if i % 2 else 0.0, seed=i, logprobs=(i % 4) * 5 or None
        )
        reqs.append(EngineRequest(f"plain{i}", tok.encode("y" * (1 + 13 * i)), params))
    return reqs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_constrained_and_logprobs_on_cuda_sync_equals_async(dtype):
    model, tok = load_model("small-llama", torch.device("cuda"), dtype)
    reqs = batch(tok)
    out = {}
    for mode in ("sync", "async"):
        engine = Engine(model, tok, EngineConfig(device="cuda", mode=mode, max_num_seqs=64))
        out[mode] = {r.request_id: r for r in engine.generate(reqs)}
        assert engine.stats().mask_seconds > 0
        engine.blocks.check_integrity([])
        del engine
        torch.cuda.empty_cache()
    for req in reqs:
        s, a = out["sync"][req.request_id], out["async"][req.request_id]
        assert s.token_ids == a.token_ids, req.request_id
        assert (s.logprobs is None) == (req.sampling.logprobs is None)
        if s.logprobs:
            ends_on_eos = s.token_ids[-1] in tok.eos_token_ids  # a final EOS is no text and has no logprob
            assert [lp.token_id for lp in s.logprobs] == s.token_ids[: len(s.token_ids) - ends_on_eos]
            for x, y in zip(s.logprobs, a.logprobs, strict=True):
                assert abs(x.logprob - y.logprob) < 1e-5 and len(x.top) == req.sampling.logprobs
                assert x.logprob <= x.top[0][1] + 1e-3 if x.top else x.logprob <= 0
        name = req.request_id.rsplit("-", 1)[0]
        if req.sampling.constraint is not None:
            assert s.finish_reason == FinishReason.STOP, (req.request_id, s.finish_reason, s.text)
            jsonschema.validate(json.loads(s.text), SCHEMAS[name])
