"""FP8 weight GEMMs of small decode steps (at most decode_gemm.MAX_TOKENS rows) as one Triton kernel per linear
that takes part in programmatic dependent launch (kernels/pdl.py). Owns nothing.

Why: on the large-step path every FP8 linear is two launches, the per-token quantization kernel and cuBLASLt's
_scaled_mm (kernels.py), and neither is chained by PDL, while the bf16 small-step path runs one PDL kernel per
linear (kernels/decode_gemm.py). Here x (bf16/fp16; a decode step's few rows stay in L2) is quantized inside the
GEMM: every program first takes the absmax of its rows over all of K, then quantizes each K tile to e4m3 just
before the FP8 x FP8 MMA, with fp8.py's formula and rounding (kernels/common.py quantize_to_fp8). No x_fp8 tensor is
written and no quantization kernel runs; the price is that each program reads its x rows twice, from L2.

The layout is decode_gemm's: a program owns BLOCK_N whole weight rows over all of K (deep products, the down
projection, over half or a quarter of K: kernels/split_k.py, SPLIT_MIN_K_TILES), the weight rows are the MMA's long
side (W_tile [BLOCK_N, BLOCK_K] @ x_tile^T), fp32 accumulation. The epilogue multiplies by
x_scale[m], then by w_scale[n], adds the bias and rounds to x's dtype, so it computes fp8_linear_emulated up to
fp32 summation order (the emulation sums the dequantized products in fp64 on the CPU); the quantized x is
fp8.py's bit for bit. `fp8_step_gate_up_act` is the same kernel with act·mul in its epilogue, rounded as the
unfused GEMM then fused.act_mul round (decode_gemm.decode_gate_up_silu's rule): the two agree bit for bit.

Schemes: weights per tensor or per output channel; activations dynamic per token (fbgemm's absmax cap included)
or static per tensor (the checkpoint's input_scale, read on the device: no absmax pass). Block-wise FP8
(per-token-group activations) and shapes that do not tile keep kernels.fp8_linear (its Triton block GEMM, or
quantization + _scaled_mm): `step_config` gives None for them. `fp8_step_qkv_rope_write` is the QKV projection
with decode_gemm.decode_qkv_rope_write's rotary + KV-write epilogue (`qkv_rope_epilogue`, shared): this file's
prologue and products over that kernel's rotary-pair tile rows, each row with its own weight scale (fuse_fp8 makes
the fused q/k/v scales per channel where they differ). It equals this GEMM then fused.qkv_rope_write bit for bit.

Where x is quantized, for dynamic per-token schemes (the same bits every way): inside the GEMM (X_QUANT "gemm"),
by kernels.per_token_quant first (X_QUANT "kernel"), or by the norm before it: `fp8_add_rmsnorm` is the decoder's
add+RMSNorm with the normed rows quantized in the same program (`Fp8Rows`), which the decoder uses where the
norm's one consumer is an FP8 linear that reads per-token rows (layer_ops.rows_for: QKV and gate/up), so
those two linears per layer need no quantization at all. (Large steps do the same, and their act·mul quantizes
down's rows: kernels.act_mul_per_token_quant.)

Measured on the H200 (2026-12-01, benchmarks/h200/2026-12-01e and -01f, fp8_step_gemm.log): the in-GEMM variant
loses to quantization + _scaled_mm on QKV, O and down at M = 32; x quantized first (X_QUANT "kernel", now the
default) beats that pair on all four projections, 1.4-1.5x; the decoder's `decode_gemm` "auto" takes this path since
W1 with FP8 weights ran 1.357x faster through it (2026-12-03). Launches depend only on shapes: CUDA-graph capturable.
"""

from __future__ import annotations

import torch

from ..kernels import fused as fk
from ..kernels import split_k as sk
from ..kernels.common import HAVE_TRITON, tl, triton
from ..kernels.decode_gemm import ROPE_PAIRS, Config, block_m_for, rope_epilogue_args
from .config import ActivationScale, WeightScale
from .fp8 import FP8_DTYPE, FP8_MAX, MIN_ABSMAX, Fp8Linear, Fp8Rows
from .kernels import fp8_linear, per_token_quant

if HAVE_TRITON:
    from ..kernels.common import fp8_row_scale, quantize_to_fp8
    from ..kernels.decode_gemm import qkv_rope_epilogue, rope_tile_rows
    from ..kernels.fused import activation
    from ..kernels.pdl import pdl_wait_and_release
    from ..kernels.split_k import split_k_sum

