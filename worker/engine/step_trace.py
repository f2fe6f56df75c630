"""The trace hooks of one step: `StageMarks`, where its H2D copy, compute and D2H copy start and end.

Made only while a tracer is set (`bench engine --trace`: `Engine.trace_steps` sets `ModelRunner.tracer`); the
runner records the marks as it queues each stage and hands them to the tracer's `on_step` when it waits for the
step (worker/bench/trace.py reads them). Without a tracer no mark is made and nothing here runs.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class StageMarks:
    """Where one step's stages start and end. On CUDA, timing-enabled events recorded on each stage's stream
    (compute's are the step's own timing events); on CPU, where the stages run in turn on the host,
    `time.perf_counter()` seconds."""

    h2d_start: Any = None
    h2d_end: Any = None
    compute_start: Any = None
    compute_end: Any = None
    d2h_start: Any = None
    d2h_end: Any = None

    @classmethod
    def for_cuda(cls, compute_start: torch.cuda.Event, compute_end: torch.cuda.Event) -> StageMarks:
        """Fresh timing events for the copies; compute's are the step's own `start`/`end`."""
        h2d_start, h2d_end, d2h_start, d2h_end = (torch.cuda.Event(enable_timing=True) for _ in range(4))
        return cls(h2d_start, h2d_end, compute_start, compute_end, d2h_start, d2h_end)
