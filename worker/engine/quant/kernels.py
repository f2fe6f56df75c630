"""FP8 GEMMs and activation quantization on the GPU. Owns nothing.

  fp8_linear                 the one entry point: x quantized as the layer's scheme says, then the GEMM;
                             "auto" runs the kernels below on sm89+ GPUs and the emulation (fp8.py)
                             elsewhere
  per_token_quant            Triton: one fp32 scale per row (absmax / 448, optionally capped: fbgemm's ub)
  per_token_group_quant      Triton: one scale per row and per group of columns (the block-wise format)
  scaled_mm                  cuBLASLt through torch._scaled_mm: per-tensor scales (static activations and
                             per-tensor weights) or row-wise ones (per-token activations, per-channel weights)
  block_fp8_gemm             Triton: FP8 x FP8 with one scale per (row, K group) of x and per [bn, bk] block
                             of w, fp32 accumulation, the scales applied per K tile

The kernels round as fp8.py does (the same scale formula, the same clamp, round-to-nearest-even casts), so on
the interpreter (TRITON_INTERPRET=1, with its fp8 cast fixed as tests/worker/engine/test_quant_kernels.py
does) they match the torch reference bit for bit; on the GPU too (divisions are div_rn, IEEE, as torch's).
Launches depend only on shapes: CUDA-graph capturable. Imports without triton (`HAVE_TRITON`).
"""

from __future__ import annotations

import functools

import torch

from .config import ActivationScale, WeightScale
from .fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    MIN_ABSMAX,
    Fp8Linear,
    Fp8Rows,
    fp8_linear_emulated,
    quantize_static,
    takes_rows,
)

try:
    import triton
    import triton.language as tl

    from ..kernels.common import fp8_row_scale, quantize_to_fp8
    from ..kernels.fused import activation
    from ..kernels.pdl import pdl_wait_and_release

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False

BACKENDS = ("auto", "kernels", "emulated")


def fp8_linear(
    x: torch.Tensor | Fp8Rows, layer: Fp8Linear, bias: torch.Tensor | None = None, backend: str = "auto"
) -> torch.Tensor:
    """x [..., K] @ w^T (+ bias) in x's dtype, w the layer's FP8 weight. "kernels" forces the GPU path
    (the tests run it on CPU tensors through Triton's interpreter and torch's CPU _scaled_mm). `Fp8Rows` (x
    quantized per token by the kernel before: `takes_rows` layers) go straight to the GEMM."""
    assert backend in BACKENDS, f"backend must be one of {BACKENDS}"
    if backend == "emulated" or (backend == "auto" and not (x.device.type == "cuda" and has_fp8_tensor_cores(x.device))):
        return fp8_linear_emulated(x, layer, bias)
    if isinstance(x, Fp8Rows):
        assert takes_rows(layer), "per-token rows reach only layers that quantize per token"
        out = scaled_mm(x.x, x.scale, layer, x.dtype)
        return out if bias is None else out + bias
    x2d = x.reshape(-1, layer.in_features)
    scheme = layer.scheme
    if scheme.weight is WeightScale.BLOCK:
        x_fp8, x_scale = per_token_group_quant(x2d, scheme.group_size)
        out = block_fp8_gemm(x_fp8, x_scale, layer, x.dtype, bias)
    else:
        if scheme.activation is ActivationScale.STATIC:
            assert layer.input_scale is not None
            x_fp8, x_scale = quantize_static(x2d, layer.input_scale), layer.input_scale
        else:
            x_fp8, x_scale = per_token_quant(x2d, scheme.activation_scale_ub)
        out = scaled_mm(x_fp8, x_scale, layer, x.dtype)
        if bias is not None:
            out = out + bias
    return out.reshape(*x.shape[:-1], layer.out_features)


