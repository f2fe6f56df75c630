"""What decode attention costs inside W1's step: W1 async, one process, the engine rebuilt per variant.

    python3 benchmarks/w1_attention_ab.py                      # every variant once, landed code first and last
    python3 benchmarks/w1_attention_ab.py --rounds 2 landed reduce-2-warps

Each variant swaps `attention_triton.paged_decode_attention` (or one of its rules) while its engine is built and
run, so its CUDA graphs capture the swapped kernel. The stubs give wrong tokens on purpose: they time the step
with attention's KV reads (or the whole attention) taken out, not a usable engine.
  landed          the code as it is
  none            no attention kernel at all (the O projection reads q): what the rest of the step costs
  stub            the landed kernels, every context clamped to 1 token: their launches and waits, no KV reads
  stub-1-split    the same with one split (one kernel, no reduce)
  splits-2        at most 2 context splits (faster at W1's shape, but the split count then changes with the
                  batch size where sync and async steps differ: see attention_triton.decode_num_splits)
  reduce-2-warps  the split-K reduce with the rule before 2026-11-30 (2 warps, 4 from 2,048 values)
  stages-5        the split kernel with 5 pipeline stages instead of 3 (K/V tile t+1 loads while tile t computes)
  1-split-stages-5  the same with one split: no reduce kernel, batch-invariant, 28.6 against 33.5 us alone
H200 results for the last two: benchmarks/README.md, "Pipelined attention loops" (h200/2026-11-30g).
H200 results: benchmarks/README.md, "Where W1's attention time goes" (log: h200/2026-11-30f/w1_attention_ab.log).
"""

from __future__ import annotations

import argparse
import functools
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.engine import attention_triton as at  # noqa: E402

LANDED = at.paged_decode_attention
LANDED_REDUCE_WARPS = at._reduce_warps
LANDED_DECODE_CONFIG = at._decode_config


def _clamped(max_num_splits: int | None = None):
    def attend(q, k_cache, v_cache, block_tables, context_lens, scale, **kw):
        if max_num_splits is not None:
            kw["max_num_splits"] = max_num_splits
        return LANDED(q, k_cache, v_cache, block_tables, context_lens.clamp(max=1), scale, **kw)

    return attend


def _no_attention(q, k_cache, v_cache, block_tables, context_lens, scale, out=None, **kw):
    if out is None:
        return q
    return out.copy_(q)


VARIANTS = {
    "landed": dict(attend=LANDED),
    "none": dict(attend=_no_attention),
    "stub": dict(attend=_clamped()),
    "stub-1-split": dict(attend=_clamped(max_num_splits=1)),
    "splits-2": dict(attend=functools.partial(LANDED, max_num_splits=2)),
    "reduce-2-warps": dict(attend=LANDED, reduce_warps=lambda elements: 4 if elements >= 2048 else 2),
    "stages-5": dict(attend=LANDED, decode_config=lambda head_dim, dtype: (64, 4, 5)),
    "1-split-stages-5": dict(
        attend=functools.partial(LANDED, max_num_splits=1), decode_config=lambda head_dim, dtype: (64, 4, 5)
    ),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("variants", nargs="*", help=f"of {', '.join(VARIANTS)} (default: all, then landed again)")
    parser.add_argument("--rounds", type=int, default=1)
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

    device = torch.device("cuda")
    model, tokenizer = load_model("llama3-8b", device, torch.bfloat16)
    bandwidth = measure_copy_bandwidth(device)
    vocab_limit = min(model.config.vocab_size, 32000)
    reqs = make_workload("W1", vocab_limit)
    warmup = warmup_requests(reqs, vocab_limit)
    print(f"{torch.cuda.get_device_name(device)}, torch {torch.__version__}; W1 async, max_num_seqs 32", flush=True)
    first = True
    for round_index in range(args.rounds):
        for name in names:
            variant = VARIANTS[name]
            at.paged_decode_attention = variant["attend"]
            at._reduce_warps = variant.get("reduce_warps", LANDED_REDUCE_WARPS)
            at._decode_config = variant.get("decode_config", LANDED_DECODE_CONFIG)
            try:
                config = EngineConfig(mode="async", device="cuda", dtype="bfloat16", max_num_seqs=32,
                                      max_num_batched_tokens=2048)  # fmt: skip
                engine = Engine(model, tokenizer, config)
                engine.generate(warmup)
                if first:  # a process's first run is slow on the device (benchmarks/README.md): absorb it
                    engine.generate(warmup_requests(reqs, vocab_limit, full_length=True))
                    first = False
                res = run_engine_mode(engine, reqs, name, bandwidth)
                print(
                    f"round {round_index} {name:15s} {res.output_tok_s:7,.0f} tok/s  {res.gpu_ms:.3f} GPU ms/step  "
                    f"busy {res.gpu_busy:.3f}  compiles {len(res.extra['triton_compiles'])}",
                    flush=True,
                )
                del engine
                torch.cuda.empty_cache()
            finally:
                at.paged_decode_attention = LANDED
                at._reduce_warps = LANDED_REDUCE_WARPS
                at._decode_config = LANDED_DECODE_CONFIG


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
