"""Qwen2.5-VL (3B-72B, and olmOCR-style fine-tunes of it): Qwen2's language model (q/k/v biases) rotated with
multimodal rotary positions (M-RoPE: temporal, height and width rows over three sections of each head), after a
windowed ViT whose 2x2-merged patches take the places of the prompt's image pads. The whole checkpoint loads as
transformers' Qwen2_5_VLForConditionalGeneration; its language model runs on the owned decoder (M-RoPE's sections:
image_inputs.py) or on decoder "hf" (spec.VisionSpec)."""

from __future__ import annotations

from .llama import read
from .spec import Family, MRopeLayout, NormKind, VisionSpec, llama_layer

FAMILY = Family(
    name="qwen2_5_vl",
    model_types=("qwen2_5_vl",),
    layer=llama_layer(),
    norm=NormKind.RMS,
    read=read,  # of its text config
    layers_path="model.language_model.layers",
    embed_path="model.language_model.embed_tokens",
    final_norm_path="model.language_model.norm",
    rotary_path="model.language_model.rotary_emb",
    vision=VisionSpec(model_class="Qwen2_5_VLForConditionalGeneration", mrope=MRopeLayout.SECTIONS),
)
