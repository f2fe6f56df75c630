"""Cohere 2 (Command R7B, Command A): one LayerNorm (mean-centred, no bias, in fp32) before attention and the MLP,
which run in parallel on the same input and join the residual together, (residual + attention) + MLP; interleaved
rotary on the sliding layers only (the global layers are NoPE); logits times logit_scale. The owned decoder computes
the LayerNorm in its add+norm kernels (CENTRED) and the parallel block in its layer loop; the interleaved rotary
stage runs as torch ops."""

from __future__ import annotations

from dataclasses import replace

from ..kv_cache import head_dim_of
from .spec import DecoderArgs, Family, NormKind, activation_of, llama_layer


def read(config) -> DecoderArgs:
    return DecoderArgs(
        activation=activation_of(config, "hidden_act"),
        attention_scale=head_dim_of(config) ** -0.5,
        logits_scale=config.logit_scale,
        nope_layers=tuple(i for i, t in enumerate(config.layer_types) if t != "sliding_attention"),
    )


FAMILY = Family(
    name="cohere2",
    model_types=("cohere2",),
    layer=replace(llama_layer(), mlp_in_norm="input_layernorm", parallel_blocks=True),
    norm=NormKind.LAYER,
    read=read,
    handles=frozenset({"logit_scale"}),
    rotary_interleaved=True,
    norm_eps_field="layer_norm_eps",
)
