"""W4A16 weight GEMMs: y = x @ W^T (+ bias) with W held as packed 4-bit integers, dequantized in registers.
Owns nothing.

The weight is read in cbq's one INT4 form (quant/int4/packed.py `Int4Linear`), passed here as its tensors so
that this module stays below quant/: qweight int32 [N, K / 8] (value k of a row at bits 4 * (k % 8) of word
k // 8), scales [N, K / g] in the model dtype, zeros uint8 [N, K / g] or None (symmetric: every zero is 8).
Act-order releases (a column permutation) are the caller's: x is gathered by the permutation before the GEMM
(quant/int4/linear.py), so the kernel reads the stored columns in order.

Why: a decode step streams every weight byte once; at 4 bits a weight is a quarter of its bf16 bytes (plus a
scale per group), so a memory-bound decode step reads ~3.5x fewer bytes of linear weights. The dequantization is
arithmetic on values already in registers, which a memory-bound kernel has issue slots for (how many is what the
H200's measurements of the tiles and splits below decide).

The GEMM kernel has two launch shapes (`launch_config`):
  small steps (M <= decode_gemm.MAX_TOKENS): decode_gemm's layout, a program owns BLOCK_N weight rows and the
      step's few x rows (the weight rows are the MMA's long side), K split over programs (kernels/split_k.py)
      where the launch would otherwise leave SMs idle; it takes part in programmatic dependent launch (pdl.py)
  large steps: the same program over a 2-D grid of (BLOCK_N rows, BLOCK_M rows of x) tiles, each weight tile
      dequantized to x's dtype inside the GEMM; or, where `large_step_kernel` says so (many rows), the weight
      dequantized once by `dequantize_weight` and multiplied by cuBLAS. The choice is that function's alone.
The decoder's small steps also take two fused variants, as decode_gemm's: the fused [gate; up] weight with act·mul in
the epilogue (`gated_act`: a program owns BLOCK_N gate rows and the up rows that pair with them; rounded as the GEMM
then fused.act_mul round), and the QKV weight with decode_gemm's rotary + KV-write epilogue (`w4a16_qkv_rope_write`,
over decode_gemm's rotary-pair tile rows).

Per K tile (`tile_dot`): the tile's words are loaded once each, shifted and masked to 0..15 (eight nibbles per
word), turned into floats without a conversion instruction (`exact_values`), the group's zero subtracted and its
scale multiplied in fp32, rounded to x's dtype (the twin's dequantized weight, bit for bit), then multiplied with
fp32 accumulation: either the nibbles reshaped into column order and one dot, or one dot per nibble position over
the x columns it holds (`UNPACK`). A K tile never spans two groups (BLOCK_K divides the group size), so a tile reads
one scale (and zero) per row.

Launches depend only on shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from . import split_k as sk
from .common import HAVE_TRITON, cdiv, dot_precision, next_pow2, tl, triton
from .decode_gemm import MAX_TOKENS, ROPE_PAIRS, rope_epilogue_args

if HAVE_TRITON:
    from .decode_gemm import qkv_rope_epilogue, rope_tile_rows
    from .fused import activation
    from .pdl import pdl_wait_and_release
    from .split_k import split_k_sum

PACK = 8  # 4-bit values per int32 word (quant/int4/packed.py)

# (BLOCK_N, BLOCK_K, num_warps, num_stages). Not yet swept on the H200: the small-step tile is decode_gemm's
# WIDE_CONFIG (64 rows, the wgmma's least, and 128-column K tiles = one group of the usual group size 128); the
# large-step tile is a common Hopper GEMM tile with room for the dequantization in registers.
SMALL_STEP_CONFIG = (64, 128, 4, 4)
LARGE_STEP_CONFIG = (128, 64, 8, 3)
LARGE_BLOCK_M = 64
MIN_BLOCK_K = 16  # the MMA's least K
# Split-K of small steps: the least split of SPLIT_CHOICES giving SPLIT_FILL programs per SM (split_k.split_for),
# for products of at least SPLIT_MIN_K_TILES K tiles. A 4096-row projection is 64 programs of 64 rows on 132 SMs.
# More than one program per SM (FP8's rule is 0.9): a W4A16 program issues several unpacking instructions per weight
# byte it reads, so an SM needs more programs in flight to keep its loads streaming. Unmeasured: at 1.8, QKV, O and
# down split in four, gate/up (448 programs) not at all; `benchmarks/w4a16_gemm.py --sweep` times each split.
SPLIT_FILL = 1.8
SPLIT_CHOICES = (1, 2, 4, 8)
SPLIT_MIN_K_TILES = 16
# Large steps: this file's tiled GEMM (each weight tile dequantized in registers by every one of the M / BLOCK_M
# programs that read it) up to DEQUANTIZE_FROM_M rows, above that the weight dequantized once to the model dtype
# (`dequantize_weight`, a transient [N, K] tensor) and then cuBLAS. Why a row bound: the tiled kernel's unpacking
# grows with M while dequantizing once costs ~2.5 bytes of traffic per weight whatever M is. Measured
# (`benchmarks/w4a16_gemm.py`, H100, 2026-12-06): at 512 rows the tiled kernel took 922 us on gate/up, the
# dequantization then cuBLAS 281 (bf16 alone 156), and the same 3.3-3.8x on every projection: every large step
# dequantizes. None sends every large step to the tiled kernel.
DEQUANTIZE_FROM_M: int | None = MAX_TOKENS + 1
DEQUANTIZE_CONFIG = (64, 128, 4, 1)  # (BLOCK_N, BLOCK_K, num_warps, num_stages) of the dequantization kernel
# How a K tile's nibbles meet the MMA (`tile_dot`): reshaped into column order, or each nibble position its own dot
# over the x columns it holds. By nibble position was the faster on every Llama-3-8B projection at 1, 8 and 32 rows
# (`benchmarks/w4a16_gemm.py`, H100, 2026-12-06): gate/up 64.7 vs 101.9 us at one row, down 60.8 vs 72.9 at 32.
UNPACK_RESHAPE, UNPACK_NIBBLES = 0, 1
UNPACK = UNPACK_NIBBLES


def unpack_for(block_k: int, unpack: int | None = None) -> int:
    """`unpack` (default UNPACK) where the K tile allows it: by nibble position needs BLOCK_K / 8 columns a dot, at
    least the MMA's least K."""
    unpack = UNPACK if unpack is None else unpack
    return unpack if block_k >= 8 * MIN_BLOCK_K else UNPACK_RESHAPE


