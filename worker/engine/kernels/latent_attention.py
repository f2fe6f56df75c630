"""Triton decode kernel for multi-head latent attention (DeepSeek) over the paged latent cache; its CPU twin is
latent_attention.latent_decode_attention_ref.

  cache: [num_blocks, block_size, 1, C + R]: per token the latent (C = kv_lora_rank) and the rotated shared key
    (R = qk_rope_head_dim), one row (kv_cache.py's latent layout)
  q_latent [B, H, C]: each head's no-rotary query absorbed into the latent space (W_UK^T q_nope); q_rope [B, H, R]
  block_tables, context_lens: as kernels/attention.py (one query row per sequence, at position context_lens[b] - 1)
  returns [B, H, C]: sum_j softmax_j(scale * (q_latent . c_j + q_rope . k_rope_j)) c_j, which W_UV then maps to
    each head's value (latent_attention.py)

Unlike the generic decode kernel on these shapes (one 576-wide head padded to 1,024, K and V loaded as two tiles
of the same rows, every head in one program), a program here takes HEAD_BLOCK heads of one sequence and loads each
cache tile once: its latent part serves the scores and the output, its rotary part the scores only. Split-K over
the context as the generic kernel does, the splits combined by its reduce kernel; PDL as kernels/pdl.py says.

An e4m3 latent cache (`--kv-cache-dtype fp8`, kv_cache.py) holds each row / cache_scale, one per-tensor scale per
layer for the latent and the rotary key alike: a tile widens after its load as the generic kernel's do (to fp16
under a bf16 query: exact, and one conversion per two values on sm90), the scale folds into the softmax scale
(q . (row * s) = (q . row) * s) and the output (sum_j p_j (c_j * s) = s * sum_j p_j c_j), so the loop is the
bf16 cache's.
"""

from __future__ import annotations

import torch

from .attention import DEFAULT_MAX_NUM_SPLITS, _decode_reduce_kernel, _reduce_warps, decode_num_splits
from .common import HAVE_TRITON, dot_precision, next_pow2, require_triton, tl, triton

if HAVE_TRITON:
    from .pdl import pdl_wait_and_release

HEAD_BLOCK = 16  # heads a program takes (tensor-core rows): V2-Lite's 16 in one, V3's 128 in eight
TILE_N = 32  # cache rows per tile: 32 x 576 bf16 = 36 KB

