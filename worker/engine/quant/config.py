"""What a checkpoint's `quantization_config` asks for, as typed descriptions. Owns nothing after parsing.

`checkpoint_quantization(config.quantization_config, requested)` turns the dict of config.json (or the
`--quantization fp8` request on an unquantized checkpoint) into one frozen description per format:

  BlockFp8Config             quant_method "fp8" with weight_block_size (Qwen3-*-FP8, DeepSeek-V3): FP8
                             weights with one `weight_scale_inv` per [bn, bk] block, activations quantized
                             per token and per group of bk columns at run time
  CompressedTensorsFp8Config quant_method "compressed-tensors", format "float-quantized" (RedHatAI
                             *-FP8-dynamic, *-FP8, *-FP8-block): `weight_scale` per tensor, per output
                             channel or per block; activations dynamic per token (or per group, with block
                             weights) or static per tensor (`input_scale`); `config_groups` targets and
                             `ignore` name which linears are quantized
  FbgemmFp8Config            quant_method "fbgemm_fp8" (Llama-3.1-*-FP8): `weight_scale` per output channel,
                             activations per token with their absmax capped at `activation_scale_ub`;
                             `modules_to_not_convert` stay in the compute dtype
  OnlineFp8Config            `--quantization fp8` on a bf16/fp16/fp32 checkpoint: weights quantized per
                             output channel at load, activations per token

Each answers `scheme_for(module_name)`: the module's `Fp8Scheme`, or None when that linear is not quantized.
`moe_quantization` is the same for a mixture of experts, narrowed to the formats whose experts cbq reads (kept FP8
on sm89+ GPUs for the FP8 grouped GEMMs, dequantized at load elsewhere). gpt-oss's release (`has_mxfp4_experts`: quant_method "mxfp4", only its experts quantized,
none of its linears) is not a linear format: the loader dequantizes its experts (layers/experts.py) and never asks for one here.
The INT4 weight-only formats are one module each under int4/ (their configs answer `scheme_for` alike, with an
`Int4Scheme`), parsed from here:

  int4/gptq.py               quant_method "gptq", bits 4 (AutoGPTQ / GPTQModel releases)
  int4/awq.py                quant_method "awq", bits 4, version "gemm" (AutoAWQ releases)
  int4/compressed_tensors.py quant_method "compressed-tensors", format "pack-quantized" (llm-compressor W4A16)

Everything else (bitsandbytes, GGUF, other bit widths, AWQ's gemv/exllama/marlin versions, GPTQ's marlin or other
checkpoint formats, int8 compressed-tensors, FP8 variants not listed above) raises `UnsupportedQuantization` with
one line that names the field and what cbq runs (`CBQ_RUNS`); a format module says what it refuses
(`base.FormatRefused`) and this module adds what cbq runs.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..config import QUANTIZATIONS  # what `--quantization` accepts
from .base import FIELD, FormatRefused, QuantConfig, ct_matches, stays_dense
from .int4 import awq, compressed_tensors, gptq
from .int4.method import Int4Config

CBQ_RUNS = (
    "cbq runs bf16, fp16 and fp32 checkpoints, FP8 ones in the formats fp8 (block-wise), "
    "compressed-tensors (float-quantized FP8) and fbgemm_fp8 (mixtures of experts: fp8 block-wise and "
    "compressed-tensors with per-channel weights, their experts in FP8 on sm89+ GPUs), INT4 weight-only ones "
    "(gptq 4-bit, formats gptq and gptq_v2, with or without desc_act; awq 4-bit version gemm; compressed-tensors "
    "pack-quantized int4 weights with 16-bit activations; dequantized at load), and gpt-oss's MXFP4 experts "
    "(dequantized at load)"
)
MOE_RUNS = (
    "cbq runs mixtures of experts in bf16, fp16 and fp32, FP8 ones in the formats fp8 (block-wise) and "
    "compressed-tensors with per-channel FP8 weights (their experts multiplied in FP8 on sm89+ GPUs where the "
    "activations are dynamic, else dequantized to the model dtype at load), INT4 ones (gptq, awq gemm, "
    "compressed-tensors pack-quantized; dequantized at load), --quantization fp8 (on sm89+ GPUs the "
    "experts too, gpt-oss's excepted), and gpt-oss's MXFP4 experts"
)
_FIELD = FIELD
MXFP4 = "mxfp4"  # gpt-oss's experts' quant_method


class UnsupportedQuantization(ValueError):
    """A quantization cbq does not run; the message is one line (the CLI prints it as is)."""


def _refuse(what: str) -> UnsupportedQuantization:
    return UnsupportedQuantization(f"{what} is not supported; {CBQ_RUNS}")


class WeightScale(str, Enum):
    TENSOR = "tensor"  # one scale for the whole weight
    CHANNEL = "channel"  # one scale per output row
    BLOCK = "block"  # one scale per [bn, bk] block


class ActivationScale(str, Enum):
    TOKEN = "token"  # dynamic: one scale per row of x, from its absmax
    TOKEN_GROUP = "token_group"  # dynamic: one scale per row and per group of `group_size` columns
    STATIC = "static"  # one scale for the whole tensor, read from the checkpoint (`input_scale`)


@dataclass(frozen=True)
class Fp8Scheme:
    """How one linear's weights and inputs are quantized to float8_e4m3fn."""

    weight: WeightScale
    activation: ActivationScale
    block_shape: tuple[int, int] | None = None  # BLOCK: (rows, columns) of weight each scale covers
    activation_scale_ub: float | None = None  # TOKEN: a row's absmax is capped here (fbgemm)

    def __post_init__(self) -> None:
        is_block = self.weight is WeightScale.BLOCK
        assert is_block == (self.block_shape is not None), "a block shape goes with block weight scales"
        assert is_block == (self.activation is ActivationScale.TOKEN_GROUP), (
            "block weights take per-token-group activations, and only they do"
        )
        assert self.activation_scale_ub is None or self.activation is ActivationScale.TOKEN

    @property
    def group_size(self) -> int:
        """TOKEN_GROUP: the columns of x that share one scale (the weight blocks' width)."""
        assert self.block_shape is not None
        return self.block_shape[1]


