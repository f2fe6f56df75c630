"""Qwen3 (dense): Llama's layer with an RMSNorm over each q and k head before rotary, no biases."""

from __future__ import annotations

from .llama import read
from .spec import Family, NormKind, llama_layer

FAMILY = Family(
    name="qwen3",
    model_types=("qwen3",),
    layer=llama_layer(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    norm=NormKind.RMS,
    read=read,
)
