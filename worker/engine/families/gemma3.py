"""Gemma 3 text (1B, and the language model inside the 4B-27B Gemma3ForConditionalGeneration checkpoints): Gemma 2's layer (sandwich (1 + w) norms, GELU-tanh,
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
    # 4B-27B ship as Gemma3ForConditionalGeneration: transformers 5 names its text weights model.language_model.*,
    # earlier saves language_model.model.*; the vision tower's weights are left unread.
    wrappers={
        "gemma3": {
            r"^model\.language_model\.": "model.",
            r"^language_model\.model\.": "model.",
            r"^language_model\.lm_head\.": "lm_head.",
        }
    },
)
