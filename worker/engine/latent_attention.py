"""Multi-head latent attention over a paged latent cache (DeepSeek-V2/V3, Kimi K2, Moonlight): the torch reference.

Owns the latent attention's forward, installed beside transformers' own on each attention module of a family that
declares `Family.mla` (`install_latent_attention`). A step whose metadata carries a latent cache (kv_cache.py:
`kv_lora_rank + qk_rope_head_dim` values per token per layer, K and V one tensor) runs it; anything else (a plain
forward, `model.generate`, decoder "hf" with its expanded per-head cache) runs transformers' forward unchanged.

Per token the cache holds the normed latent c (kv_lora_rank) and the rotated shared key k_rope (qk_rope_head_dim),
written once. Attention never expands them: with kv_b_proj's rows split per head into W_UK [nope, kv_lora] and W_UV
[v, kv_lora], head h's score q_nope.(W_UK c) + q_rope.k_rope is (W_UK^T q_nope).c + q_rope.k_rope, so the query is
absorbed into the latent space, [W_UK^T q_nope; q_rope] (kv_lora + rope wide), and attends, as multi-query attention
with one shared head, over the cache rows themselves; the output sum_j p_j W_UV c_j is W_UV (sum_j p_j c_j): the
attention's first kv_lora columns times W_UV. The same for prefill and decode steps (fp32 gives `generate`'s greedy
tokens; the rounding differs from expanded attention by the order of the products). On CUDA decode rows (a decode
step's, and a mixed step's leading ones) attend through kernels/latent_attention.py (its twin:
`latent_decode_attention_ref`); prefill rows through the backend's paged attention with the cache as one shared head,
or, where latent_prefill.py finds it cheaper, over K/V expanded per head from the cached latent.

`--kv-cache-dtype fp8`: the cache is float8_e4m3fn, each layer's row (latent and rotary key alike) stored as
row / s with one static per-tensor scale s (kv_cache.kv_scales_of: 1.0, or a checkpoint's k_scale; K and V are
the same rows, so the layer's pair is (s, s)); the write rounds it, the prefill path's attention and the decode
kernel (and its twin) read row * s. Half the bytes of a bf16 cache, so twice the tokens.
"""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from typing import Any

import torch

from .attention import paged_attention_ref
from .attention_backend import AttentionMetadata
from .kernels.latent_attention import latent_decode_attention as latent_decode_kernel
from .latent_prefill import LatentWidths, expanded_prefill, expands
from .quant.fp8 import FP8_DTYPE, dequantize_weight

LATENT_FORWARD_ATTR = "cbq_transformers_forward"  # the module's own forward, kept beside the latent one
DEQUANTIZED_KV_B_ATTR = "cbq_kv_b_dequantized"


def is_latent_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> bool:
    """A latent cache is one tensor per layer: its K and V views are the same rows (kv_cache.allocate_kv_cache)."""
    return k_cache.data_ptr() == v_cache.data_ptr() and k_cache.shape == v_cache.shape


def kv_b_heads(module: Any, dtype: torch.dtype) -> torch.Tensor:
    """kv_b_proj's weight per head, [H, nope + v, kv_lora]: each head's W_UK rows, then its W_UV rows (a view). An FP8
    kv_b_proj (`Fp8LinearModule`, kept FP8 on sm89+) is dequantized to `dtype` once and kept beside it (V3: 17M values
    a layer)."""
    weight = module.kv_b_proj.weight
    if weight.dtype == FP8_DTYPE:
        weight = module.__dict__.get(DEQUANTIZED_KV_B_ATTR)
        if weight is None or weight.dtype != dtype:
            weight = dequantize_weight(module.kv_b_proj.layer, dtype)
            module.__dict__[DEQUANTIZED_KV_B_ATTR] = weight
    return weight.view(module.num_heads, module.qk_nope_head_dim + module.v_head_dim, module.kv_lora_rank)


def rotate(module: Any, q_rope: torch.Tensor, k_rope: torch.Tensor, position_embeddings):
    """transformers' own rotary for the module's family, so the rotated values are the bits its forward computes:
    V2's complex product, V3's interleaved (or half-split) pairs. q [1, H, T, r] and k [1, 1, T, r] with its
    position embeddings [1, T, ...], or q [1, T, H, r] and k [1, T, 1, r] with rows [T, ...] of them (latent_layer.py,
    which broadcast as [T, 1, ...] against the tokens and heads)."""
    modeling = sys.modules[type(module).__module__]
    if hasattr(modeling, "apply_rotary_emb"):  # DeepSeek-V2: position_embeddings are the complex freqs_cis
        return modeling.apply_rotary_emb(q_rope, k_rope, position_embeddings.to(q_rope.device))
    cos, sin = position_embeddings
    if module.config.rope_interleave:
        return modeling.apply_rotary_pos_emb_interleave(q_rope, k_rope, cos, sin)
    return modeling.apply_rotary_pos_emb(q_rope, k_rope, cos, sin)


