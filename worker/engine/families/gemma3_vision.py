"""Gemma 3 4B-27B with their images (Gemma3ForConditionalGeneration, model_type "gemma3"): gemma3.py's language
model after a SigLIP vision tower whose patches are average-pooled to `mm_tokens_per_image` (256) and projected
(`mm_soft_emb_norm`, `mm_input_projection_weight`) into the places of each image's `<image_soft_token>`s. In
prefill an image's tokens attend to each other both ways (transformers' `token_type_ids` mask; multimodal.py).

The whole checkpoint loads as transformers' Gemma3ForConditionalGeneration; its language model runs on the owned
decoder (an image step's embeddings come from the model's own embedding module, the scale in the token rows only;
the image rows' both-ways attention through the attention's key limits) or on decoder "hf" (spec.VisionSpec).
gemma3.py runs the same checkpoints' text alone (their vision weights unread) under --deterministic or
--quantization: the loader picks this module otherwise (models/loader.py)."""

from __future__ import annotations

from .gemma2 import HANDLES, read, sandwich_layer
from .spec import Family, NormKind, VisionSpec

FAMILY = Family(
    name="gemma3_vision",
    model_types=("gemma3",),
    layer=sandwich_layer(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    norm=NormKind.RMS_ONE_PLUS,
    read=read,  # of its text config
    handles=HANDLES,
    rope_per_layer_type=True,
    layers_path="model.language_model.layers",
    embed_path="model.language_model.embed_tokens",
    final_norm_path="model.language_model.norm",
    rotary_path="model.language_model.rotary_emb",
    vision=VisionSpec(model_class="Gemma3ForConditionalGeneration", images="gemma3"),
)
