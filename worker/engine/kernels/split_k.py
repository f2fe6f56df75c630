"""Split-K for the small-step GEMMs: a tile's K range shared by SPLIT_K programs, reduced by the last to finish,
in a fixed order. Owns the per-device tile counters.

Why: a small decode step's GEMM is a stream of weight bytes, and a program owns BLOCK_N (64: the wgmma's least)
whole weight rows. A 4096-row projection is then 64 programs on the H200's 132 SMs, and half the SMs stream
nothing (FP8 O and down at 1.5-1.9 TB/s against gate/up's 3.3 with 224 programs: h200/2026-12-01f). Splitting
K gives SPLIT_K times as many programs, each streaming 1/SPLIT_K of the rows' bytes.

How a split tile finishes (`split_k_sum`), in one kernel, no second launch: every program stores its fp32
partial product in the launch's workspace, then (after a CTA barrier, so every thread's store is ordered before
it) adds 1 to its tile's counter with acquire-release semantics. The program that sees SPLIT_K - 1 arrivals
before its own is the tile's last: it loads the SPLIT_K partials in split order, sums them (partial 0 +
partial 1 + ..., so the bits do not depend on which program came last), runs the epilogue, and sets the counter
back to 0. The others store nothing more. The counters therefore rest at 0 between launches, which is what a
CUDA graph replaying the launch needs; kernels that share them run one after another on the device's one
stream (a PDL successor reads nothing before its predecessor has completed: pdl.py).

The sum differs from the unsplit kernel's only by where the K chain is cut (each split accumulates its own K
range, then the partials add in fp32), so a split GEMM agrees with the emulation as the unsplit one does, not
bit for bit with it.
"""

from __future__ import annotations

import functools

import torch

from .common import HAVE_TRITON, tl, triton

# Tiles a split launch may have (programs over N times programs over M): 4096-row tiles of 64 rows at M = 32 is
# 64; a 1M-row weight would be 16,384. One int32 each, allocated once per device.
MAX_SPLIT_TILES = 1 << 16


@functools.cache
def _counters(device: torch.device) -> torch.Tensor:
    return torch.zeros(MAX_SPLIT_TILES, dtype=torch.int32, device=device)


def tile_counters(device: torch.device) -> torch.Tensor:
    """The device's tile counters, all 0 between launches (allocated on first use: the decoder's first eager
    step, before any CUDA graph is captured)."""
    if device.type == "cuda" and device.index is None:
        device = torch.device("cuda", torch.cuda.current_device())
    return _counters(device)


def split_workspace(split_k: int, tiles: int, block_n: int, block_m: int, device: torch.device) -> torch.Tensor:
    """The fp32 partials of one split launch, [split_k, tiles, block_n, block_m] (written before read)."""
    assert tiles <= MAX_SPLIT_TILES, f"{tiles} tiles exceed split_k.MAX_SPLIT_TILES"
    return torch.empty(split_k, tiles, block_n, block_m, dtype=torch.float32, device=device)


@functools.cache
def sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def split_for(tiles: int, k_tiles: int, device: torch.device, fill: float, choices: tuple[int, ...]) -> int:
    """The least split in `choices` that gives the launch at least `fill` programs per SM, among those that divide
    `k_tiles` (where none reaches it, the largest that divides: a small model's GEMMs); 1 off CUDA (the
    interpreter's tests pass their split)."""
    if device.type != "cuda":
        return 1
    sms = sm_count(device.index if device.index is not None else torch.cuda.current_device())
    dividing = [split for split in sorted(choices) if k_tiles % split == 0]
    return next((split for split in dividing if tiles * split >= fill * sms), max(dividing, default=1))


if HAVE_TRITON:

    @triton.jit
    def split_k_sum(acc, partial_ptr, counter_ptr, SPLIT_K: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr):
        """(the tile's whole product [BLOCK_N, BLOCK_M], whether this program is its last) for a program of a grid
        (tiles over N, tiles over M, SPLIT_K) whose partial product is `acc`. Only the last program's sum is the
        product; the others' is not to be stored."""
        num_tiles = tl.num_programs(0) * tl.num_programs(1)
        tile = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
        offsets = tl.arange(0, BLOCK_N)[:, None] * BLOCK_M + tl.arange(0, BLOCK_M)[None, :]
        tile_ptr = partial_ptr + tile.to(tl.int64) * (BLOCK_N * BLOCK_M) + offsets
        split_stride = num_tiles.to(tl.int64) * (BLOCK_N * BLOCK_M)
        tl.store(tile_ptr + tl.program_id(2) * split_stride, acc)
        tl.debug_barrier()  # every thread's partial is stored before the arrival that publishes it
        arrived = tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel")
        last = arrived == SPLIT_K - 1
        tl.debug_barrier()
        mask = (offsets >= 0) & last
        total = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for split in tl.static_range(SPLIT_K):  # split order, whichever program came last
            total += tl.load(tile_ptr + split * split_stride, mask=mask, other=0.0, cache_modifier=".cg")
        tl.atomic_xchg(counter_ptr + tile, 0, mask=last, sem="relaxed")
        return total, last
