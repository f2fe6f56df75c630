"""OLMo 2 (1B-32B): no pre-norms; an RMSNorm on each block's output before the residual add, an RMSNorm over
the whole q and k projections (not per head) before rotary, and the norm weight multiplied in fp32."""

from __future__ import annotations

from dataclasses import replace

from .llama import read
from .spec import Family, NormKind, QKNormSpan, llama_layer

FAMILY = Family(
    name="olmo2",
    model_types=("olmo2",),
    layer=replace(
        llama_layer(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
        attn_in_norm=None,
        attn_out_norm="post_attention_layernorm",
        mlp_in_norm=None,
        mlp_out_norm="post_feedforward_layernorm",
        qk_norm_span=QKNormSpan.FULL,
    ),
    norm=NormKind.RMS_FP32_WEIGHT,
    read=read,
)
