"""Model loading: a named preset with random weights, or a checkpoint by local path or hub name.

Owns nothing after loading: returns a transformers causal LM and a tokenizer. A checkpoint is read in one
pass: config.json -> its quantization (quant/: FP8 formats, `--quantization fp8`, gpt-oss's MXFP4 experts; any
other is refused in one line) -> its family (registry.py; a config the family does not implement stops here,
before any weights) -> generation_config.json -> the tokenizer (given the checkpoint's eos ids) -> the weights.

One loader: a checkpoint is read by slice as the one rank of a world of one (models/shard_build.py
`load_whole_model`, the reader the tensor-parallel ranks use: the family's transformers model built on meta, each
linear read through its parallel layer and its method (quant/methods.py `LinearMethods`), straight onto the device,
the model's parameters views of the layers' weights). Every text family takes it, multi-head latent attention
included: bf16/fp16/fp32 checkpoints, FP8 ones (kept FP8 or dequantized after loading, each linear by its method),
INT4 ones, `--quantization fp8` (quantized per channel as each linear is loaded) and gpt-oss's MXFP4 release (its
experts dequantized one at a time by layers/experts.py, not by transformers' mxfp4 quantizer, which needs a GPU and
the `kernels` package). A mixture of experts' routed experts are read by layers/experts.py through their expert
method (moe/protocol.py), FP8 experts kept FP8 included. Two other routes remain: a vision-language model loads
whole (models/vision.py), and a folder of pickled weights only (older releases' pytorch_model*.bin, unquantized)
takes transformers' `from_pretrained`. models/quant_loader.py's whole-model quantized loader is the tests'
reference (the dequantized model `generate` runs), not a route here.

Quantization is a property of each linear: on sm89+ CUDA a quantized linear is an `Fp8LinearModule` (FP8
weight and scales, which the owned decoder multiplies with FP8 GEMMs); elsewhere its weight is dequantized to
the compute dtype (the CPU path, exact against `generate` on the same dequantized model). A mixture of experts'
routed experts likewise: kept FP8 on sm89+ CUDA (moe/fp8_experts.py `Fp8Experts`, the FP8 grouped GEMMs), from an
FP8 checkpoint or quantized per channel by `--quantization fp8`; dequantized (or left as they are) elsewhere.
Presets need no files and no network; they use the byte tokenizer.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os

import torch

from ..api import SamplingParams
from ..families.registry import MODULES, family_of
from ..families.spec import DecoderArgs, Family, UnsupportedConfig, runtime_rope_fields, unhandled_fields
from ..kv_cache import KV_SCALES_ATTR
from ..moe import moe_layer_ids, spec_from_config
from ..moe.cost import MoeModelShape, check_weights_fit, weight_bytes
from ..moe.fp8 import Fp8ExpertFormat
from ..moe.fp8_experts import quantize_model_experts
from ..quant import (
    Fp8Config,
    QuantConfig,
    UnsupportedQuantization,
    checkpoint_quantization,
    has_mxfp4_experts,
    moe_quantization,
    refuse_gguf,
)
from ..quant.int4.linear import keeps_int4
from ..quant.linear import keeps_fp8, keeps_fp8_experts, quantize_linears
from ..quant.methods import LinearMethods
from ..tokenizer import ByteTokenizer, HFTokenizer
from .errors import ModelLoadError
from .errors import one_line as _one_line
from .presets import PRESETS, preset_config
from .quant_loader import (
    AccountedCheckpoint,
    SparseLayers,
    checkpoint_tensors,
    read_kv_scales,
)
from .shard_build import load_whole_model, local_folder, open_checkpoint, slice_reader_refuses
from .vision import load_vision_model

SUPPORTED_MODEL_TYPES = tuple(MODULES)

logger = logging.getLogger("cbq.models")

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


def check_moe_fit(config, dtype: torch.dtype, gpu_free_bytes: int, fp8_experts: Fp8ExpertFormat | None = None) -> str:
    """For a mixture of experts: its weights' bytes in `dtype` against the GPU's free bytes, from the config alone
    (before anything is allocated). Every expert is held once, gpt-oss's too (the owned decoder moves them into the
    kernels' layout a layer at a time: models/moe_from_model.py); `fp8_experts`: the experts are kept in FP8 (1 byte a
    weight and their scales). Returns the line that says the numbers; a `ModelLoadError` with them when nothing is
    left for the KV cache."""

    weights = weight_bytes(MoeModelShape.from_config(config), dtype.itemsize, fp8_experts=fp8_experts)
    try:
        check_weights_fit(weights, gpu_free_bytes, min_kv_bytes=1)
    except ValueError as exc:
        raise ModelLoadError(f"model type {config.model_type!r}: {exc}") from exc
    gb = 1e9
    experts_in = " in FP8" if fp8_experts is not None else ""
    return (
        f"{config.model_type}: weights {weights.total / gb:.1f} GB (experts {weights.experts / gb:.1f} GB{experts_in}) "
        f"in {str(dtype).removeprefix('torch.')}, GPU free {gpu_free_bytes / gb:.1f} GB, "
        f"{(gpu_free_bytes - weights.total) / gb:.1f} GB left for the KV cache"
    )


def _check_fit(
    config, family: Family, device: torch.device, dtype: torch.dtype, fp8_experts: Fp8ExpertFormat | None
) -> None:
    if family.moe is not None and device.type == "cuda":
        logger.info(check_moe_fit(config, dtype, torch.cuda.mem_get_info(device)[0], fp8_experts))


def fp8_expert_format(config, family: Family, quant: QuantConfig | None) -> Fp8ExpertFormat | None:
    """The format a mixture of experts' experts are kept in where FP8 experts are kept (None: a dense model, or
    experts that run in the model dtype): the checkpoint's, or `--quantization fp8`'s per-channel one."""
    sparse = sparse_layers(config, family)
    return None if sparse is None else sparse.fp8_format(quant)


def load_model(
    name_or_path: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    quantization: str | None = None,
    keep_fp8: bool | None = None,
    keep_fp8_experts: bool | None = None,
    images: bool = False,
    keep_int4: bool | None = None,
):
    """Returns (model, tokenizer). `name_or_path` is a preset name, a local directory or a hub name.
    `quantization`: "fp8" quantizes an unquantized model at load (`--quantization`; an FP8 checkpoint keeps its
    own format). `keep_fp8`: quantized linears stay FP8 (`Fp8LinearModule`) rather than dequantized; None: where
    FP8 tensor cores run them (sm89+ CUDA). The tests set it on the CPU, where the FP8 GEMM is emulated.
    `keep_fp8_experts`: a mixture of experts' routed experts stay FP8 too (`Fp8Experts`, the FP8 grouped GEMMs;
    quantized per channel under `--quantization fp8`); None: with `keep_fp8` on CUDA. The tests set it on the CPU,
    where Triton's interpreter runs the kernels; elsewhere the CPU keeps its experts in the model dtype.
    `keep_int4`: an INT4 checkpoint's linears stay packed (`Int4LinearModule`, the W4A16 GEMMs) rather than
    dequantized; None: where the W4A16 kernels run (CUDA, bf16/fp16). The tests set it on the CPU (the twin runs).
    `images`: a multimodal checkpoint whose family runs its text alone (Gemma 3 4B-27B) loads whole with its vision
    tower instead, where its folder holds preprocessor_config.json and the run is unquantized
    (families/registry.py `IMAGE_MODULES`; either decoder runs it).

    Raises `ModelLoadError` for a missing path, a folder that holds no checkpoint, an unsupported
    architecture, quantization or config value, custom code (`auto_map`), or files that cannot be read (a
    corrupt shard, a missing FP8 scale).
    """
    from transformers import AutoModelForCausalLM

    if keep_fp8 is None:
        keep_fp8 = keeps_fp8(device)
    if keep_fp8_experts is None:
        keep_fp8_experts = keeps_fp8_experts(keep_fp8, device)
    read_by_slice = False  # the slice reader's methods quantize `--quantization fp8` linears as they load
    if keep_int4 is None:
        keep_int4 = keeps_int4(device, dtype)
    if name_or_path in PRESETS:
        config = preset_config(name_or_path)
        quant = _quantization(config, quantization)
        family = family_for(config)[0]
        fp8_experts = fp8_expert_format(config, family, quant) if keep_fp8_experts else None
        _check_fit(config, family, device, dtype, fp8_experts)
        torch.manual_seed(seed)
        with torch.device(device):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        tokenizer: ByteTokenizer | HFTokenizer = ByteTokenizer()
    else:
        config = _load_config(name_or_path)
        quant = _quantization(config, quantization)
        family, _ = family_for(config)  # before reading any weights
        if images and quant is None and os.path.exists(os.path.join(name_or_path, "preprocessor_config.json")):
            # the family that takes the checkpoint's images, where another runs its text alone (a folder without
            # the image processor's file keeps to the text, and so does a quantized run: images run unquantized)
            family = family_of(str(config.model_type), images=True) or family
        fp8_experts = fp8_expert_format(config, family, quant) if keep_fp8_experts else None
        _check_fit(config, family, device, dtype, fp8_experts)
        text_config, key_mapping = _text_model(config, family)
        if family.vision is not None and quant is not None:
            raise ModelLoadError(f"{family.name} runs unquantized (with its images)")
        try:
            generation_config = _load_generation_config(name_or_path, config)
            tokenizer = _load_tokenizer(name_or_path, checkpoint_eos_token_ids(config, generation_config))
            sparse = sparse_layers(config, family)
            methods = LinearMethods(
                quant, keep_fp8, stays_dense(sparse), keep_fp8_experts=keep_fp8_experts, keep_int4=keep_int4
            )
            if family.vision is not None:  # the whole vision-language model (models/vision.py)
                model = load_vision_model(name_or_path, family, generation_config, dtype, device)
            elif not _only_pickled_weights(name_or_path):  # the one reader (shard_build.load_whole_model)
                refusal = slice_reader_refuses(family)
                if refusal is not None:
                    raise ModelLoadError(refusal)
                model = _read_by_slice(name_or_path, text_config, family, key_mapping, quant, methods, device, dtype)
                model.generation_config = generation_config
                read_by_slice = True
            elif quant is not None and quant.is_serialized:
                raise ModelLoadError(
                    f"{name_or_path} holds its quantized weights in pytorch_model*.bin: cbq reads quantized checkpoints "
                    "from safetensors files (as their releases ship them)"
                )
            else:  # pickled weights (older releases): transformers reads them
                model = AutoModelForCausalLM.from_pretrained(
                    name_or_path,
                    config=text_config,
                    key_mapping=key_mapping,
                    generation_config=generation_config,
                    dtype=dtype,
                    trust_remote_code=False,
                ).to(device)
        except ModelLoadError:
            raise
        except Exception as exc:  # safetensors, OSError, ...: whatever a bad file raises
            raise ModelLoadError(f"cannot load the checkpoint {name_or_path}: {_one_line(exc)}") from exc
    if isinstance(quant, Fp8Config) and not quant.is_serialized:  # --quantization fp8: on the device, so it is quick
        sparse = sparse_layers(model.config, family_for(model.config)[0])
        if not read_by_slice:  # the slice reader's methods quantized each linear as it was loaded
            quantize_linears(model, quant, keep_fp8, stays_dense=stays_dense(sparse))
        if sparse is not None and fp8_experts is not None and not read_by_slice:  # a preset's, or pickled weights':
            # the routed experts per channel, a layer at a time (the slice reader's expert methods did it as they read)
            quantize_model_experts(model, sparse.layer_prefixes, sparse.mlp.experts, sparse.spec)
    model.eval().requires_grad_(False)
    return model, tokenizer


def _only_pickled_weights(name_or_path: str) -> bool:
    """A local folder whose weights are only pytorch_model*.bin (older releases): transformers reads those, the slice
    reader reads safetensors only."""
    if not os.path.isdir(name_or_path):
        return False
    files = os.listdir(name_or_path)
    return not any(f.endswith(".safetensors") for f in files) and any(f.endswith(".bin") for f in files)


def _read_by_slice(
    name_or_path: str, config, family: Family, renames, quant: QuantConfig | None, methods: LinearMethods,
    device: torch.device, dtype: torch.dtype,
):  # fmt: skip
    """The one reader at a world of one (`load_whole_model`). A quantized checkpoint (FP8, INT4) keeps the quantized
    loader's checks (a missing scale, a quantized tensor its config does not account for, named in one line) and its
    KV-cache scales."""
    path = local_folder(name_or_path)
    source = open_checkpoint(path, renames, name_or_path)
    if quant is None or not quant.is_serialized:
        return load_whole_model(source, config, family, device, dtype, methods)
    accounted = AccountedCheckpoint(source)
    model = load_whole_model(accounted, config, family, device, dtype, methods)
    names = getattr(source, "names", None)
    if names is not None:  # a multimodal checkpoint's renamed view lists no names: its FP8 is not checked here
        accounted.check_unread(names(), config)
    kv_scales = read_kv_scales(checkpoint_tensors(path), config.num_hidden_layers)
    if kv_scales:
        setattr(model, KV_SCALES_ATTR, kv_scales)
    return model


def _quantization(config, requested: str | None) -> QuantConfig | None:
    """The quantization the linears run: the checkpoint's own, or `requested` on an unquantized one. None for
    gpt-oss's MXFP4 release too: its linears are unquantized, its experts dequantized at load."""
    if has_mxfp4_experts(config):
        if requested is not None:
            raise ModelLoadError(
                f"--quantization {requested} is not supported on gpt-oss's MXFP4 release (cbq runs its experts "
                "dequantized to the model dtype and its other linears as shipped)"
            )
        return None
    quantization_config = getattr(config, "quantization_config", None)
    try:
        if _require_family(config.model_type).moe is not None:  # the formats whose experts cbq reads
            return moe_quantization(quantization_config, config.model_type, requested=requested)
        return checkpoint_quantization(quantization_config, requested=requested)
    except UnsupportedQuantization as exc:
        raise ModelLoadError(str(exc)) from None