def latent_attention_forward(
    module: Any,
    hidden_states: torch.Tensor,
    position_embeddings: Any = None,
    attention_mask: torch.Tensor | None = None,
    **kwargs: Any,
):
    """transformers' DeepSeek attention forward, with the latent cache of the step's metadata (`cbq`)."""
    meta: AttentionMetadata | None = kwargs.get("cbq")
    if meta is None or not is_latent_cache(*meta.kv_caches[module.layer_idx]):
        original = getattr(module, LATENT_FORWARD_ATTR)
        return original(hidden_states, position_embeddings=position_embeddings, attention_mask=attention_mask, **kwargs)
    batch, num_tokens = hidden_states.shape[:-1]
    assert batch == 1, "the engine lays a step's tokens end to end"
    heads, nope, rope, kv_lora = module.num_heads, module.qk_nope_head_dim, module.qk_rope_head_dim, module.kv_lora_rank
    if module.q_lora_rank is None:
        q = module.q_proj(hidden_states)
    else:
        q = module.q_b_proj(module.q_a_layernorm(module.q_a_proj(hidden_states)))
    q = q.view(batch, num_tokens, heads, nope + rope).transpose(1, 2)  # [1, H, T, qk]
    q_nope, q_rope = torch.split(q, [nope, rope], dim=-1)
    latent, k_rope = torch.split(module.kv_a_proj_with_mqa(hidden_states), [kv_lora, rope], dim=-1)
    latent = module.kv_a_layernorm(latent)
    q_rope, k_rope = rotate(module, q_rope, k_rope.view(batch, 1, num_tokens, rope), position_embeddings)

    out = attend_latent(
        q_nope[0].transpose(0, 1), q_rope[0].transpose(0, 1), latent[0], k_rope[0, 0], meta, module.layer_idx,
        kv_b_heads(module, hidden_states.dtype), module.v_head_dim, module.scaling,
    )  # fmt: skip
    return module.o_proj(out.reshape(batch, num_tokens, heads * module.v_head_dim)), None


def attend_latent(
    q_nope: torch.Tensor,
    q_rope: torch.Tensor,
    latent: torch.Tensor,
    k_rope: torch.Tensor,
    meta: AttentionMetadata,
    layer_idx: int,
    kv_b: torch.Tensor,
    v_dim: int,
    scale: float,
) -> torch.Tensor:
    """One layer's latent attention after its projections, shared by transformers' modules (`latent_attention_forward`)
    and the owned decoder (latent_layer.py): writes each token's row [latent; k_rope] into the layer's latent cache,
    then attends. The leading single-row sequences (decodes) attend absorbed: the query absorbed (W_UK^T q_nope)
    attends over the cache rows, the result mapped through W_UV (on CUDA through the latent decode kernel, in a mixed
    step too). The prefill rows attend absorbed as well, or over expanded K/V where latent_prefill.py's choice says so.
    q_nope [T, H, nope], q_rope [T, H, rope] (rotated), latent [T, kv_lora] (normed), k_rope [T, rope] (rotated),
    kv_b [H, nope + v, kv_lora] (`kv_b_heads`) -> [T, H, v]."""
    num_tokens, heads, nope = q_nope.shape
    kv_lora, rope = latent.shape[-1], k_rope.shape[-1]
    cache, _ = meta.kv_caches[layer_idx]  # [blocks, block_size, 1, kv_lora + rope]
    row = torch.cat((latent, k_rope), dim=-1)[:, None]  # [T, 1, kv_lora + rope]
    cache_scale = meta.kv_scale(layer_idx)  # (s, s): one row serves as K and V
    meta.backend.write_kv(row, row, cache, cache, meta.slot_mapping, cache_scale)
    num_seqs = meta.context_lens.shape[0]
    num_decode = num_seqs if meta.is_decode_only else meta.num_decode_seqs
    if num_decode == num_seqs:  # one row a sequence (a decode step, or prompts' last single tokens)
        decodes = meta if meta.is_decode_only else replace(meta, is_decode_only=True)
        return _absorbed(q_nope, q_rope, cache, decodes, layer_idx, kv_b, nope, scale)
    prefills = _prefill_part(meta, num_decode)
    q_nope_p, q_rope_p = q_nope[num_decode:], q_rope[num_decode:]
    widths = LatentWidths(heads, nope, rope, v_dim, kv_lora)
    if expands(prefills, widths, cache.shape[1]):
        prefill_out = expanded_prefill(q_nope_p, q_rope_p, cache, prefills, kv_b, widths, scale, cache_scale[0])
    else:
        prefill_out = _absorbed(q_nope_p, q_rope_p, cache, prefills, layer_idx, kv_b, nope, scale)
    if not num_decode:
        return prefill_out
    # A mixed step: its decodes (one row each, the step's first rows) apart, on their own kernel
    decodes = replace(
        meta, block_tables=meta.block_tables[:num_decode], cu_seqlens_q=meta.cu_seqlens_q[: num_decode + 1],
        context_lens=meta.context_lens[:num_decode], is_decode_only=True, num_decode_seqs=num_decode, prefill_lens=(),
    )  # fmt: skip
    out = q_nope.new_empty(num_tokens, heads, v_dim)
    out[:num_decode] = _absorbed(q_nope[:num_decode], q_rope[:num_decode], cache, decodes, layer_idx, kv_b, nope, scale)
    out[num_decode:] = prefill_out
    return out


