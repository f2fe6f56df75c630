"""Mistral (7B v0.1-v0.3, Ministral, Mistral-Nemo and other MistralForCausalLM releases): Llama's layer,
with a sliding window in every layer when the config sets one."""

from __future__ import annotations

from .llama import read
from .spec import Family, NormKind, llama_layer

FAMILY = Family(name="mistral", model_types=("mistral",), layer=llama_layer(), norm=NormKind.RMS, read=read)
