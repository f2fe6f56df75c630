"""The engine's host work per step, with the device's work taken out: scheduling, building the step's buffers,
and applying its tokens, for a workload's real request mix. Runs anywhere (CPU); no model compute.

    python3 benchmarks/host_step.py                    # W2, async, as `bench engine` runs it on the H200
    python3 benchmarks/host_step.py --mode sync --repeat 3

Every step's forward and sampling are replaced by nothing: each sampled token is 0 (W2's requests ignore EOS and
run to their lengths), so the scheduler sees the same sequence of batches as a real run. What remains is what the
host spends per step, which async mode hides behind the GPU only while it is shorter than the GPU's step (a small
model's W2 step is a few ms). Results: benchmarks/archive/HISTORY.md, "Host work per step".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.bench.common import WORKLOADS, make_workload  # noqa: E402
from worker.engine import batch, engine, model_runner, scheduler  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.models import load_model  # noqa: E402


def _no_device_work(self, meta, extras):
    slot = self.builder.slots[meta.slot]
    handle = model_runner.StepHandle(meta, slot.sampled_host, None, cpu_seconds=0.0)
    handle.extras, handle.is_sampled = extras, True
    return handle


def _timed(cls, name: str, totals: dict[str, float], key: str) -> None:
    original = getattr(cls, name)

    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return original(*args, **kwargs)
        finally:
            totals[key] += time.perf_counter() - t0

    setattr(cls, name, wrapper)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workload", default="W2", choices=sorted(WORKLOADS))
    parser.add_argument("--mode", default="async", choices=("async", "sync"))
    parser.add_argument("--max-num-seqs", type=int, default=1024)
    parser.add_argument("--max-num-batched-tokens", type=int, default=8192)
    parser.add_argument("--repeat", type=int, default=1)
    args = parser.parse_args()

    model_runner.ModelRunner._launch = _no_device_work
    totals = dict.fromkeys(("schedule", "describe", "build", "apply tokens"), 0.0)
    _timed(scheduler.Scheduler, "schedule", totals, "schedule")
    _timed(engine, "describe_step", totals, "describe")  # the plan's translation into a StepDescription
    _timed(batch.BatchBuilder, "build", totals, "build")
    _timed(engine.Engine, "_process", totals, "apply tokens")
    model, tokenizer = load_model("tiny-llama", torch.device("cpu"), torch.float32)
    config = EngineConfig(
        mode=args.mode, device="cpu", dtype="float32", max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens, num_kv_blocks=200_000,
    )  # fmt: skip
    for _ in range(args.repeat):
        totals.update(dict.fromkeys(totals, 0.0))
        eng = engine.Engine(model, tokenizer, config)
        reqs = make_workload(args.workload, 200)
        t0 = time.perf_counter()
        eng.generate(reqs)
        wall = time.perf_counter() - t0
        steps = max(eng.stats().steps, 1)
        parts = "  ".join(f"{k} {1000 * v / steps:.3f}" for k, v in totals.items())
        print(f"{args.workload} {args.mode}: {steps} steps, {1000 * wall / steps:.3f} ms per step ({parts})", flush=True)


if __name__ == "__main__":
    main()
