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


class ModelLoadError(ValueError):
    """The model cannot be loaded; the message is one line that says why (the CLI prints it as is)."""


def load_model(name_or_path: str, device: torch.device, dtype: torch.dtype, seed: int = 0):
    """Returns (model, tokenizer). `name_or_path` is a preset name, a local directory or a hub name.

    Raises `ModelLoadError` for a missing path, a folder that holds no checkpoint, an unsupported
    architecture, or files that cannot be read (a corrupt shard).
    """
    from transformers import AutoModelForCausalLM

    if name_or_path in PRESETS:
        config = preset_config(name_or_path)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer = ByteTokenizer()
    else:
        _check_model_type(_load_config(name_or_path).model_type)  # before reading any weights
        try:
            model = AutoModelForCausalLM.from_pretrained(name_or_path, dtype=dtype).to(device)
            tokenizer = _load_tokenizer(name_or_path, model_eos_token_ids(model))
        except Exception as exc:  # safetensors, OSError, ...: whatever a bad file raises
            raise ModelLoadError(f"cannot load the checkpoint {name_or_path}: {_one_line(exc)}") from exc
    _check_model_type(model.config.model_type)
    model.eval().requires_grad_(False)
    return model, tokenizer


def _load_config(name_or_path: str):
    from transformers import AutoConfig

    if os.path.isdir(name_or_path) and not os.path.exists(os.path.join(name_or_path, "config.json")):
        raise ModelLoadError(f"{name_or_path} is not a checkpoint folder: it has no config.json")
    parent = os.path.dirname(name_or_path)
    is_path = name_or_path.startswith((".", "/", "~")) or (parent != "" and os.path.isdir(parent))
    if is_path and not os.path.exists(name_or_path):
        raise ModelLoadError(f"no such checkpoint folder: {name_or_path}")
    try:
        return AutoConfig.from_pretrained(name_or_path)
    except Exception as exc:  # not on the hub, no network, an unknown model_type, bad JSON
        presets = ", ".join(PRESETS)
        raise ModelLoadError(
            f"cannot load {name_or_path!r} (not a preset: {presets}): {_one_line(exc)}"
        ) from exc


def _one_line(exc: BaseException) -> str:
    lines = [line.strip() for line in str(exc).splitlines() if line.strip()]
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


def _check_model_type(model_type: str) -> None:
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ModelLoadError(
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
GENERATION_CONFIG_FIELDS = ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "min_p")
# What `generate()` applies in greedy decoding too (do_sample: false keeps them).
_GREEDY_FIELDS = ("max_new_tokens", "repetition_penalty")


def generation_defaults(model) -> dict[str, int | float]:
    """The defaults the checkpoint's generation_config.json sets for `GENERATION_CONFIG_FIELDS` (only the
    values written there). With `do_sample: false` the file asks for greedy decoding, as in `generate()`,
    so its temperature, top_p, top_k and min_p are left out."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        return {}
    given = generation_config.to_diff_dict()  # only what differs from GenerationConfig's defaults
    if given.get("do_sample") is False:
        given = {k: v for k, v in given.items() if k in _GREEDY_FIELDS}
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
