"""Paged attention: write new K/V into the paged cache, then attend over each sequence's block table.

Owns nothing: the cache tensors belong to the model runner, the metadata to the batch builder.
Two implementations share one calling convention:
  - plain torch (this file): the reference, used on CPU and in tests;
  - Triton (`kernels/attention.py`): used on CUDA.

Conventions (all index tensors int32 unless stated):
  k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
  slot_mapping[T]: flat slot (block * block_size + offset) of each new token's K/V; padding rows write
    into scratch block 0, which no sequence owns
  q[T, num_heads, head_dim], the T tokens of B sequences laid end to end
  cu_seqlens_q[B+1]: sequence b owns query rows cu_seqlens_q[b] : cu_seqlens_q[b+1]
  context_lens[B]: tokens of sequence b in the cache *including* this step's; query row j of b sits at
    position context_lens[b] - q_len_b + j and sees keys at positions <= its own (causal).
  block_tables[B, max_blocks]: block ids of each sequence, in order.
  sliding_window: 0, or W: a row at position p then sees only keys at positions > p - W (the last W,
    itself included), as transformers' sliding-window mask does (Mistral, Qwen2/3 sliding layers).
  key_limits[T] (int, optional; the Triton prefill kernel's `key_limits` too): row t sees keys up to position key_limits[t] instead
    of its own (a Gemma 3 image's tokens in prefill see their whole image, which is in the same step), still
    within its sliding window, as transformers' AND(window, OR(causal, image block)).
A step's new K/V are written before attention runs, so attention only ever reads the cache.
An FP8 cache (`--kv-cache-dtype fp8`, float8_e4m3fn) holds K / k_scale and V / v_scale, saturated at ±448;
reads multiply the scale back. The scales are per tensor (one pair per layer, host floats): 1.0, vLLM's default
without calibrated scales, or the checkpoint's k_scale / v_scale (kv_cache.kv_scales_of).
"""

from __future__ import annotations

import torch

from .quant.fp8 import FP8_DTYPE, to_fp8


def to_cache(x: torch.Tensor, cache_dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    """K or V as the cache stores it: e4m3 divided by the per-tensor scale (saturating: e4m3 has no infinity,
    a plain cast of an overflow would be NaN), else a cast."""
    # NOTE: times the inverse, as the Triton writers compute it, so both round the same fp32 value
    return to_fp8(x.float() * (1.0 / scale)) if cache_dtype == FP8_DTYPE else x.to(cache_dtype)


def from_cache(x: torch.Tensor, dtype: torch.dtype, scale: float = 1.0) -> torch.Tensor:
    if x.dtype != FP8_DTYPE:
        return x.to(dtype)
    return (x.float() * scale).to(dtype) if scale != 1.0 else x.to(dtype)


def write_kv_ref(
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """key/value: [T, num_kv_heads, head_dim], row t into flat slot slot_mapping[t]."""
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    slots = slot_mapping[: key.shape[0]].long()
    k_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache(key, k_cache.dtype, k_scale)
    v_cache.view(-1, num_kv_heads, head_dim)[slots] = to_cache(value, v_cache.dtype, v_scale)


def paged_attention_ref(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    cu_seqlens_q: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    sliding_window: int = 0,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
    key_limits: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal attention of T ragged query rows over the paged cache (within `sliding_window` keys when it is
    not 0; scores soft-capped to cap * tanh(s / cap) when `softcap` is set, as Gemma 2 does before masking).
    `sinks` [num_heads]: one more logit per head in the softmax's denominator, attending to nothing (gpt-oss).
    Returns [T, num_heads, head_dim]."""
    num_tokens, num_heads, head_dim = q.shape
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.zeros_like(q)
    cu = cu_seqlens_q.tolist()
    ctx = context_lens.tolist()
    tables = block_tables.long()
    for b in range(len(ctx)):
        q_start, q_end, ctx_len = cu[b], cu[b + 1], ctx[b]
        q_len = q_end - q_start
        if q_len == 0 or ctx_len == 0:
            continue
        num_blocks = (ctx_len + block_size - 1) // block_size
        blocks = tables[b, :num_blocks]
        keys = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]  # [L, KVH, D]
        values = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)[:ctx_len]
        keys = from_cache(keys, q.dtype, k_scale).repeat_interleave(group, dim=1).transpose(0, 1)  # [H, L, D]
        values = from_cache(values, q.dtype, v_scale).repeat_interleave(group, dim=1).transpose(0, 1)
        queries = q[q_start:q_end].transpose(0, 1)  # [H, q_len, D]
        scores = torch.matmul(queries, keys.transpose(1, 2)) * scale  # [H, q_len, L]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        q_pos = torch.arange(ctx_len - q_len, ctx_len, device=q.device)
        k_pos = torch.arange(ctx_len, device=q.device)
        limits = q_pos if key_limits is None else key_limits[q_start:q_end].to(q_pos)
        assert key_limits is None or int(limits.max()) < ctx_len, "a row sees a key this step has not written"
        hidden = k_pos[None, :] > limits[:, None]
        if sliding_window:
            hidden |= k_pos[None, :] <= q_pos[:, None] - sliding_window
        scores.masked_fill_(hidden[None], float("-inf"))
        if sinks is not None:  # a column per head that no value row matches: softmax over it, then drop it
            sink_column = sinks.to(scores.dtype)[:, None, None].expand(num_heads, q_len, 1)
            scores = torch.cat((scores, sink_column), dim=-1)
        probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)[..., :ctx_len]
        out[q_start:q_end] = torch.matmul(probs, values).transpose(0, 1)
    return out
