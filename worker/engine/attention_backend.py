"""Glue between transformers' attention interface and cbq's paged attention.

`paged_attention_forward` is registered with transformers' `AttentionInterface` as "cbq_paged", so any
Llama / Mistral / Qwen2 / Qwen3 checkpoint runs unchanged: the model computes q, k, v (with its own
norms and rotary embedding) and hands them here. Step metadata arrives through the forward kwargs
(`cbq=AttentionMetadata`), not through global state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .attention import paged_attention_ref, write_kv_ref

ATTN_IMPLEMENTATION = "cbq_paged"


@dataclass
class AttentionMetadata:
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)
    slot_mapping: torch.Tensor
    block_tables: torch.Tensor
    cu_seqlens_q: torch.Tensor
    context_lens: torch.Tensor
    max_query_len: int  # host-side bounds, so kernels pick their grids without reading the device
    max_context_len: int
    is_decode_only: bool
    backend: AttentionBackend
    num_decode_seqs: int = 0  # leading sequences with one query row (host int; see BatchMeta)


class AttentionBackend:
    """Plain torch over the paged cache: the reference, used on CPU."""

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        return paged_attention_ref(
            q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.context_lens, scale
        )


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels on CUDA: split-K decode for decode-only steps, varlen prefill otherwise."""

    name = "triton"

    def __init__(self):
        from . import attention_triton

        self._k = attention_triton

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping) -> None:
        self._k.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(self, q, k_cache, v_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        num_seqs = meta.context_lens.shape[0]
        if meta.is_decode_only or meta.num_decode_seqs == num_seqs:
            return self._k.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                scale,
                max_context_len=meta.max_context_len,
            )
        # Mixed step: the leading single-row sequences (decodes) through the split-K decode kernel, in
        # a varlen query tile each they would waste most of it; the rest through the varlen kernel.
        num_decode = meta.num_decode_seqs
        out = torch.empty_like(q) if num_decode else None
        if out is not None:
            self._k.paged_decode_attention(
                q[:num_decode],
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens[:num_decode],
                scale,
                out=out[:num_decode],
                max_context_len=meta.max_context_len,
            )
        return self._k.paged_prefill_attention(
            q,
            k_cache,
            v_cache,
            meta.block_tables[num_decode:],
            meta.cu_seqlens_q[num_decode:],
            meta.context_lens[num_decode:],
            scale,
            out=out,
            max_query_len=meta.max_query_len,
        )


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers calls this per layer with query [1, H, T, D], key/value [1, KVH, T, D]."""
    meta: AttentionMetadata | None = kwargs.pop("cbq", None)
    if meta is None:
        # A plain forward / `model.generate` on a model an Engine has adopted: behave like sdpa.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    k_cache, v_cache = meta.kv_caches[module.layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D], strided: the kernels take any strides but the last
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    meta.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping)
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = meta.backend.attend(q, k_cache, v_cache, meta, scale)
    return out[None], None  # [1, T, H, D], no attention weights


def register_paged_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
