"""Mixtral (8x7B, 8x22B): Mistral's attention and a sparse MLP in every layer: a softmax router over 8 experts,
top-2, the two weights renormalised; no shared expert."""

from __future__ import annotations

from .qwen3_moe import read
from .spec import Family, MoeMlpSpec, NormKind, llama_layer

FAMILY = Family(
    name="mixtral",
    model_types=("mixtral",),
    layer=llama_layer(),
    norm=NormKind.RMS,
    read=read,
    moe=MoeMlpSpec(router="mlp.gate", experts="mlp.experts"),
)
