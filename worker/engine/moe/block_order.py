"""What the grouped expert GEMMs' programs share before their K loop, the bf16 kernel (triton_moe.py) and the FP8
one (triton_fp8.py): the order in which they take their blocks (`grouped_block`) and a block's rows, columns and
first operand pointers (`block_operands`). Owns nothing."""

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

    @triton.jit
    def block_operands(
        a_ptr, w_ptr, sorted_pairs_ptr, block_expert_ptr, pid_m, pid_n, num_pairs, N, K, stride_we,
        TOP_K: tl.constexpr, GATE_UP: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):  # fmt: skip
        """(expert, pairs, is_pair, a_rows, cols, is_col, ks, a_ptrs, w_ptrs) of row block `pid_m` (BLOCK_M sorted pairs of
        one expert; padding slots hold num_pairs or more) and column block `pid_n`: the rows of A it reads (x's
        token row pair // TOP_K for gate/up, the pair itself for down), the weight columns it computes, and the
        pointers to the first K tile of A [BLOCK_M, BLOCK_K] and of the expert's weight^T [BLOCK_K, BLOCK_N]."""
        expert = tl.load(block_expert_ptr + pid_m).to(tl.int64)
        pairs = tl.load(sorted_pairs_ptr + pid_m * BLOCK_M + tl.arange(0, BLOCK_M))
        is_pair = pairs < num_pairs
        a_rows = (pairs // TOP_K).to(tl.int64) if GATE_UP else pairs.to(tl.int64)
        cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        is_col = cols < N
        ks = tl.arange(0, BLOCK_K)
        a_ptrs = a_ptr + a_rows[:, None] * K + ks[None, :]
        w_ptrs = w_ptr + expert * stride_we + cols[None, :].to(tl.int64) * K + ks[:, None]
        return expert, pairs, is_pair, a_rows, cols, is_col, ks, a_ptrs, w_ptrs