if HAVE_TRITON:

    @triton.jit
    def _latent_decode_kernel(
        q_latent_ptr,
        q_rope_ptr,
        cache_ptr,
        block_tables_ptr,
        context_lens_ptr,
        out_ptr,
        part_o_ptr,
        part_lse_ptr,
        scale_log2,
        cache_scale,
        num_heads,
        stride_qlb,
        stride_qlh,
        stride_qrb,
        stride_qrh,
        stride_ob,
        stride_oh,
        stride_cb,
        stride_cs,
        stride_bt,
        NUM_SPLITS: tl.constexpr,
        LATENT: tl.constexpr,
        ROPE: tl.constexpr,
        BLOCK_C: tl.constexpr,
        BLOCK_R: tl.constexpr,
        HEAD_BLOCK: tl.constexpr,
        BLOCK_SIZE: tl.constexpr,
        TILE_N: tl.constexpr,
        DOT_PREC: tl.constexpr,
        USE_PDL: tl.constexpr,
        KV_FP8: tl.constexpr,
    ):
        pdl_wait_and_release(USE_PDL)
        b = tl.program_id(0)
        head_block = tl.program_id(1)
        split = tl.program_id(2)
        ctx = tl.load(context_lens_ptr + b)
        tiles_per_split = tl.cdiv(tl.cdiv(ctx, TILE_N), NUM_SPLITS)
        start = split * tiles_per_split * TILE_N
        end = tl.minimum(start + tiles_per_split * TILE_N, ctx)

        heads = head_block * HEAD_BLOCK + tl.arange(0, HEAD_BLOCK)
        h_mask = heads < num_heads
        c = tl.arange(0, BLOCK_C)
        r = tl.arange(0, BLOCK_R)
        c_mask = c < LATENT
        r_mask = r < ROPE
        b64 = b.to(tl.int64)
        q_lat = tl.load(
            q_latent_ptr + b64 * stride_qlb + heads[:, None] * stride_qlh + c[None, :],
            mask=h_mask[:, None] & c_mask[None, :], other=0.0,
        )  # fmt: skip
        q_rope = tl.load(
            q_rope_ptr + b64 * stride_qrb + heads[:, None] * stride_qrh + r[None, :],
            mask=h_mask[:, None] & r_mask[None, :], other=0.0,
        )  # fmt: skip
        compute = q_lat.dtype
        if KV_FP8 and compute == tl.bfloat16:
            compute = tl.float16  # e4m3 -> fp16 is exact and cheaper than -> bf16 (kernels/attention.py)
        q_lat = q_lat.to(compute)
        q_rope = q_rope.to(compute)
        m_i = tl.full([HEAD_BLOCK], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([HEAD_BLOCK], dtype=tl.float32)
        acc = tl.zeros([HEAD_BLOCK, BLOCK_C], dtype=tl.float32)
        bt_row = block_tables_ptr + b64 * stride_bt
        offs_n = tl.arange(0, TILE_N)
        for n0 in range(start, end, TILE_N):
            pos = n0 + offs_n
            valid = pos < end
            page = tl.load(bt_row + pos // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
            row = cache_ptr + page * stride_cb + (pos % BLOCK_SIZE) * stride_cs
            lat = tl.load(row[:, None] + c[None, :], mask=valid[:, None] & c_mask[None, :], other=0.0).to(compute)
            rope = tl.load(row[:, None] + LATENT + r[None, :], mask=valid[:, None] & r_mask[None, :], other=0.0)
            rope = rope.to(compute)
            s = tl.dot(q_lat, tl.trans(lat), input_precision=DOT_PREC)
            s += tl.dot(q_rope, tl.trans(rope), input_precision=DOT_PREC)
            s = tl.where(valid[None, :], s * scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(s - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(lat.dtype), lat, input_precision=DOT_PREC)
            m_i = m_new

        has = l_i > 0.0
        o = tl.where(has[:, None], acc / tl.where(has, l_i, 1.0)[:, None], 0.0)
        if KV_FP8:  # the rows were read unscaled: sum_j p_j (c_j * s) = s * sum_j p_j c_j
            o = o * cache_scale
        mask = h_mask[:, None] & c_mask[None, :]
        if NUM_SPLITS == 1:
            out = out_ptr + b64 * stride_ob + heads[:, None] * stride_oh + c[None, :]
            tl.store(out, o.to(out_ptr.dtype.element_ty), mask=mask)
        else:
            part = (b64 * num_heads + heads) * NUM_SPLITS + split  # the generic reduce kernel's workspace rows
            tl.store(part_o_ptr + part[:, None] * LATENT + c[None, :], o, mask=mask)
            lse = tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf"))
            tl.store(part_lse_ptr + part, lse, mask=h_mask)


def latent_decode_attention(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    max_context_len: int | None = None,
    max_num_splits: int = DEFAULT_MAX_NUM_SPLITS,
    pdl: bool = False,
    cache_scale: float = 1.0,
) -> torch.Tensor:
    """One query row per sequence over the latent cache (module docstring); returns [B, H, kv_lora_rank] in q's
    dtype. Launch bounds come from host ints only (CUDA-graph capturable); an fp32 workspace with more than one split.
    `cache_scale`: an e4m3 cache's per-tensor scale (its rows are read as row * cache_scale)."""
    require_triton("kernels.latent_attention (use latent_decode_attention_ref on CPU)")
    num_seqs, num_heads, latent = q_latent.shape
    rope = q_rope.shape[-1]
    num_blocks, block_size, one, width = cache.shape
    assert one == 1 and width == latent + rope and cache.stride(-1) == 1, f"latent cache {tuple(cache.shape)}"
    assert q_latent.stride(-1) == 1 and q_rope.stride(-1) == 1 and block_tables.stride(-1) == 1
    kv_fp8 = cache.dtype == torch.float8_e4m3fn
    assert kv_fp8 or cache.dtype == q_latent.dtype, f"a {cache.dtype} cache under a {q_latent.dtype} query"
    out = torch.empty_like(q_latent)
    if num_seqs == 0:
        return out
    bound = block_tables.shape[1] * block_size
    if max_context_len is not None:
        bound = min(bound, max_context_len)
    head_blocks = triton.cdiv(num_heads, HEAD_BLOCK)
    num_splits = decode_num_splits(
        num_seqs, head_blocks, 128, q_latent.dtype, bound, max_num_splits=max_num_splits, device=q_latent.device
    )
    if num_splits > 1:
        n_o = num_seqs * num_heads * num_splits * latent
        workspace = torch.empty(n_o + num_seqs * num_heads * num_splits, dtype=torch.float32, device=q_latent.device)
        part_o, part_lse = workspace[:n_o], workspace[n_o:]
    else:
        part_o = part_lse = out  # unused
    _latent_decode_kernel[(num_seqs, head_blocks, num_splits)](
        q_latent, q_rope, cache, block_tables, context_lens, out, part_o, part_lse,
        float(scale) * (cache_scale if kv_fp8 else 1.0) * 1.4426950408889634, float(cache_scale), num_heads,
        q_latent.stride(0), q_latent.stride(1), q_rope.stride(0), q_rope.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1), block_tables.stride(0),
        NUM_SPLITS=num_splits, LATENT=latent, ROPE=rope, BLOCK_C=next_pow2(latent), BLOCK_R=max(16, next_pow2(rope)),
        HEAD_BLOCK=HEAD_BLOCK, BLOCK_SIZE=block_size, TILE_N=TILE_N, DOT_PREC=dot_precision(q_latent.dtype, "tf32"),
        USE_PDL=pdl, KV_FP8=kv_fp8, num_warps=4, num_stages=2, launch_pdl=pdl,
    )  # fmt: skip
    if num_splits > 1:
        block_c = next_pow2(latent)
        _decode_reduce_kernel[(num_seqs, num_heads)](
            part_o, part_lse, out, num_heads, out.stride(0), out.stride(1), out,
            NUM_SPLITS=num_splits, BLOCK_S=next_pow2(num_splits), HEAD_DIM=latent, BLOCK_D=block_c, USE_PDL=pdl,
            HAS_SINKS=False, num_warps=_reduce_warps(block_c * next_pow2(num_splits)), launch_pdl=pdl,
        )  # fmt: skip
    return out

