"""Glue between transformers' attention interface and cbq's paged attention.

`paged_attention_forward` is registered with transformers' `AttentionInterface` as "cbq_paged", so any
Llama / Mistral / Qwen2 / Qwen3 checkpoint runs unchanged: the model computes q, k, v (with its own
norms and rotary embedding) and hands them here. Step metadata arrives through the forward kwargs
(`cbq=AttentionMetadata`), not through global state.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import Any

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
    # Per layer: 0 (full causal attention) or the sliding window W (`sliding_windows_of`); () when no
    # layer slides. Host ints, so a captured graph keeps them.
    sliding_windows: tuple[int, ...] = ()
    # Per layer: (k_scale, v_scale) of an FP8 cache (kv_cache.kv_scales_of); () when every scale is 1.0.
    kv_scales: tuple[tuple[float, float], ...] = ()
    # [T] the last key position each row sees where that is past its own (a Gemma 3 image's tokens in prefill see
    # their whole image: multimodal.py); None: causal. Only eager image steps set it, never a graph.
    key_limits: torch.Tensor | None = None
    # (q_len, context_len) of each sequence after the leading `num_decode_seqs` (BatchMeta.prefill_lens): host ints
    # for work sized per step (latent attention's expanded prefill); () in a decode-only step or where unknown.
    prefill_lens: tuple[tuple[int, int], ...] = ()
    # What a layer derives from this step's metadata once and the step's other layers reuse (latent attention's
    # gather plan: latent_prefill.py), by its owner's key. A fresh dict each step.
    step_cache: dict[str, Any] = field(default_factory=dict)

    def sliding_window(self, layer_idx: int) -> int:
        return self.sliding_windows[layer_idx] if self.sliding_windows else 0

    def kv_scale(self, layer_idx: int) -> tuple[float, float]:
        return self.kv_scales[layer_idx] if self.kv_scales else (1.0, 1.0)


def sliding_windows_of(config) -> tuple[int, ...]:
    """Each layer's sliding window from a transformers config (0: full attention), or () if none slides.

    Mistral slides in every layer; Qwen2/Qwen3 name the sliding layers in `layer_types`."""
    window = getattr(config, "sliding_window", None) or 0
    if not window:
        return ()
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None:
        return (window,) * config.num_hidden_layers
    windows = tuple(window if t == "sliding_attention" else 0 for t in layer_types)
    return windows if any(windows) else ()


class AttentionBackend:
    """Plain torch over the paged cache: the reference, used on CPU."""

    name = "torch"

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, kv_scale=(1.0, 1.0)) -> None:
        """`kv_scale`: (k_scale, v_scale) of an FP8 cache (attention.py)."""
        write_kv_ref(key, value, k_cache, v_cache, slot_mapping, *kv_scale)

    # Whether `attend` computes soft-capped scores (Gemma 2): both backends do.
    has_softcap = True

    def attend(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        layer_idx: int,
        pdl: bool = False,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention of this step's rows for layer `layer_idx` (which picks its sliding window). `pdl`: the
        decode kernels launch with programmatic dependent launch (kernels/pdl.py; ignored here). `softcap`:
        scores become cap * tanh(scores / cap). `sinks` [H]: each head's sink logit (gpt-oss)."""
        k_scale, v_scale = meta.kv_scale(layer_idx)
        return paged_attention_ref(
            q,
            k_cache,
            v_cache,
            meta.block_tables,
            meta.cu_seqlens_q,
            meta.context_lens,
            scale,
            sliding_window=meta.sliding_window(layer_idx),
            softcap=softcap,
            sinks=sinks,
            k_scale=k_scale,
            v_scale=v_scale,
            key_limits=meta.key_limits,
        )


