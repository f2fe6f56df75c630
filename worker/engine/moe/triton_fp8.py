"""The grouped gate/up and down GEMMs of `triton_moe.experts_triton` for FP8 experts (fp8.py): the weights read as
the checkpoint stores them (e4m3, half the bytes of bf16), the activations quantized at run time. Owns nothing.

Per step (the count, align and top-k sum launches are triton_moe.py's, shared with the bf16 experts):
  1. x [T, H] quantized once per token (per-channel experts) or per token and group of bk columns (block-wise
     experts): quant/kernels.py's kernels, the dense FP8 linears' own, so both round alike;
  2. gate/up: e4m3 x e4m3 `tl.dot`s with fp32 accumulators; per-channel experts scale the sum once
     (x's row scale times the weight's column scale), block-wise ones scale each K tile's dot by x's group scale
     and the weight block's scale before adding it (the DeepSeek-V3 recipe: a K tile lies in one group); then the
     bf16 kernel's epilogue: bias, rounding to the model dtype, SiLU·mul or gpt-oss's clamped SwiGLU;
  3. the activated [P, I] quantized as x was (per pair, or per pair and group of bk columns of I);
  4. down: the same GEMM over [P, I], times each pair's routing weight.
What it computes is reference.experts_fp8_emulated's arithmetic (the tests compare the two). As triton_moe.py's
kernel, nothing reads a device value on the host: a step is CUDA-graph capturable at a fixed T.

Per-channel sums chain through one accumulator with each FP8 wgmma's partial sum promoted to fp32
(`max_num_imprecise_acc=32`, one wgmma's K: the value quant/small_step.py ran on the H200 on 2026-12-03);
block-wise tiles are added in fp32, each tile's dot started afresh. The dense small-step GEMM keeps the tensor
cores' own accumulation for W1's speed; here, on the H200 (2026-12-03f), Qwen3-30B-A3B's per-channel layer (K 2,048
and 768) with it was 1.28% off the emulation at 2,048 tokens (the worst of 4M outputs), past the test's bound of a
quarter of FP8's own 4.4%, while block-wise (promoted per tile) passed at every token count. The promoted kernel
has not run on the H200 yet (the session's device time was spent).
"""

from __future__ import annotations

from typing import Any

import torch

from ..quant import kernels as fp8_kernels
from .fp8 import Fp8ExpertFormat
from .weights import ExpertWeights

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False


MIN_BLOCK_K = 32  # an FP8 tl.dot's K on CUDA (Triton's min_dot_size for 8-bit operands)


