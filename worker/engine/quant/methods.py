"""Quantization methods: one object per format (FP8's here, INT4's in int4/), as vLLM draws them. Owns nothing; each method is told a
linear module's name and reads that linear's tensors from a checkpoint's state dict.

A method knows three things about its format's linears:
  load(tensors, prefix)    the `Fp8Linear` (INT4: `Int4Linear`) of module `prefix`, read under the format's names
                           and checked against the shapes the releases ship
  dequantize(layer, dtype) the weight in the compute dtype (the CPU path, models/quant_loader.py)
  apply(layer, x, bias)    the GEMM: FP8's quantizes x as the format asks, then kernels.fp8_linear

`linear_method(config, module_name)` gives the method for one linear, or None where that linear stays in the
compute dtype (an ignored module, the output head).
"""

from __future__ import annotations

from collections.abc import Mapping

import torch

from .base import QuantCheckpointError, QuantConfig
from .config import (
    BlockFp8Config,
    CompressedTensorsFp8Config,
    FbgemmFp8Config,
    Fp8Config,
    Fp8Scheme,
    OnlineFp8Config,
    WeightScale,
)
from .fp8 import FP8_DTYPE, Fp8Linear, dequantize_weight, quantize_weight_per_channel, weight_scale_shape
from .int4.awq import AwqConfig, AwqInt4Method
from .int4.compressed_tensors import CompressedTensorsInt4Config, CompressedTensorsInt4Method
from .int4.gptq import GptqConfig, GptqInt4Method
from .int4.method import Int4LinearMethod


class Fp8CheckpointError(QuantCheckpointError):
    """A checkpoint's tensors do not match its quantization_config; the message names the tensor."""


