"""Fused element-wise kernels for the CUDA path. Owns nothing.

A decode step of an 8B model is ~4.6 ms of weight GEMMs; transformers' RMSNorm is 8 small kernels
(upcast, pow, mean, add, rsqrt, mul, downcast, scale) run twice per layer, which at batch 32 cost
more launch-bound device time than the math. `install_fused_rmsnorm` swaps each RMSNorm module's
forward for one Triton kernel computing the same function (fp32 statistics, rounding to the input
dtype before the weight multiply, as transformers does). Likewise `install_fused_rotary` replaces
the rotary embedding's ~10 kernels (mul, slice, neg, cat, mul, add for q and for k) with one launch
each for q and k. CPU runs keep transformers' own code.
"""

from __future__ import annotations

import sys
from typing import Any

import torch

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except ImportError:  # CPU-only installs
    HAVE_TRITON = False

# RMSNorm classes whose forward is exactly: w * (x * rsqrt(mean(x^2) + eps)).to(x.dtype)
FUSABLE_RMSNORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")

if HAVE_TRITON:

    @triton.jit
    def _rmsnorm_kernel(
        x_ptr, w_ptr, out_ptr, x_row_stride, out_row_stride, n_cols, eps, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * x_row_stride + cols, mask=mask, other=0.0).to(tl.float32)
        inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
        normed = (x * inv_rms).to(x_ptr.dtype.element_ty).to(tl.float32)  # transformers rounds here
        w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(out_ptr + row * out_row_stride + cols, (w * normed).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _rotary_kernel(x_ptr, cos_ptr, sin_ptr, out_ptr, num_t, sxb, sxh, sxt, scb, sct, HALF: tl.constexpr):
        bt = tl.program_id(0)
        h = tl.program_id(1)
        b = (bt // num_t).to(tl.int64)
        t = (bt % num_t).to(tl.int64)
        x_row = x_ptr + b * sxb + h * sxh + t * sxt
        out_row = out_ptr + b * sxb + h * sxh + t * sxt
        c_row = b * scb + t * sct
        i = tl.arange(0, HALF)
        x1 = tl.load(x_row + i).to(tl.float32)
        x2 = tl.load(x_row + HALF + i).to(tl.float32)
        c1 = tl.load(cos_ptr + c_row + i).to(tl.float32)
        c2 = tl.load(cos_ptr + c_row + HALF + i).to(tl.float32)
        s1 = tl.load(sin_ptr + c_row + i).to(tl.float32)
        s2 = tl.load(sin_ptr + c_row + HALF + i).to(tl.float32)
        # rotate_half(x) = cat(-x2, x1)
        tl.store(out_row + i, (x1 * c1 - x2 * s1).to(out_ptr.dtype.element_ty))
        tl.store(out_row + HALF + i, (x2 * c2 + x1 * s2).to(out_ptr.dtype.element_ty))


def rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] (any strides, last dim contiguous); cos/sin [B, T, D]. Same math as transformers."""
    num_b, num_h, num_t, head_dim = x.shape
    out = torch.empty_like(x)  # keeps x's strides, so both use the same offsets
    assert (
        out.stride() == x.stride()
        and x.stride(-1) == 1
        and cos.stride(-1) == 1
        and cos.stride() == sin.stride()
    )
    if x.numel():
        _rotary_kernel[(num_b * num_t, num_h)](
            x,
            cos,
            sin,
            out,
            num_t,
            x.stride(0),
            x.stride(1),
            x.stride(2),
            cos.stride(0),
            cos.stride(1),
            HALF=head_dim // 2,
            num_warps=1,
        )
    return out


def install_fused_rotary(model: torch.nn.Module) -> bool:
    """Swap `apply_rotary_pos_emb` in the model's modeling module for the fused kernel on CUDA tensors.

    NOTE: this rebinds a module-level function, so it affects every model of that family in the process;
    it computes the same function and falls back to the original for anything but the plain case.
    """
    module: Any = sys.modules.get(type(model).__module__)
    original = getattr(module, "apply_rotary_pos_emb", None)
    if not HAVE_TRITON or original is None or getattr(original, "is_cbq_fused", False):
        return False

    def apply_rotary_pos_emb(q, k, cos, sin, *args, **kwargs):
        half = q.shape[-1] // 2
        plain = not args and not kwargs and cos.dim() == 3 and cos.shape[-1] == q.shape[-1]
        if q.is_cuda and plain and half >= 8 and half & (half - 1) == 0:
            return rotary(q, cos, sin), rotary(k, cos, sin)
        return original(q, k, cos, sin, *args, **kwargs)

    apply_rotary_pos_emb.is_cbq_fused = True  # type: ignore[attr-defined]
    module.apply_rotary_pos_emb = apply_rotary_pos_emb
    return True


def rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """RMSNorm over the last dim of x (any leading shape); output dtype as transformers' (w * x) promotion."""
    shape = x.shape
    x2 = x.reshape(-1, shape[-1])
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    out = torch.empty(x2.shape, dtype=torch.promote_types(weight.dtype, x.dtype), device=x.device)
    n_rows, n_cols = x2.shape
    if n_rows:
        block = triton.next_power_of_2(n_cols)
        num_warps = 4 if block <= 2048 else 8
        _rmsnorm_kernel[(n_rows,)](
            x2, weight, out, x2.stride(0), out.stride(0), n_cols, eps, BLOCK=block, num_warps=num_warps
        )
    return out.view(shape)


def install_fused_rmsnorm(model: torch.nn.Module) -> int:
    """Route every supported RMSNorm of `model` through the fused kernel. Returns how many were swapped."""
    if not HAVE_TRITON:
        return 0
    count = 0
    for module in model.modules():
        if type(module).__name__ in FUSABLE_RMSNORMS and hasattr(module, "variance_epsilon"):
            module.forward = _bound_rmsnorm(module)
            count += 1
    return count


def _bound_rmsnorm(module):
    def forward(hidden_states: torch.Tensor) -> torch.Tensor:
        return rmsnorm(hidden_states, module.weight, module.variance_epsilon)

    return forward