class TritonAttentionBackend(AttentionBackend):
    """Triton kernels on CUDA: split-K decode for decode-only steps, varlen prefill otherwise."""

    name = "triton"

    def __init__(self):
        from .kernels import attention

        self._k = attention

    def write_kv(self, key, value, k_cache, v_cache, slot_mapping, kv_scale=(1.0, 1.0)) -> None:
        self._k.write_kv(key, value, k_cache, v_cache, slot_mapping, *kv_scale)

    def attend(
        self,
        q,
        k_cache,
        v_cache,
        meta: AttentionMetadata,
        scale: float,
        layer_idx: int,
        pdl: bool = False,
        softcap: float | None = None,
        sinks: torch.Tensor | None = None,
    ) -> torch.Tensor:
        window = meta.sliding_window(layer_idx)
        k_scale, v_scale = meta.kv_scale(layer_idx)
        num_seqs = meta.context_lens.shape[0]
        # A step holding a bidirectional image's rows (Gemma 3 in prefill, never a decode graph) sends every row to
        # the prefill kernel, each seeing to its key limit: the decode kernels are causal only.
        num_decode = 0 if meta.key_limits is not None else meta.num_decode_seqs
        if meta.key_limits is None and (meta.is_decode_only or num_decode == num_seqs):
            return self._k.paged_decode_attention(
                q,
                k_cache,
                v_cache,
                meta.block_tables,
                meta.context_lens,
                scale,
                max_context_len=meta.max_context_len,
                sliding_window=window,
                pdl=pdl,
                sinks=sinks,
                softcap=softcap,
                k_scale=k_scale,
                v_scale=v_scale,
            )
        # Mixed step: the leading single-row sequences (decodes) through the split-K decode kernel, in
        # a varlen query tile each they would waste most of it; the rest through the varlen kernel.
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
                sliding_window=window,
                sinks=sinks,
                softcap=softcap,
                k_scale=k_scale,
                v_scale=v_scale,
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
            sliding_window=window,
            sinks=sinks,
            softcap=softcap,
            k_scale=k_scale,
            v_scale=v_scale,
            key_limits=meta.key_limits,
        )


def paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """transformers calls this per layer with query [1, H, T, D], key/value [1, KVH, T, D]."""
    meta: AttentionMetadata | None = kwargs.pop("cbq", None)
    if meta is None:
        # A plain forward / `model.generate` on a model an Engine has adopted: behave like sdpa.
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        window = kwargs.get("sliding_window") or 0
        if kwargs.get("softcap") is not None or kwargs.get("s_aux") is not None:
            # sdpa has neither soft-capping (Gemma 2) nor sinks (gpt-oss): the model's own eager attention does,
            # given the causal (windowed) mask that transformers builds for no attention it does not know.
            eager = sys.modules[type(module).__module__].eager_attention_forward
            mask = _additive_mask(attention_mask, query, key.shape[2], window)
            return eager(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)
        if window and attention_mask is None:
            # NOTE: transformers builds no mask for an attention it does not know, and sdpa's is_causal has no
            # window: mask it here (unpadded input; the keys end at the last query, even in a window cache).
            attention_mask = _sliding_window_mask(query.shape[2], key.shape[2], window, query.device)
        return sdpa_attention_forward(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    layer_idx = module.layer_idx
    # NOTE: transformers passes the layer's window (None for full attention); the metadata must agree.
    assert (kwargs.get("sliding_window") or 0) == meta.sliding_window(layer_idx), (
        f"layer {layer_idx}: model window {kwargs.get('sliding_window')}, cbq {meta.sliding_window(layer_idx)}"
    )
    k_cache, v_cache = meta.kv_caches[layer_idx]
    q = query[0].transpose(0, 1)  # [T, H, D], strided: the kernels take any strides but the last
    k = key[0].transpose(0, 1)
    v = value[0].transpose(0, 1)
    v_dim = v.shape[-1]
    if v_dim < k.shape[-1]:  # latent attention's expanded heads (DeepSeek): V narrower than K, zero-padded to it
        v = torch.nn.functional.pad(v, (0, k.shape[-1] - v_dim))
    meta.backend.write_kv(k, v, k_cache, v_cache, meta.slot_mapping, meta.kv_scale(layer_idx))
    scale = scaling if scaling is not None else q.shape[-1] ** -0.5
    out = meta.backend.attend(
        q, k_cache, v_cache, meta, scale, layer_idx, softcap=kwargs.get("softcap"), sinks=kwargs.get("s_aux")
    )
    return out[None, ..., :v_dim], None  # [1, T, H, Dv], no attention weights


def _additive_mask(attention_mask, query: torch.Tensor, num_keys: int, window: int) -> torch.Tensor:
    """What eager attention adds to its scores: 0 where a query sees a key, the dtype's minimum elsewhere. Without
    a mask: causal (and within `window` when it is not 0), the keys ending at the last query."""
    if attention_mask is None:
        attention_mask = _sliding_window_mask(query.shape[2], num_keys, window or num_keys, query.device)
    if attention_mask.dtype != torch.bool:
        return attention_mask
    hidden = torch.zeros(attention_mask.shape, dtype=query.dtype, device=query.device)
    return hidden.masked_fill(~attention_mask, torch.finfo(query.dtype).min)


def _sliding_window_mask(num_queries: int, num_keys: int, window: int, device) -> torch.Tensor:
    """[1, 1, Q, K] bool, True where query i (the last Q of K positions) sees key j: causal, in the window
    (0: no window)."""
    q_pos = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    k_pos = torch.arange(num_keys, device=device)[None, :]
    visible = k_pos <= q_pos
    if window:
        visible &= k_pos > q_pos - window
    return visible[None, None]


def register_paged_attention() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTN_IMPLEMENTATION, paged_attention_forward)
