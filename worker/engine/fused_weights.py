"""Load-time weight fusion for the owned decoder. Owns nothing after building: the HF model keeps
owning every parameter.

`fuse_rows` makes one weight (and bias) out of several linears that read the same input (q/k/v, or
gate/up), so each is one GEMM. It does not copy the weights: the fused tensor is allocated once and
each linear's parameter is rebound to a view of its rows. So the transformers model keeps working
(tests use it as the reference, `model.generate` still runs) and memory holds every weight once.
Fusing a model a second time (a second engine on the same model) finds the views adjacent and
allocates nothing.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass(frozen=True)
class LayerWeights:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv_weight: torch.Tensor  # [(H + 2 * KVH) * D, hidden]: rows of q, then k, then v
    qkv_bias: torch.Tensor | None  # Qwen2 (and Llama with attention_bias)
    o_weight: torch.Tensor
    o_bias: torch.Tensor | None
    gate_up_weight: torch.Tensor  # [2 * I, hidden]: gate rows, then up rows
    gate_up_bias: torch.Tensor | None
    down_weight: torch.Tensor
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # Qwen3's per-head RMSNorm weights [D]
    k_norm: torch.Tensor | None


def fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the linears stacked along the output dim; the linears then view into them."""
    weight = _fuse_param(linears, "weight")
    has_bias = [lin.bias is not None for lin in linears]
    assert all(has_bias) or not any(has_bias), "fused linears must all have a bias or none"
    return weight, (_fuse_param(linears, "bias") if has_bias[0] else None)


def _fuse_param(linears: list[nn.Linear], name: str) -> torch.Tensor:
    parts = [getattr(lin, name) for lin in linears]
    rows = sum(p.shape[0] for p in parts)
    shape = (rows, *parts[0].shape[1:])
    if _are_adjacent_rows(parts):
        return parts[0].detach().as_strided(shape, torch.empty(shape, device="meta").stride())
    fused = torch.cat([p.detach() for p in parts], dim=0)
    offset = 0
    for lin, part in zip(linears, parts, strict=True):
        n = part.shape[0]
        setattr(lin, name, nn.Parameter(fused[offset : offset + n], requires_grad=False))
        offset += n
    return fused


def _are_adjacent_rows(parts: list[torch.Tensor]) -> bool:
    first = parts[0]
    offset = first.storage_offset()
    for p in parts:
        same = (
            p.is_contiguous()
            and p.dtype == first.dtype
            and p.shape[1:] == first.shape[1:]
            and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and p.storage_offset() == offset
        )
        if not same:
            return False
        offset += p.numel()
    return True


def layer_weights(layer: Any) -> LayerWeights:
    """Fused weights of one transformers Llama / Mistral / Qwen2 / Qwen3 decoder layer.

    `layer` is typed Any: transformers' layer classes differ per family; they share these attribute names."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv_weight, qkv_bias = fuse_rows([attn.q_proj, attn.k_proj, attn.v_proj])
    gate_up_weight, gate_up_bias = fuse_rows([mlp.gate_proj, mlp.up_proj])
    q_norm = getattr(attn, "q_norm", None)
    k_norm = getattr(attn, "k_norm", None)
    return LayerWeights(
        input_norm=layer.input_layernorm.weight,
        post_norm=layer.post_attention_layernorm.weight,
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        o_weight=attn.o_proj.weight,
        o_bias=attn.o_proj.bias,
        gate_up_weight=gate_up_weight,
        gate_up_bias=gate_up_bias,
        down_weight=mlp.down_proj.weight,
        down_bias=mlp.down_proj.bias,
        q_norm=q_norm.weight if q_norm is not None else None,
        k_norm=k_norm.weight if k_norm is not None else None,
    )
