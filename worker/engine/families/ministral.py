"""Ministral (Ministral-8B-Instruct-2410; MinistralForCausalLM): Llama's layer with sliding-window layers named
in `layer_types` (interleaved with full-attention ones)."""

from __future__ import annotations

from .llama import read
from .spec import Family, NormKind, llama_layer

FAMILY = Family(name="ministral", model_types=("ministral",), layer=llama_layer(), norm=NormKind.RMS, read=read)