def _prefill_part(meta: AttentionMetadata, num_decode: int) -> AttentionMetadata:
    """The step's sequences after its leading `num_decode` one-row ones, as a step of their own (their rows counted
    from 0; the step's `prefill_lens` and `step_cache` are theirs already)."""
    if not num_decode:
        return meta
    return replace(
        meta, block_tables=meta.block_tables[num_decode:], cu_seqlens_q=meta.cu_seqlens_q[num_decode:] - num_decode,
        context_lens=meta.context_lens[num_decode:], num_decode_seqs=0,
    )  # fmt: skip


def _absorbed(
    q_nope: torch.Tensor, q_rope: torch.Tensor, cache: torch.Tensor, meta: AttentionMetadata, layer_idx: int,
    kv_b: torch.Tensor, nope: int, scale: float,
) -> torch.Tensor:  # fmt: skip
    """Absorbed attention of the rows of the step `meta` describes. A decode-only one on CUDA takes the latent decode
    kernel (each cache tile loaded once, heads in blocks of 16); the rest the backend's paged attention with the
    cache as one shared head."""
    kv_lora = cache.shape[-1] - q_rope.shape[-1]
    w_uk, w_uv = kv_b[:, :nope], kv_b[:, nope:]
    q_latent = torch.einsum("thn,hnc->thc", q_nope, w_uk)  # [T, H, kv_lora]
    if meta.backend.name == "triton" and meta.is_decode_only:
        out = latent_decode_kernel(
            q_latent.contiguous(), q_rope, cache, meta.block_tables, meta.context_lens, scale,
            max_context_len=meta.max_context_len, cache_scale=meta.kv_scale(layer_idx)[0],
        )  # fmt: skip
    else:
        query = torch.cat((q_latent, q_rope), dim=-1)  # [T, H, kv_lora + rope]
        out = meta.backend.attend(query, cache, cache, meta, scale, layer_idx)[..., :kv_lora]
    return torch.einsum("thc,hvc->thv", out, w_uv)  # [T, H, v]


def install_latent_attention(model: Any) -> int:
    """Give every DeepSeek attention module of `model` the latent forward (its own kept for everything else).
    Idempotent; returns how many modules carry it."""
    count = 0
    for module in model.modules():
        if not hasattr(module, "kv_a_proj_with_mqa"):
            continue
        if not hasattr(module, LATENT_FORWARD_ATTR):
            setattr(module, LATENT_FORWARD_ATTR, module.forward)
            module.forward = types.MethodType(latent_attention_forward, module)
        count += 1
    _capturable_experts(model)
    return count


def _capturable_experts(model: Any) -> None:
    """DeepSeek's routed experts run transformers' experts forward. Its default, torch's grouped_mm, captures into a
    CUDA graph only in bf16: in another dtype (fp32, the GPU exactness tests') it copies a host tensor and capture
    fails. There transformers' "batched_mm" form (each token's experts gathered, then one batched GEMM; no host copy,
    no data-dependent shape) runs instead: the same products, so generate's outputs are unchanged."""
    weight = next(model.parameters(), None)
    if weight is None or weight.device.type != "cuda" or weight.dtype == torch.bfloat16:
        return
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is not None and getattr(config, "_experts_implementation", None) == "grouped_mm":
            config._experts_implementation = "batched_mm"


def latent_decode_attention_ref(
    q_latent: torch.Tensor,
    q_rope: torch.Tensor,
    cache: torch.Tensor,
    block_tables: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    cache_scale: float = 1.0,
) -> torch.Tensor:
    """kernels/latent_attention.py's CPU twin: the torch paged attention with the cache as one shared head (K and V
    the same rows), the output's latent columns. One query row per sequence; returns [B, H, kv_lora_rank].
    `cache_scale`: an e4m3 cache's per-tensor scale (rows read as row * cache_scale)."""
    num_seqs = q_latent.shape[0]
    cu_seqlens = torch.arange(num_seqs + 1, dtype=torch.int32, device=q_latent.device)
    query = torch.cat((q_latent, q_rope), dim=-1)
    out = paged_attention_ref(
        query, cache, cache, block_tables, cu_seqlens, context_lens, scale, k_scale=cache_scale, v_scale=cache_scale
    )
    return out[..., : q_latent.shape[-1]]
