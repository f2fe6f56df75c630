"""FP8 experts (issue 26, item 4): a mixture of experts' routed experts kept as float8_e4m3fn with fp32 scales, as
the releases store them, so that the grouped GEMMs (triton_fp8.py) read half the bytes of bf16 experts. Owns the
format: `Fp8ExpertFormat` (how the experts are scaled) and `ExpertFp8Scales` (the scale tensors, which
`weights.ExpertWeights.fp8` carries beside its e4m3 `gate_up` [E, 2I, H] and `down` [E, H, I]); and the few
functions that make the format (a checkpoint's per-expert linears through `Fp8ExpertMethod`, the format's expert
method; `--quantization fp8` at load), undo it (the CPU path and the emulation) and weigh it (cost.py).

Two scale layouts, each the one a release (or vLLM's online FP8) writes for one expert's linear, stacked over E:
  per output channel   gate_up [E, 2I] ([gate; up] rows), down [E, H]; activations quantized per token
                       (GLM-4.5-Air-FP8's compressed-tensors, `--quantization fp8`)
  block-wise [bn, bk]  gate_up [E, 2 * ceil(I / bn), ceil(H / bk)]: gate's block rows, then up's (each projection
                       keeps its own grid, as the release scales it, so I need not be a multiple of bn); down
                       [E, ceil(H / bn), ceil(I / bk)]; activations quantized per token and per group of bk
                       columns (Qwen3-*-FP8's `weight_scale_inv`, the DeepSeek-V3 recipe)
A weight is w ≈ w_fp8 * scale, quant/fp8.py's convention (`weight_scale_inv` is a multiplier despite its name).
Activation quantization is quant/fp8.py's (torch) and quant/kernels.py's (Triton): the dense FP8 linears' own.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from ..quant.config import ActivationScale, Fp8Scheme, WeightScale
from ..quant.fp8 import (
    FP8_DTYPE,
    expand_block_scale,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_per_channel,
)
from ..quant.methods import Fp8LinearMethod
from .protocol import ExpertMethod
from .spec import MoeSpec

SCALE_BYTES = 4  # every scale is kept in fp32


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class Fp8ExpertFormat:
    """How FP8 experts are scaled: per [bn, bk] block (`block_shape`) or per output channel (None)."""

    block_shape: tuple[int, int] | None = None

    @property
    def scheme(self) -> Fp8Scheme:
        """The dense linears' description of the same scaling (its activation quantization is the experts' too)."""
        if self.block_shape is None:
            return Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)
        return Fp8Scheme(WeightScale.BLOCK, ActivationScale.TOKEN_GROUP, block_shape=self.block_shape)

    def scale_shapes(
        self, num_experts: int, hidden: int, inter: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """(gate_up's, down's) scale shapes for E experts of hidden size H and intermediate size I."""
        if self.block_shape is None:
            return (num_experts, 2 * inter), (num_experts, hidden)
        bn, bk = self.block_shape
        return (num_experts, 2 * _cdiv(inter, bn), _cdiv(hidden, bk)), (
            num_experts,
            _cdiv(hidden, bn),
            _cdiv(inter, bk),
        )

    def bytes_per_expert(self, spec: MoeSpec) -> int:
        """One expert's e4m3 matrices (1 byte a weight) and fp32 scales; its biases (gpt-oss) are not FP8."""
        gate_up, down = self.scale_shapes(1, spec.hidden_size, spec.expert_intermediate_size)
        scales = (_numel(gate_up) + _numel(down)) * SCALE_BYTES
        return 3 * spec.hidden_size * spec.expert_intermediate_size + scales

    def quantize_input(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x [M, K] -> (x_fp8, scale [M] or [M, ceil(K / bk)]): the activations as the kernels quantize them."""
        if self.block_shape is None:
            return quantize_per_token(x)
        return quantize_per_token_group(x, self.block_shape[1])


def _numel(shape: tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= d
    return n


@dataclass(frozen=True)
class ExpertFp8Scales:
    """The fp32 scales of e4m3 experts, in `format`'s layout (module docstring)."""

    gate_up: torch.Tensor
    down: torch.Tensor
    format: Fp8ExpertFormat

    def check(self, num_experts: int, hidden: int, inter: int) -> None:
        """Shapes and dtypes; raises ValueError naming the tensor."""
        for name, tensor, shape in zip(
            ("gate_up", "down"),
            (self.gate_up, self.down),
            self.format.scale_shapes(num_experts, hidden, inter),
            strict=True,
        ):
            if tensor.dtype != torch.float32 or tuple(tensor.shape) != shape:
                raise ValueError(
                    f"MoE weight experts.fp8.{name} is {tensor.dtype} {tuple(tensor.shape)}, expected fp32 {shape}"
                )

    def to(self, device: torch.device | str) -> ExpertFp8Scales:
        return ExpertFp8Scales(self.gate_up.to(device), self.down.to(device), self.format)


def supported_scheme(scheme: Fp8Scheme | None) -> Fp8ExpertFormat | None:
    """The expert format of a linear's FP8 scheme where the FP8 expert GEMMs compute it: per-channel weights with
    dynamic per-token activations (no cap), or blocks whose width is a power of two of at least 32 (a K tile of the
    kernels must lie in one group, and an FP8 dot takes 32 columns at least). Else None: those experts are
    dequantized at load (static input scales, per-tensor weights)."""
    if scheme is None:
        return None
    if scheme.weight is WeightScale.CHANNEL and scheme.activation is ActivationScale.TOKEN:
        return Fp8ExpertFormat() if scheme.activation_scale_ub is None else None
    if scheme.weight is WeightScale.BLOCK and scheme.block_shape is not None:
        bk = scheme.block_shape[1]
        return Fp8ExpertFormat(scheme.block_shape) if bk >= 32 and bk & (bk - 1) == 0 else None
    return None


class Fp8ExpertMethod(ExpertMethod):
    """FP8 experts kept FP8 (a release's per-expert FP8 linears, read by its linear method: block-wise
    `weight_scale_inv`, compressed-tensors' per-channel `weight_scale`): each expert's e4m3 bytes and scales copied
    as shipped into the stacks, the scales in the layout above (gate's, then up's, as a merged linear lays them
    out). Only for a scheme the grouped GEMMs compute (`supported_scheme`); a layer's experts all take its first
    expert's scheme, so an expert scaled otherwise is refused by its scales' shapes."""

    def __init__(self, linear: Fp8LinearMethod):
        super().__init__(linear)
        fmt = supported_scheme(linear.scheme)
        assert fmt is not None, f"the FP8 grouped GEMMs do not compute {linear.scheme}"
        self.format = fmt

    def kernel_scales(self, layer: nn.Module) -> ExpertFp8Scales:
        gate_up, down = layer.get_parameter("gate_up_scale").data, layer.get_parameter("down_scale").data
        return ExpertFp8Scales(gate_up, down, self.format)  # checked with the weights (ExpertWeights.check)


class OnlineFp8ExpertMethod(ExpertMethod):
    """`--quantization fp8` on a layer of experts kept FP8: each expert's linears read as they are stored (the
    unquantized method), then, once every expert is in, quantized per output channel where they lie
    (`quantize_experts_per_channel`, as the dense linears' online method does at load), the stacks replaced by the
    e4m3 ones and their scales kept beside them. The one loader's way: no pass over a loaded model. A rank of a
    tensor-parallel replica scales its down rows over its own columns (finer than one process's rows)."""

    def process_after_loading(self, layer: nn.Module) -> None:
        gate_up, down = layer.get_parameter("gate_up").data, layer.get_parameter("down").data
        gate_up_w, down_w, scales = quantize_experts_per_channel(gate_up, down)
        del gate_up, down
        for name, tensor in (("gate_up", gate_up_w), ("down", down_w), ("gate_up_scale", scales.gate_up),
                             ("down_scale", scales.down)):  # fmt: skip
            setattr(layer, name, nn.Parameter(tensor, requires_grad=False))

    def kernel_scales(self, layer: nn.Module) -> ExpertFp8Scales:
        gate_up, down = layer.get_parameter("gate_up_scale").data, layer.get_parameter("down_scale").data
        return ExpertFp8Scales(gate_up, down, Fp8ExpertFormat())


# -- making and undoing the format ------------------------------------------------------------------------------


def quantize_experts_per_channel(
    gate_up: torch.Tensor, down: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, ExpertFp8Scales]:
    """`--quantization fp8` on stacked experts (gate_up [E, 2I, H], down [E, H, I], any float dtype, on their own
    device): each row quantized per output channel as the dense linears are (quant/fp8.py). One expert at a time:
    the temporaries are one expert's fp32 rows, the result half the input's bytes (bf16)."""
    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    device = gate_up.device
    gate_up_w = torch.empty(gate_up.shape, dtype=FP8_DTYPE, device=device)
    down_w = torch.empty(down.shape, dtype=FP8_DTYPE, device=device)
    gate_up_s = torch.empty(num_experts, two_inter, dtype=torch.float32, device=device)
    down_s = torch.empty(num_experts, hidden, dtype=torch.float32, device=device)
    for e in range(num_experts):
        gate_up_w[e], gate_up_s[e] = quantize_weight_per_channel(gate_up[e])
        down_w[e], down_s[e] = quantize_weight_per_channel(down[e])
    scales = ExpertFp8Scales(gate_up_s, down_s, Fp8ExpertFormat())
    scales.check(num_experts, hidden, inter)
    return gate_up_w, down_w, scales


def dequantize_gate_up(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8ExpertFormat) -> torch.Tensor:
    """One expert's gate_up [2I, H] e4m3 with its scales -> fp32 (each half on its own block grid)."""
    if fmt.block_shape is None:
        return weight.float() * scale[:, None]
    inter = weight.shape[0] // 2
    rows = scale.shape[0] // 2
    halves = (
        _dequantize_blocks(weight[:inter], scale[:rows], fmt.block_shape),
        _dequantize_blocks(weight[inter:], scale[rows:], fmt.block_shape),
    )
    return torch.cat(halves)


def dequantize_down(weight: torch.Tensor, scale: torch.Tensor, fmt: Fp8ExpertFormat) -> torch.Tensor:
    """One expert's down [H, I] e4m3 with its scales -> fp32."""
    if fmt.block_shape is None:
        return weight.float() * scale[:, None]
    return _dequantize_blocks(weight, scale, fmt.block_shape)


def _dequantize_blocks(
    weight: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int]
) -> torch.Tensor:
    return weight.float() * expand_block_scale(scale, block_shape, *weight.shape)