def sparse_layers(config, family: Family) -> SparseLayers | None:
    """Where a mixture of experts' sparse layers sit, for the quantized loader (None: a dense model)."""

    if family.moe is None:
        return None
    config, _ = _text_model(config, family)
    prefixes = tuple(f"{family.layers_path}.{i}" for i in moe_layer_ids(config))
    return SparseLayers(prefixes, family.moe, spec_from_config(config))


def stays_dense(sparse: SparseLayers | None):
    """Whether a module stays in the model dtype under FP8: those under a mixture of experts' sparse MLPs (`sparse`;
    None: a dense model), which cbq's MoE kernels multiply unquantized."""
    return (lambda _: False) if sparse is None else sparse.holds


def family_for(config, images: bool = False) -> tuple[Family, DecoderArgs]:
    """The family that runs `config` and the numbers it reads from it; a `ModelLoadError` (one line naming the
    model type or the field) when cbq has no family for it or the family does not implement a value it sets.
    `images`: the family that runs the checkpoint with its images, where another runs its text alone (Gemma 3)."""
    family = _require_family(config.model_type)
    if images:
        family = family_of(str(config.model_type), images=True) or family
    config, _ = _text_model(config, family)
    unhandled = unhandled_fields(config, family) + runtime_rope_fields(config, family)
    try:
        if unhandled:
            raise UnsupportedConfig(", ".join(unhandled))
        return family, family.read(config)
    except UnsupportedConfig as exc:
        raise ModelLoadError(f"model type {config.model_type!r}: config.json sets {exc}, which cbq does not implement") from exc


