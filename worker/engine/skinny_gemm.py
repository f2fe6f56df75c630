"""y = x @ W^T (+ bias) for few tokens and a large weight: the decode-step projections. Owns nothing.

At decode batch sizes (M <= 32 rows) a weight GEMM is a stream over W: its time is W's bytes over the
memory bandwidth. cuBLAS picks split-K tiles for Llama-3-8B's QKV and O shapes at M = 32 that reach only
~3.0-3.3 TB/s plus a separate reduce kernel (benchmarks/README.md, "Owned decoder"). This kernel gives
each program BLOCK_N whole weight rows over the full K, so there is no reduce, and pipelines the K loop
deep enough to keep the HBM busy. It computes W_tile @ x^T so the weight rows are the MMA's long side.

`pick_config` returns None where cuBLAS should run (fp32, large M, shapes the tiles don't divide); the
choice depends only on shapes and dtype, so CUDA graphs capture one fixed kernel per batch size.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False

# (BLOCK_N, BLOCK_K, num_warps, num_stages). CONFIGS is the sweep of benchmarks/skinny_gemm.py --sweep.
Config = tuple[int, int, int, int]
CONFIGS: list[Config] = [
    (16, 256, 4, 4),
    (16, 256, 4, 6),
    (16, 512, 4, 3),
    (32, 128, 4, 4),
    (32, 128, 4, 6),
    (32, 256, 4, 3),
    (32, 256, 4, 4),
    (32, 512, 4, 2),
    (64, 128, 4, 4),
    (64, 256, 4, 3),
    (64, 64, 4, 8),
    (32, 128, 8, 6),
]
# Best or within 2% of best for every Llama-3-8B projection with K = 4096 at M = 32 on the H200
# (benchmarks/README.md, "Skinny GEMMs"): QKV 15.6 us vs cuBLAS 16.3, O 12.6 vs 14.2 (cuBLAS adds a
# split-K reduce), gate/up 59.6 vs 61.7, lm_head 246.9 vs 256.7. The down projection (K = 14336) runs
# slower here than cuBLAS (37.2 vs 33.4 us), hence the K limit.
DEFAULT_CONFIG: Config = (64, 64, 4, 8)
MAX_M = 32
MAX_K = 8192


def pick_config(m: int, n: int, k: int, dtype: torch.dtype = torch.bfloat16) -> Config | None:
    """The launch configuration for an [m, k] x [n, k]^T product, or None to use cuBLAS."""
    if not HAVE_TRITON or dtype not in (torch.bfloat16, torch.float16) or not 0 < m <= MAX_M or k > MAX_K:
        return None
    block_n, block_k = DEFAULT_CONFIG[:2]
    if n % block_n or k % block_k:
        return None
    return DEFAULT_CONFIG


def _block_m(m: int) -> int:
    return max(16, 1 << (m - 1).bit_length())


if HAVE_TRITON:

    @triton.jit
    def _skinny_kernel(
        x_ptr,
        w_ptr,
        bias_ptr,
        out_ptr,
        M,
        stride_xm,
        stride_wn,
        stride_om,
        K_TILES: tl.constexpr,  # per weight shape: a handful of compilations, fixed trip count
        HAS_BIAS: tl.constexpr,
        BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr,
        BLOCK_K: tl.constexpr,
    ):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rk = tl.arange(0, BLOCK_K)
        m_mask = rm < M
        w_ptrs = w_ptr + rn[:, None].to(tl.int64) * stride_wn + rk[None, :]
        x_ptrs = x_ptr + rm[None, :].to(tl.int64) * stride_xm + rk[:, None]
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
        for _ in range(K_TILES):  # K % BLOCK_K == 0 and N % BLOCK_N == 0 (pick_config checks)
            w = tl.load(w_ptrs)
            x = tl.load(x_ptrs, mask=m_mask[None, :], other=0.0)
            acc = tl.dot(w, x, acc)
            w_ptrs += BLOCK_K
            x_ptrs += BLOCK_K
        if HAS_BIAS:
            acc += tl.load(bias_ptr + rn).to(tl.float32)[:, None]
        out_ptrs = out_ptr + rm[None, :].to(tl.int64) * stride_om + rn[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=m_mask[None, :])


def skinny_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    config: Config | None = None,
) -> torch.Tensor:
    """x [M, K] @ weight[N, K]^T (+ bias [N]) with the Triton kernel; `config` defaults to pick_config's."""
    m, k = x.shape
    n = weight.shape[0]
    config = config or pick_config(m, n, k, x.dtype)
    assert config is not None, f"no skinny-GEMM configuration for M={m} N={n} K={k} {x.dtype}"
    block_n, block_k, num_warps, num_stages = config
    assert n % block_n == 0 and k % block_k == 0, f"N={n} K={k} not divisible by {block_n}/{block_k}"
    assert x.stride(1) == 1 and weight.stride(1) == 1, "x and weight rows must be contiguous"
    if out is None:
        out = torch.empty(m, n, device=x.device, dtype=x.dtype)
    block_m = _block_m(min(m, 64))
    grid = (n // block_n, triton.cdiv(m, block_m))
    _skinny_kernel[grid](
        x,
        weight,
        bias if bias is not None else weight,
        out,
        m,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        K_TILES=k // block_k,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=block_k,
        num_warps=num_warps,
        num_stages=num_stages,
    )
    return out


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """F.linear, through the skinny kernel where pick_config chooses it (CUDA only)."""
    if x.is_cuda and x.dim() == 2 and pick_config(x.shape[0], weight.shape[0], x.shape[1], x.dtype):
        return skinny_linear(x, weight, bias)
    return torch.nn.functional.linear(x, weight, bias)