class Fp8Config(QuantConfig):
    """Base of the FP8 formats' descriptions: which scheme each linear module runs, and its tensors' names."""

    weight_scale_name: str = "weight_scale"  # the scale tensor next to `<module>.weight`

    def scheme_for(self, module_name: str) -> Fp8Scheme | None:
        raise NotImplementedError


@dataclass(frozen=True)
class BlockFp8Config(Fp8Config):
    block_shape: tuple[int, int]
    modules_to_not_convert: tuple[str, ...] = ()

    quant_method = "fp8"
    weight_scale_name = "weight_scale_inv"  # a multiplier despite its name: w = w_fp8 * weight_scale_inv

    def scheme_for(self, module_name: str) -> Fp8Scheme | None:
        if stays_dense(module_name, self.modules_to_not_convert):
            return None
        return Fp8Scheme(WeightScale.BLOCK, ActivationScale.TOKEN_GROUP, block_shape=self.block_shape)


@dataclass(frozen=True)
class FbgemmFp8Config(Fp8Config):
    activation_scale_ub: float
    modules_to_not_convert: tuple[str, ...] = ()

    quant_method = "fbgemm_fp8"

    def scheme_for(self, module_name: str) -> Fp8Scheme | None:
        if stays_dense(module_name, self.modules_to_not_convert):
            return None
        return Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN, activation_scale_ub=self.activation_scale_ub)


@dataclass(frozen=True)
class CompressedTensorsFp8Config(Fp8Config):
    groups: tuple[tuple[tuple[str, ...], Fp8Scheme], ...]  # (targets, scheme), in config_groups order
    ignore: tuple[str, ...] = ()

    quant_method = "compressed-tensors"

    def scheme_for(self, module_name: str) -> Fp8Scheme | None:
        """compressed-tensors' matching: a target is a class name ("Linear": every linear this is asked
        about), a "re:" regex matched from the start of the name, or the name itself; `ignore` wins."""
        if any(ct_matches(module_name, target) for target in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(ct_matches(module_name, target) for target in targets):
                return scheme
        return None


@dataclass(frozen=True)
class OnlineFp8Config(Fp8Config):
    """`--quantization fp8`: every linear but the output head, per-channel weights, per-token activations."""

    quant_method = "fp8 (at load)"
    is_serialized = False

    def scheme_for(self, module_name: str) -> Fp8Scheme | None:
        if stays_dense(module_name, ()):
            return None
        return Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)




