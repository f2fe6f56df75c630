"""Varlen prefill attention's launch configuration inside W2: W2 async, one process, the engine rebuilt per variant.

    python3 benchmarks/w2_prefill_ab.py                       # every variant once, landed first and last
    python3 benchmarks/w2_prefill_ab.py --rounds 2 landed stages-5
    python3 benchmarks/w2_prefill_ab.py --kernels-only            # the bit-equality check and kernel times only

Each variant swaps `attention_triton._prefill_config` (BLOCK_M, BLOCK_N, warps, stages for full query tiles) while
its engine is built and run. Before the runs it checks, on a random paged batch, that every variant's prefill output
equals the landed one's bit for bit (same KV tile order, so it should), and prints the kernel's time per variant.
  landed      the code as it is
  stages-3    128-row query tiles, 64 keys, 8 warps, 3 stages (the configuration before 2026-11-30, sixth session)
  stages-5    the same with 5 stages
  m64         64-row query tiles, 4 warps, 5 stages
H200 results: benchmarks/README.md, "Pipelined attention loops".
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine import attention_triton as at  # noqa: E402

LANDED = at._prefill_config
VARIANTS = {
    "landed": LANDED,
    "stages-3": lambda head_dim, dtype, device=None: (128, 64, 8, 3),
    "stages-5": lambda head_dim, dtype, device=None: (128, 64, 8, 5),
    "m64": lambda head_dim, dtype, device=None: (64, 64, 4, 5),
}


def check_and_time_kernels(names: list[str]) -> None:
    """Bit-equality against the landed configuration, and the kernel's time, on W2-like prompts."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import gpu_kernels as gk

    lens = [100, 173, 260, 384, 512, 640, 777, 900, 1024]
    case = gk.make_paged(lens, lens)
    runs = {}
    for name in dict.fromkeys(["landed", *names]):
        at._prefill_config = VARIANTS[name]
        out = torch.empty_like(case["q"])
        run = gk.prefill_runner(case, out)
        run()
        runs[name] = (out.clone(), gk.bench(run))
    at._prefill_config = LANDED
    for name, (out, ms) in runs.items():
        equal = torch.equal(out, runs["landed"][0])
        print(f"prefill {len(lens)} prompts of 100-1,024 tokens, {name:9s} {ms * 1e3:7.1f} us  bit-equal to landed: {equal}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", help=f"of {', '.join(VARIANTS)} (default: all, then landed again)")
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--kernels-only", action="store_true", help="skip the engine runs")
    args = parser.parse_args()
    unknown = sorted(set(args.variants) - set(VARIANTS))
    if unknown:
        parser.error(f"unknown variant(s) {', '.join(unknown)}; choose from {', '.join(VARIANTS)}")
    names = args.variants or [*VARIANTS, "landed"]

    from worker.bench.common import make_workload, warmup_requests
    from worker.bench.engine import measure_copy_bandwidth, run_engine_mode
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.models import load_model

    check_and_time_kernels(names)
    if args.kernels_only:
        return
    device = torch.device("cuda")
    model, tokenizer = load_model("llama3-8b", device, torch.bfloat16)
    bandwidth = measure_copy_bandwidth(device)
    vocab_limit = min(model.config.vocab_size, 32000)
    reqs = make_workload("W2", vocab_limit)
    warmup = warmup_requests(reqs, vocab_limit)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; W2 async, max_num_seqs 1024", flush=True)
    first = True
    for round_index in range(args.rounds):
        for name in names:
            at._prefill_config = VARIANTS[name]
            try:
                config = EngineConfig(mode="async", device="cuda", dtype="bfloat16", max_num_seqs=1024,
                                      max_num_batched_tokens=8192)  # fmt: skip
                engine = Engine(model, tokenizer, config)
                engine.generate(warmup)
                if first:  # a process's first run is slow on the device (benchmarks/README.md): absorb it
                    engine.generate(warmup_requests(reqs, vocab_limit, full_length=True))
                    first = False
                res = run_engine_mode(engine, reqs, name, bandwidth)
                print(
                    f"round {round_index} {name:9s} {res.output_tok_s:7,.0f} tok/s  {res.gpu_ms:.2f} GPU ms/step  "
                    f"busy {res.gpu_busy:.3f}  compiles {len(res.extra['triton_compiles'])}",
                    flush=True,
                )
                del engine
                torch.cuda.empty_cache()
            finally:
                at._prefill_config = LANDED


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
