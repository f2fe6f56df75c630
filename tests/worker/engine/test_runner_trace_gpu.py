"""`bench engine --trace` on CUDA: each step's device spans, from timing-enabled events placed on the host clock by
the tracer's calibration, come in stream order and sit inside the run on the host clock."""

from __future__ import annotations

import itertools
import time

import pytest
import torch

from worker.bench.trace import COMPUTE, D2H, H2D, PREP, WAIT, StepTracer
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import load_model

from .conftest import make_requests

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_device_spans_are_ordered_per_stream_and_on_the_host_clock(mode):
    model, tok = load_model("small-llama", torch.device("cuda"), torch.bfloat16)
    engine = Engine(model, tok, EngineConfig(device="cuda", mode=mode))
    reqs = make_requests(tok, 16, seed=5, max_prompt=200, max_new=24)
    engine.generate(reqs)  # warm-up: graphs and kernels
    tracer = StepTracer(engine.device)
    engine.trace_steps(tracer)
    engine.generate([r.__class__(f"t{r.request_id}", r.prompt_ids, r.sampling) for r in reqs])
    engine.trace_steps(None)
    end = time.perf_counter() - tracer.origin
    assert tracer.num_steps == tracer.num_prepared > 0
    for track in (PREP, H2D, COMPUTE, D2H, WAIT):
        spans = tracer.track_spans(track)
        assert len(spans) == tracer.num_steps
        assert [s.step for s in spans] == list(range(tracer.num_steps)), track  # stream order is step order
        for a, b in itertools.pairwise(spans):
            assert a.end <= b.start + 1e-6, (track, a, b)
        assert all(-1e-3 <= s.start <= s.end <= end + 1e-3 for s in spans), track
    by_step = {(s.track, s.step): s for s in tracer.spans}
    for step in range(tracer.num_steps):  # a step's stages follow one another on the device
        assert by_step[H2D, step].end <= by_step[COMPUTE, step].start + 1e-5  # each waits on the one before
        assert by_step[COMPUTE, step].end <= by_step[D2H, step].start + 1e-5
        assert by_step[D2H, step].end <= by_step[WAIT, step].end + 1e-3  # the host saw the copy done after it ended
    del engine
    torch.cuda.empty_cache()
