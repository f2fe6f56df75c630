"""SmolLM3 (3B): Llama's layer where every fourth layer (config.no_rope_layers[i] == 0) has no rotary (NoPE)."""

from __future__ import annotations

from dataclasses import replace

from . import llama
from .spec import DecoderArgs, Family, NormKind, llama_layer


def read(config) -> DecoderArgs:
    nope = tuple(i for i, uses_rope in enumerate(config.no_rope_layers) if not uses_rope)
    return replace(llama.read(config), nope_layers=nope)


FAMILY = Family(
    name="smollm3",
    model_types=("smollm3",),
    layer=llama_layer(),
    norm=NormKind.RMS,
    read=read,
    handles=frozenset({"no_rope_layers"}),
)
