"""act·mul + per-token quantization of a large step's gate/up output on the H200, per launch configuration.

    python3 benchmarks/act_mul_quant.py [--m 8192 --m 2048]

Times quant/kernels.act_mul_per_token_quant (the FP8 model's down-projection input in a large step) at Llama-3-8B's
intermediate size (14,336) for each (BLOCK, num_warps) in LAUNCHES, one program a row: a BLOCK below the row's
length takes two passes over it (absmax, then quantize: the row read twice), one at or above it a single pass from
registers. Against fused.act_mul (the bf16 model's kernel: the same gate/up bytes read once, twice the e4m3 rows'
bytes written). Every launch must give the first one's bits. Prints us per call and the gate/up bytes per second.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from worker.engine.kernels import fused as fk  # noqa: E402
from worker.engine.quant import kernels as qk  # noqa: E402

INTER = 14336
LAUNCHES = [(1024, 4), (2048, 8), (4096, 8), (4096, 16), (16384, 16), (16384, 32)]


def time_us(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000)
    return sorted(times)[len(times) // 2]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--m", type=int, action="append")
    args = parser.parse_args()
    torch.manual_seed(0)
    landed = qk._row_block
    print(f"{torch.cuda.get_device_name()} torch {torch.__version__}; us per call (gate/up GB/s, read once)")
    for m in args.m or [8192, 2048]:
        gate_up = torch.randn(m, 2 * INTER, device="cuda", dtype=torch.bfloat16) * 3
        read = gate_up.numel() * gate_up.element_size()
        us = time_us(lambda gu=gate_up: fk.act_mul(gu, act=fk.ACT_SILU))
        print(f"M={m:5d} bf16 act_mul               {us:8.1f} us  {read / us / 1e3:6.0f} GB/s", flush=True)
        print(f"M={m:5d} landed launch: {landed(INTER)}", flush=True)
        want = None
        for launch in LAUNCHES:
            qk._row_block = lambda cols, lc=launch: lc  # the launcher reads it at each call
            got = qk.act_mul_per_token_quant(gate_up, fk.ACT_SILU)
            want = want or got
            assert torch.equal(got.x.view(torch.uint8), want.x.view(torch.uint8)), launch
            assert torch.equal(got.scale, want.scale), launch
            us = time_us(lambda gu=gate_up: qk.act_mul_per_token_quant(gu, fk.ACT_SILU))
            print(f"M={m:5d} act_mul+quant {str(launch):12s} {us:8.1f} us  {read / us / 1e3:6.0f} GB/s", flush=True)
        qk._row_block = landed


if __name__ == "__main__":
    main()
