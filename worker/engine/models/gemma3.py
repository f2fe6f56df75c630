"""Gemma 3 text (1B, and the language model of 4B-27B): Gemma 2's layer (sandwich (1 + w) norms, GELU-tanh,
sqrt(hidden) embedding scale, query_pre_attn_scalar) with a (1 + w) RMSNorm over each q and k head, local
(sliding) and global layers with their own rotary bases, and soft-caps only when the config sets them."""

from __future__ import annotations

from .gemma2 import HANDLES, read, sandwich_layer
from .spec import Family, NormKind

FAMILY = Family(
    name="gemma3",
    model_types=("gemma3_text",),
    layer=sandwich_layer(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    norm=NormKind.RMS_ONE_PLUS,
    read=read,
    handles=HANDLES,
    rope_per_layer_type=True,
)
