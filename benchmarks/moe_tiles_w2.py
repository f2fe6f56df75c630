"""W2 on an MoE shape with the routed experts' large tile tier off (before) and on (after), in one process.

    python3 benchmarks/moe_tiles_w2.py --model deepseek-v2-lite --out-dir DIR

Runs `bench engine --workload W2 --mode async --max-num-seqs 1024 --max-num-batched-tokens 8192 --max-model-len
8192` twice: first with triton_moe.LARGE_FROM_PAIRS raised past any step (every large step on the 64-row _PREFILL
tile, the configuration before 2026-12-06's tuning), then at its value (128 x 128 tiles from 128 pairs an
expert). Writes DIR/w2_moe_tiles_{before,after}.json, the bench's JSON each.
"""

from __future__ import annotations

import argparse
import gc
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.bench.engine import engine_bench  # noqa: E402
from worker.engine.moe import triton_moe  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="deepseek-v2-lite")
    parser.add_argument("--out-dir", default="benchmarks/out")
    args = parser.parse_args()
    tuned = triton_moe.LARGE_FROM_PAIRS
    for label, threshold in (("before", float("inf")), ("after", tuned)):
        triton_moe.LARGE_FROM_PAIRS = threshold
        print(f"== {label}: LARGE_FROM_PAIRS {threshold}", flush=True)
        engine_bench.main(
            [
                "--model", args.model, "--workload", "W2", "--mode", "async", "--max-num-seqs", "1024",
                "--max-num-batched-tokens", "8192", "--max-model-len", "8192",
                "--json-out", str(Path(args.out_dir) / f"w2_moe_tiles_{label}.json"),
            ],
            standalone_mode=False,
        )  # fmt: skip
        gc.collect()  # the first run's model and KV cache, before the second loads its own
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
