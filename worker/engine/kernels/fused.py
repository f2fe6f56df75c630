"""Fused element-wise kernels of the owned decoder (`decoder.py`). Owns nothing.

Each op has a Triton kernel (CUDA) and a plain-torch twin (`*_ref`, CPU and tests) computing the same
function as transformers' Llama/Qwen layer, with the same roundings to the model dtype where transformers
rounds:
  add_rmsnorm      residual += x (rounded to the dtype), then RMSNorm of the new residual; one launch
                   returns both, and writes the residual in place. Epilogue flags for the other families:
                   x first normed by its own weight (the post-norm of the block that made it: Gemma's sandwich,
                   OLMo 2) and/or scaled (Granite's residual multiplier; the embedding scale on the first call);
                   the weight multiplied in fp32 without rounding the normed value first (`weight_fp32`: OLMo 2's
                   norm, and Gemma's (1 + w) with the 1 + w folded into an fp32 weight at load, `fold_one_plus`)
  act_mul          act(gate) * up over a fused [T, 2 * I] gate/up GEMM output (SiLU or GELU-tanh)
  logits_epilogue  the final logits divided, scaled and soft-capped (Granite, Cohere, Gemma 2) in one launch
  qkv_rope_write   from one fused [T, (H + 2 * KVH) * D] QKV GEMM output: Qwen3's per-head q/k RMSNorm,
                   rotary on q and k (cos/sin tables indexed by position), q out as [T, H, D], and k/v
                   scattered into the paged cache at `slot_mapping` (padding rows write scratch block 0): one launch per layer
                   instead of norm, rotary and KV-write kernels (the q/k norm in Gemma's fp32-weight form too)
The torch twins also cover what no kernel computes yet (q/k norms over the whole projection, partial,
interleaved and absent rotary): the owned decoder runs that stage of those families through them on every
device, and the rest of their layer through the kernels.
The kernels read flags (which norm arithmetic, which activation, which epilogue), never a family's name.
All launches depend only on shapes, so they are CUDA-graph capturable. The module imports without
triton (`HAVE_TRITON`).
"""

from __future__ import annotations

import torch

from .common import HAVE_TRITON, next_pow2, tl, triton

if HAVE_TRITON:
    from .common import fp8_row_scale, quantize_to_fp8, to_kv_cache

if HAVE_TRITON:
    from .pdl import pdl_wait_and_release


# The kernels' ACT constexpr: which activation `act_mul` and decode_gemm's gated epilogue compute.
ACT_SILU, ACT_GELU_TANH = 0, 1

# -- torch references (CPU path) ------------------------------------------------------------------------


def mean_square(xf: torch.Tensor) -> torch.Tensor:
    """[..., W] fp32 -> [..., 1]: the RMSNorm statistic over the last dimension, all of it here. A tensor-parallel
    shard passes its own (layers/tensor_parallel.TensorParallel.mean_square): the sum over the ranks' slices."""
    return xf.pow(2).mean(-1, keepdim=True)


def rmsnorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float, mean_square=mean_square) -> torch.Tensor:
    """transformers' RMSNorm: fp32 statistics, round to x's dtype, then multiply by the weight."""
    xf = x.float()
    normed = (xf * torch.rsqrt(mean_square(xf) + eps)).to(x.dtype)
    return weight * normed


def rmsnorm_one_plus_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Gemma's RMSNorm: everything in fp32, times (1 + weight), rounded to x's dtype once at the end."""
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps) * (1.0 + weight.float())).to(x.dtype)


def rmsnorm_fp32_weight_ref(
    x: torch.Tensor, weight: torch.Tensor, eps: float, mean_square=mean_square
) -> torch.Tensor:
    """OLMo 2's RMSNorm: the weight multiply in fp32 too, rounded to x's dtype once at the end."""
    xf = x.float()
    return (weight * (xf * torch.rsqrt(mean_square(xf) + eps))).to(x.dtype)


def layernorm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Cohere's LayerNorm (no bias): mean-centred, fp32 statistics, the weight multiply in fp32 too, rounded to x's
    dtype once at the end."""
    xf = x.float()
    centred = xf - xf.mean(-1, keepdim=True)
    return (weight.float() * (centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + eps))).to(x.dtype)


