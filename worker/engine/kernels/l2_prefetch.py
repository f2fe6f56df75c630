"""Weight bytes pulled into L2 while a kernel waits for its input (programmatic dependent launch). Owns nothing.

Why: a small decode step is a chain of short kernels (pdl.py), each a stream of weight bytes behind a fixed cost of
a few microseconds (the wait for its predecessor, the pipeline's fill, the epilogue). During those microseconds
DRAM idles. Under PDL a kernel's programs are already on the SMs while the kernel before them runs, and weights
are the one input no kernel of the step writes, so a program may ask for its own weight rows before its PDL wait:
the bytes then stream from DRAM into L2 during its predecessor, and the GEMM's loads find them there. Measured on
the H200 for the FP8 small step: benchmarks/fp8_step_gemm.py --chain (`prefetch` rows), docs/performance.md#fp8.

How: one `cp.async.bulk.prefetch.L2` (sm90: a bulk request for up to 4 GB of contiguous bytes, no registers, no
shared memory, nothing to wait for) per chunk of each weight row the program owns. A launch prefetches at most
L2_PREFETCH_FRACTION of the device's L2 in all, so that what it asks for is still there when it reads it and the
predecessor's own bytes are not pushed out: a weight larger than that gets the first part of each row (the part
its loop reads first).

(The bf16 small step measured a prefetch of the first 1,024 bytes of each row in 2026-11 and found nothing: W1
5,721 vs 5,699 tok/s. That asked for 1/8 of the weights; this asks for all of them where they fit.)
"""

from __future__ import annotations

import functools

import torch

from .common import HAVE_TRITON, tl, triton

# The share of the device's L2 one launch may prefetch (0: no prefetch anywhere).
L2_PREFETCH_FRACTION = 0.5
# Each row's prefetched bytes go as this many bulk requests: a program of 64 rows then issues 256, two per thread
# of four warps (a [64] tensor alone would repeat each row's request in two threads).
PREFETCH_CHUNKS = 4
L2_LINE_BYTES = 128
DEFAULT_L2_BYTES = 50 * 1024 * 1024  # GH100 (H100, H200), where the device does not say


@functools.cache
def l2_bytes(device_index: int) -> int:
    return getattr(torch.cuda.get_device_properties(device_index), "L2_cache_size", 0) or DEFAULT_L2_BYTES


def prefetch_chunk(
    weight_bytes: int, row_elems: int, element_size: int, device: torch.device, pdl: bool,
    fraction: float | None = None,
) -> int:  # fmt: skip
    """Elements per chunk (PREFETCH_CHUNKS a row) that each program prefetches of each of its weight rows, whose
    K range is `row_elems` long, for a launch that reads `weight_bytes` of weights in all: 0 (no prefetch) off
    CUDA or without PDL (no window before the wait), else the largest whole number of L2 lines that keeps the
    launch within `fraction` (default L2_PREFETCH_FRACTION) of the device's L2."""
    fraction = L2_PREFETCH_FRACTION if fraction is None else fraction
    if not pdl or device.type != "cuda" or fraction <= 0 or weight_bytes <= 0:
        return 0
    index = device.index if device.index is not None else torch.cuda.current_device()
    share = min(1.0, fraction * l2_bytes(index) / weight_bytes)
    line = L2_LINE_BYTES // element_size
    return int(row_elems * share) // PREFETCH_CHUNKS // line * line


def weight_prefetch_chunk(weight: torch.Tensor, split: int, pdl: bool) -> int:
    """`prefetch_chunk` for a launch that reads all of `weight` [N, K], each program the rows it owns over one of
    `split` equal K ranges: the PREFETCH_CHUNK argument of the small-step GEMM kernels."""
    size = weight.element_size()
    return prefetch_chunk(weight.numel() * size, weight.shape[1] // split, size, weight.device, pdl)


if HAVE_TRITON:
    _CHUNKS = tl.constexpr(PREFETCH_CHUNKS)

    @triton.jit
    def prefetch_rows_to_l2(row_ptrs, CHUNK: tl.constexpr):
        """Ask L2 for PREFETCH_CHUNKS x CHUNK elements from each of `row_ptrs` (a [R] tensor of each weight row's first
        element to read). Nothing to wait for and nothing returned: the bytes arrive in L2 or, under pressure,
        do not, and the loads that follow read them from wherever they are."""
        ELEMENT_BYTES: tl.constexpr = row_ptrs.dtype.element_ty.primitive_bitwidth // 8
        starts = row_ptrs[:, None] + (tl.arange(0, _CHUNKS) * CHUNK).to(tl.int64)[None, :]
        sizes = tl.full(starts.shape, CHUNK * ELEMENT_BYTES, tl.int32)
        tl.inline_asm_elementwise(
            "cp.async.bulk.prefetch.L2.global [$1], $2; // $0 unused",
            "=r,l,r",
            [starts, sizes],
            dtype=tl.int32,
            is_pure=False,
            pack=1,
        )
