"""Which family module runs a checkpoint: config.json's `model_type` -> module under worker/engine/families/.
Owns that map, and `IMAGE_MODULES`: the family that runs a multimodal checkpoint with its images where the family
of `MODULES` runs its text alone. Adding a family = its module, one line here, and its tests. Modules import on
first use.
"""

from __future__ import annotations

import importlib

from .spec import Family

MODULES = {  # model_type -> family module
    "llama": "llama",
    "mistral": "mistral",
    "qwen2": "qwen2",
    "qwen3": "qwen3",
    "gemma2": "gemma2",
    "gemma3_text": "gemma3",
    "gemma3": "gemma3",  # Gemma3ForConditionalGeneration: its language model
    "granite": "granite",
    "olmo2": "olmo2",
    "phi3": "phi3",
    "smollm3": "smollm3",
    "cohere2": "cohere2",
    "glm4": "glm4",
    "ministral": "ministral",
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
    "glm4_moe": "glm4_moe",
    "deepseek_v2": "deepseek_v2",
    "deepseek_v3": "deepseek_v3",  # Kimi K2 and Moonlight too
    "qwen2_5_vl": "qwen2_5_vl",  # with its images (Family.vision)
    "qwen3_vl": "qwen3_vl",  # with its images, DeepStack
    "mistral3": "mistral3",  # Mistral Small 3.1, with its images
}

# model_type -> the module that runs it with its images (decoder "hf": models/loader.py `load_model(images=...)`).
IMAGE_MODULES = {
    "gemma3": "gemma3_vision",
}


def family_of(model_type: str, images: bool = False) -> Family | None:
    """The family that runs `model_type` (with `images`: the one that takes its images, where that is another
    module), or None."""
    module = IMAGE_MODULES.get(model_type) if images else None
    module = module or MODULES.get(model_type)
    if module is None:
        return None
    family: Family = importlib.import_module(f"{__package__}.{module}").FAMILY
    listed = model_type in family.model_types or model_type in family.wrappers
    assert listed, f"registry line {model_type!r} -> {module}.py, which does not list it"
    return family