def usable(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the W4A16 kernels run here: Triton on CUDA, bf16 or fp16 activations (the CPU and fp32 take the
    twin; the interpreter's tests call the kernels directly)."""
    return HAVE_TRITON and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16)


def large_step_kernel(m: int, n: int, k: int) -> bool:
    """Whether a step of `m` rows (more than MAX_TOKENS) takes this file's tiled GEMM (True) or the weight
    dequantized once, then cuBLAS (False): the one place that choice is made."""
    return DEQUANTIZE_FROM_M is None or m < DEQUANTIZE_FROM_M


def block_k_for(config_k: int, group_size: int) -> int | None:
    """The K tile: the largest power of two up to `config_k` that divides the group size (a tile then reads one
    scale per row), or None where that is below the MMA's least K."""
    block_k = config_k
    while block_k >= MIN_BLOCK_K and group_size % block_k:
        block_k //= 2
    return block_k if block_k >= MIN_BLOCK_K else None


def block_m_for(m: int) -> int:
    """Rows of x per program: small steps M rounded up to a power of two, at least 16; large steps LARGE_BLOCK_M."""
    return LARGE_BLOCK_M if m > MAX_TOKENS else max(16, next_pow2(m))


def launch_config(m: int, group_size: int, dtype: torch.dtype) -> tuple[int, int, int, int] | None:
    """(BLOCK_N, BLOCK_K, num_warps, num_stages) for a step of `m` rows, or None where the group size does not tile
    (the caller takes the twin)."""
    block_n, config_k, warps, stages = SMALL_STEP_CONFIG if m <= MAX_TOKENS else LARGE_STEP_CONFIG
    block_k = block_k_for(config_k, group_size)
    if block_k is None:
        return None
    if dtype == torch.float32:  # tests only: fp32 tiles take twice the shared memory per stage
        stages = 2
    return block_n, block_k, warps, stages


def split_for(n_tiles: int, m_tiles: int, k_tiles: int, device: torch.device, split_k: int | None = None) -> int:
    """The split of a small-step launch over its K tiles: `split_k` where given (it must divide them), else 1 for
    shallow products and split_k.py's fill rule for deep ones."""
    if split_k is not None:
        assert split_k >= 1 and k_tiles % split_k == 0, f"split_k {split_k} does not divide {k_tiles} K tiles"
        return split_k
    if k_tiles < SPLIT_MIN_K_TILES:
        return 1
    return sk.split_for(n_tiles * m_tiles, k_tiles, device, SPLIT_FILL, SPLIT_CHOICES)


if HAVE_TRITON:

    @triton.jit
    def group_scale_zero(scales_ptr, zeros_ptr, group_offsets, group, n_mask, HAS_ZEROS: tl.constexpr, BLOCK_N: tl.constexpr):
        """Each row's scale of the tile's group in fp32, and its zero as 2^23 + zero (`exact_values`)."""
        scale = tl.load(scales_ptr + group_offsets + group, mask=n_mask, other=0.0).to(tl.float32)
        if HAS_ZEROS:
            zero = tl.load(zeros_ptr + group_offsets + group, mask=n_mask, other=0).to(tl.float32) + 8388608.0
        else:
            zero = tl.full([BLOCK_N], 8388616.0, tl.float32)  # 2^23 + 8
        return scale, zero

    @triton.jit
    def exact_values(nibbles, zero, scale, dtype: tl.constexpr):
        """(q - zero) * scale rounded to `dtype`, for int32 `nibbles` q in 0..15: q's bits put under 2^23's exponent
        are the float 2^23 + q (one OR, where a conversion instruction runs at a sixteenth of the FMA rate), minus
        2^23 + zero is q - zero exactly, and the product with a 16-bit scale is exact in fp32, so the one rounding is
        packed.dequantize's: the twin's bits."""
        q = (nibbles | 0x4B000000).to(tl.float32, bitcast=True)  # 0x4B000000: 2^23's bits
        return ((q - zero[:, None]) * scale[:, None]).to(dtype)

    @triton.jit
    def dequantized_tile(
        qw_ptrs,  # [BLOCK_N, BLOCK_K / 8] pointers to the tile's words
        scales_ptr,
        zeros_ptr,
        group_offsets,  # [BLOCK_N]: each row's first group in scales/zeros
        group,  # the tile's group (a tile lies in one: BLOCK_K divides the group size)
        n_mask,
        dtype: tl.constexpr,
        HAS_ZEROS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        """The weight tile [BLOCK_N, BLOCK_K] in `dtype`: each word loaded once, shifted by 0, 4, ..., 28 into
        [BLOCK_N, BLOCK_K / 8, 8] nibbles whose row-major order is the columns' (column k is nibble k % 8 of word
        k // 8), then `exact_values`: packed.dequantize's arithmetic, bit for bit."""
        scale, zero = group_scale_zero(scales_ptr, zeros_ptr, group_offsets, group, n_mask, HAS_ZEROS, BLOCK_N)
        words = tl.load(qw_ptrs, mask=n_mask[:, None], other=0)
        shifts = (tl.arange(0, 8) * 4)[None, None, :]
        nibbles = (words[:, :, None] >> shifts) & 0xF  # the arithmetic shift's sign bits are masked off
        return exact_values(tl.reshape(nibbles, [BLOCK_N, BLOCK_K]), zero, scale, dtype)

    @triton.jit
    def tile_dot(
        acc,
        qw_ptrs,  # [BLOCK_N, BLOCK_K / 8] pointers to the tile's words
        x_rows,  # [1, BLOCK_M] pointers to each x row's first column of the tile
        scales_ptr,
        zeros_ptr,
        group_offsets,
        group,
        n_mask,
        m_mask,
        HAS_ZEROS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        UNPACK: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """acc + W tile @ x tile^T ([BLOCK_N, BLOCK_M] fp32). UNPACK_RESHAPE: the weight tile in column order
        (`dequantized_tile`), one dot over the tile's x columns. UNPACK_NIBBLES: no reshape (a layout change that
        goes through shared memory): the tile's nibble j of every word, the columns j, j + 8, ..., is its own
        [BLOCK_N, BLOCK_K / 8] operand, multiplied by those x columns (a strided load of a few rows), eight dots; the
        same products, summed in another order."""
        dtype = x_rows.dtype.element_ty
        if UNPACK == 0:
            w = dequantized_tile(qw_ptrs, scales_ptr, zeros_ptr, group_offsets, group, n_mask, dtype, HAS_ZEROS,
                                 BLOCK_N, BLOCK_K)  # fmt: skip
            x = tl.load(x_rows + tl.arange(0, BLOCK_K)[:, None], mask=m_mask[None, :], other=0.0)
            acc = tl.dot(w, x, acc, input_precision=DOT_PREC)
        else:
            scale, zero = group_scale_zero(scales_ptr, zeros_ptr, group_offsets, group, n_mask, HAS_ZEROS, BLOCK_N)
            words = tl.load(qw_ptrs, mask=n_mask[:, None], other=0)
            strided = (tl.arange(0, BLOCK_K // 8) * 8)[:, None]
            for j in tl.static_range(8):
                w = exact_values((words >> (4 * j)) & 0xF, zero, scale, dtype)
                x = tl.load(x_rows + strided + j, mask=m_mask[None, :], other=0.0)
                acc = tl.dot(w, x, acc, input_precision=DOT_PREC)
        return acc

    @triton.jit
    def _w4a16_dequantize_kernel(
        qw_ptr,
        scales_ptr,
        zeros_ptr,
        out_ptr,  # [N, K] in the model dtype
        N,
        stride_qn,
        stride_sn,
        stride_on,
        GROUP_SIZE: tl.constexpr,
        HAS_ZEROS: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        k0 = tl.program_id(1) * BLOCK_K
        n_mask = rn < N
        qw_ptrs = qw_ptr + rn[:, None].to(tl.int64) * stride_qn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :]
        w = dequantized_tile(
            qw_ptrs, scales_ptr, zeros_ptr, rn.to(tl.int64) * stride_sn, k0 // GROUP_SIZE, n_mask,
            out_ptr.dtype.element_ty, HAS_ZEROS, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        out_ptrs = out_ptr + rn[:, None].to(tl.int64) * stride_on + k0 + tl.arange(0, BLOCK_K)[None, :]
        tl.store(out_ptrs, w, mask=n_mask[:, None])

    @triton.jit
    def _w4a16_gemm_kernel(
        x_ptr,  # [M, K] bf16/fp16 (fp32 in tests), columns in the weight's stored order
        qw_ptr,  # int32 [N, K / 8]
        scales_ptr,  # [N, K / GROUP_SIZE]
        zeros_ptr,  # uint8 [N, K / GROUP_SIZE] (HAS_ZEROS)
        bias_ptr,
        out_ptr,
        partial_ptr,  # SPLIT_K > 1: fp32 [SPLIT_K, tiles, BLOCK_N, BLOCK_M] (kernels/split_k.py)
        counter_ptr,  # SPLIT_K > 1: int32 tile counters, 0 between launches
        M,
        N,  # output columns: the weight's rows, or GATED the gate rows (I)
        stride_xm,
        stride_qn,
        stride_sn,
        stride_om,
        K_TILES: tl.constexpr,  # K // BLOCK_K
        GROUP_SIZE: tl.constexpr,
        GATED: tl.constexpr,  # out = act(x @ gate^T) * (x @ up^T), the up rows N rows after the gate rows
        ACT: tl.constexpr,  # fused.ACT_SILU or ACT_GELU_TANH
        HAS_ZEROS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        SPLIT_K: tl.constexpr,  # programs sharing a tile's K range (program_id(2) is the split)
        UNPACK: tl.constexpr,  # UNPACK_RESHAPE or UNPACK_NIBBLES (`tile_dot`)
        USE_PDL: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        pdl_wait_and_release(USE_PDL)  # x is the previous kernel's output
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        n_mask = rn < N
        m_mask = rm < M
        SPLIT_TILES: tl.constexpr = K_TILES // SPLIT_K
        k0 = tl.program_id(2) * (SPLIT_TILES * BLOCK_K)  # this split's first column
        qw_ptrs = qw_ptr + rn[:, None].to(tl.int64) * stride_qn + (k0 // 8 + tl.arange(0, BLOCK_K // 8))[None, :]
        x_rows = x_ptr + rm[None, :].to(tl.int64) * stride_xm + k0  # x tile^T [BLOCK_K, BLOCK_M] from here
        group_ptrs = rn.to(tl.int64) * stride_sn
        up_qw_ptrs = qw_ptrs + N * stride_qn
        up_group_ptrs = group_ptrs + N * stride_sn
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for t in range(SPLIT_TILES):
            group = (k0 + t * BLOCK_K) // GROUP_SIZE
            acc = tile_dot(
                acc, qw_ptrs, x_rows, scales_ptr, zeros_ptr, group_ptrs, group, n_mask, m_mask, HAS_ZEROS, BLOCK_N,
                BLOCK_K, UNPACK, DOT_PREC,
            )  # fmt: skip
            if GATED:
                acc_up = tile_dot(
                    acc_up, up_qw_ptrs, x_rows, scales_ptr, zeros_ptr, up_group_ptrs, group, n_mask, m_mask,
                    HAS_ZEROS, BLOCK_N, BLOCK_K, UNPACK, DOT_PREC,
                )  # fmt: skip
                up_qw_ptrs += BLOCK_K // 8
            qw_ptrs += BLOCK_K // 8
            x_rows += BLOCK_K
        store_mask = m_mask[None, :] & n_mask[:, None]
        if SPLIT_K > 1:  # the tile's last program sums the partials in split order and stores (not with GATED)
            acc, last = split_k_sum(acc, partial_ptr, counter_ptr, SPLIT_K, BLOCK_N, BLOCK_M)
            store_mask = store_mask & last
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
            if GATED:
                acc_up += tl.load(bias_ptr + N + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        if GATED:  # rounded as the GEMM's output then fused.act_mul round it (decode_gemm's gated rule)
            out_dtype = out_ptr.dtype.element_ty
            gate = acc.to(out_dtype).to(tl.float32)
            act = activation(gate, ACT).to(out_dtype).to(tl.float32)
            acc = act * acc_up.to(out_dtype).to(tl.float32)
        out_ptrs = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)

    @triton.jit
    def _w4a16_qkv_rope_kernel(
        x_ptr,
        qw_ptr,  # int32 [(H + 2 KVH) D, K / 8]
        scales_ptr,
        zeros_ptr,
        bias_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        M,
        k_scale_inv,
        v_scale_inv,
        stride_xm,
        stride_qn,
        stride_sn,
        stride_cos,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAIRS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        K_TILES: tl.constexpr,
        GROUP_SIZE: tl.constexpr,
        HAS_ZEROS: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        UNPACK: tl.constexpr,
        USE_PDL: tl.constexpr,
        DOT_PREC: tl.constexpr,
    ):
        """The small-step W4A16 GEMM over decode_gemm's rotary-pair tile rows (a program owns rows j and j + D/2 of one
        head), then decode_gemm's rotary + KV-write epilogue: equals this file's GEMM then fused.qkv_rope_write."""
        pdl_wait_and_release(USE_PDL)  # x is the previous kernel's output
        head, first, col = rope_tile_rows(HEAD_DIM, PAIRS)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        m_mask = rm < M
        rows = col >= 0  # every tile row is a weight row
        qw_ptrs = qw_ptr + col[:, None].to(tl.int64) * stride_qn + tl.arange(0, BLOCK_K // 8)[None, :]
        x_rows = x_ptr + rm[None, :].to(tl.int64) * stride_xm
        group_ptrs = col.to(tl.int64) * stride_sn
        acc = tl.zeros([2 * PAIRS, BLOCK_M], dtype=tl.float32)
        for t in range(K_TILES):
            acc = tile_dot(
                acc, qw_ptrs, x_rows, scales_ptr, zeros_ptr, group_ptrs, (t * BLOCK_K) // GROUP_SIZE, rows, m_mask,
                HAS_ZEROS, 2 * PAIRS, BLOCK_K, UNPACK, DOT_PREC,
            )  # fmt: skip
            qw_ptrs += BLOCK_K // 8
            x_rows += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + col).to(tl.float32)[:, None]
        qkv_rope_epilogue(
            acc, head, first, rm, m_mask, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
            k_scale_inv, v_scale_inv, stride_cos, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
            stride_vch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAIRS, BLOCK_SIZE, BLOCK_M,
        )  # fmt: skip


def w4a16_gemm(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
    config: tuple[int, int, int, int] | None = None,
    block_m: int | None = None,
    split_k: int | None = None,
    gated_act: int | None = None,
    unpack: int | None = None,
) -> torch.Tensor:
    """x [M, K] (columns in the stored order: act-order gathered by the caller) @ W^T (+ bias) -> [M, N] in x's
    dtype, W the packed INT4 weight. The small-step launch for M <= MAX_TOKENS (split over K by `split_for` unless
    `split_k` is given), the tiled one above. `config`/`block_m` override `launch_config`/`block_m_for` (tests,
    benchmarks), `unpack` the module's UNPACK. The caller checks `launch_config` is not None (the group size tiles).
    `gated_act` (fused.ACT_*): W is a fused [gate; up] [2I, K] and the output act(x @ gate^T) * (x @ up^T) [M, I],
    rounded as this GEMM then fused.act_mul round (a program owns BLOCK_N gate rows and their up rows; no split)."""
    m, k = x.shape
    rows, words = qweight.shape
    gated = gated_act is not None
    assert not gated or (rows % 2 == 0 and split_k in (None, 1)), "a gated launch has an even row count, no split"
    n = rows // 2 if gated else rows
    assert words * PACK == k, f"x {tuple(x.shape)} vs qweight {tuple(qweight.shape)}"
    assert x.stride(1) == 1 and qweight.stride(1) == 1 and scales.stride(1) == 1, "rows must be contiguous"
    assert zeros is None or zeros.stride() == scales.stride(), "zeros and scales share a layout"
    config = config or launch_config(m, group_size, x.dtype)
    assert config is not None, f"group size {group_size} does not tile"
    block_n, block_k, num_warps, num_stages = config
    assert group_size % block_k == 0 and k % block_k == 0, f"K {k}, group {group_size} vs BLOCK_K {block_k}"
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    block_m = block_m or block_m_for(m)
    grid = (cdiv(n, block_n), cdiv(m, block_m))
    k_tiles = k // block_k
    split = split_for(*grid, k_tiles, x.device, split_k) if m <= MAX_TOKENS and not gated else (split_k or 1)
    if split > 1:
        partials = sk.split_workspace(split, grid[0] * grid[1], block_n, block_m, x.device)
        counters = sk.tile_counters(x.device)
    else:
        partials = counters = x  # unread placeholders
    _w4a16_gemm_kernel[(grid[0], grid[1], split)](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,  # unread placeholder
        bias if bias is not None else scales,
        out,
        partials,
        counters,
        m,
        n,
        x.stride(0),
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        K_TILES=k_tiles,
        GROUP_SIZE=group_size,
        GATED=gated,
        ACT=gated_act or 0,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        SPLIT_K=split,
        UNPACK=unpack_for(block_k, unpack),
        USE_PDL=pdl,
        DOT_PREC=dot_precision(x.dtype, None),
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
    )
    return out


def dequantize_weight(
    qweight: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, dtype: torch.dtype
) -> torch.Tensor:
    """The packed weight as [N, K] in `dtype`, columns in the stored order: packed.dequantize's values (before its
    act-order restore) in one kernel and no fp32 intermediates. For large steps that multiply it with cuBLAS."""
    n, words = qweight.shape
    k = words * PACK
    block_n, config_k, num_warps, num_stages = DEQUANTIZE_CONFIG
    block_k = block_k_for(config_k, group_size)
    assert block_k is not None and k % block_k == 0, f"group size {group_size} does not tile"
    out = torch.empty(n, k, device=qweight.device, dtype=dtype)
    _w4a16_dequantize_kernel[(cdiv(n, block_n), k // block_k)](
        qweight,
        scales,
        zeros if zeros is not None else scales,  # unread placeholder
        out,
        n,
        qweight.stride(0),
        scales.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def rope_launch_fits(num_heads: int, num_kv_heads: int, head_dim: int, m: int, group_size: int, dtype) -> bool:
    """Whether `w4a16_qkv_rope_write` takes the QKV projection of a step of `m` rows: a small step whose heads hold
    whole groups of decode_gemm.ROPE_PAIRS rotary pairs, in a group size that tiles."""
    config = launch_config(m, group_size, dtype)
    return m <= MAX_TOKENS and config is not None and head_dim % (2 * ROPE_PAIRS) == 0


def w4a16_qkv_rope_write(
    x: torch.Tensor,
    qweight: torch.Tensor,
    scales: torch.Tensor,
    zeros: torch.Tensor | None,
    group_size: int,
    bias: torch.Tensor | None,
    positions: torch.Tensor,
    cos_table: torch.Tensor,
    sin_table: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    pdl: bool = False,
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """q [M, H, D] of x @ qkv^T (+ bias) for the packed fused QKV weight, rotated at `positions`, k (rotated) and v
    written into the paged caches at `slot_mapping` (decode_gemm.decode_qkv_rope_write's contract, x in the stored
    column order). The caller checks `rope_launch_fits`."""
    m, k = x.shape
    head_dim = cos_table.shape[-1]
    assert qweight.shape == ((num_heads + 2 * num_kv_heads) * head_dim, k // PACK) and x.stride(1) == 1
    config = launch_config(m, group_size, x.dtype)
    assert config is not None and head_dim % (2 * ROPE_PAIRS) == 0
    _, block_k, num_warps, num_stages = config
    q = torch.empty(m, num_heads, head_dim, device=x.device, dtype=x.dtype)
    if m == 0:
        return q
    block_m = block_m_for(m)
    _w4a16_qkv_rope_kernel[(qweight.shape[0] // (2 * ROPE_PAIRS), cdiv(m, block_m))](
        x,
        qweight,
        scales,
        zeros if zeros is not None else scales,  # unread placeholder
        bias if bias is not None else scales,
        M=m,
        stride_xm=x.stride(0),
        stride_qn=qweight.stride(0),
        stride_sn=scales.stride(0),
        K_TILES=k // block_k,
        GROUP_SIZE=group_size,
        HAS_ZEROS=zeros is not None,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        UNPACK=unpack_for(block_k),
        USE_PDL=pdl,
        DOT_PREC=dot_precision(x.dtype, None),
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
        **rope_epilogue_args(positions, cos_table, sin_table, slot_mapping, q, k_cache, v_cache, num_kv_heads, kv_scale),
    )
    return q
