"""Model families and loading. `loader.py` reads a checkpoint (or builds a preset); `registry.py` maps a
config's model_type to its family module (llama.py, gemma2.py, ...), each of which fills in `spec.Family`.
"""

from .loader import (
    GENERATION_CONFIG_FIELDS,
    PRESETS,
    SUPPORTED_MODEL_TYPES,
    ModelLoadError,
    checkpoint_eos_token_ids,
    family_for,
    generation_defaults,
    load_model,
    preset_config,
    resolve_device,
    resolve_dtype,
)

__all__ = [
    "GENERATION_CONFIG_FIELDS",
    "PRESETS",
    "SUPPORTED_MODEL_TYPES",
    "ModelLoadError",
    "checkpoint_eos_token_ids",
    "family_for",
    "generation_defaults",
    "load_model",
    "preset_config",
    "resolve_device",
    "resolve_dtype",
]