def checkpoint_quantization(
    quantization_config: Mapping[str, Any] | None, requested: str | None = None
) -> QuantConfig | None:
    """The typed description of a checkpoint's `quantization_config` (None: an unquantized checkpoint run as
    is). `requested` is `--quantization`: "fp8" quantizes an unquantized checkpoint at load, and leaves an
    FP8 or INT4 checkpoint in its own format (as vLLM does). Raises `UnsupportedQuantization` for anything else."""
    if requested is not None and requested not in QUANTIZATIONS:
        raise _refuse(f"--quantization {requested!r}")
    to_dict = getattr(quantization_config, "to_dict", None)  # a transformers QuantizationConfigMixin
    if callable(to_dict):
        quantization_config = to_dict()
    if not quantization_config:
        return OnlineFp8Config() if requested == "fp8" else None
    if not isinstance(quantization_config, Mapping):
        raise _refuse(f"{_FIELD} of type {type(quantization_config).__name__}")
    method = quantization_config.get("quant_method")
    try:  # the INT4 weight-only formats, one module each (int4/)
        if method == "gptq":
            return gptq.parse(quantization_config)
        if method == "awq":
            return awq.parse(quantization_config)
        if method == "compressed-tensors" and compressed_tensors.is_pack_quantized(quantization_config):
            return compressed_tensors.parse(quantization_config)
    except FormatRefused as exc:
        raise _refuse(str(exc)) from None
    if method == "fp8":
        return _parse_block_fp8(quantization_config)
    if method == "compressed-tensors":
        return _parse_compressed_tensors(quantization_config)
    if method == "fbgemm_fp8":
        return _parse_fbgemm(quantization_config)
    if method == MXFP4:  # gpt-oss's release is read before this (has_mxfp4_experts): any other model lands here
        raise _refuse(f"{_FIELD}.quant_method {MXFP4!r} on a model other than gpt-oss")
    raise _refuse(f"{_FIELD}.quant_method {method!r}")


def moe_quantization(
    quantization_config: Any, model_type: str, requested: str | None = None
) -> QuantConfig | None:
    """`checkpoint_quantization` for a mixture of experts, whose other linears run as in a dense model. The experts
    are read one linear an expert (layers/experts.py), in the formats tested on the releases' layouts:
    block-wise "fp8" (Qwen3-*-FP8) and compressed-tensors with per-channel weights (GLM-4.5-Air-FP8). In one process
    on sm89+ CUDA they stay FP8 for the FP8 grouped GEMMs (moe/fp8.py: block-wise, or per-channel with dynamic
    per-token activations; a static input scale's experts are dequantized); on the CPU and under tensor parallelism
    they are dequantized to the model dtype at load. `--quantization fp8` quantizes the attention and the dense
    MLPs, and on sm89+ CUDA the routed experts per output channel (not gpt-oss's, nor a shared expert). The INT4
    formats' per-expert linears (GPTQ, AWQ, pack-quantized) are dequantized to the model dtype at load. Anything
    else raises `UnsupportedQuantization` naming `MOE_RUNS`."""
    quant = checkpoint_quantization(quantization_config, requested)
    if quant is None or isinstance(quant, (BlockFp8Config, OnlineFp8Config, Int4Config)):
        return quant
    if isinstance(quant, CompressedTensorsFp8Config) and all(s.weight is WeightScale.CHANNEL for _, s in quant.groups):
        return quant
    detail = "" if not isinstance(quant, CompressedTensorsFp8Config) else " with per-tensor or block weight scales"
    raise UnsupportedQuantization(
        f"{_FIELD}.quant_method {quant.quant_method!r}{detail} on a mixture of experts ({model_type}) is not "
        f"supported; {MOE_RUNS}"
    )


def has_mxfp4_experts(config: Any) -> bool:
    """gpt-oss as released: quant_method "mxfp4" on a gpt_oss config, which quantizes its experts alone (its linears
    are bf16). cbq dequantizes the experts to the model dtype at load, in one process and by rank's slice."""
    quant = getattr(config, "quantization_config", None)
    to_dict = getattr(quant, "to_dict", None)  # a transformers QuantizationConfigMixin
    if callable(to_dict):
        quant = to_dict()
    method = quant.get("quant_method") if isinstance(quant, Mapping) else None
    return getattr(config, "model_type", None) == "gpt_oss" and method == MXFP4


def refuse_gguf(name_or_path: str) -> None:
    """A GGUF file (or a folder of them without config.json) is refused before transformers tries to read it."""
    is_gguf = name_or_path.lower().endswith(".gguf")
    if os.path.isdir(name_or_path) and not os.path.exists(os.path.join(name_or_path, "config.json")):
        is_gguf = any(f.lower().endswith(".gguf") for f in os.listdir(name_or_path))
    if is_gguf:
        raise _refuse(f"{name_or_path}: GGUF")


def _parse_block_fp8(qc: Mapping[str, Any]) -> BlockFp8Config:
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise _refuse(f"{_FIELD}.fmt {fmt!r} (FP8 {fmt})")
    block = qc.get("weight_block_size")
    if block is None:
        raise _refuse(f"{_FIELD}: quant_method 'fp8' without weight_block_size (per-tensor FP8)")
    if not (isinstance(block, (list, tuple)) and len(block) == 2 and all(_is_pos_int(b) for b in block)):
        raise _refuse(f"{_FIELD}.weight_block_size {block!r} (two positive ints expected)")
    if qc.get("modules_to_convert"):  # FP8 embedding tables (DeepSeek-V4 style)
        raise _refuse(f"{_FIELD}.modules_to_convert {qc['modules_to_convert']!r} (FP8 embeddings)")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise _refuse(f"{_FIELD}.activation_scheme {scheme!r} with block-wise FP8 weights")
    return BlockFp8Config((int(block[0]), int(block[1])), _names(qc.get("modules_to_not_convert")))


