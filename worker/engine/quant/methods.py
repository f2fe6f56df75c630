"""The FP8 linear formats as methods of the one protocol (quant/protocol.py), and the config object that hands each
linear its method. Owns nothing; each method's parameters are its layer's.

  Fp8LinearMethod (block-wise "fp8", compressed-tensors, fbgemm_fp8)  FP8 `weight` [N, K] and `weight_scale` in the
                    layout the scheme names (per tensor: one per logical output of a merged layer; per channel [N];
                    block-wise [ceil(N / bn), ceil(K / bk)], split by blocks), `input_scale` for static activations;
                    the scale tensors of each release read under their names and checked against their shapes
  OnlineFp8LinearMethod (`--quantization fp8`)  the weight read in the model dtype, quantized per output channel
                    after loading (a row-parallel rank's scale is the whole row's: `layer.row_absmax`)
  DequantizedLinearMethod  a format read as shipped, then run in the model dtype (the CPU; the linears under a
                    mixture of experts' sparse MLP)
  LinearMethods     `method_for(prefix)`: the method each linear of a model takes (`Fp8Config.scheme_for` says
                    which are quantized, `keep_fp8` whether FP8 is kept)
  Int4LinearMethod (int4/: GPTQ, AWQ gemm, compressed-tensors pack-quantized)  the release's packed words, group
                    scales and zero points (and act-order's g_idx) read by slice, then dequantized to the model dtype
                    or kept packed (`keep_int4`: the W4A16 GEMMs)

Adding a format: one module with its method class, one line in `_METHODS` (its config type -> method), its tests.
`linear_method(config, module_name)` gives a format's method for one linear, or None where the config leaves it
unquantized; a method's `load(tensors, prefix)` reads one whole linear through the protocol (a world of one).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from .base import QuantCheckpointError, QuantConfig
from .config import (
    ActivationScale,
    BlockFp8Config,
    CompressedTensorsFp8Config,
    FbgemmFp8Config,
    Fp8Scheme,
    OnlineFp8Config,
    WeightScale,
)
from .fp8 import FP8_DTYPE, Fp8Linear, dequantize_weight, quantize_weight_per_channel, weight_scale_shape
from .int4.awq import AwqConfig, AwqInt4Method
from .int4.compressed_tensors import CompressedTensorsInt4Config, CompressedTensorsInt4Method
from .int4.gptq import GptqConfig, GptqInt4Method
from .int4.method import Int4LinearMethod
from .protocol import (
    UNQUANTIZED,
    LinearLoadError,
    LinearMethod,
    ParamSplit,
    add_parameter,
    load_whole_linear,
)


class Fp8CheckpointError(LinearLoadError, QuantCheckpointError):
    """A checkpoint's tensors do not match its quantization_config; the message names the tensor."""


FP8_SCHEME_ATTR = "fp8_scheme"  # the scheme a loaded layer runs (per-tensor scales that differ become per channel)
SHARD_SCALES_ATTR = "fp8_shard_scales"  # a merged layer's per-tensor scales, one per logical output, as shipped