@functools.cache
def _capability(device_index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(device_index)


def has_fp8_tensor_cores(device: torch.device) -> bool:
    """sm89+ (Ada, Hopper and later) multiply FP8; older GPUs run the emulation (dequantized weights)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    return HAVE_TRITON and _capability(index) >= (8, 9)


def scaled_mm(x_fp8: torch.Tensor, x_scale: torch.Tensor, layer: Fp8Linear, out_dtype: torch.dtype) -> torch.Tensor:
    """x_fp8 [M, K] (scale [] or [M]) @ w^T through torch._scaled_mm, which wants the weight column-major
    (w^T of the row-major [N, K] weight is) and fp32 scales: both per tensor, or [M, 1] and [1, N] row-wise.
    Row-wise output is bf16 (cuBLASLt's constraint), cast to `out_dtype` when that differs."""
    w_t = layer.weight.t()
    if x_scale.dim() == 0 and layer.scheme.weight is WeightScale.TENSOR:
        return torch._scaled_mm(x_fp8, w_t, scale_a=x_scale, scale_b=layer.weight_scale, out_dtype=out_dtype)
    m, n = x_fp8.shape[0], layer.out_features
    # A per-tensor scale on one side is repeated into that side's vector (repeat, not expand: cuBLASLt wants
    # unit strides even where a dimension has size one).
    w_scale = layer.weight_scale
    scale_a = x_scale.reshape(m, 1) if x_scale.dim() == 1 else x_scale.reshape(1, 1).repeat(m, 1)
    scale_b = w_scale.reshape(1, n) if w_scale.dim() == 1 else w_scale.reshape(1, 1).repeat(1, n)
    out = torch._scaled_mm(x_fp8, w_t, scale_a=scale_a, scale_b=scale_b, out_dtype=torch.bfloat16)
    return out.to(out_dtype)


def _check_triton() -> None:
    assert HAVE_TRITON, "the FP8 kernels need Triton (CUDA builds of torch bring it)"


def _next_pow2(x: int) -> int:
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def per_token_quant(
    x: torch.Tensor, scale_ub: float | None = None, *, pdl: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale fp32 [M]); fp8.quantize_per_token's kernel (`pdl`: launched as a link of
    the small-step path's PDL chain, kernels/pdl.py)."""
    _check_triton()
    m, k = x.shape
    return _quantize_rows(_per_token_quant_kernel, x.contiguous(), m, k, scale_ub, K=k, USE_PDL=pdl, launch_pdl=pdl)


# A row of at most ONE_PASS_MAX_K columns is quantized from registers in one pass (one load of x, not two), whatever
# the step's size. Small steps: the per_token_quant of O's and down's inputs (K 4,096 and 14,336) is otherwise a
# chain of 2 x K / 1,024 dependent loads on one SM per row (W1_fp8 4.31 -> 4.19 ms a step with it, H200
# 2026-12-03f). Large steps: act·mul + quantization of 8,192 rows of Llama-3-8B's 14,336 took 267 us in one pass
# of 16 warps against 309 in 1,024-column passes of 4 warps (2,048 rows: 98 vs 120; `benchmarks/act_mul_quant.py`,
# h200/2026-12-03l), which read each gate/up row twice.
ONE_PASS_MAX_K = 16384


def _row_block(k: int) -> tuple[int, int]:
    """(BLOCK, num_warps) of the per-row quantization kernels for rows of k columns (any number of them)."""
    if k <= ONE_PASS_MAX_K:
        block = _next_pow2(k)
        return block, min(16, max(4, block // 512))
    return min(1024, _next_pow2(k)), 4


def act_mul_per_token_quant(
    gate_up: torch.Tensor, act: int, scale_ub: float | None = None
) -> Fp8Rows:
    """act(gate) * up of a fused [M, 2I] gate/up output, quantized per token for the down projection: the bits of
    fused.act_mul then per_token_quant, in one kernel (the [M, I] model-dtype rows are never written; a large
    step's down input is 8,192 x 14,336 of them in Llama-3-8B)."""
    _check_triton()
    assert gate_up.is_contiguous()
    m, inter = gate_up.shape[0], gate_up.shape[1] // 2
    x_fp8, scale = _quantize_rows(_act_mul_quant_kernel, gate_up, m, inter, scale_ub, INTER=inter, ACT=act)
    return Fp8Rows(x_fp8, scale, gate_up.dtype)


def _quantize_rows(kernel, source: torch.Tensor, m: int, k: int, scale_ub: float | None, **constants):
    """(x_fp8 [m, k], scale fp32 [m]) from one of the per-row quantization kernels (one program a row, `_row_block`'s
    launch) reading `source`; `constants` are the kernel's own."""
    x_fp8 = torch.empty((m, k), dtype=FP8_DTYPE, device=source.device)
    scale = torch.empty((m,), dtype=torch.float32, device=source.device)
    if m:
        block, num_warps = _row_block(k)
        kernel[(m,)](
            source, x_fp8, scale, 0.0 if scale_ub is None else float(scale_ub),
            HAS_UB=scale_ub is not None, BLOCK=block, FP8_MAX=FP8_MAX, MIN_ABSMAX=MIN_ABSMAX, num_warps=num_warps,
            **constants,
        )  # fmt: skip
    return x_fp8, scale


def per_token_group_quant(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale fp32 [M, ceil(K / group_size)]); fp8.quantize_per_token_group's kernel."""
    _check_triton()
    m, k = x.shape
    x = x.contiguous()
    num_groups = triton.cdiv(k, group_size)
    x_fp8 = torch.empty((m, k), dtype=FP8_DTYPE, device=x.device)
    scale = torch.empty((m, num_groups), dtype=torch.float32, device=x.device)
    if m:
        _per_token_group_quant_kernel[(m, num_groups)](
            x, x_fp8, scale, k, group_size,
            BLOCK=_next_pow2(group_size), FP8_MAX=FP8_MAX, MIN_ABSMAX=MIN_ABSMAX,
        )
    return x_fp8, scale


def block_fp8_gemm(
    x_fp8: torch.Tensor,
    x_scale: torch.Tensor,
    layer: Fp8Linear,
    out_dtype: torch.dtype,
    bias: torch.Tensor | None = None,
) -> torch.Tensor:
    """x_fp8 [M, K] (scales [M, K groups]) @ w^T for a block-scaled weight, out [M, N] in `out_dtype`.

    Tiles: one K tile per scale group (BLOCK_K = bk); BLOCK_M follows M so decode steps (a few rows) do
    not compute a 64-row tile of padding. Not yet tuned on the H200 (issue 26 asks to choose by measurement)."""
    _check_triton()
    assert layer.scheme.block_shape is not None
    bn, bk = layer.scheme.block_shape
    m, k = x_fp8.shape
    n = layer.out_features
    assert x_scale.shape == (m, triton.cdiv(k, bk)), "activation scales: one per row and per K group"
    out = torch.empty((m, n), dtype=out_dtype, device=x_fp8.device)
    if m == 0:
        return out
    block_m = min(64, max(16, _next_pow2(m)))
    block_n = min(128, max(16, _next_pow2(n)))
    grid = (triton.cdiv(m, block_m), triton.cdiv(n, block_n))
    w_scale = layer.weight_scale
    _block_fp8_gemm_kernel[grid](
        x_fp8, x_scale, layer.weight, w_scale, out, bias if bias is not None else out,
        m, n,
        x_fp8.stride(0), x_scale.stride(0), layer.weight.stride(0), w_scale.stride(0), out.stride(0),
        K=k, GROUP_N=bn, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=bk,
    )
    return out


if HAVE_TRITON:

    @triton.jit
    def _per_token_quant_kernel(
        x_ptr, q_ptr, s_ptr, scale_ub,
        K: tl.constexpr, HAS_UB: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_ABSMAX: tl.constexpr,
        USE_PDL: tl.constexpr,
    ):
        # One program per row: a pass for the absmax, a pass to quantize (the row stays in L2 between them), or
        # where the row fits one BLOCK, one load kept in registers for both.
        # K is a constexpr (one compile per hidden size): loop bounds must be scalars in the interpreter too.
        pdl_wait_and_release(USE_PDL)  # x is the previous kernel's output
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        if BLOCK >= K:
            mask = cols < K
            x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
            scale = fp8_row_scale(tl.max(tl.abs(x), axis=0), scale_ub, HAS_UB, FP8_MAX, MIN_ABSMAX)
            tl.store(s_ptr + row, scale)
            tl.store(q_ptr + row * K + cols, quantize_to_fp8(x, scale, FP8_MAX), mask=mask)
        else:
            running = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, K, BLOCK):
                x = tl.load(x_ptr + row * K + start + cols, mask=start + cols < K, other=0.0).to(tl.float32)
                running = tl.maximum(running, tl.abs(x))
            scale = fp8_row_scale(tl.max(running, axis=0), scale_ub, HAS_UB, FP8_MAX, MIN_ABSMAX)
            tl.store(s_ptr + row, scale)
            for start in range(0, K, BLOCK):
                mask = start + cols < K
                x = tl.load(x_ptr + row * K + start + cols, mask=mask, other=0.0).to(tl.float32)
                tl.store(q_ptr + row * K + start + cols, quantize_to_fp8(x, scale, FP8_MAX), mask=mask)

    @triton.jit
    def _act_mul_cols(gu_ptr, row, cols, mask, INTER: tl.constexpr, ACT: tl.constexpr):
        """act(gate) * up at `cols` of one row, rounded as fused._act_mul_kernel rounds it (the activation to the
        model dtype, then the product), returned in fp32."""
        dtype = gu_ptr.dtype.element_ty
        g = tl.load(gu_ptr + row * 2 * INTER + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + row * 2 * INTER + INTER + cols, mask=mask, other=0.0).to(tl.float32)
        a = activation(g, ACT).to(dtype).to(tl.float32)
        return (a * u).to(dtype).to(tl.float32)

    @triton.jit
    def _act_mul_quant_kernel(
        gu_ptr, q_ptr, s_ptr, scale_ub,
        INTER: tl.constexpr, ACT: tl.constexpr, HAS_UB: tl.constexpr, BLOCK: tl.constexpr, FP8_MAX: tl.constexpr,
        MIN_ABSMAX: tl.constexpr,
    ):  # fmt: skip
        # _per_token_quant_kernel over act·mul's row, which is computed (twice where it takes two passes: the
        # gate/up row stays in L2) and never stored in the model dtype. Padding columns are act(0) * 0 = 0.
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        if BLOCK >= INTER:
            mask = cols < INTER
            h = _act_mul_cols(gu_ptr, row, cols, mask, INTER, ACT)
            scale = fp8_row_scale(tl.max(tl.abs(h), axis=0), scale_ub, HAS_UB, FP8_MAX, MIN_ABSMAX)
            tl.store(s_ptr + row, scale)
            tl.store(q_ptr + row * INTER + cols, quantize_to_fp8(h, scale, FP8_MAX), mask=mask)
        else:
            running = tl.zeros([BLOCK], dtype=tl.float32)
            for start in range(0, INTER, BLOCK):
                h = _act_mul_cols(gu_ptr, row, start + cols, start + cols < INTER, INTER, ACT)
                running = tl.maximum(running, tl.abs(h))
            scale = fp8_row_scale(tl.max(running, axis=0), scale_ub, HAS_UB, FP8_MAX, MIN_ABSMAX)
            tl.store(s_ptr + row, scale)
            for start in range(0, INTER, BLOCK):
                mask = start + cols < INTER
                h = _act_mul_cols(gu_ptr, row, start + cols, mask, INTER, ACT)
                tl.store(q_ptr + row * INTER + start + cols, quantize_to_fp8(h, scale, FP8_MAX), mask=mask)

    @triton.jit
    def _per_token_group_quant_kernel(
        x_ptr, q_ptr, s_ptr, K, GROUP_SIZE,
        BLOCK: tl.constexpr, FP8_MAX: tl.constexpr, MIN_ABSMAX: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        group = tl.program_id(1)
        cols = group * GROUP_SIZE + tl.arange(0, BLOCK)
        mask = (tl.arange(0, BLOCK) < GROUP_SIZE) & (cols < K)
        x = tl.load(x_ptr + row * K + cols, mask=mask, other=0.0).to(tl.float32)
        scale = fp8_row_scale(tl.max(tl.abs(x), axis=0), 0.0, False, FP8_MAX, MIN_ABSMAX)  # a group's, no cap
        tl.store(s_ptr + row * tl.num_programs(1) + group, scale)
        tl.store(q_ptr + row * K + cols, quantize_to_fp8(x, scale, FP8_MAX), mask=mask)

    @triton.jit
    def _block_fp8_gemm_kernel(
        a_ptr, a_s_ptr, b_ptr, b_s_ptr, c_ptr, bias_ptr,
        M, N,
        stride_a, stride_a_s, stride_b, stride_b_s, stride_c,
        K: tl.constexpr, GROUP_N: tl.constexpr, HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    ):
        # c[m, n] = sum over K groups g of (sum_{k in g} a[m, k] * b[n, k]) * a_s[m, g] * b_s[n // GROUP_N, g]
        rm = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        rk = tl.arange(0, BLOCK_K)
        m_ok, n_ok = rm < M, rn < N
        a_rows = a_ptr + rm.to(tl.int64)[:, None] * stride_a
        b_cols = b_ptr + rn.to(tl.int64)[None, :] * stride_b  # b is [N, K] row-major: a K tile is [BK, BN]
        a_s_rows = a_s_ptr + rm * stride_a_s
        b_s_rows = b_s_ptr + (rn // GROUP_N) * stride_b_s
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for g in range(0, tl.cdiv(K, BLOCK_K)):
            k = g * BLOCK_K + rk
            k_ok = k < K
            a = tl.load(a_rows + k[None, :], mask=m_ok[:, None] & k_ok[None, :], other=0.0)
            b = tl.load(b_cols + k[:, None], mask=k_ok[:, None] & n_ok[None, :], other=0.0)
            a_s = tl.load(a_s_rows + g, mask=m_ok, other=0.0)
            b_s = tl.load(b_s_rows + g, mask=n_ok, other=0.0)
            acc += tl.dot(a, b) * a_s[:, None] * b_s[None, :]
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        c = c_ptr + rm.to(tl.int64)[:, None] * stride_c + rn[None, :]
        tl.store(c, acc.to(c_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])
