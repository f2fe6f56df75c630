"""Qwen2 and Qwen2.5: Llama's layer with q/k/v biases; sliding-window layers named in `layer_types`."""

from __future__ import annotations

from .llama import read
from .spec import Family, NormKind, llama_layer

FAMILY = Family(name="qwen2", model_types=("qwen2",), layer=llama_layer(), norm=NormKind.RMS, read=read)
