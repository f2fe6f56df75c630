"""What decode attention costs inside W1's step: W1 async, one process, the engine rebuilt per variant.

    python3 benchmarks/w1_attention_ab.py                      # every variant once, landed code first and last
    python3 benchmarks/w1_attention_ab.py --rounds 2 landed reduce-2-warps

Each variant swaps `kernels.attention.paged_decode_attention` (or one of its rules) while its engine is built and
run, so its CUDA graphs capture the swapped kernel. The stubs give wrong tokens on purpose: they time the step
with attention's KV reads (or the whole attention) taken out, not a usable engine.
  landed          the code as it is
  none            no attention kernel at all (the O projection reads q): what the rest of the step costs
  stub            the landed kernels, every context clamped to 1 token: their launches and waits, no KV reads
  stub-1-split    the same with one split (one kernel, no reduce)
  splits-2        at most 2 context splits (faster at W1's shape, but the split count then changes with the
                  batch size where sync and async steps differ: see kernels.attention.decode_num_splits)
  reduce-2-warps  the split-K reduce with the rule before 2026-11-30 (2 warps, 4 from 2,048 values)
  stages-5        the split kernel with 5 pipeline stages instead of 3 (K/V tile t+1 loads while tile t computes)
  1-split-stages-5  the same with one split: no reduce kernel, batch-invariant, 28.6 against 33.5 us alone
H200 results for the last two: benchmarks/README.md, "Pipelined attention loops" (h200/2026-11-30g).
H200 results: benchmarks/README.md, "Where W1's attention time goes" (log: h200/2026-11-30f/w1_attention_ab.log).
"""

from __future__ import annotations

import functools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.bench.ab import chosen_variants, run_engine_ab, variant_parser  # noqa: E402
from worker.engine.kernels import attention as at  # noqa: E402

LANDED = at.paged_decode_attention


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


# Each variant: the kernels.attention attributes it swaps while its engine is built and run.
VARIANTS = {
    "landed": {},
    "none": dict(paged_decode_attention=_no_attention),
    "stub": dict(paged_decode_attention=_clamped()),
    "stub-1-split": dict(paged_decode_attention=_clamped(max_num_splits=1)),
    "splits-2": dict(paged_decode_attention=functools.partial(LANDED, max_num_splits=2)),
    "reduce-2-warps": dict(_reduce_warps=lambda elements: 4 if elements >= 2048 else 2),
    "stages-5": dict(_decode_config=lambda head_dim, dtype: (64, 4, 5)),
    "1-split-stages-5": dict(
        paged_decode_attention=functools.partial(LANDED, max_num_splits=1),
        _decode_config=lambda head_dim, dtype: (64, 4, 5),
    ),
}


def main() -> None:
    parser = variant_parser(__doc__, VARIANTS)
    args = parser.parse_args()
    names = chosen_variants(parser, args, VARIANTS)
    run_engine_ab(at, VARIANTS, names, args.rounds, "W1", max_num_seqs=32, max_num_batched_tokens=2048)


if __name__ == "__main__":
    t0 = time.time()
    main()
    print(f"done in {time.time() - t0:.0f} s")