def _parse_fbgemm(qc: Mapping[str, Any]) -> FbgemmFp8Config:
    ub = qc.get("activation_scale_ub", 1200.0)  # transformers' FbgemmFp8Config default
    if not isinstance(ub, (int, float)) or isinstance(ub, bool) or ub <= 0:
        raise _refuse(f"{_FIELD}.activation_scale_ub {ub!r} (a positive number expected)")
    return FbgemmFp8Config(float(ub), _names(qc.get("modules_to_not_convert")))


def _parse_compressed_tensors(qc: Mapping[str, Any]) -> CompressedTensorsFp8Config:
    # A kv_cache_scheme's k_scale/v_scale are no weights: loader.read_kv_scales gives them to --kv-cache-dtype fp8.
    groups_in = qc.get("config_groups") or {}
    if not isinstance(groups_in, Mapping) or not groups_in:
        raise _refuse(f"{_FIELD}: compressed-tensors without config_groups")
    groups = []
    for name, group in groups_in.items():
        where = f"{_FIELD}.config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt != "float-quantized":
            raise _refuse(f"{where}: compressed-tensors format {fmt!r}")
        targets = group.get("targets") or []
        if not isinstance(targets, list) or not all(isinstance(t, str) for t in targets) or not targets:
            raise _refuse(f"{where}.targets {targets!r} (a list of module names expected)")
        groups.append((tuple(targets), _ct_scheme(group, where)))
    return CompressedTensorsFp8Config(tuple(groups), _names(qc.get("ignore")))


def _ct_scheme(group: Mapping[str, Any], where: str) -> Fp8Scheme:
    weights, inputs = group.get("weights"), group.get("input_activations")
    if not isinstance(weights, Mapping):
        raise _refuse(f"{where}.weights {weights!r}")
    if not _is_fp8(weights):
        raise _refuse(f"{where}.weights: {weights.get('type')} {weights.get('num_bits')}-bit")
    if inputs is None:
        raise _refuse(f"{where}: FP8 weights without activation quantization (W8A16)")
    if not isinstance(inputs, Mapping) or not _is_fp8(inputs):
        raise _refuse(f"{where}.input_activations: {_describe(inputs)}")
    if group.get("output_activations") is not None:
        raise _refuse(f"{where}.output_activations")
    w_strategy, a_strategy, dynamic = weights.get("strategy"), inputs.get("strategy"), inputs.get("dynamic")
    if weights.get("dynamic"):
        raise _refuse(f"{where}.weights.dynamic true")
    if w_strategy == "block":
        block = weights.get("block_structure")
        if not (isinstance(block, list) and len(block) == 2 and all(_is_pos_int(b) for b in block)):
            raise _refuse(f"{where}.weights.block_structure {block!r}")
        if not (a_strategy == "group" and dynamic is True and inputs.get("group_size") == block[1]):
            raise _refuse(f"{where}.input_activations: {_describe(inputs)} with block weights")
        return Fp8Scheme(WeightScale.BLOCK, ActivationScale.TOKEN_GROUP, block_shape=(block[0], block[1]))
    if w_strategy not in ("tensor", "channel"):
        raise _refuse(f"{where}.weights.strategy {w_strategy!r}")
    weight = WeightScale(w_strategy)
    if a_strategy == "token" and dynamic is True:
        return Fp8Scheme(weight, ActivationScale.TOKEN)
    if a_strategy == "tensor" and dynamic is False:
        return Fp8Scheme(weight, ActivationScale.STATIC)
    raise _refuse(f"{where}.input_activations: {_describe(inputs)}")


def _is_fp8(args: Mapping[str, Any]) -> bool:
    return args.get("type") == "float" and args.get("num_bits") == 8 and args.get("symmetric", True) is True


def _describe(args: Any) -> str:
    if not isinstance(args, Mapping):
        return repr(args)
    flag = args.get("dynamic")
    dynamic = "dynamic" if flag is True else "static" if flag is False else f"dynamic={flag!r}"
    return f"{args.get('type')} {args.get('num_bits')}-bit, {dynamic} per {args.get('strategy')}"


def _is_pos_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _names(value: Any) -> tuple[str, ...]:
    if value is None:
        return ()
    if not isinstance(value, (list, tuple)) or not all(isinstance(v, str) for v in value):
        raise _refuse(f"{_FIELD}: a module list of {value!r} (a list of names expected)")
    return tuple(value)