def fold_one_plus(weight: torch.Tensor) -> torch.Tensor:
    """Gemma's (1 + w) as an fp32 weight, so that its RMSNorm is `rmsnorm_fp32_weight_ref` (and the kernels'
    `weight_fp32`). Exact in every dtype: Gemma computes 1 + w.float() in fp32, and so does this, once."""
    return 1.0 + weight.float()


def add_rmsnorm_ref(x, residual, weight, eps, norm=rmsnorm_ref, x_weight=None, x_scale=None):
    """Returns (norm(s), s) for s = residual + x' (x itself when residual is None), x' = x normed by `x_weight`
    (a block's post-norm) then times `x_scale` (a float or 0-dim tensor); weight None (a layer without that
    pre-norm) returns the sum un-normed."""
    if x_weight is not None:
        x = norm(x, x_weight, eps)
    if x_scale is not None:
        x = x * x_scale
    residual = x if residual is None else residual + x
    return (residual if weight is None else norm(residual, weight, eps)), residual


def silu_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.silu(gate) * up


def gelu_tanh_mul_ref(gate_up: torch.Tensor) -> torch.Tensor:
    """transformers' gelu_pytorch_tanh(gate) * up."""
    gate, up = gate_up.chunk(2, dim=-1)
    return torch.nn.functional.gelu(gate, approximate="tanh") * up


def logits_epilogue_ref(
    logits: torch.Tensor, divisor: float | None, scale: float | None, softcap: float | None
) -> torch.Tensor:
    """As transformers computes them, each op rounded to the logits' dtype: / divisor (Granite's logits_scaling),
    * scale (Cohere's logit_scale), then cap * tanh(logits / cap) (Gemma 2's final soft-cap)."""
    if divisor is not None:
        logits = logits / divisor
    if scale is not None:
        logits = logits * scale
    if softcap is not None:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qkv_rope_write_ref(
    qkv,
    positions,
    cos_table,
    sin_table,
    q_norm,
    k_norm,
    eps,
    num_heads,
    num_kv_heads,
    write_kv,
    norm=rmsnorm_ref,
    qk_norm_full=False,
    interleaved=False,
) -> torch.Tensor:
    """Split, (q/k `norm` per head, or over the whole q and k projections with `qk_norm_full`), rotary like transformers' `apply_rotary_pos_emb`, `write_kv(k, v)`; returns q."""
    num_tokens = qkv.shape[0]
    head_dim = qkv.shape[-1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * head_dim, num_kv_heads * head_dim, num_kv_heads * head_dim], dim=-1)
    if q_norm is not None and qk_norm_full:
        q, k = norm(q, q_norm, eps), norm(k, k_norm, eps)
    q = q.view(num_tokens, num_heads, head_dim)
    k = k.view(num_tokens, num_kv_heads, head_dim)
    v = v.view(num_tokens, num_kv_heads, head_dim)
    if q_norm is not None and not qk_norm_full:
        q, k = norm(q, q_norm, eps), norm(k, k_norm, eps)
    if cos_table is not None:  # None: a layer without rotary (NoPE)
        cos = cos_table[positions][:, None, :]
        sin = sin_table[positions][:, None, :]
        rotary = _rotary_interleaved_ref if interleaved else _rotary_ref
        q, k = rotary(q, cos, sin), rotary(k, cos, sin)
    write_kv(k, v)
    return q


def _rotary_interleaved_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """GLM's and Cohere's rotary: dims (2i, 2i + 1) rotate by frequency i (tables as Llama's: [f, f] halves)."""
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half].repeat_interleave(2, dim=-1), sin[..., :half].repeat_interleave(2, dim=-1)
    rotary_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    rotated = torch.stack((-x_rot[..., 1::2], x_rot[..., 0::2]), dim=-1).flatten(-2)
    return torch.cat([x_rot * cos + rotated * sin, x_pass], dim=-1)


