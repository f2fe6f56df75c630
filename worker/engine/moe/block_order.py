"""The order in which the grouped expert GEMMs' programs take their blocks (`grouped_block`), shared by the bf16
kernel (triton_moe.py) and the FP8 one (triton_fp8.py). Owns nothing."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False

if HAVE_TRITON:

    @triton.jit
    def grouped_block(N, num_blocks_m, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """(row block, column block) of this program: consecutive programs share a column block over GROUP_M row
        blocks, so an expert's weight tile is read from L2 by all of them."""
        pid = tl.program_id(0)
        num_blocks_n = tl.cdiv(N, BLOCK_N)
        group = pid // (GROUP_M * num_blocks_n)
        first_m = group * GROUP_M
        group_size = min(num_blocks_m - first_m, GROUP_M)
        pid_m = first_m + (pid % (GROUP_M * num_blocks_n)) % group_size
        pid_n = (pid % (GROUP_M * num_blocks_n)) // group_size
        return pid_m, pid_n