class Fp8LinearMethod(LinearMethod):
    """Common to the serialized formats: `<prefix>.weight` in FP8 and `<prefix>.<weight_scale_name>`."""

    format_name = ""
    weight_scale_name = "weight_scale"

    def __init__(self, scheme: Fp8Scheme):
        self.scheme = scheme

    @classmethod
    def for_config(cls, config: QuantConfig, scheme: Fp8Scheme) -> Fp8LinearMethod:
        return cls(scheme)

    # -- the protocol
    def create_weights(self, layer, sizes, dtype, device) -> None:
        n, k, shards = sizes.output_size, sizes.input_size, len(sizes.output_sizes)
        add_parameter(layer, "weight", torch.empty(n, k, dtype=FP8_DTYPE, device=device), ParamSplit())
        scale_name = self.weight_scale_name
        if self.scheme.weight is WeightScale.TENSOR:
            shape: tuple[int, ...] = (shards,)
            split = ParamSplit(None, None, per_shard=True, checkpoint_name=scale_name)
        elif self.scheme.weight is WeightScale.CHANNEL:
            shape, split = (n,), ParamSplit(0, None, checkpoint_name=scale_name)
        else:
            assert self.scheme.block_shape is not None
            bn, bk = self.scheme.block_shape
            split = ParamSplit(0, 1, bn, bk, checkpoint_name=scale_name, what="block-wise FP8 blocks")
            shape = (sum(split.entries(size, bn) for size in sizes.output_sizes), split.entries(k, bk))
        add_parameter(layer, "weight_scale", torch.empty(shape, dtype=torch.float32, device=device), split)
        if self.scheme.activation is ActivationScale.STATIC:
            static = torch.empty(shards, dtype=torch.float32, device=device)
            add_parameter(layer, "input_scale", static, ParamSplit(None, None, per_shard=True))
        else:
            layer.register_parameter("input_scale", None)
        setattr(layer, FP8_SCHEME_ATTR, self.scheme)

    def load_tensor(self, layer, name, tensor, what, part):
        n, k = part
        if name == "weight":
            if tensor.dtype != FP8_DTYPE or tensor.dim() != 2:
                raise Fp8CheckpointError(
                    f"{what} is {tensor.dtype} {list(tensor.shape)}; {self.format_name} needs a 2-D "
                    f"float8_e4m3fn weight here"
                )
            return tensor
        if name == "weight_scale":
            return self._weight_scale(tensor, what, n, k)
        return self._per_tensor(tensor, what)

    def process_after_loading(self, layer) -> None:
        """A merged layer's per-tensor scales: one scale when its outputs' are equal, else one per row (exact, as
        `Fp8Linear.concat`); static input scales: the largest (the releases ship them equal)."""
        if self.scheme.weight is WeightScale.TENSOR:
            scales = layer.weight_scale.data
            setattr(layer, SHARD_SCALES_ATTR, scales.clone())
            if bool((scales == scales[0]).all()):
                layer.weight_scale = nn.Parameter(scales[0].clone(), requires_grad=False)
            else:
                sizes = getattr(layer, "sizes", None)  # a parallel layer's; a single linear's rows are its weight's
                rows = list(sizes.output_sizes) if sizes is not None else [layer.weight.shape[0]]
                per_row = torch.cat([s.expand(size) for s, size in zip(scales, rows, strict=True)])
                layer.weight_scale = nn.Parameter(per_row.contiguous(), requires_grad=False)
                setattr(layer, FP8_SCHEME_ATTR, replace(self.scheme, weight=WeightScale.CHANNEL))
        if self.scheme.activation is ActivationScale.STATIC:
            layer.input_scale = nn.Parameter(layer.input_scale.data.amax(), requires_grad=False)

    def apply(self, layer, x, bias):
        from .kernels import fp8_linear

        return fp8_linear(x, layer if isinstance(layer, Fp8Linear) else fp8_linear_of(layer), bias)

    # -- one whole linear (a world of one), through the protocol
    def load(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> Fp8Linear:
        weight = _get(tensors, f"{prefix}.weight")
        if weight.dim() != 2:
            raise Fp8CheckpointError(
                f"{prefix}.weight is {weight.dtype} {list(weight.shape)}; {self.format_name} needs a 2-D weight"
            )
        dtype = weight.dtype if weight.is_floating_point() and weight.dtype != FP8_DTYPE else torch.float32
        layer = load_whole_linear(
            self, tensors, prefix, tuple(weight.shape), dtype, missing=Fp8CheckpointError, device=weight.device
        )
        return fp8_linear_of(layer)

    def dequantize(self, layer: Fp8Linear, dtype: torch.dtype) -> torch.Tensor:
        return dequantize_weight(layer, dtype)

    # -- scale layouts: each format names the shapes its releases ship; all become `Fp8Linear`'s fp32 ones
    def _weight_scale(self, scale: torch.Tensor, name: str, n: int, k: int) -> torch.Tensor:
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


def fp8_linear_of(layer: Any) -> Fp8Linear:
    """A loaded FP8 layer's tensors as the FP8 GEMMs read them (views, no copy)."""
    input_scale = None if layer.input_scale is None else layer.input_scale.data
    return Fp8Linear(layer.weight.data, layer.weight_scale.data, getattr(layer, FP8_SCHEME_ATTR), input_scale)


def fp8_parts(layer: Any, rows: list[int]) -> list[Fp8Linear]:
    """Each logical output of a loaded FP8 layer (q, k, v; gate, up) as its own `Fp8Linear`, views of the layer's
    rows and of their scales, with the scales it shipped (a per-tensor one each)."""
    whole = fp8_linear_of(layer)
    scheme = whole.scheme
    shard_scales = getattr(layer, SHARD_SCALES_ATTR, None)
    parts, row, scale_row = [], 0, 0
    for i, size in enumerate(rows):
        weight = whole.weight[row : row + size]
        if shard_scales is not None:  # per tensor as shipped, whatever the fused layer runs; a copy, not a view:
            # cuBLASLt refuses a scale 4 bytes into an allocation (CUBLAS_STATUS_NOT_SUPPORTED for k_proj on the H100)
            scale, part_scheme = shard_scales[i].clone(), replace(scheme, weight=WeightScale.TENSOR)
        elif scheme.weight is WeightScale.CHANNEL:
            scale, part_scheme = whole.weight_scale[row : row + size], scheme
        elif scheme.weight is WeightScale.BLOCK:
            assert scheme.block_shape is not None
            blocks = -(-size // scheme.block_shape[0])
            scale, part_scheme = whole.weight_scale[scale_row : scale_row + blocks], scheme
            scale_row += blocks
        else:
            scale, part_scheme = whole.weight_scale, scheme
        parts.append(Fp8Linear(weight, scale, part_scheme, whole.input_scale))
        row += size
    return parts


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
    """`--quantization fp8`: the checkpoint holds the weight in bf16/fp16/fp32, read in the model dtype; it is
    quantized per output channel after loading. A layer holding part of each row (row-parallel) says the whole
    row's absmax (`row_absmax`), so that every rank's scales are one process's."""

    format_name = "--quantization fp8"

    def create_weights(self, layer, sizes, dtype, device) -> None:
        weight = torch.empty(sizes.output_size, sizes.input_size, dtype=dtype, device=device)
        add_parameter(layer, "weight", weight, ParamSplit())
        layer.register_parameter("input_scale", None)
        setattr(layer, FP8_SCHEME_ATTR, self.scheme)

    def load_tensor(self, layer, name, tensor, what, part):
        if not tensor.is_floating_point() or tensor.dtype == FP8_DTYPE or tensor.dim() != 2:
            raise Fp8CheckpointError(
                f"{what} is {tensor.dtype} {list(tensor.shape)}; --quantization fp8 quantizes a 2-D "
                f"bf16, fp16 or fp32 weight"
            )
        return tensor

    def process_after_loading(self, layer) -> None:
        weight = layer.weight.data
        row_absmax = getattr(layer, "row_absmax", None)
        w_fp8, scale = quantize_weight_per_channel(weight, None if row_absmax is None else row_absmax(weight))
        layer.weight = nn.Parameter(w_fp8, requires_grad=False)
        layer.weight_scale = nn.Parameter(scale, requires_grad=False)


class DequantizedLinearMethod(LinearMethod):
    """A quantized format read as its checkpoint ships it (the inner method's parameters and checks), then its
    weight dequantized to the model dtype and multiplied by F.linear: where FP8 is not kept (the CPU, pre-sm89
    GPUs) and for the linears under a mixture of experts' sparse MLP (the MoE kernels multiply plain weights)."""

    def __init__(self, inner: Fp8LinearMethod):
        self.inner = inner

    def create_weights(self, layer, sizes, dtype, device) -> None:
        self.inner.create_weights(layer, sizes, dtype, device)
        layer.compute_dtype = dtype

    def load_tensor(self, layer, name, tensor, what, part):
        return self.inner.load_tensor(layer, name, tensor, what, part)

    def process_after_loading(self, layer) -> None:
        self.inner.process_after_loading(layer)
        weight = dequantize_weight(fp8_linear_of(layer), layer.compute_dtype)
        for name in ("weight_scale", "input_scale"):
            layer.register_parameter(name, None)
        layer.weight = nn.Parameter(weight, requires_grad=False)

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)


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

# A format's method as `linear_method` gives it.
FormatMethod = Fp8LinearMethod | Int4LinearMethod


def linear_method(config: QuantConfig, module_name: str) -> FormatMethod | None:
    """The method that loads and runs linear `module_name` (e.g. "model.layers.0.mlp.up_proj"), or None
    when the config leaves it in the compute dtype."""
    scheme = config.scheme_for(module_name)
    return None if scheme is None else _METHODS[type(config)].for_config(config, scheme)


def fp8_linear_method(config: QuantConfig, module_name: str) -> Fp8LinearMethod | None:
    """`linear_method` of an FP8 format, where the caller handles FP8 linears alone (kept FP8, sharded by slice)."""
    method = linear_method(config, module_name)
    assert method is None or isinstance(method, Fp8LinearMethod), f"{type(config).__name__} is an FP8 format"
    return method


def load_dequantized(
    method: FormatMethod, tensors: Mapping[str, torch.Tensor], prefix: str, dtype: torch.dtype
) -> torch.Tensor:
    """Linear `prefix` read by `method` and dequantized to `dtype` (each method takes its own layer type back)."""
    return method.dequantize(method.load(tensors, prefix), dtype)  # type: ignore[arg-type]


def stored_quantized(method: FormatMethod, tensors: Mapping[str, torch.Tensor] | object, prefix: str) -> bool:
    """Whether the checkpoint holds linear `prefix` in the method's format (its first tensor: the weight, FP8's, or
    the packed INT4 words). Not so: a head tied to the embedding, or a linear a GPTQ release left dense (a router)."""
    return method.tensor_names(prefix)[0] in tensors  # type: ignore[operator]


class LinearMethods:
    """The config object that hands each linear of a model its method, by the linear's name (its prefix in the
    checkpoint, e.g. "model.layers.0.self_attn.q_proj"). `quant` None: every linear unquantized. `keep_fp8`:
    FP8 linears stay FP8 (sm89+ CUDA), else they are dequantized after loading; `keep_int4` likewise keeps INT4
    linears packed (int4/linear.py `keeps_int4`: CBQ_INT4_PACKED=1 on CUDA). `stays_dense`: linears
    run in the model dtype whatever the config says (a mixture of experts' sparse MLPs: read as shipped, then
    dequantized; under `--quantization fp8`, left as they are). `keep_fp8_experts`: a mixture of experts' FP8
    experts stay FP8 (the FP8 grouped GEMMs). A layer of experts takes its method from this object too
    (moe/methods.py `expert_method_for`, above this package: the expert formats live with the MoE kernels), so
    `quant` may be any format's config for the experts' sake."""

    def __init__(
        self, quant: QuantConfig | None = None, keep_fp8: bool = False,
        stays_dense: Callable[[str], bool] = lambda _: False, keep_fp8_experts: bool = False,
        keep_int4: bool = False,
    ):  # fmt: skip
        self.quant, self.keep_fp8, self.stays_dense = quant, keep_fp8, stays_dense
        self.keep_fp8_experts, self.keep_int4 = keep_fp8_experts, keep_int4

    def method_for(self, prefix: str) -> LinearMethod:
        quant = self.quant
        method = None if quant is None else linear_method(quant, prefix)
        if quant is None or method is None:
            return UNQUANTIZED
        if isinstance(method, Int4LinearMethod):  # under a sparse MLP: dequantized, as FP8 is
            return method.kept(self.keep_int4 and not self.stays_dense(prefix))
        if self.stays_dense(prefix):
            return DequantizedLinearMethod(method) if quant.is_serialized else UNQUANTIZED
        return method if self.keep_fp8 else DequantizedLinearMethod(method)


UNQUANTIZED_MODEL = LinearMethods()


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
