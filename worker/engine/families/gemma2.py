"""Gemma 2 (2B, 9B, 27B): (1 + w) RMSNorm in fp32, sandwich norms around attention and the MLP, GELU-tanh,
embeddings times sqrt(hidden) rounded to the model dtype, q scaled by query_pre_attn_scalar^-1/2 (not the
head size), attention scores and final logits soft-capped, sliding-window layers named in `layer_types`."""

from __future__ import annotations

from dataclasses import replace

from .spec import DecoderArgs, Family, LayerSpec, NormKind, activation_of, llama_layer


def read(config) -> DecoderArgs:
    return DecoderArgs(
        activation=activation_of(config, "hidden_activation"),
        attention_scale=config.query_pre_attn_scalar**-0.5,
        attn_softcap=config.attn_logit_softcapping,
        final_softcap=config.final_logit_softcapping,
        embed_scale=config.hidden_size**0.5,
        embed_scale_in_dtype=True,
    )


HANDLES = frozenset({"hidden_activation", "query_pre_attn_scalar", "attn_logit_softcapping", "final_logit_softcapping"})


def sandwich_layer(**qk_norms: str) -> LayerSpec:
    """Llama's linears with Gemma's four norms: before and after attention, before and after the MLP."""
    return replace(
        llama_layer(**qk_norms),
        attn_out_norm="post_attention_layernorm",
        mlp_in_norm="pre_feedforward_layernorm",
        mlp_out_norm="post_feedforward_layernorm",
    )


FAMILY = Family(
    name="gemma2",
    model_types=("gemma2",),
    layer=sandwich_layer(),
    norm=NormKind.RMS_ONE_PLUS,
    read=read,
    handles=HANDLES,
)