def _text_model(config, family: Family):
    """The config of the model cbq runs and the renames of its weight names: the checkpoint's own, or for a
    multimodal checkpoint whose family runs its language model, that model's (which ties its embeddings as
    the whole checkpoint does, since the whole decides what was saved)."""
    if family.vision is not None:  # the whole model loads; its language model's config is read
        return config.get_text_config(), None
    key_mapping = family.wrappers.get(config.model_type)
    if key_mapping is None:
        return config, None
    text_config = copy.deepcopy(config.get_text_config())
    text_config.tie_word_embeddings = config.tie_word_embeddings
    return text_config, key_mapping


def _require_family(model_type) -> Family:
    family = family_of(str(model_type))
    if family is None:
        raise ModelLoadError(f"model type {model_type!r} is not supported; cbq runs {', '.join(SUPPORTED_MODEL_TYPES)}")
    return family


def _load_config(name_or_path: str):
    from transformers import AutoConfig, PretrainedConfig

    try:  # before transformers tries to read it (and advises installing a package)
        refuse_gguf(name_or_path)
    except UnsupportedQuantization as exc:
        raise ModelLoadError(str(exc)) from None
    if os.path.isdir(name_or_path) and not os.path.exists(os.path.join(name_or_path, "config.json")):
        raise ModelLoadError(f"{name_or_path} is not a checkpoint folder: it has no config.json")
    parent = os.path.dirname(name_or_path)
    is_path = name_or_path.startswith((".", "/", "~")) or (parent != "" and os.path.isdir(parent))
    if is_path and not os.path.exists(name_or_path):
        raise ModelLoadError(f"no such checkpoint folder: {name_or_path}")
    try:
        raw, _ = PretrainedConfig.get_config_dict(name_or_path)
    except Exception as exc:  # not on the hub, no network, bad JSON
        presets = ", ".join(PRESETS)
        raise ModelLoadError(
            f"cannot load {name_or_path!r} (not a preset: {presets}): {_one_line(exc)}"
        ) from exc
    model_type = raw.get("model_type")
    if "auto_map" in raw and family_of(str(model_type)) is None:
        # NOTE: a supported model_type runs transformers' own implementation, as trust_remote_code=False does.
        raise ModelLoadError(
            f"{name_or_path} needs custom code (config.json auto_map, model type {model_type!r}): cbq runs no code "
            f"from checkpoints; it runs {', '.join(SUPPORTED_MODEL_TYPES)}"
        )
    _require_family(model_type)
    try:
        return AutoConfig.from_pretrained(name_or_path, trust_remote_code=False)
    except Exception as exc:  # an unknown model_type, bad values
        raise ModelLoadError(f"cannot load the config of {name_or_path}: {_one_line(exc)}") from exc


