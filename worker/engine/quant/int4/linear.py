"""INT4 weight-only linears kept packed in a model, and the GEMM that runs them. Owns `Int4LinearModule`, the module
that takes an `nn.Linear`'s place and holds its packed weight.

  int4_linear         y = x @ W^T (+ bias) for an `Int4Linear`: x gathered by the act-order permutation, then the
                      W4A16 Triton GEMM (kernels/w4a16.py) on CUDA, or for steps of many rows the weight dequantized
                      by its kernel and cuBLAS (`w4a16.large_step_kernel` decides); the twin (dequantize + F.linear)
                      elsewhere and where the kernels do not take the shape
  int4_gate_up_act    the fused gate/up GEMM with act·mul in the small-step kernel's epilogue (decoder small steps)
  int4_qkv_rope_write the fused QKV GEMM with rotary and the KV-cache write in its epilogue (decoder small steps)
  w4a16_twin          that twin: the torch reference the kernels are tested against, and the CPU's path
  Int4LinearModule    an `nn.Linear`'s stand-in: qweight, scales, zeros, perm as buffers (`.to(device)` moves
                      them), the bias; its forward is `int4_linear`, so transformers' forward still runs
  Int4Weight          one GEMM's packed weight as the owned decoder holds it (q/k/v or gate/up stacked by
                      fused_weights.fuse_int4): `apply(x, bias)` replaces F.linear
  keeps_int4          whether a checkpoint's INT4 linears stay packed on a device (CUDA bf16/fp16) or are dequantized
  quantize_linears    round-to-nearest INT4 of a model already in memory (`bench engine --precision int4`): each
                      linear but the output head becomes an `Int4LinearModule`
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ...kernels import fused as fk
from ...kernels import w4a16
from .packed import Int4Linear, dequantize, quantize_rtn


def w4a16_twin(x: torch.Tensor, layer: Int4Linear, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The weight dequantized to x's dtype (columns back in the input's order), then F.linear."""
    return F.linear(x, dequantize(layer, x.dtype), bias)


def int4_linear(
    x: torch.Tensor, layer: Int4Linear, bias: torch.Tensor | None = None, *, pdl: bool = False
) -> torch.Tensor:
    """x [M, K] @ W^T (+ bias) in x's dtype. `pdl`: the small-step launch joins the PDL chain (sm90+ only)."""
    config = w4a16.launch_config(x.shape[0], layer.group_size, x.dtype)
    if config is None or not w4a16.usable(x.device, x.dtype):
        return w4a16_twin(x, layer, bias)
    if layer.perm is not None:  # stored column j holds input feature perm[j]
        x = x.index_select(1, layer.perm)
    large = x.shape[0] > w4a16.MAX_TOKENS
    if large and not w4a16.large_step_kernel(x.shape[0], layer.out_features, layer.in_features):
        weight = w4a16.dequantize_weight(layer.qweight, layer.scales, layer.zeros, layer.group_size, x.dtype)
        return F.linear(x, weight, bias)
    return w4a16.w4a16_gemm(
        x.contiguous(), layer.qweight, layer.scales, layer.zeros, layer.group_size, bias, pdl=pdl and not large
    )


def int4_gate_up_act(
    x: torch.Tensor, layer: Int4Linear, bias: torch.Tensor | None = None, *, pdl: bool = False, act: int = 0
) -> torch.Tensor:
    """act(x @ gate^T) * (x @ up^T) [M, I] for a fused [gate; up] INT4 weight ([2I, K]; `act` fused.ACT_*), on a
    small step in one W4A16 launch with act·mul in its epilogue; elsewhere `int4_linear`, then fused.act_mul. For
    the decoder's small-step path (CUDA, or Triton's interpreter in the tests)."""
    small = x.shape[0] <= w4a16.MAX_TOKENS and w4a16.usable(x.device, x.dtype)
    if not small or w4a16.launch_config(x.shape[0], layer.group_size, x.dtype) is None:
        return fk.act_mul(int4_linear(x, layer, bias, pdl=pdl), pdl=pdl, act=act)
    if layer.perm is not None:
        x = x.index_select(1, layer.perm)
    return w4a16.w4a16_gemm(
        x.contiguous(), layer.qweight, layer.scales, layer.zeros, layer.group_size, bias, pdl=pdl, gated_act=act
    )


