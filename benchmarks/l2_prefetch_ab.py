"""W1 with and without the small step's L2 prefetch (worker/engine/kernels/l2_prefetch.py), one process, one model.

    python3 benchmarks/l2_prefetch_ab.py [--precision fp8] [--share 0 --share 0.5 ...] [--rounds 2] [--out FILE]

The random-weight Llama-3-8B shape at `--precision` (bench engine's names: fp8 is FP8 weights and KV) runs W1
(`--max-num-seqs 32 --max-num-batched-tokens 2048`, async, CUDA graphs) once per share of L2 a launch may
prefetch (L2_PREFETCH_FRACTION; 0: none), the shares in turn for `--rounds` rounds (A B A B: a drift of the device
shows as a difference between rounds, not between shares). Each run builds its own engine, since the share is
read when the step's graphs are captured. Prints output tok/s and device ms per step; --out writes the JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from worker.bench.common import make_workload, warmup_requests  # noqa: E402
from worker.bench.engine import PRECISIONS  # noqa: E402
from worker.engine.config import EngineConfig  # noqa: E402
from worker.engine.engine import Engine  # noqa: E402
from worker.engine.kernels import l2_prefetch  # noqa: E402
from worker.engine.models import load_model  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama3-8b")
    parser.add_argument("--precision", choices=list(PRECISIONS), default="fp8")
    parser.add_argument("--share", type=float, action="append")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    shares = args.share or [0.0, l2_prefetch.L2_PREFETCH_FRACTION]
    settings = PRECISIONS[args.precision]
    model, tok = load_model(args.model, torch.device("cuda"), torch.bfloat16, quantization=settings["quantization"])
    reqs = make_workload("W1", 32000)
    runs = []
    for round_ in range(args.rounds):
        for share in shares:
            l2_prefetch.L2_PREFETCH_FRACTION = share
            config = EngineConfig(
                mode="async", max_num_seqs=32, max_num_batched_tokens=2048,
                quantization=settings["quantization"], kv_cache_dtype=settings["kv_cache_dtype"] or "auto",
            )  # fmt: skip
            engine = Engine(model, tok, config)
            engine.generate(warmup_requests(reqs, 32000, full_length=not runs))  # compiles, and the first-run effect
            engine.reset_stats()
            t0 = time.perf_counter()
            results = engine.generate(reqs)
            wall = time.perf_counter() - t0
            stats = engine.stats()
            tokens = sum(len(s.token_ids) for r in results for s in r.all_samples)
            run = dict(
                round=round_, share=share, output_tok_s=tokens / wall, steps=stats.steps,
                gpu_ms_per_step=1000 * stats.busy_seconds / max(stats.steps, 1),
            )  # fmt: skip
            runs.append(run)
            print(
                f"round {round_} prefetch {share:4g} of L2: {run['output_tok_s']:8.1f} output tok/s  "
                f"gpu {run['gpu_ms_per_step']:.3f} ms/step",
                flush=True,
            )
            engine.close()
            del engine
            torch.cuda.empty_cache()
    report = dict(
        model=args.model, precision=args.precision, workload="W1", device=torch.cuda.get_device_name(),
        l2_bytes=l2_prefetch.l2_bytes(torch.cuda.current_device()), date=time.strftime("%Y-%m-%d"), runs=runs,
    )  # fmt: skip
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")


if __name__ == "__main__":
    main()