def _load_generation_config(name_or_path: str, config):
    """generation_config.json, or (without one) what transformers derives from config.json."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(name_or_path)
    except OSError:  # no such file: as `from_pretrained` does
        return GenerationConfig.from_model_config(config)


def checkpoint_eos_token_ids(config, generation_config) -> frozenset[int]:
    """Every end-of-sequence id the checkpoint names: config.json's and generation_config.json's (an int or a
    list each). Instruct releases (Llama 3, Qwen3) list their end-of-turn token only in generation_config."""
    configs = {id(c): c for c in (config, config.get_text_config())}.values()  # a multimodal one's text config too
    sources = [getattr(c, "eos_token_id", None) for c in configs] + [getattr(generation_config, "eos_token_id", None)]
    return frozenset(i for eos in sources for i in _as_list(eos))


def _as_list(value) -> list[int]:
    if value is None:
        return []
    return [int(v) for v in value] if isinstance(value, (list, tuple)) else [int(value)]


# Sampling fields a checkpoint's generation_config.json may set, as cbq names them (vLLM reads the same ones),
# those the engine's SamplingParams knows: repetition_penalty and min_p join once the engine has them.
GENERATION_CONFIG_FIELDS = tuple(
    name
    for name in ("max_new_tokens", "temperature", "top_p", "top_k", "repetition_penalty", "min_p")
    if name in {f.name for f in dataclasses.fields(SamplingParams)}
)


# What `generate()` applies in greedy decoding too (do_sample: false keeps them).
_GREEDY_FIELDS = ("max_new_tokens", "repetition_penalty")


def generation_defaults(model) -> dict[str, int | float]:
    """The defaults the checkpoint's generation_config.json sets for `GENERATION_CONFIG_FIELDS` (only the
    values written there). With `do_sample: false` the file asks for greedy decoding, as in `generate()`,
    so its temperature, top_p, top_k and min_p are left out and temperature is 0."""
    generation_config = getattr(model, "generation_config", None)
    if generation_config is None:
        return {}
    given = generation_config.to_diff_dict()  # only what differs from GenerationConfig's defaults
    if given.get("do_sample") is False:  # greedy, said explicitly: a line's own default must not sample
        given = {k: v for k, v in given.items() if k in _GREEDY_FIELDS} | {"temperature": 0.0}
    return {name: given[name] for name in GENERATION_CONFIG_FIELDS if given.get(name) is not None}


def _load_tokenizer(name_or_path: str, checkpoint_eos: frozenset[int]) -> ByteTokenizer | HFTokenizer:
    """The checkpoint's tokenizer, its eos ids joined with the checkpoint's (the one place they are joined)."""
    is_local = os.path.isdir(name_or_path)
    has_files = is_local and any(
        os.path.exists(os.path.join(name_or_path, f))
        for f in ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
    )
    if has_files or not is_local:
        return HFTokenizer.from_pretrained(name_or_path, extra_eos_ids=tuple(sorted(checkpoint_eos)))
    # A checkpoint saved without a tokenizer (e.g. a preset saved with save_pretrained): bytes.
    return ByteTokenizer(extra_eos_ids=tuple(sorted(checkpoint_eos)))