def int4_qkv_rope_write(x, layer: Int4Linear, bias, positions, cos_table, sin_table, num_heads, num_kv_heads,
                        k_cache, v_cache, slot_mapping, *, pdl: bool = False, kv_scale=(1.0, 1.0)) -> torch.Tensor:
    """The QKV projection of a fused INT4 q/k/v weight with rotary and the KV write (decode_gemm.decode_qkv_rope_write's
    contract): one W4A16 launch with that epilogue on a small step whose shape it tiles, elsewhere `int4_linear`,
    then fused.qkv_rope_write. For the decoder's small-step path (CUDA, or Triton's interpreter in the tests)."""
    head_dim = cos_table.shape[-1]
    fused = w4a16.usable(x.device, x.dtype) and w4a16.rope_launch_fits(
        num_heads, num_kv_heads, head_dim, x.shape[0], layer.group_size, x.dtype
    )
    if not fused:
        return fk.qkv_rope_write(
            int4_linear(x, layer, bias, pdl=pdl), positions, cos_table, sin_table, None, None, 0.0, num_heads,
            num_kv_heads, k_cache, v_cache, slot_mapping, pdl=pdl, kv_scale=kv_scale,
        )  # fmt: skip
    if layer.perm is not None:
        x = x.index_select(1, layer.perm)
    return w4a16.w4a16_qkv_rope_write(
        x.contiguous(), layer.qweight, layer.scales, layer.zeros, layer.group_size, bias, positions, cos_table,
        sin_table, num_heads, num_kv_heads, k_cache, v_cache, slot_mapping, pdl=pdl, kv_scale=kv_scale,
    )  # fmt: skip


class Int4LinearModule(nn.Module):
    """A linear kept as packed INT4: `forward(x)` is `int4_linear` (on the CPU, the twin)."""

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    perm: torch.Tensor | None
    bias: nn.Parameter | None

    def __init__(self, layer: Int4Linear, bias: torch.Tensor | None):
        super().__init__()
        self.group_size = layer.group_size
        self.register_buffer("qweight", layer.qweight)
        self.register_buffer("scales", layer.scales)
        self.register_buffer("zeros", layer.zeros)
        self.register_buffer("perm", layer.perm)
        self.bias = None if bias is None else nn.Parameter(bias, requires_grad=False)

    @property
    def layer(self) -> Int4Linear:
        return Int4Linear(self.qweight, self.scales, self.zeros, self.group_size, self.perm)

    @property
    def in_features(self) -> int:
        return self.qweight.shape[1] * w4a16.PACK

    @property
    def out_features(self) -> int:
        return self.qweight.shape[0]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        y = int4_linear(x.reshape(-1, shape[-1]), self.layer, self.bias)
        return y.reshape(*shape[:-1], y.shape[-1])


@dataclass(frozen=True)
class Int4Weight:
    """A GEMM's packed INT4 weight in the owned decoder: `apply(x, bias, pdl=)` replaces `F.linear(x, weight, bias)`."""

    layer: Int4Linear

    def apply(self, x: torch.Tensor, bias: torch.Tensor | None, pdl: bool = False) -> torch.Tensor:
        return int4_linear(x, self.layer, bias, pdl=pdl)

    def gate_up_act(self, x: torch.Tensor, bias: torch.Tensor | None, pdl: bool = False, act: int = 0) -> torch.Tensor:
        """For a fused [gate; up] weight: act(x @ gate^T) * (x @ up^T) (`int4_gate_up_act`)."""
        return int4_gate_up_act(x, self.layer, bias, pdl=pdl, act=act)


PACKED_ENV = "CBQ_INT4_PACKED"  # "1": keep an INT4 checkpoint packed on CUDA (the W4A16 GEMMs)


def keeps_int4(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether an INT4 checkpoint's linears stay packed (the W4A16 GEMMs) rather than dequantized at load
    (models/quant_loader.py). Opt-in (`CBQ_INT4_PACKED=1`) where the kernels run (CUDA, bf16/fp16): on an H100 on
    2026-12-06 the untuned kernels ran W1 of the Llama-3-8B shape at 0.60x bf16 (2,717 vs 4,525 out tok/s,
    `run_gpu.sh w1int4`), so the dequantized weights are the faster default until they are tuned."""
    return os.environ.get(PACKED_ENV) == "1" and w4a16.usable(device, dtype)


def quantize_linears(
    model: nn.Module,
    group_size: int = 128,
    symmetric: bool = True,
    stays_dense: Callable[[str], bool] = lambda name: False,
) -> int:
    """Every `nn.Linear` of `model` but the output head (`lm_head`, which may be the tied embedding) and those
    `stays_dense` names, rounded to INT4 (`quantize_rtn`) and replaced in place by an `Int4LinearModule` on the
    linear's device. Returns how many were replaced."""
    replaced = 0
    output = getattr(model, "get_output_embeddings", lambda: None)()
    for name, module in list(model.named_modules()):
        if not isinstance(module, nn.Linear) or module is output or stays_dense(name):
            continue
        weight = module.weight.detach()
        if weight.shape[1] % group_size:
            continue  # a linear whose input does not tile by the group stays dense
        layer = quantize_rtn(weight, group_size, symmetric)
        bias = None if module.bias is None else module.bias.detach()
        parent_name, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent_name) if parent_name else model, child, Int4LinearModule(layer, bias))
        replaced += 1
    return replaced
