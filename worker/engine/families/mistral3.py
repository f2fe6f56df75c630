"""Mistral Small 3.1 24B (and fine-tunes in its transformers layout) (Mistral3ForConditionalGeneration): Mistral's language model after Pixtral's vision
encoder (2-D rotary patches, each image attending within itself), whose patches are merged 2x2 and projected into
the places of the prompt's `[IMG]` tokens (a row of them per row of merged patches, closed by `[IMG_BREAK]`, the
image by `[IMG_END]`: worker/media/pixtral.py). The whole checkpoint loads as transformers'
Mistral3ForConditionalGeneration; its language model (Mistral's, 1-D rotary) runs on the owned decoder, the image
rows as input embeddings, or on decoder "hf" (spec.VisionSpec)."""

from __future__ import annotations

from .llama import read
from .spec import Family, NormKind, VisionSpec, llama_layer

FAMILY = Family(
    name="mistral3",
    model_types=("mistral3",),
    layer=llama_layer(),
    norm=NormKind.RMS,
    read=read,  # of its text config
    layers_path="model.language_model.layers",
    embed_path="model.language_model.embed_tokens",
    final_norm_path="model.language_model.norm",
    rotary_path="model.language_model.rotary_emb",
    vision=VisionSpec(model_class="Mistral3ForConditionalGeneration", images="pixtral"),
)
