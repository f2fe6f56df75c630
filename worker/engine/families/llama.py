"""Llama (Llama 2, 3, 3.1-3.3 and their fine-tunes): pre-norm RMSNorm, SiLU-gated MLP, full rotary
(default, linear, llama3 or yarn scaling), optional q/k/v/o and MLP biases."""

from __future__ import annotations

from ..kv_cache import head_dim_of
from .spec import DecoderArgs, Family, NormKind, activation_of, llama_layer


def read(config) -> DecoderArgs:
    return DecoderArgs(activation=activation_of(config, "hidden_act"), attention_scale=head_dim_of(config) ** -0.5)


FAMILY = Family(name="llama", model_types=("llama",), layer=llama_layer(), norm=NormKind.RMS, read=read)
