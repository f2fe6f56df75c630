"""Batch-invariant weight GEMMs for deterministic mode (EngineConfig.deterministic). Owns nothing.

Every weight product of a step, whatever its row count M, runs decode_gemm.py's Triton kernel with one launch
configuration per weight shape: the same BLOCK_K and K tile order (no split-K), the same program shape
(BLOCK_N weight rows x BLOCK_M = 64 rows of x) and warp count for M = 1 as for M = 8,192. A row of x is
computed by the same instructions on the same data in every step, so its output bits do not depend on M or on
the other rows. cuBLAS is never called: it picks kernels and split-K by M.

The fused epilogues (SiLU·mul in the gate/up GEMM, rotary and the KV write in the QKV GEMM) are decode_gemm's,
which round as the unfused pair does, so they are row-local too. What it costs: large steps lose cuBLAS's
bigger tiles (measured by `bench engine --deterministic`).
"""

from __future__ import annotations

import torch

from . import decode_gemm as dg

# Rows of x per program for every M: decode_gemm's largest (its `block_m_for` gives 16-64 by M).
BLOCK_M = 64


def gemm_config(n: int, k: int, dtype: torch.dtype) -> dg.Config | None:
    """decode_gemm's configuration for a [*, k] x [n, k]^T product at any depth (its MAX_K only routes deep
    products to cuBLAS for speed), or None when the shape does not tile."""
    # max_k=None: Llama-3-8B's down projection (K = 14,336) is deeper than decode_gemm's MAX_K; the H200 run of
    # W2 --deterministic found deterministic mode refusing it (2026-12-01).
    return dg._fitted(dg.WIDE_CONFIG if n > 8192 else dg.NARROW_CONFIG, n, k, dtype, max_k=None)


def gated_config(inter: int, k: int, dtype: torch.dtype) -> dg.Config | None:
    return dg._fitted(dg.GATED_CONFIG, inter, k, dtype, max_k=None)


def untiled(weights: dict[str, torch.Tensor]) -> list[str]:
    """The names of `weights` ([N, K] each) whose shape has no configuration: deterministic mode refuses them."""
    return [name for name, w in weights.items() if gemm_config(w.shape[0], w.shape[1], w.dtype) is None]


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool = False):
    """x [M, K] @ weight [N, K]^T (+ bias), batch-invariant."""
    config = gemm_config(weight.shape[0], x.shape[1], x.dtype)
    assert config is not None, (
        f"weight {tuple(weight.shape)} does not tile (checked when the decoder is built)"
    )
    return dg.decode_linear(x.contiguous(), weight, bias, pdl=pdl, config=config, block_m=BLOCK_M)


def gate_up_silu(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *, pdl: bool = False, act: int = 0
):
    """act(x @ gate^T) * (x @ up^T) (SiLU, or fused.ACT_GELU_TANH) for the fused [gate; up] weight,
    batch-invariant (fused when the intermediate size tiles, else the GEMM then the row-local act_mul kernel)."""
    x = x.contiguous()
    config = gated_config(weight.shape[0] // 2, x.shape[1], x.dtype)
    if config is None:
        return dg.fk.act_mul(linear(x, weight, bias, pdl=pdl), pdl=pdl, act=act)
    return dg.decode_gate_up_silu(x, weight, bias, pdl=pdl, config=config, block_m=BLOCK_M, act=act)


def qkv_rope_write(x, weight, bias, positions, cos_table, sin_table, num_heads, num_kv_heads, k_cache, v_cache,
                   slot_mapping, *, pdl: bool = False, kv_scale: tuple[float, float] = (1.0, 1.0)) -> torch.Tensor:  # fmt: skip
    """decode_gemm.decode_qkv_rope_write at any depth, batch-invariant (the two launches when the heads do
    not hold whole groups of rotary pairs)."""
    m, k = x.shape
    head_dim = cos_table.shape[-1]
    rope = None
    if head_dim % (2 * dg.ROPE_PAIRS) == 0 and dg.ROPE_CONFIG[0] == 2 * dg.ROPE_PAIRS:
        rope = dg._fitted(dg.ROPE_CONFIG, (num_heads + 2 * num_kv_heads) * head_dim, k, x.dtype)
    return dg.decode_qkv_rope_write(
        x.contiguous(), weight, bias, positions, cos_table, sin_table, num_heads, num_kv_heads,
        k_cache, v_cache, slot_mapping, pdl=pdl, config=rope, kv_scale=kv_scale,
        linear_config=gemm_config(weight.shape[0], k, x.dtype), block_m=BLOCK_M,
    )  # fmt: skip