# (BLOCK_N, BLOCK_K, num_warps, num_stages). The H200 sweep at M = 32 with x quantized first (2026-12-01f,
# fp8_step_gemm.log): 64 x 256 tiles, 4 stages, were the fastest for QKV, O and down (12.3 / 11.0 / 30.6 us vs
# 15.3 / 13.9 / 41.5 at 64 x 128; quantization + _scaled_mm 19.5 / 16.5 / 45.4). A depth that is not a multiple
# of 256 takes the 64 x 128 tiles (SHALLOW_STEP_CONFIG). Gate/up: 64 x 128 within 1% of the sweep's best.
STEP_CONFIG: Config = (64, 256, 4, 4)
SHALLOW_STEP_CONFIG: Config = (64, 128, 4, 4)
GATED_STEP_CONFIG: Config = (64, 128, 4, 4)  # 64 gate rows and the 64 up rows that pair with them
# Unlike bf16 (decode_gemm.MAX_K keeps the K = 14,336 down projection on cuBLAS), the down projection takes this
# kernel too: its alternative is two launches outside the PDL chain, not one. None: any depth. The H200 decides
# (the microbenchmark times down both ways).
MAX_K: int | None = None
# Where a dynamic per-token x is quantized: "gemm" (inside the GEMM, by every program for its own rows: no launch
# more, but each program takes the absmax over all of K before its first product and quantizes the same x tiles
# again) or "kernel" (kernels.per_token_quant first, a link of the PDL chain, then the GEMM reads e4m3 x and the
# row scales: half the x bytes, no prologue). The same bits either way. The H200 sweeps of 2026-12-01 found the
# "gemm" kernel 26-40 us for a 16-25 MB projection at M = 32 whatever its tiles (the prologue's serial loop), and
# "kernel" (the two launches together) faster than quantization + _scaled_mm on every Llama-3-8B projection
# (benchmarks/fp8_step_gemm.py times both).
X_QUANT = "kernel"
X_QUANTS = ("gemm", "kernel")
# Split-K (kernels/split_k.py) for the plain and QKV kernels of deep products (at least SPLIT_MIN_K_TILES K tiles):
# the least split of SPLIT_CHOICES that gives a launch SPLIT_FILL programs per SM. Measured on the H200 at M = 32
# (2026-12-03f, fp8_split_gemm.log, per_token_quant + the GEMM): down (K = 14,336, 56 tiles, 64 programs) 30.4 us
# unsplit, 27.4 at 2, 29.8 at 4; O (16 tiles) 11.2 / 11.4 / 11.7 and QKV 12.4 / 12.8 / 16.0, so those stay whole.
# The layer chain: 85.0 us unsplit, 84.2 with every projection split by the fill rule alone.
SPLIT_FILL = 0.9
SPLIT_CHOICES = (1, 2, 4)
SPLIT_MIN_K_TILES = 32


