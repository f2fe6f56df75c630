"""Which family module runs a checkpoint: config.json's `model_type` -> module under worker/engine/models/.
Owns that map. Adding a family = its module, one line here, and its tests. Modules import on first use.
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
    "granite": "granite",
    "olmo2": "olmo2",
    "qwen3_moe": "qwen3_moe",
    "qwen2_moe": "qwen2_moe",
    "mixtral": "mixtral",
    "gpt_oss": "gpt_oss",
}


def family_of(model_type: str) -> Family | None:
    """The family that runs `model_type`, or None."""
    module = MODULES.get(model_type)
    if module is None:
        return None
    family: Family = importlib.import_module(f"{__package__}.{module}").FAMILY
    assert model_type in family.model_types, f"registry line {model_type!r} -> {module}.py, which does not list it"
    return family