def quantize_rows(x: torch.Tensor, fmt: Fp8ExpertFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (e4m3 [M, K], fp32 scales [M] or [M, ceil(K / bk)]) by quant/kernels.py's Triton kernels."""
    if fmt.block_shape is None:
        return fp8_kernels.per_token_quant(x)
    return fp8_kernels.per_token_group_quant(x, fmt.block_shape[1])


def fp8_expert_gemms(
    hidden: torch.Tensor,
    experts: ExpertWeights,
    activated: torch.Tensor,
    pair_out: torch.Tensor,
    pair_weights: torch.Tensor,
    common: dict[str, Any],
    block_k: int,
    num_blocks_m: int,
) -> None:
    """Steps 1-4 above, writing `activated` [P, I] and `pair_out` [P, H] (the workspace's rows of this step).
    `common`: `experts_triton`'s launch arguments shared with the bf16 kernel (the align step's buffers, the
    activation's constants, the tile sizes but BLOCK_K)."""
    assert experts.fp8 is not None, "fp8_expert_gemms multiplies FP8 experts"
    scales, fmt = experts.fp8, experts.fp8.format
    group_n, group_k = fmt.block_shape or (1, 1)
    block_k = max(block_k, MIN_BLOCK_K)
    if fmt.block_shape is not None:  # a K tile must lie in one scale group
        block_k = min(block_k, group_k)
        assert group_k % block_k == 0 and block_k >= MIN_BLOCK_K, (
            f"a K tile of {block_k} does not divide the {group_k}-column groups"
        )
    inter, hidden_size = activated.shape[1], hidden.shape[1]
    block_scales = fmt.block_shape is not None

    def launch(
        a: torch.Tensor,  # A rows in e4m3 (x, or the activated pairs), then their scales
        a_scale: torch.Tensor,
        weight: torch.Tensor,  # [E, N (x2 for gate/up), K] e4m3, then its scales
        w_scale: torch.Tensor,
        bias: torch.Tensor | None,
        out: torch.Tensor,  # [P, N]
        n: int,
        k: int,
        is_gate_up: bool,
    ) -> None:
        _fp8_expert_gemm_kernel[(num_blocks_m * triton.cdiv(n, common["BLOCK_N"]),)](
            a,
            a_scale,
            weight,
            w_scale,
            weight if bias is None else bias,  # never read without HAS_BIAS
            pair_weights,
            out,
            N=n,
            K=k,
            stride_as=a_scale.stride(0),
            stride_we=weight.stride(0),
            stride_se=w_scale.stride(0),
            stride_sn=w_scale.stride(1) if block_scales else 1,
            stride_be=0 if bias is None else bias.stride(0),
            GATE_UP=is_gate_up,
            BLOCK_SCALES=block_scales,
            GROUP_N=group_n,
            GROUP_K=group_k,
            BLOCK_K=block_k,
            EVEN_K=k % block_k == 0,
            **common,
        )

    x_fp8, x_scale = quantize_rows(hidden, fmt)
    launch(
        x_fp8,
        x_scale,
        experts.gate_up,
        scales.gate_up,
        experts.gate_up_bias,
        activated,
        inter,
        hidden_size,
        True,
    )
    a_fp8, a_scale = quantize_rows(activated, fmt)
    launch(a_fp8, a_scale, experts.down, scales.down, experts.down_bias, pair_out, hidden_size, inter, False)


if HAVE_TRITON:
    from .block_order import block_operands, grouped_block

    @triton.jit(do_not_specialize=["num_pairs", "num_blocks_m"])
    def _fp8_expert_gemm_kernel(
        a_ptr,  # [rows, K] e4m3: x (gate/up, row = pair // TOP_K) or the activated pairs (down, row = pair)
        a_scale_ptr,  # [rows] or [rows, ceil(K / GROUP_K)] fp32
        w_ptr,  # [E, N (x2 for gate/up), K] e4m3
        w_scale_ptr,  # [E, N (x2)] or [E, ceil(N / GROUP_N) (x2), ceil(K / GROUP_K)] fp32
        bias_ptr,  # [E, N (x2)]
        pair_weight_ptr,  # [P] fp32 routing weights (down)
        out_ptr,  # [P, N] model dtype
        sorted_pairs_ptr,
        block_expert_ptr,
        num_padded_ptr,
        num_pairs,
        num_blocks_m,
        N,
        K,
        stride_as,
        stride_we,
        stride_se,
        stride_sn,
        stride_be,
        alpha,
        limit,
        TOP_K: tl.constexpr,
        GATE_UP: tl.constexpr,
        ACTIVATION: tl.constexpr,  # 0: silu(gate) * up; 1: gpt-oss's clamped SwiGLU
        HAS_BIAS: tl.constexpr,
        BLOCK_SCALES: tl.constexpr,  # False: per-channel weights, per-row x; True: [GROUP_N, GROUP_K] blocks
        GROUP_N: tl.constexpr,
        GROUP_K: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
        GROUP_M: tl.constexpr,
        EVEN_K: tl.constexpr,
    ):
        pid_m, pid_n = grouped_block(N, num_blocks_m, BLOCK_N, GROUP_M)
        if pid_m * BLOCK_M >= tl.load(num_padded_ptr):
            return  # past the padded total: this step has fewer blocks than the grid allows for
        expert, pairs, is_pair, a_rows, cols, is_col, ks, a_ptrs, w_ptrs = block_operands(
            a_ptr, w_ptr, sorted_pairs_ptr, block_expert_ptr, pid_m, pid_n, num_pairs, N, K, stride_we, TOP_K, GATE_UP,
            BLOCK_M, BLOCK_N, BLOCK_K,
        )  # fmt: skip
        a_scales = a_scale_ptr + a_rows * stride_as
        if BLOCK_SCALES:  # each column's block row; up's block rows follow gate's
            w_scales = w_scale_ptr + expert * stride_se + (cols // GROUP_N) * stride_sn
            up_scales = w_scales + tl.cdiv(N, GROUP_N) * stride_sn
        else:
            w_scales = w_scale_ptr + expert * stride_se + cols
            up_scales = w_scales + N
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for k0 in range(0, K, BLOCK_K):
            if EVEN_K:  # no mask along K (the contiguous dim), so the loads stay vectorised
                a_mask = is_pair[:, None]
                w_mask = is_col[None, :]
            else:
                k_ok = ks < K - k0
                a_mask = is_pair[:, None] & k_ok[None, :]
                w_mask = k_ok[:, None] & is_col[None, :]
            a = tl.load(a_ptrs + k0, mask=a_mask, other=0.0)
            w = tl.load(w_ptrs + k0, mask=w_mask, other=0.0)
            if BLOCK_SCALES:
                g = k0 // GROUP_K
                a_s = tl.load(a_scales + g, mask=is_pair, other=0.0)[:, None]
                acc += tl.dot(a, w) * a_s * tl.load(w_scales + g, mask=is_col, other=0.0)[None, :]
                if GATE_UP:  # the up rows sit N rows below the gate rows
                    w_up = tl.load(w_ptrs + N * K + k0, mask=w_mask, other=0.0)
                    acc_up += tl.dot(a, w_up) * a_s * tl.load(up_scales + g, mask=is_col, other=0.0)[None, :]
            else:  # each FP8 wgmma's partial sum (K 32) promoted to fp32: see the module docstring
                acc = tl.dot(a, w, acc, max_num_imprecise_acc=32)
                if GATE_UP:
                    w_up = tl.load(w_ptrs + N * K + k0, mask=w_mask, other=0.0)
                    acc_up = tl.dot(a, w_up, acc_up, max_num_imprecise_acc=32)
        if not BLOCK_SCALES:  # x's row scale times the weight's column scale, once
            a_s = tl.load(a_scales, mask=is_pair, other=0.0)[:, None]
            acc = acc * a_s * tl.load(w_scales, mask=is_col, other=0.0)[None, :]
            if GATE_UP:
                acc_up = acc_up * a_s * tl.load(up_scales, mask=is_col, other=0.0)[None, :]
        # from here on, triton_moe._expert_gemm_kernel's epilogue
        dtype = out_ptr.dtype.element_ty
        if HAS_BIAS:
            acc += tl.load(bias_ptr + expert * stride_be + cols, mask=is_col, other=0.0).to(tl.float32)[
                None, :
            ]
        acc = acc.to(dtype).to(tl.float32)  # round where the model rounds
        if GATE_UP:
            if HAS_BIAS:
                acc_up += tl.load(bias_ptr + expert * stride_be + N + cols, mask=is_col, other=0.0).to(
                    tl.float32
                )[None, :]
            up = acc_up.to(dtype).to(tl.float32)
            if ACTIVATION == 0:
                result = (acc / (1.0 + tl.exp(-acc))).to(dtype).to(tl.float32) * up
            else:
                gate = tl.minimum(acc, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                result = (up + 1.0) * (gate / (1.0 + tl.exp(-alpha * gate)))
        else:
            result = acc * tl.load(pair_weight_ptr + pairs, mask=is_pair, other=0.0)[:, None]
        out_ptrs = out_ptr + pairs[:, None].to(tl.int64) * N + cols[None, :]
        tl.store(out_ptrs, result.to(dtype), mask=is_pair[:, None] & is_col[None, :])
