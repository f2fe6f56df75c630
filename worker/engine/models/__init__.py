"""Loading a model: `loader.py` reads a checkpoint (or builds a preset, `presets.py`) in one process; `shard_model.py` and
`shard_build.py` build a tensor-parallel rank's shard by slice, each linear through its method (quant/methods.py); `quant_loader.py`
reads a quantized checkpoint's linears (and an MoE's experts) kept FP8 or dequantized; `moe_from_model.py` the
owned decoder's expert views of a loaded model. The family declarations it reads are families/'s.
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