def fp8_add_rmsnorm(
    x, residual, weight, eps, *, scale_ub: float | None = None, pdl: bool = False, weight_fp32: bool = False,
    centred: bool = False, x_weight: torch.Tensor | None = None, x_scale=None,
) -> tuple[Fp8Rows, torch.Tensor]:  # fmt: skip
    """fused.add_rmsnorm whose normed rows come out quantized per token in the same kernel (the bits of
    add_rmsnorm then kernels.per_token_quant, `scale_ub` its cap): the input of a linear whose scheme is dynamic
    per token, read by this file's kernels without a quantization launch of their own."""
    out = torch.empty(x.shape, dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty(x.shape[0], dtype=torch.float32, device=x.device)
    fp8_out = dict(
        scale_out_ptr=scale, scale_ub=0.0 if scale_ub is None else float(scale_ub), HAS_UB=scale_ub is not None,
        FP8_MAX=FP8_MAX, MIN_ABSMAX=MIN_ABSMAX,
    )  # fmt: skip
    out, total = fk.add_rmsnorm_into(
        out, x, residual, weight, eps, pdl, weight_fp32, x_weight, x_scale, fp8_out, centred=centred
    )
    return Fp8Rows(out, scale, x.dtype), total


def step_config(layer: Fp8Linear, gated: bool = False, config: Config | None = None) -> Config | None:
    """The launch configuration of this file's kernel for `layer` (`gated`: its rows are [gate; up]), or None
    where kernels.fp8_linear keeps it: block-wise or per-token-group scales, or a shape that does not tile."""
    scheme = layer.scheme
    if scheme.weight is WeightScale.BLOCK or scheme.activation is ActivationScale.TOKEN_GROUP:
        return None
    n, k = layer.weight.shape
    if config is None:
        config = GATED_STEP_CONFIG if gated else STEP_CONFIG if k % STEP_CONFIG[1] == 0 else SHALLOW_STEP_CONFIG
    rows = n // 2 if gated else n
    if (gated and n % 2) or rows % config[0] or k % config[1] or (MAX_K is not None and k > MAX_K):
        return None
    return config


def fp8_step_linear(
    x: torch.Tensor,
    layer: Fp8Linear,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
    config: Config | None = None,
    block_m: int | None = None,
    x_quant: str | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """x [M, K] @ w^T (+ bias) in x's dtype, x quantized as the layer's scheme says (where: `x_quant`, default
    X_QUANT), K split over `split_k` programs (default `split_for`); the decoder calls it for M <=
    decode_gemm.MAX_TOKENS. Where `step_config` gives None: kernels.fp8_linear."""
    config = step_config(layer, config=config)
    if config is None or not HAVE_TRITON:
        return fp8_linear(x, layer, bias)
    return _launch(
        x, layer, bias, layer.out_features, config, gated=False, pdl=pdl, block_m=block_m, x_quant=x_quant,
        split_k=split_k,
    )  # fmt: skip


def fp8_step_gate_up_act(
    x: torch.Tensor,
    layer: Fp8Linear,
    bias: torch.Tensor | None = None,
    *,
    pdl: bool = False,
    act: int = fk.ACT_SILU,
    config: Config | None = None,
    block_m: int | None = None,
    x_quant: str | None = None,
) -> torch.Tensor:
    """act(x @ gate^T) * (x @ up^T) [M, I] for the fused FP8 weight [gate; up] ([2I, K], scales and bias [2I]) in
    one kernel; `act` fused.ACT_*. Where `step_config` gives None: the GEMM (fp8_step_linear), then act_mul."""
    config = step_config(layer, gated=True, config=config)
    if config is None or not HAVE_TRITON:
        return fk.act_mul(fp8_step_linear(x, layer, bias, pdl=pdl, x_quant=x_quant), pdl=pdl, act=act)
    inter = layer.out_features // 2
    return _launch(x, layer, bias, inter, config, gated=True, pdl=pdl, block_m=block_m, act=act, x_quant=x_quant)


def rope_step_config(
    layer: Fp8Linear, num_heads: int, num_kv_heads: int, head_dim: int, config: Config | None = None
) -> Config | None:
    """The launch configuration of `fp8_step_qkv_rope_write`'s fused kernel, or None (the two launches): the
    scheme and shape `step_config` takes, each head's half whole groups of decode_gemm.ROPE_PAIRS pairs, and the
    QKV rows (H + 2 KVH) D."""
    config = step_config(layer, config=config)
    rows = (num_heads + 2 * num_kv_heads) * head_dim
    if config is None or head_dim % (2 * ROPE_PAIRS) or config[0] != 2 * ROPE_PAIRS or layer.out_features != rows:
        return None
    return config


def fp8_step_qkv_rope_write(
    x: torch.Tensor,
    layer: Fp8Linear,
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
    config: Config | None = None,
    block_m: int | None = None,
    kv_scale: tuple[float, float] = (1.0, 1.0),
    x_quant: str | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """decode_gemm.decode_qkv_rope_write for the fused FP8 QKV weight: q [M, H, D] with rotary at `positions`, k
    (rotated) and v written into the paged caches at `slot_mapping` (`kv_scale`: an e4m3 cache's (k_scale,
    v_scale)), x quantized inside the GEMM. Equals fp8_step_linear, then fused.qkv_rope_write, bit for bit; that
    pair runs where `rope_step_config` gives None."""
    head_dim = cos_table.shape[-1]
    fused_config = rope_step_config(layer, num_heads, num_kv_heads, head_dim, config)
    if fused_config is None or not HAVE_TRITON:
        qkv = fp8_step_linear(
            x, layer, bias, pdl=pdl, config=config, block_m=block_m, x_quant=x_quant, split_k=split_k
        )
        return fk.qkv_rope_write(
            qkv, positions, cos_table, sin_table, None, None, 0.0, num_heads, num_kv_heads,
            k_cache, v_cache, slot_mapping, pdl=pdl, kv_scale=kv_scale,
        )  # fmt: skip
    m, k = x.shape
    weight = layer.weight
    assert weight.shape[1] == k and x.stride(1) == 1 and weight.stride(1) == 1
    q = torch.empty(m, num_heads, head_dim, device=x.device, dtype=x.dtype)
    if m == 0:
        return q
    block_n, block_k, num_warps, num_stages = fused_config
    block_m = block_m or block_m_for(m)
    x_operand, scheme_args = _x_operand(x, layer, pdl, x_quant)
    grid = (weight.shape[0] // block_n, triton.cdiv(m, block_m))
    split = split_for(*grid, k // block_k, x.device, split_k)
    _fp8_qkv_rope_kernel[(grid[0], grid[1], split)](
        x_operand,
        weight,
        bias_ptr=bias if bias is not None else x_operand,  # unread placeholder: a tensor (Fp8Rows is not one)
        M=m,
        stride_xm=x_operand.stride(0),
        stride_wn=weight.stride(0),
        K_TILES=k // block_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_K=block_k,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
        **scheme_args,
        **rope_epilogue_args(positions, cos_table, sin_table, slot_mapping, q, k_cache, v_cache, num_kv_heads, kv_scale),
        **_split_args(split, grid[0] * grid[1], block_n, block_m, x.device, x_operand),
    )
    return q


def split_for(n_tiles: int, m_tiles: int, k_tiles: int, device: torch.device, split_k: int | None = None) -> int:
    """The split of a launch of n_tiles x m_tiles tiles over k_tiles K tiles: `split_k` where given (it must
    divide k_tiles), else 1 below SPLIT_MIN_K_TILES and kernels/split_k.py's rule with SPLIT_FILL and SPLIT_CHOICES
    above."""
    if split_k is not None:
        assert split_k >= 1 and k_tiles % split_k == 0, f"split_k {split_k} does not divide {k_tiles} K tiles"
        return split_k
    if k_tiles < SPLIT_MIN_K_TILES:
        return 1
    return sk.split_for(n_tiles * m_tiles, k_tiles, device, SPLIT_FILL, SPLIT_CHOICES)


def _split_args(split: int, tiles: int, block_n: int, block_m: int, device: torch.device, placeholder) -> dict:
    """The split-K launch arguments: the partials' workspace and the tile counters (unread placeholders at 1)."""
    if split == 1:
        return dict(partial_ptr=placeholder, counter_ptr=placeholder, SPLIT_K=1)
    workspace = sk.split_workspace(split, tiles, block_n, block_m, device)
    return dict(partial_ptr=workspace, counter_ptr=sk.tile_counters(device), SPLIT_K=split)


def _x_operand(x: torch.Tensor, layer: Fp8Linear, pdl: bool, x_quant: str | None) -> tuple[torch.Tensor, dict]:
    """(x as the kernel reads it, the launch arguments of the scheme): x itself, quantized inside the GEMM, or
    with `x_quant` "kernel" and dynamic per-token activations, e4m3 x and its row scales from per_token_quant."""
    x_quant = x_quant or X_QUANT
    assert x_quant in X_QUANTS, x_quant
    args = _scheme_args(layer)
    if isinstance(x, Fp8Rows):
        assert not args["STATIC_X"] and args["scale_ub"] == (layer.scheme.activation_scale_ub or 0.0), "per token"
        return x.x, dict(args, x_scale_ptr=x.scale, HAS_UB=False, PREQUANT_X=True)
    if x_quant == "gemm" or args["STATIC_X"]:
        return x, args
    x_fp8, x_scale = per_token_quant(x, layer.scheme.activation_scale_ub, pdl=pdl)
    return x_fp8, dict(args, x_scale_ptr=x_scale, HAS_UB=False, PREQUANT_X=True)


def _scheme_args(layer: Fp8Linear) -> dict:
    """The launch arguments, by name, that the layer's scheme sets in this file's kernels: the scales and how
    x is quantized."""
    scheme = layer.scheme
    is_static = scheme.activation is ActivationScale.STATIC
    assert not is_static or layer.input_scale is not None, "static activations come with an input scale"
    ub = scheme.activation_scale_ub
    return dict(
        w_scale_ptr=layer.weight_scale,
        x_scale_ptr=layer.input_scale if is_static else layer.weight_scale,  # unread without static activations
        scale_ub=0.0 if ub is None else float(ub),
        W_SCALE_STRIDE=1 if scheme.weight is WeightScale.CHANNEL else 0,  # 0: one scale, read by every row
        STATIC_X=is_static,
        PREQUANT_X=False,
        HAS_UB=ub is not None,
        FP8_MAX=FP8_MAX,
        MIN_ABSMAX=MIN_ABSMAX,
    )


def _launch(
    x: torch.Tensor,
    layer: Fp8Linear,
    bias: torch.Tensor | None,
    n: int,
    config: Config,
    gated: bool,
    pdl: bool,
    block_m: int | None = None,
    act: int = 0,
    x_quant: str | None = None,
    split_k: int | None = None,
) -> torch.Tensor:
    """out [M, n]: the first n rows of the layer's weight (gated: paired with the n rows after them; never split,
    its 2 x 64 rows a program already give Llama's gate/up 224 programs)."""
    m, k = x.shape
    weight = layer.weight
    assert weight.shape[1] == k, f"x {tuple(x.shape)} vs weight {tuple(weight.shape)}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight rows must be contiguous"
    block_n, block_k, num_warps, num_stages = config
    out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    if m == 0:
        return out
    block_m = block_m or block_m_for(m)
    x_operand, scheme_args = _x_operand(x, layer, pdl, x_quant)
    grid = (n // block_n, triton.cdiv(m, block_m))
    split = 1 if gated else split_for(*grid, k // block_k, x.device, split_k)
    _fp8_step_gemm_kernel[(grid[0], grid[1], split)](
        x_operand,
        weight,
        bias_ptr=bias if bias is not None else x_operand,  # unread placeholder: a tensor (Fp8Rows is not one)
        out_ptr=out,
        M=m,
        up_rows=n,
        stride_xm=x_operand.stride(0),
        stride_wn=weight.stride(0),
        stride_om=out.stride(0),
        K_TILES=k // block_k,
        HAS_BIAS=bias is not None,
        GATED=gated,
        ACT=act,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        USE_PDL=pdl,
        num_warps=num_warps,
        num_stages=num_stages,
        launch_pdl=pdl,
        **scheme_args,
        **_split_args(split, grid[0] * grid[1], block_n, block_m, x.device, x_operand),
    )
    return out


if HAVE_TRITON:

    @triton.jit
    def x_row_scales(
        x_rows,  # x tile^T pointers [BLOCK_K, BLOCK_M] of the first K tile
        x_scale_ptr,
        rm,
        m_mask,
        scale_ub,
        STATIC_X: tl.constexpr,
        PREQUANT_X: tl.constexpr,
        HAS_UB: tl.constexpr,
        K_TILES: tl.constexpr,
        BLOCK_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        FP8_MAX: tl.constexpr,
        MIN_ABSMAX: tl.constexpr,
    ):
        """The fp32 scale [BLOCK_M] of each x row: STATIC_X's one input scale, or fp8.quantize_per_token's from
        the row's absmax over all of K (max is exact in any order; fbgemm's cap when HAS_UB). Padding rows (masked
        to 0) get MIN_ABSMAX's and are never stored. PREQUANT_X: per_token_quant's row scales, read. The prologue
        of this file's kernels."""
        if PREQUANT_X:
            x_scale = tl.load(x_scale_ptr + rm, mask=m_mask, other=1.0)
        elif STATIC_X:
            x_scale = tl.load(x_scale_ptr + rm * 0)  # the one scale, per row so that both branches broadcast alike
        else:
            running = tl.zeros([BLOCK_K, BLOCK_M], dtype=tl.float32)
            for t in range(K_TILES):
                x = tl.load(x_rows + t * BLOCK_K, mask=m_mask[None, :], other=0.0).to(tl.float32)
                running = tl.maximum(running, tl.abs(x))
            x_scale = fp8_row_scale(tl.max(running, axis=0), scale_ub, HAS_UB, FP8_MAX, MIN_ABSMAX)
        return x_scale

    @triton.jit
    def x_tile_fp8(x_tile, m_mask, x_scale, PREQUANT_X: tl.constexpr, FP8_MAX: tl.constexpr):
        """The e4m3 x tile^T [BLOCK_K, BLOCK_M] at `x_tile`: read as it is (PREQUANT_X) or quantized with the rows'
        scales, as kernels.per_token_quant would have."""
        if PREQUANT_X:
            return tl.load(x_tile, mask=m_mask[None, :], other=0.0)
        x = tl.load(x_tile, mask=m_mask[None, :], other=0.0).to(tl.float32)
        return quantize_to_fp8(x, x_scale[None, :], FP8_MAX)

    @triton.jit
    def _fp8_step_gemm_kernel(
        x_ptr,
        w_ptr,  # e4m3 [N or 2I, K]
        w_scale_ptr,  # fp32 [N] or [] (W_SCALE_STRIDE 0)
        x_scale_ptr,  # fp32 []: STATIC_X's input scale
        bias_ptr,
        out_ptr,
        partial_ptr,  # SPLIT_K > 1: fp32 [SPLIT_K, tiles, BLOCK_N, BLOCK_M] (kernels/split_k.py)
        counter_ptr,  # SPLIT_K > 1: int32 tile counters, 0 between launches
        M,
        up_rows,  # GATED: the up rows start this many rows after the gate rows (I)
        scale_ub,  # HAS_UB: a row's absmax is capped here (fbgemm's activation_scale_ub)
        stride_xm,
        stride_wn,
        stride_om,
        W_SCALE_STRIDE: tl.constexpr,
        STATIC_X: tl.constexpr,
        PREQUANT_X: tl.constexpr,  # x_ptr: e4m3 x, x_scale_ptr: its fp32 row scales [M] (per_token_quant)
        HAS_UB: tl.constexpr,
        K_TILES: tl.constexpr,  # K // BLOCK_K: a fixed trip count per weight shape
        HAS_BIAS: tl.constexpr,
        GATED: tl.constexpr,
        ACT: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr,
        FP8_MAX: tl.constexpr,
        MIN_ABSMAX: tl.constexpr,
        SPLIT_K: tl.constexpr,  # programs sharing a tile's K range (program_id(2) is the split; not with GATED)
    ):
        pdl_wait_and_release(USE_PDL)  # x is the previous kernel's output
        rn = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        x_rows = x_ptr + rm[None, :].to(tl.int64) * stride_xm + rk[:, None]  # x tile^T [BLOCK_K, BLOCK_M]
        x_scale = x_row_scales(
            x_rows, x_scale_ptr, rm, m_mask, scale_ub, STATIC_X, PREQUANT_X, HAS_UB, K_TILES, BLOCK_K, BLOCK_M, FP8_MAX,
            MIN_ABSMAX,
        )
        SPLIT_TILES: tl.constexpr = K_TILES // SPLIT_K
        k0 = tl.program_id(2) * (SPLIT_TILES * BLOCK_K)  # this split's first column of x and w
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :] + k0
        up_ptrs = w_ptr + (rn[:, None] + up_rows).to(tl.int64) * stride_wn + rk[None, :]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        acc_up = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for t in range(SPLIT_TILES):
            x_fp8 = x_tile_fp8(x_rows + k0 + t * BLOCK_K, m_mask, x_scale, PREQUANT_X, FP8_MAX)
            # The tensor cores' FP8 accumulation over the K chain (sm90 Triton's default, as cuBLASLt's fast
            # accumulation). Promoting each wgmma's partial sum to fp32 (max_num_imprecise_acc=32) cost W1_fp8 10%
            # on the H200 (6,469 vs 7,218 tok/s) and did not bring the decoder test's logits nearer the
            # emulation (0.0328 vs 0.0269 apart, each under a quarter of FP8's own 0.139 from the dense model).
            acc = tl.dot(tl.load(w_ptrs), x_fp8, acc)
            if GATED:
                acc_up = tl.dot(tl.load(up_ptrs), x_fp8, acc_up)
                up_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        store_mask = m_mask
        if SPLIT_K > 1:  # the tile's last program sums the partials and runs the epilogue
            acc, last = split_k_sum(acc, partial_ptr, counter_ptr, SPLIT_K, BLOCK_N, BLOCK_M)
            store_mask = m_mask & last
        # (sum of e4m3 products) * x_scale * w_scale: the emulation's dequantized operands, one product each
        acc = acc * x_scale[None, :] * tl.load(w_scale_ptr + rn * W_SCALE_STRIDE)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        if GATED:  # rounded as the unfused GEMM + act_mul kernel round
            acc_up = acc_up * x_scale[None, :] * tl.load(w_scale_ptr + (rn + up_rows) * W_SCALE_STRIDE)[:, None]
            if HAS_BIAS:
                acc_up += tl.load(bias_ptr + up_rows + rn).to(tl.float32)[:, None]
            dtype = out_ptr.dtype.element_ty
            gate = acc.to(dtype).to(tl.float32)
            act = activation(gate, ACT).to(dtype).to(tl.float32)
            acc = act * acc_up.to(dtype).to(tl.float32)
        out_ptrs = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask[None, :])

    @triton.jit
    def _fp8_qkv_rope_kernel(
        x_ptr,
        w_ptr,  # e4m3 [(H + 2 KVH) D, K]
        w_scale_ptr,  # fp32 [(H + 2 KVH) D] or [] (W_SCALE_STRIDE 0)
        x_scale_ptr,  # fp32 []: STATIC_X's input scale
        bias_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        slot_ptr,
        q_ptr,
        k_cache_ptr,
        v_cache_ptr,
        partial_ptr,  # SPLIT_K > 1: fp32 [SPLIT_K, tiles, 2 PAIRS, BLOCK_M] (kernels/split_k.py)
        counter_ptr,  # SPLIT_K > 1: int32 tile counters, 0 between launches
        M,
        scale_ub,
        k_scale_inv,
        v_scale_inv,
        stride_xm,
        stride_wn,
        stride_cos,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        W_SCALE_STRIDE: tl.constexpr,
        STATIC_X: tl.constexpr,
        PREQUANT_X: tl.constexpr,  # x_ptr: e4m3 x, x_scale_ptr: its fp32 row scales [M] (per_token_quant)
        HAS_UB: tl.constexpr,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        PAIRS: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        K_TILES: tl.constexpr,
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_K: tl.constexpr,
        USE_PDL: tl.constexpr,
        FP8_MAX: tl.constexpr,
        MIN_ABSMAX: tl.constexpr,
        SPLIT_K: tl.constexpr,
    ):
        """_fp8_step_gemm_kernel's prologue and products over decode_gemm's rotary-pair tile rows (a program owns
        rows j and j + D/2 of one head, each with its own weight scale), then decode_gemm's rotary + KV epilogue."""
        pdl_wait_and_release(USE_PDL)  # x is the previous kernel's output
        head, first, col = rope_tile_rows(HEAD_DIM, PAIRS)
        rm = tl.program_id(1) * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        x_rows = x_ptr + rm[None, :].to(tl.int64) * stride_xm + rk[:, None]
        x_scale = x_row_scales(
            x_rows, x_scale_ptr, rm, m_mask, scale_ub, STATIC_X, PREQUANT_X, HAS_UB, K_TILES, BLOCK_K, BLOCK_M, FP8_MAX,
            MIN_ABSMAX,
        )
        SPLIT_TILES: tl.constexpr = K_TILES // SPLIT_K
        k0 = tl.program_id(2) * (SPLIT_TILES * BLOCK_K)
        w_ptrs = w_ptr + col[:, None].to(tl.int64) * stride_wn + rk[None, :] + k0
        acc = tl.zeros([2 * PAIRS, BLOCK_M], dtype=tl.float32)
        for t in range(SPLIT_TILES):
            x_fp8 = x_tile_fp8(x_rows + k0 + t * BLOCK_K, m_mask, x_scale, PREQUANT_X, FP8_MAX)
            acc = tl.dot(tl.load(w_ptrs), x_fp8, acc)  # accumulated as _fp8_step_gemm_kernel's
            w_ptrs += BLOCK_K
        if SPLIT_K > 1:  # as _fp8_step_gemm_kernel's: the tile's last program goes on, the others store nothing
            acc, last = split_k_sum(acc, partial_ptr, counter_ptr, SPLIT_K, 2 * PAIRS, BLOCK_M)
            m_mask = m_mask & last
        # as _fp8_step_gemm_kernel's epilogue, each tile row with its own row's weight scale and bias
        acc = acc * x_scale[None, :] * tl.load(w_scale_ptr + col * W_SCALE_STRIDE)[:, None]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + col).to(tl.float32)[:, None]
        qkv_rope_epilogue(
            acc, head, first, rm, m_mask, pos_ptr, cos_ptr, sin_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
            k_scale_inv, v_scale_inv, stride_cos, stride_kcb, stride_kcs, stride_kch, stride_vcb, stride_vcs,
            stride_vch, NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, PAIRS, BLOCK_SIZE, BLOCK_M,
        )  # fmt: skip
