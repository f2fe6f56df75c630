"""OLMo 2 (1B-32B): no pre-norms; an RMSNorm on each block's output before the residual add, an RMSNorm over
the whole q and k projections (not per head) before rotary, and the norm weight multiplied in fp32."""

from __future__ import annotations

from .llama import read
from .spec import Family, LayerSpec, LinearSpec, NormKind, Parallel, QKNormSpan

FAMILY = Family(
    name="olmo2",
    model_types=("olmo2",),
    layer=LayerSpec(
        qkv=LinearSpec(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), Parallel.COLUMN),
        o=LinearSpec(("self_attn.o_proj",), Parallel.ROW),
        gate_up=LinearSpec(("mlp.gate_proj", "mlp.up_proj"), Parallel.COLUMN),
        down=LinearSpec(("mlp.down_proj",), Parallel.ROW),
        attn_in_norm=None,
        attn_out_norm="post_attention_layernorm",
        mlp_in_norm=None,
        mlp_out_norm="post_feedforward_layernorm",
        q_norm="self_attn.q_norm",
        k_norm="self_attn.k_norm",
        qk_norm_span=QKNormSpan.FULL,
    ),
    norm=NormKind.RMS_FP32_WEIGHT,
    read=read,
)
