"""FP8 linears kept as FP8 in a model: what the owned decoder multiplies with FP8 GEMMs. Owns `Fp8LinearModule`,
the module that takes a quantized `nn.Linear`'s place and holds its FP8 weight and scales.

  Fp8LinearModule     an `nn.Linear`'s stand-in: FP8 weight, fp32 scales (buffers, so `.to(device)` moves
                      them), the bias, and the method whose `apply` runs it; transformers' forward still runs
  Fp8Weight           one GEMM's FP8 weight as the owned decoder holds it: the method and its `Fp8Linear`
                      (q/k/v or gate/up stacked by fused_weights.fuse_fp8)
  quantize_linears    `--quantization fp8` on a model already in memory: each linear its config quantizes is
                      rounded to FP8 per output channel, kept as FP8 (`keep_fp8`) or dequantized back (CPU)
  keeps_fp8(device)   whether a model on `device` keeps FP8 weights (sm89+ CUDA) or runs them dequantized

A linear is quantized or not by its own declaration (the config's `scheme_for(name)`); nothing here names a
family.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

from .config import Fp8Config
from .fp8 import Fp8Linear
from .methods import Fp8LinearMethod, fp8_linear_method


class Fp8LinearModule(nn.Module):
    """A quantized linear: `forward(x)` is the method's FP8 GEMM (on the CPU, its emulation)."""

    weight: torch.Tensor  # float8_e4m3fn [N, K]
    weight_scale: torch.Tensor  # fp32, Fp8Linear's layout
    input_scale: torch.Tensor | None
    bias: nn.Parameter | None

    def __init__(self, method: Fp8LinearMethod, layer: Fp8Linear, bias: torch.Tensor | None):
        super().__init__()
        self.method = method
        self.scheme = layer.scheme
        self.register_buffer("weight", layer.weight)
        self.register_buffer("weight_scale", layer.weight_scale)
        self.register_buffer("input_scale", layer.input_scale)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def layer(self) -> Fp8Linear:
        return Fp8Linear(self.weight, self.weight_scale, self.scheme, self.input_scale)

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.method.apply(self.layer, x, self.bias)


@dataclass(frozen=True)
class Fp8Weight:
    """A GEMM's FP8 weight in the owned decoder: `apply(x, bias)` replaces `F.linear(x, weight, bias)`."""

    method: Fp8LinearMethod
    layer: Fp8Linear

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        return self.method.apply(self.layer, x, bias)


def keeps_fp8(device: torch.device) -> bool:
    """FP8 weights stay FP8 where FP8 tensor cores multiply them (sm89+); elsewhere they are dequantized."""
    if device.type != "cuda":
        return False
    from .kernels import has_fp8_tensor_cores

    return has_fp8_tensor_cores(device)


def keeps_fp8_experts(keep_fp8: bool, device: torch.device) -> bool:
    """A mixture of experts' FP8 experts stay FP8 with its linears on CUDA (the FP8 grouped GEMMs); on the CPU they
    run in the model dtype (the tests force them, the kernels then in Triton's interpreter)."""
    return keep_fp8 and device.type == "cuda"


def quantize_linears(
    model: nn.Module, quant: Fp8Config, keep_fp8: bool, stays_dense: Callable[[str], bool] = lambda name: False
) -> None:
    """`--quantization fp8` (`quant.is_serialized` False) on `model`, in place, on the device it is on: every
    `nn.Linear` the config quantizes becomes an `Fp8LinearModule` (`keep_fp8`) or takes the dequantized FP8
    weight (the emulation of weight rounding that runs on the CPU). `stays_dense`: linears left as they are (a
    mixture of experts' sparse MLPs, which the MoE kernels multiply in the model dtype)."""
    assert not quant.is_serialized, "a checkpoint's FP8 weights are loaded (models/quant_loader.py), not quantized"
    for name, module in list(model.named_modules()):
        method = fp8_linear_method(quant, name)  # None for the output head (it may be the embedding, tied)
        if not isinstance(module, nn.Linear) or method is None or stays_dense(name):
            continue
        layer = method.load({f"{name}.weight": module.weight.detach()}, name)
        if keep_fp8:
            replace_module(model, name, Fp8LinearModule(method, layer, _bias(module)))
        else:
            with torch.no_grad():
                module.weight.copy_(method.dequantize(layer, module.weight.dtype))


def replace_module(model: nn.Module, name: str, new: nn.Module) -> None:
    parent_name, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent_name) if parent_name else model, child, new)


def _bias(module: nn.Linear) -> torch.Tensor | None:
    return None if module.bias is None else module.bias.detach()