class Fp8LinearMethod:
    """Common to the serialized formats: `<prefix>.weight` in FP8 and `<prefix>.<weight_scale_name>`."""

    format_name = ""
    weight_scale_name = "weight_scale"

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme

    @classmethod
    def for_config(cls, config: QuantConfig, scheme: Fp8Scheme) -> Fp8LinearMethod:
        return cls(scheme)

    def tensor_names(self, prefix: str) -> list[str]:
        """What `load` reads: the loader takes these out of the state dict."""
        names = [f"{prefix}.weight", f"{prefix}.{self.weight_scale_name}"]
        return names + ([f"{prefix}.input_scale"] if self.scheme.activation.value == "static" else [])

    def load(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> Fp8Linear:
        weight = _get(tensors, f"{prefix}.weight")
        if weight.dtype != FP8_DTYPE or weight.dim() != 2:
            raise Fp8CheckpointError(
                f"{prefix}.weight is {weight.dtype} {list(weight.shape)}; {self.format_name} needs a 2-D "
                f"float8_e4m3fn weight here"
            )
        n, k = weight.shape
        scale = self._weight_scale(_get(tensors, f"{prefix}.{self.weight_scale_name}"), prefix, n, k)
        input_scale = None
        if self.scheme.activation.value == "static":
            input_scale = self._per_tensor(_get(tensors, f"{prefix}.input_scale"), f"{prefix}.input_scale")
        return Fp8Linear(weight, scale, self.scheme, input_scale)

    def dequantize(self, layer: Fp8Linear, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight(layer, dtype)

    def apply(self, layer: Fp8Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        from .kernels import fp8_linear

        return fp8_linear(x, layer, bias)

    # -- scale layouts: each format names the shapes its releases ship; all become `Fp8Linear`'s fp32 ones
    def _weight_scale(self, scale: torch.Tensor, prefix: str, n: int, k: int) -> torch.Tensor:
        name = f"{prefix}.{self.weight_scale_name}"
        want = weight_scale_shape(self.scheme, n, k)
        accepted = {WeightScale.TENSOR: [(), (1,)], WeightScale.CHANNEL: [(n,), (n, 1)], WeightScale.BLOCK: [want]}
        if tuple(scale.shape) not in accepted[self.scheme.weight]:
            raise Fp8CheckpointError(
                f"{name} has shape {list(scale.shape)}; {self.scheme.weight.value}-scaled FP8 of a [{n}, {k}] "
                f"weight needs {list(want)}"
            )
        return _as_fp32(scale, name).reshape(want).contiguous()

    def _per_tensor(self, scale: torch.Tensor, name: str) -> torch.Tensor:
        if scale.numel() != 1:
            raise Fp8CheckpointError(f"{name} has shape {list(scale.shape)}; a per-tensor scale is one value")
        return _as_fp32(scale, name).reshape(())


class BlockFp8LinearMethod(Fp8LinearMethod):
    """quant_method "fp8" with weight_block_size: `weight_scale_inv` [ceil(N / bn), ceil(K / bk)], stored in
    bf16 (Qwen3-FP8), fp16 (some Qwen3-2507) or fp32 (DeepSeek-V3); the product w_fp8 * scale is the weight."""

    format_name = "block-wise FP8 (quant_method 'fp8')"
    weight_scale_name = "weight_scale_inv"


class CompressedTensorsFp8LinearMethod(Fp8LinearMethod):
    """compressed-tensors float-quantized: `weight_scale` [1] or [] (tensor), [N, 1] (channel) or
    [ceil(N / bn), ceil(K / bk)] (block); `input_scale` [1] for static activations."""

    format_name = "compressed-tensors FP8"


class FbgemmFp8LinearMethod(Fp8LinearMethod):
    """fbgemm_fp8: `weight_scale` [N, 1]; the activations' absmax cap comes from the config
    (activation_scale_ub), not from a tensor."""

    format_name = "fbgemm_fp8"


class OnlineFp8LinearMethod(Fp8LinearMethod):
    """`--quantization fp8`: the checkpoint holds the weight in bf16/fp16/fp32; it is quantized per output
    channel at load."""

    format_name = "--quantization fp8"

    def tensor_names(self, prefix: str) -> list[str]:
        return [f"{prefix}.weight"]

    def load(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> Fp8Linear:
        weight = _get(tensors, f"{prefix}.weight")
        if not weight.is_floating_point() or weight.dtype == FP8_DTYPE or weight.dim() != 2:
            raise Fp8CheckpointError(
                f"{prefix}.weight is {weight.dtype} {list(weight.shape)}; --quantization fp8 quantizes a 2-D "
                f"bf16, fp16 or fp32 weight"
            )
        w_fp8, scale = quantize_weight_per_channel(weight)
        return Fp8Linear(w_fp8, scale, self.scheme)


# One line a format: its config's type -> its method (`for_config` builds it for one linear's scheme).
_METHODS: dict[type[QuantConfig], type[Fp8LinearMethod] | type[Int4LinearMethod]] = {
    BlockFp8Config: BlockFp8LinearMethod,
    CompressedTensorsFp8Config: CompressedTensorsFp8LinearMethod,
    FbgemmFp8Config: FbgemmFp8LinearMethod,
    OnlineFp8Config: OnlineFp8LinearMethod,
    CompressedTensorsInt4Config: CompressedTensorsInt4Method,
    GptqConfig: GptqInt4Method,
    AwqConfig: AwqInt4Method,
}

LinearMethod = Fp8LinearMethod | Int4LinearMethod


def linear_method(config: QuantConfig, module_name: str) -> LinearMethod | None:
    """The method that loads and runs linear `module_name` (e.g. "model.layers.0.mlp.up_proj"), or None
    when the config leaves it in the compute dtype."""
    scheme = config.scheme_for(module_name)
    return None if scheme is None else _METHODS[type(config)].for_config(config, scheme)


def fp8_linear_method(config: Fp8Config, module_name: str) -> Fp8LinearMethod | None:
    """`linear_method` of an FP8 format, where the caller handles FP8 linears alone (kept FP8, sharded by slice)."""
    method = linear_method(config, module_name)
    assert method is None or isinstance(method, Fp8LinearMethod), f"{type(config).__name__} is an FP8 format"
    return method


def load_dequantized(
    method: LinearMethod, tensors: Mapping[str, torch.Tensor], prefix: str, dtype: torch.dtype
) -> torch.Tensor:
    """Linear `prefix` read by `method` and dequantized to `dtype` (each method takes its own layer type back)."""
    if isinstance(method, Int4LinearMethod):
        return method.dequantize(method.load(tensors, prefix), dtype)
    return method.dequantize(method.load(tensors, prefix), dtype)


def stored_quantized(method: LinearMethod, tensors: Mapping[str, torch.Tensor] | object, prefix: str) -> bool:
    """Whether the checkpoint holds linear `prefix` in the method's format (its first tensor: the weight, FP8's, or
    the packed INT4 words). Not so: a head tied to the embedding, or a linear a GPTQ release left dense (a router)."""
    return method.tensor_names(prefix)[0] in tensors  # type: ignore[operator]


def dequantized_weight(
    tensors: Mapping[str, torch.Tensor], config: QuantConfig, prefix: str, dtype: torch.dtype
) -> torch.Tensor:
    """Linear `prefix`'s weight in `dtype`: its quantized tensors dequantized where the config quantizes it (the
    method's `load` and `dequantize`: FP8 weight times scales, INT4 (q - zero) * scale), else the stored weight
    cast. One expert's linear as the loader reads it where the experts run dequantized."""
    method = linear_method(config, prefix)
    if method is not None:
        return load_dequantized(method, tensors, prefix, dtype)
    weight = _get(tensors, f"{prefix}.weight")
    if weight.dtype == FP8_DTYPE:
        raise Fp8CheckpointError(f"the checkpoint has {prefix}.weight in FP8, but its quantization_config leaves {prefix} unquantized")
    return weight.to(dtype)


def _get(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise Fp8CheckpointError(f"the checkpoint has no {name}, which its quantization_config needs")
    return tensors[name]


def _as_fp32(scale: torch.Tensor, name: str) -> torch.Tensor:
    if not scale.is_floating_point() or scale.dtype == FP8_DTYPE:
        raise Fp8CheckpointError(f"{name} is {scale.dtype}; scales are bf16, fp16 or fp32")
    scale = scale.float()
    if not bool(torch.isfinite(scale).all()) or bool((scale <= 0).any()):
        raise Fp8CheckpointError(f"{name} holds a scale that is not a positive finite number")
    return scale
