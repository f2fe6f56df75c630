"""Granite 3.x dense (2B, 8B): Llama's layer with four multipliers from the config: embeddings times
embedding_multiplier, q.k times attention_multiplier (instead of head_dim^-1/2), each block's output times
residual_multiplier before the residual add, logits divided by logits_scaling."""

from __future__ import annotations

from .spec import DecoderArgs, Family, NormKind, activation_of, llama_layer


def read(config) -> DecoderArgs:
    return DecoderArgs(
        activation=activation_of(config, "hidden_act"),
        attention_scale=config.attention_multiplier,
        embed_scale=config.embedding_multiplier,
        residual_scale=config.residual_multiplier,
        logits_divisor=config.logits_scaling,
    )


FAMILY = Family(
    name="granite",
    model_types=("granite",),
    layer=llama_layer(),
    norm=NormKind.RMS,
    read=read,
    handles=frozenset({"embedding_multiplier", "attention_multiplier", "residual_multiplier", "logits_scaling"}),
)
