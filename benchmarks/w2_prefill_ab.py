"""Varlen prefill attention's launch configuration inside W2: W2 async, one process, the engine rebuilt per variant.

    python3 benchmarks/w2_prefill_ab.py                       # every variant once, landed first and last
    python3 benchmarks/w2_prefill_ab.py --rounds 2 landed stages-5
    python3 benchmarks/w2_prefill_ab.py --kernels-only            # the bit-equality check and kernel times only

Each variant swaps `kernels.attention._prefill_config` (BLOCK_M, BLOCK_N, warps, stages for full query tiles) while
its engine is built and run. Before the runs it checks, on a random paged batch, that every variant's prefill output
equals the landed one's bit for bit (same KV tile order, so it should), and prints the kernel's time per variant.
  landed      the code as it is
  stages-3    128-row query tiles, 64 keys, 8 warps, 3 stages (the configuration before 2026-11-30, sixth session)
  stages-5    the same with 5 stages
  m64         64-row query tiles, 4 warps, 5 stages
H200 results: benchmarks/README.md, "Pipelined attention loops".
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.bench.ab import chosen_variants, patched, run_engine_ab, variant_parser  # noqa: E402
from worker.engine.kernels import attention as at  # noqa: E402

# Each variant: the kernels.attention attributes it swaps while its engine is built and run.
VARIANTS = {
    "landed": {},
    "stages-3": dict(_prefill_config=lambda head_dim, dtype, device=None: (128, 64, 8, 3)),
    "stages-5": dict(_prefill_config=lambda head_dim, dtype, device=None: (128, 64, 8, 5)),
    "m64": dict(_prefill_config=lambda head_dim, dtype, device=None: (64, 64, 4, 5)),
}


def check_and_time_kernels(names: list[str]) -> None:
    """Bit-equality against the landed configuration, and the kernel's time, on W2-like prompts."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_kernels as gk

    lens = [100, 173, 260, 384, 512, 640, 777, 900, 1024]
    case = gk.make_paged(lens, lens)
    runs = {}
    for name in dict.fromkeys(["landed", *names]):
        with patched(at, VARIANTS[name]):
            out = torch.empty_like(case["q"])
            run = gk.prefill_runner(case, out)
            run()
            runs[name] = (out.clone(), gk.bench(run))
    for name, (out, ms) in runs.items():
        equal = torch.equal(out, runs["landed"][0])
        print(f"prefill {len(lens)} prompts of 100-1,024 tokens, {name:9s} {ms * 1e3:7.1f} us  bit-equal to landed: {equal}")


def main() -> None:
    parser = variant_parser(__doc__, VARIANTS)
    parser.add_argument("--kernels-only", action="store_true", help="skip the engine runs")
    args = parser.parse_args()
    names = chosen_variants(parser, args, VARIANTS)
    check_and_time_kernels(names)
    if not args.kernels_only:
        run_engine_ab(at, VARIANTS, names, args.rounds, "W2", max_num_seqs=1024, max_num_batched_tokens=8192)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
