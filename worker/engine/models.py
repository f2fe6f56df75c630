"""Model loading: a named preset with random weights, or a checkpoint by local path or hub name.

Owns nothing after loading: returns a transformers causal LM and a tokenizer.
Presets need no files and no network; they use the byte tokenizer.
"""

from __future__ import annotations

import os

import torch

from .tokenizer import ByteTokenizer, HFTokenizer

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")

_BYTE_VOCAB = 320  # the byte tokenizer needs 259 ids; a multiple of 64 is friendlier to kernels

_TINY = dict(
    vocab_size=_BYTE_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    # Random weights at the usual 0.02 give near-uniform logits, so greedy decoding repeats one token
    # and near-ties make exactness tests flaky. A larger scale gives diverse text with clear winners.
    initializer_range=0.25,
    tie_word_embeddings=False,
)

PRESETS: dict[str, tuple[str, dict]] = {
    "tiny-llama": ("llama", dict(_TINY)),
    "tiny-qwen3": ("qwen3", dict(_TINY)),
    "tiny-mistral": ("mistral", dict(_TINY, sliding_window=None)),
    "tiny-qwen2": ("qwen2", dict(_TINY)),
    # Small but GPU-sized: for GPU correctness tests (fast to build, real head_dim).
    "small-llama": (
        "llama",
        dict(
            vocab_size=_BYTE_VOCAB,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
            initializer_range=0.08,
            tie_word_embeddings=False,
        ),
    ),
    # The Llama-3-8B shape, for benchmarks (random weights: EOS is ignored there).
    "llama3-8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            initializer_range=0.02,
            tie_word_embeddings=False,
        ),
    ),
}


def preset_config(name: str):
    """The transformers config of a preset, with the byte tokenizer's special ids."""
    from transformers import AutoConfig

    model_type, kwargs = PRESETS[name]
    tok = ByteTokenizer()
    return AutoConfig.for_model(
        model_type,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kwargs,
    )


_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
}


def resolve_device(device: str) -> torch.device:
    """"auto" is CUDA when there is one, else the CPU; anything else is a torch device string."""
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    if dtype not in _DTYPES:
        raise ValueError(f"dtype must be 'auto' or one of {sorted(_DTYPES)}, got {dtype!r}")
    return _DTYPES[dtype]


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Returns (model, tokenizer). `name_or_path` is a preset name, a local directory or a hub name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if name_or_path in PRESETS:
        config = preset_config(name_or_path)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = ByteTokenizer()
    else:
        _check_model_type(AutoConfig.from_pretrained(name_or_path).model_type)  # before reading any weights
        model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype).to(device)
        tokenizer = _load_tokenizer(name_or_path, model_eos_token_ids(model))
    _check_model_type(model.config.model_type)
    model.eval().requires_grad_(False)
    return model, tokenizer


def _check_model_type(model_type: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} is not supported; cbq runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )


def model_eos_token_ids(model) -> frozenset[int]:
    """Every end-of-sequence id the checkpoint names: config.json's and generation_config.json's (an int or a
    list each). Instruct releases (Llama 3, Qwen3) list their end-of-turn token only in generation_config."""
    generation_config = getattr(model, "generation_config", None)
    sources = (model.config.eos_token_id, getattr(generation_config, "eos_token_id", None))
    return frozenset(i for eos in sources for i in _as_list(eos))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


# Sampling fields a checkpoint's generation_config.json may set, as cbq names them (vLLM reads the same ones).
GENERATION_CONFIG_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k")


def generation_defaults(model) -> dict[str, int | float]:
    """The defaults the checkpoint's generation_config.json sets for `GENERATION_CONFIG_FIELDS` (only the
    values written there). With `do_sample: false` the file asks for greedy decoding, as in `generate()`,
    so its temperature, top_p and top_k are left out."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        return {}
    given = generation_config.to_diff_dict()  # only what differs from GenerationConfig's defaults
    if given.get("do_sample") is False:
        given = {k: v for k, v in given.items() if k == "max_new_tokens"}
    return {name: given[name] for name in GENERATION_CONFIG_FIELDS if given.get(name) is not None}


def _load_tokenizer(name_or_path: str, extra: frozenset[int]):
    is_local = os.path.isdir(name_or_path)
    has_files = is_local and any(
        os.path.exists(os.path.join(name_or_path, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if has_files or not is_local:
        return HFTokenizer.from_pretrained(name_or_path, extra_eos_ids=tuple(sorted(extra)))
    # A checkpoint saved without a tokenizer (e.g. a preset saved with save_pretrained): bytes.
    return ByteTokenizer()
