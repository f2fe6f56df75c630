"""Qwen3-VL (dense: 2B-32B, Qwen3VLForConditionalGeneration): Qwen3's language model (q/k norms, no biases) rotated
with interleaved multimodal rotary positions (M-RoPE: the temporal, height and width rows take turns over the
rotary frequencies, `mrope_section` of each), after a ViT of 16-pixel patches whose 2x2-merged patches take the
places of the prompt's image pads. DeepStack: the merged features of some of the tower's blocks
(`deepstack_visual_indexes`) are added to the outputs of the first decoder layers at the image's rows
(spec.VisionSpec.deepstack; models/vision.py, multimodal.py). The whole checkpoint loads as transformers'
Qwen3VLForConditionalGeneration; its language model runs on the owned decoder (the interleaving and DeepStack:
image_inputs.py) or on decoder "hf", whose rotary does the interleaving."""

from __future__ import annotations

from .llama import read
from .spec import Family, MRopeLayout, NormKind, VisionSpec, llama_layer

FAMILY = Family(
    name="qwen3_vl",
    model_types=("qwen3_vl",),
    layer=llama_layer(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    norm=NormKind.RMS,
    read=read,  # of its text config
    layers_path="model.language_model.layers",
    embed_path="model.language_model.embed_tokens",
    final_norm_path="model.language_model.norm",
    rotary_path="model.language_model.rotary_emb",
    vision=VisionSpec(
        model_class="Qwen3VLForConditionalGeneration", deepstack=True, mrope=MRopeLayout.INTERLEAVED
    ),
)