def _rotary_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' rotary; tables narrower than the head rotate its first dims only (partial rotary)."""
    rotary_dim = cos.shape[-1]
    if rotary_dim == x.shape[-1]:
        return x * cos + _rotate_half(x) * sin
    x_rot, x_pass = x[..., :rotary_dim], x[..., rotary_dim:]
    return torch.cat([x_rot * cos + _rotate_half(x_rot) * sin, x_pass], dim=-1)


# -- Triton kernels ---------------------------------------------------------------------------------------

if HAVE_TRITON:

    @triton.jit
    def tanh(x):
        """tanh in fp32 from one exp2 (no libdevice, so the interpreter runs it too): sign(x) (1 - e) / (1 + e),
        e = exp(-2 |x|), which neither overflows nor loses x's sign."""
        e = tl.exp2(-2.8853900817779268 * tl.abs(x))  # 2 * log2(e)
        t = (1.0 - e) / (1.0 + e)
        return tl.where(x < 0, -t, t)

    @triton.jit
    def activation(g, ACT: tl.constexpr):
        """act(g) in fp32: ACT 0 SiLU, 1 GELU-tanh (transformers' gelu_pytorch_tanh). Shared with decode_gemm's
        gated epilogue, which must round alike."""
        if ACT == 1:
            return 0.5 * g * (1.0 + tanh(0.7978845608028654 * (g + 0.044715 * g * g * g)))
        else:
            return g / (1.0 + tl.exp(-g))

    @triton.jit
    def rms_weight(x, inv_rms, w, dtype: tl.constexpr, WEIGHT_FP32: tl.constexpr):
        """The normed row times its weight, rounded as the norm kind rounds: Llama rounds x * inv_rms to the dtype
        before the weight multiply; OLMo 2 and Gemma (fp32 (1 + w), folded at load) multiply in fp32."""
        if WEIGHT_FP32:
            return (w * (x * inv_rms)).to(dtype)
        else:
            return (w * (x * inv_rms).to(dtype).to(tl.float32)).to(dtype)

    @triton.jit
    def _add_rmsnorm_kernel(
        x_ptr,
        res_ptr,
        w_ptr,
        out_ptr,
        xw_ptr,
        n_cols,
        eps,
        x_scale,
        HAS_RESIDUAL: tl.constexpr,
        BLOCK: tl.constexpr,
        USE_PDL: tl.constexpr,
        HAS_WEIGHT: tl.constexpr = True,  # False: out is the sum itself (a layer without that pre-norm)
        X_NORM: tl.constexpr = False,  # x is first normed by xw (the post-norm of the block that made it)
        X_SCALE: tl.constexpr = False,  # then times x_scale (rounded), before the add
        WRITE_SUM: tl.constexpr = False,  # no residual, but x was changed: store the sum into res_ptr
        WEIGHT_FP32: tl.constexpr = False,
        CENTRED: tl.constexpr = False,  # a LayerNorm: the row's mean subtracted before the statistic (Cohere)
        scale_out_ptr=None,  # FP8_OUT: each row's fp32 scale
        scale_ub=0.0,
        FP8_OUT: tl.constexpr = False,  # out is e4m3: the normed row quantized per token (fp8.quantize_per_token)
        HAS_UB: tl.constexpr = False,
        FP8_MAX: tl.constexpr = 448.0,
        MIN_ABSMAX: tl.constexpr = 1e-10,
    ):
        pdl_wait_and_release(USE_PDL)
        row = tl.program_id(0).to(tl.int64) * n_cols
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = x_ptr.dtype.element_ty  # the model's (out's too, but with FP8_OUT)
        x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        if X_NORM:
            xw = tl.load(xw_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            x_inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
            x = rms_weight(x, x_inv_rms, xw, dtype, WEIGHT_FP32).to(tl.float32)
        if X_SCALE:
            x = (x * x_scale).to(dtype).to(tl.float32)
        if HAS_RESIDUAL:
            r = tl.load(res_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
            x = (x + r).to(res_ptr.dtype.element_ty)  # transformers adds in the model dtype
            tl.store(res_ptr + row + cols, x, mask=mask)
            x = x.to(tl.float32)
        elif WRITE_SUM:
            tl.store(res_ptr + row + cols, x.to(res_ptr.dtype.element_ty), mask=mask)
        if HAS_WEIGHT:
            if CENTRED:
                x = tl.where(mask, x - tl.sum(x, axis=0) / n_cols, 0.0)
            inv_rms = tl.rsqrt(tl.sum(x * x, axis=0) / n_cols + eps)
            w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
            y = rms_weight(x, inv_rms, w, dtype, WEIGHT_FP32)
        else:
            y = x.to(dtype)
        if FP8_OUT:  # the rounded row, quantized as per_token_quant would quantize it
            y32 = tl.where(mask, y.to(tl.float32), 0.0)
            scale = fp8_row_scale(tl.max(tl.abs(y32), axis=0), scale_ub, HAS_UB, FP8_MAX, MIN_ABSMAX)
            tl.store(scale_out_ptr + tl.program_id(0), scale)
            tl.store(out_ptr + row + cols, quantize_to_fp8(y32, scale, FP8_MAX), mask=mask)
        else:
            tl.store(out_ptr + row + cols, y, mask=mask)

    @triton.jit
    def _act_mul_kernel(gu_ptr, out_ptr, inter, BLOCK: tl.constexpr, USE_PDL: tl.constexpr, ACT: tl.constexpr = 0):
        pdl_wait_and_release(USE_PDL)
        t = tl.program_id(0).to(tl.int64)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < inter
        g = tl.load(gu_ptr + t * 2 * inter + cols, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(gu_ptr + t * 2 * inter + inter + cols, mask=mask, other=0.0).to(tl.float32)
        a = activation(g, ACT).to(out_ptr.dtype.element_ty).to(tl.float32)  # the activation rounds, then mul
        tl.store(out_ptr + t * inter + cols, (a * u).to(out_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _logits_epilogue_kernel(
        x_ptr,
        n_cols,
        divisor,
        scale,
        softcap,
        BLOCK: tl.constexpr,
        DIVIDE: tl.constexpr,
        SCALE: tl.constexpr,
        SOFTCAP: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64) * n_cols
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        mask = cols < n_cols
        dtype = x_ptr.dtype.element_ty
        x = tl.load(x_ptr + row + cols, mask=mask, other=0.0).to(tl.float32)
        if DIVIDE:
            x = (x / divisor).to(dtype).to(tl.float32)
        if SCALE:
            x = (x * scale).to(dtype).to(tl.float32)
        if SOFTCAP:  # each op rounded, as transformers' three
            x = (x / softcap).to(dtype).to(tl.float32)
            x = tanh(x).to(dtype).to(tl.float32)
            x = x * softcap
        tl.store(x_ptr + row + cols, x.to(dtype), mask=mask)

    @triton.jit
    def rotate_halves(x1, x2, cos_ptr, sin_ptr, offsets, mask, HALF: tl.constexpr):
        """Rotary of a head's two halves (x1: columns [0, HALF), x2: [HALF, 2 HALF), fp32) with the cos/sin
        table entries at `offsets` (position row + column of the first half), as transformers'
        `apply_rotary_pos_emb` computes x * cos + rotate_half(x) * sin, rotate_half(x) = cat(-x2, x1). Shared by
        `_qkv_rope_write_kernel` and decode_gemm's QKV epilogue, which must round alike."""
        c1 = tl.load(cos_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        c2 = tl.load(cos_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
        s1 = tl.load(sin_ptr + offsets, mask=mask, other=0.0).to(tl.float32)
        s2 = tl.load(sin_ptr + offsets + HALF, mask=mask, other=0.0).to(tl.float32)
        return x1 * c1 - x2 * s1, x2 * c2 + x1 * s2

    @triton.jit
    def _qkv_rope_write_kernel(
        qkv_ptr,
        pos_ptr,
        cos_ptr,
        sin_ptr,
        qw_ptr,
        kw_ptr,
        q_out_ptr,
        k_cache_ptr,
        v_cache_ptr,
        slot_ptr,
        k_scale_inv,
        v_scale_inv,
        stride_qkv,
        stride_cos,
        stride_kcb,
        stride_kcs,
        stride_kch,
        stride_vcb,
        stride_vcs,
        stride_vch,
        eps,
        NUM_HEADS: tl.constexpr,
        NUM_KV_HEADS: tl.constexpr,
        HEAD_DIM: tl.constexpr,
        HALF: tl.constexpr,
        BLOCK_HALF: tl.constexpr,
        HEADS_PER_PROG: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        HAS_QK_NORM: tl.constexpr,
        USE_PDL: tl.constexpr,
        NORM_FP32_WEIGHT: tl.constexpr = False,  # the q/k norms' weight multiply in fp32 (Gemma 3, folded 1 + w)
    ):
        pdl_wait_and_release(USE_PDL)
        # One program: token t, HEADS_PER_PROG consecutive heads of the [q heads | k heads | v heads] row.
        t = tl.program_id(0).to(tl.int64)
        hh = tl.program_id(1) * HEADS_PER_PROG + tl.arange(0, HEADS_PER_PROG)
        i = tl.arange(0, BLOCK_HALF)
        is_q = hh < NUM_HEADS
        is_k = (hh >= NUM_HEADS) & (hh < NUM_HEADS + NUM_KV_HEADS)
        is_v = (hh >= NUM_HEADS + NUM_KV_HEADS) & (hh < NUM_HEADS + 2 * NUM_KV_HEADS)
        m = (is_q | is_k | is_v)[:, None] & (i < HALF)[None, :]
        src = qkv_ptr + t * stride_qkv + hh[:, None] * HEAD_DIM + i[None, :]
        x1 = tl.load(src, mask=m, other=0.0).to(tl.float32)
        x2 = tl.load(src + HALF, mask=m, other=0.0).to(tl.float32)
        dtype = q_out_ptr.dtype.element_ty
        if HAS_QK_NORM:  # Qwen3, Gemma 3: RMSNorm over each q and k head (not v), rounded like transformers
            inv_rms = tl.rsqrt(tl.sum(x1 * x1 + x2 * x2, axis=1) / HEAD_DIM + eps)
            wm = (i < HALF)[None, :]
            w1 = tl.where(
                is_q[:, None],
                tl.load(qw_ptr + i[None, :], mask=wm, other=0.0),
                tl.load(kw_ptr + i[None, :], mask=wm, other=0.0),
            ).to(tl.float32)
            w2 = tl.where(
                is_q[:, None],
                tl.load(qw_ptr + HALF + i[None, :], mask=wm, other=0.0),
                tl.load(kw_ptr + HALF + i[None, :], mask=wm, other=0.0),
            ).to(tl.float32)
            n1 = rms_weight(x1, inv_rms[:, None], w1, dtype, NORM_FP32_WEIGHT).to(tl.float32)
            n2 = rms_weight(x2, inv_rms[:, None], w2, dtype, NORM_FP32_WEIGHT).to(tl.float32)
            x1 = tl.where(is_v[:, None], x1, n1)
            x2 = tl.where(is_v[:, None], x2, n2)
        pos = tl.load(pos_ptr + t).to(tl.int64)
        r1, r2 = rotate_halves(x1, x2, cos_ptr, sin_ptr, pos * stride_cos + i[None, :], m, HALF)
        rope = (is_q | is_k)[:, None]
        y1 = tl.where(rope, r1, x1)
        y2 = tl.where(rope, r2, x2)
        q_dst = q_out_ptr + t * (NUM_HEADS * HEAD_DIM) + hh[:, None] * HEAD_DIM + i[None, :]
        qm = m & is_q[:, None]
        tl.store(q_dst, y1.to(dtype), mask=qm)
        tl.store(q_dst + HALF, y2.to(dtype), mask=qm)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        blk = slot // BLOCK_SIZE
        off = slot % BLOCK_SIZE
        kh = (hh - NUM_HEADS)[:, None]
        k_dst = k_cache_ptr + blk * stride_kcb + off * stride_kcs + kh * stride_kch + i[None, :]
        km = m & is_k[:, None]
        tl.store(k_dst, to_kv_cache(y1, k_scale_inv, k_cache_ptr, dtype), mask=km)
        tl.store(k_dst + HALF, to_kv_cache(y2, k_scale_inv, k_cache_ptr, dtype), mask=km)
        vh = (hh - NUM_HEADS - NUM_KV_HEADS)[:, None]
        v_dst = v_cache_ptr + blk * stride_vcb + off * stride_vcs + vh * stride_vch + i[None, :]
        vm = m & is_v[:, None]
        tl.store(v_dst, to_kv_cache(y1, v_scale_inv, v_cache_ptr, dtype), mask=vm)
        tl.store(v_dst + HALF, to_kv_cache(y2, v_scale_inv, v_cache_ptr, dtype), mask=vm)


def add_rmsnorm(
    x,
    residual,
    weight,
    eps,
    pdl: bool = False,
    *,
    weight_fp32: bool = False,
    centred: bool = False,
    x_weight: torch.Tensor | None = None,
    x_scale: float | torch.Tensor | None = None,
):
    """Triton twin of `add_rmsnorm_ref` (norm `rmsnorm_ref`, `rmsnorm_fp32_weight_ref` with `weight_fp32`, or
    `layernorm_ref` with both `weight_fp32` and `centred`; a post-norm `x_weight` is never centred):
    x [T, N] contiguous; `residual` (if given) is updated in place. `pdl`: launch with programmatic dependent
    launch (pdl.py). `x_scale` may be a 0-dim tensor (read once on the host, at build time: the decoder's
    embedding scale), so that the ref and the kernel are called alike."""
    return add_rmsnorm_into(
        torch.empty_like(x), x, residual, weight, eps, pdl, weight_fp32, x_weight, x_scale, centred=centred
    )


def add_rmsnorm_into(
    out, x, residual, weight, eps, pdl, weight_fp32, x_weight, x_scale, fp8_out: dict | None = None, centred=False
) -> tuple[torch.Tensor, torch.Tensor]:
    """`add_rmsnorm` writing the normed rows into `out`. `fp8_out` (quant/small_step.py's fp8_add_rmsnorm): `out`
    is e4m3 and the rows are quantized per token in the same program, the launch arguments FP8_OUT's
    (scale_out_ptr [rows], scale_ub, HAS_UB, FP8_MAX, MIN_ABSMAX)."""
    assert x.is_contiguous() and (residual is None or residual.shape == x.shape and residual.is_contiguous())
    num_rows, num_cols = x.shape
    changes_x = x_weight is not None or x_scale is not None
    total = residual if residual is not None else torch.empty_like(x) if changes_x else x
    if num_rows:
        block = next_pow2(num_cols)
        _add_rmsnorm_kernel[(num_rows,)](
            x,
            total,
            x if weight is None else weight,  # never read without HAS_WEIGHT
            out,
            x if x_weight is None else x_weight,
            num_cols,
            eps,
            1.0 if x_scale is None else float(x_scale),
            HAS_RESIDUAL=residual is not None,
            BLOCK=block,
            USE_PDL=pdl,
            HAS_WEIGHT=weight is not None,
            X_NORM=x_weight is not None,
            X_SCALE=x_scale is not None,
            WRITE_SUM=residual is None and changes_x,
            WEIGHT_FP32=weight_fp32,
            CENTRED=centred,
            num_warps=4 if block <= 2048 else 8,
            launch_pdl=pdl,
            **(dict(FP8_OUT=True, **fp8_out) if fp8_out else dict(scale_out_ptr=x, scale_ub=0.0)),
        )
    return out, total


def act_mul(gate_up: torch.Tensor, pdl: bool = False, act: int = 0) -> torch.Tensor:
    """act(gate) * up of a fused [T, 2I] gate/up output; `act` 0 SiLU, 1 GELU-tanh (ACT_CODES)."""
    assert gate_up.is_contiguous()
    num_tokens, inter = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_tokens, inter), dtype=gate_up.dtype, device=gate_up.device)
    if num_tokens:
        block = min(1024, next_pow2(inter))
        _act_mul_kernel[(num_tokens, triton.cdiv(inter, block))](
            gate_up, out, inter, BLOCK=block, USE_PDL=pdl, ACT=act, num_warps=4, launch_pdl=pdl
        )
    return out


def silu_mul(gate_up: torch.Tensor, pdl: bool = False) -> torch.Tensor:
    return act_mul(gate_up, pdl, ACT_SILU)


def logits_epilogue(
    logits: torch.Tensor, divisor: float | None, scale: float | None, softcap: float | None
) -> torch.Tensor:
    """Triton twin of `logits_epilogue_ref`, in place on logits [R, V] (contiguous); one launch."""
    if divisor is None and scale is None and softcap is None:
        return logits
    assert logits.is_contiguous()
    num_rows, num_cols = logits.shape
    if num_rows:
        block = min(4096, next_pow2(num_cols))
        _logits_epilogue_kernel[(num_rows, triton.cdiv(num_cols, block))](
            logits,
            num_cols,
            divisor or 1.0,
            scale or 1.0,
            softcap or 1.0,
            BLOCK=block,
            DIVIDE=divisor is not None,
            SCALE=scale is not None,
            SOFTCAP=softcap is not None,
            num_warps=8,
        )
    return logits


def qkv_rope_write(
    qkv,
    positions,
    cos_table,
    sin_table,
    q_norm,
    k_norm,
    eps,
    num_heads,
    num_kv_heads,
    k_cache,
    v_cache,
    slot_mapping,
    pdl: bool = False,
    norm_fp32_weight: bool = False,
    kv_scale: tuple[float, float] = (1.0, 1.0),
) -> torch.Tensor:
    """Triton twin of `qkv_rope_write_ref` writing straight into the paged caches; returns q [T, H, D].
    `norm_fp32_weight`: the q/k norms as `rmsnorm_fp32_weight_ref` (Gemma 3's, 1 + w folded).
    `kv_scale`: (k_scale, v_scale) of an e4m3 cache (kernels/attention.py)."""
    num_tokens = qkv.shape[0]
    head_dim = cos_table.shape[-1]
    block_size = k_cache.shape[1]
    assert qkv.stride(-1) == 1 and head_dim % 2 == 0 and cos_table.stride(-1) == 1
    assert cos_table.stride() == sin_table.stride() and k_cache.shape[2:] == (num_kv_heads, head_dim)
    q = torch.empty((num_tokens, num_heads, head_dim), dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    block_half = next_pow2(head_dim // 2)
    heads_per_prog = max(1, min(next_pow2(num_heads + 2 * num_kv_heads), 1024 // block_half))
    num_progs = triton.cdiv(num_heads + 2 * num_kv_heads, heads_per_prog)
    has_norm = q_norm is not None
    _qkv_rope_write_kernel[(num_tokens, num_progs)](
        qkv,
        positions,
        cos_table,
        sin_table,
        q_norm if has_norm else cos_table,
        k_norm if has_norm else cos_table,
        q,
        k_cache,
        v_cache,
        slot_mapping,
        1.0 / kv_scale[0],
        1.0 / kv_scale[1],
        qkv.stride(0),
        cos_table.stride(0),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        eps,
        NUM_HEADS=num_heads,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HALF=head_dim // 2,
        BLOCK_HALF=block_half,
        HEADS_PER_PROG=heads_per_prog,
        BLOCK_SIZE=block_size,
        HAS_QK_NORM=has_norm,
        USE_PDL=pdl,
        NORM_FP32_WEIGHT=norm_fp32_weight,
        num_warps=4 if heads_per_prog * block_half >= 512 else 2,
        launch_pdl=pdl,
    )
    return q
