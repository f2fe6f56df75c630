"""The ops one owned-decoder forward runs (`LayerOps`) and the math each norm kind and activation means (torch
twins and the kernels' flags). Owns nothing. Split from decoder.py so that deterministic.py, which builds its own
batch-invariant LayerOps, and the decoder both read it without importing each other.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

from .families.spec import Activation, NormKind, QKNormSpan
from .kernels import decode_gemm
from .kernels import fused as fk
from .quant import small_step as fp8_step
from .quant.fp8 import Fp8Rows, takes_rows
from .quant.int4.linear import Int4Weight, int4_qkv_rope_write
from .quant.kernels import act_mul_per_token_quant
from .quant.linear import Fp8Weight


@dataclass(frozen=True)
class NormMath:
    """How the decoder computes one norm kind: `fold` turns a checkpoint norm weight into the weight the ops
    read (once, at load; None: as it is), `ref` is the torch op on that weight, `weight_fp32` the kernels' flag
    (the weight multiply in fp32, the normed value not rounded first)."""

    ref: Callable
    weight_fp32: bool
    fold: Callable[[torch.Tensor], torch.Tensor] | None = None
    centred: bool = False  # the row's mean subtracted first (a LayerNorm without bias): the kernels' flag too


NORM_MATH = {
    NormKind.RMS: NormMath(fk.rmsnorm_ref, weight_fp32=False),
    # Gemma's ((x * r) * (1 + w.float())).to(dtype) is the fp32-weight norm of the fp32 weight 1 + w, bit for bit
    NormKind.RMS_ONE_PLUS: NormMath(fk.rmsnorm_fp32_weight_ref, weight_fp32=True, fold=fk.fold_one_plus),
    NormKind.RMS_FP32_WEIGHT: NormMath(fk.rmsnorm_fp32_weight_ref, weight_fp32=True),
    NormKind.LAYER: NormMath(fk.layernorm_ref, weight_fp32=True, centred=True),
}
# What this file implements, as torch ops (the CPU path): NORMS read folded weights (`NormMath.fold`).
NORMS = {kind: math.ref for kind, math in NORM_MATH.items()}
ACTIVATIONS = {Activation.SILU: fk.silu_mul_ref, Activation.GELU_TANH: fk.gelu_tanh_mul_ref}
# The kernels' ACT flag of each activation.
ACT_CODES = {Activation.SILU: fk.ACT_SILU, Activation.GELU_TANH: fk.ACT_GELU_TANH}
QK_NORM_SPANS = (QKNormSpan.HEAD, QKNormSpan.FULL)


@dataclass(frozen=True)
class LayerOps:
    """The kernels one forward runs: which GEMM, which element-wise twins, launched with PDL or not."""

    # (x, residual, weight, eps, x_weight=, x_scale=) -> (norm(s), s), s = residual + x', x' = x post-normed by
    # x_weight, times x_scale (fused.add_rmsnorm_ref)
    add_norm: Callable
    linear: Callable  # (x, weight, bias) -> x @ weight^T + bias
    gate_up_act: Callable  # (x, fused [gate; up] weight, bias) -> act(x @ gate^T) * (x @ up^T)
    # (logits, divisor, scale, softcap) -> the final logits (in place on CUDA)
    logits_epilogue: Callable = fk.logits_epilogue_ref
    pdl: bool = False
    # the QKV GEMM computes rotary and writes the KV cache in its epilogue (models without q/k norms)
    qkv_rope_epilogue: bool = False
    qkv_rope_write: Callable = decode_gemm.decode_qkv_rope_write  # that GEMM
    # add_norm whose normed rows come out quantized per token (quant/fp8.py Fp8Rows), for a norm whose one consumer
    # is an FP8 linear that reads them (`rows_for`); None: add_norm everywhere
    add_norm_fp8: Callable | None = None
    # (x, fused [gate; up] weight, bias, scale_ub=) -> act·mul's rows quantized per token (Fp8Rows), for an FP8
    # down projection that reads them (`rows_for`); None: gate_up_act, and the down GEMM quantizes
    gate_up_act_fp8: Callable | None = None

    def add_norm_into(self, rows: dict | None) -> Callable:
        """The add+norm for a norm whose one consumer reads its rows as `rows` says (`rows_for`): quantized per token
        by the norm (`add_norm_fp8`), or `add_norm` where `rows` is None or this path has no such kernel."""
        if rows is None or self.add_norm_fp8 is None:
            return self.add_norm
        return partial(self.add_norm_fp8, **rows)

    def gate_up_act_into(self, rows: dict | None) -> Callable:
        """The gate/up GEMM and act·mul for a down projection that reads their rows as `rows` says (`rows_for`):
        quantized per token by act·mul (`gate_up_act_fp8`), or `gate_up_act` (the down GEMM quantizes, if at all)."""
        if rows is None or self.gate_up_act_fp8 is None:
            return self.gate_up_act
        return partial(self.gate_up_act_fp8, **rows)


def rows_for(weight) -> dict | None:
    """How the kernel before `weight`'s GEMM writes its rows when that GEMM is their one consumer: the arguments of
    `LayerOps.add_norm_fp8` or `gate_up_act_fp8` for an FP8 weight that reads per-token quantized rows, or None
    where it needs them as they are (not FP8, or a scheme that does not quantize per token: quant/fp8.py
    `takes_rows`)."""
    if isinstance(weight, Fp8Weight) and takes_rows(weight.layer):
        return {"scale_ub": weight.layer.scheme.activation_scale_ub}
    return None


def weight_linear(dense: Callable) -> Callable:
    """`dense` (F.linear) for a plain weight, the FP8 GEMM for an FP8 one (x a tensor, or Fp8Rows from the kernel
    before), the W4A16 GEMM for a packed INT4 one (on the CPU its twin): each linear's quantization is its own
    (fused_weights.Weight). The branch is on a Python type, so it costs no sync and graphs capture it."""

    def linear(x, weight, bias):
        return weight.apply(x, bias) if isinstance(weight, Fp8Weight | Int4Weight) else dense(x, weight, bias)

    return linear


def small_step_linear(pdl: bool) -> Callable:
    """decode_gemm's Triton GEMM for a plain weight, quant/small_step.py's for an FP8 one, kernels/w4a16.py's
    small-step launch for a packed INT4 one (each falls back to its large-step GEMM where its kernel does not tile
    the shape or, FP8, the scheme is block-wise)."""

    def linear(x, weight, bias):
        if isinstance(weight, Fp8Weight):
            return fp8_step.fp8_step_linear(x, weight.layer, bias, pdl=pdl)
        if isinstance(weight, Int4Weight):
            return weight.apply(x, bias, pdl=pdl)
        return decode_gemm.decode_linear(x, weight, bias, pdl=pdl)

    return linear


def small_step_gate_up_act(pdl: bool, act: int) -> Callable:
    """The gate/up GEMM with act·mul in its epilogue, for a plain, an FP8 or a packed INT4 weight (as
    `small_step_linear`)."""

    def gate_up_act(x, weight, bias):
        if isinstance(weight, Fp8Weight):
            return fp8_step.fp8_step_gate_up_act(x, weight.layer, bias, pdl=pdl, act=act)
        if isinstance(weight, Int4Weight):
            return weight.gate_up_act(x, bias, pdl=pdl, act=act)
        return decode_gemm.decode_gate_up_silu(x, weight, bias, pdl=pdl, act=act)

    return gate_up_act


def small_step_qkv_rope_write(x, weight, bias, *args, **kwargs) -> torch.Tensor:
    """The QKV GEMM with rotary and the KV write in its epilogue (`LayerOps.qkv_rope_write`'s signature), for a
    plain weight (decode_gemm), an FP8 one (quant/small_step.py) or a packed INT4 one (quant/int4/linear.py), as
    `small_step_linear` dispatches."""
    if isinstance(weight, Int4Weight):
        return int4_qkv_rope_write(x, weight.layer, bias, *args, **kwargs)
    if isinstance(weight, Fp8Weight):
        return fp8_step.fp8_step_qkv_rope_write(x, weight.layer, bias, *args, **kwargs)
    return decode_gemm.decode_qkv_rope_write(x, weight, bias, *args, **kwargs)


def gate_up_then_act(linear: Callable, act_mul: Callable) -> Callable:
    """The gate/up GEMM and act·mul as two launches (the large-step and torch paths)."""

    def gate_up_act(x, weight, bias):
        return act_mul(linear(x, weight, bias))

    return gate_up_act


def gate_up_then_act_fp8(linear: Callable, act: int) -> Callable:
    """The gate/up GEMM, then act·mul with its rows quantized per token in the same kernel (the large-step path of
    an FP8 model, whose down GEMM then reads e4m3 rows: `LayerOps.gate_up_act_fp8`)."""

    def gate_up_act(x, weight, bias, scale_ub: float | None = None) -> Fp8Rows:
        return act_mul_per_token_quant(linear(x, weight, bias), act, scale_ub)

    return gate_up_act


def layer_ops(
    use_triton: bool,
    small_step: bool,
    pdl: bool = True,
    norm: NormKind = NormKind.RMS,
    activation: Activation = Activation.SILU,
) -> LayerOps:
    """The torch ops (`norm`, `activation`), the Triton element-wise kernels with cuBLAS, or the small-step path
    (kernels/decode_gemm.py, and quant/small_step.py for FP8 weights; `pdl` False only where PDL cannot run, e.g.
    Triton's interpreter in the tests).
    The Triton paths read `norm` and `activation` as their kernels' flags (`NORM_MATH`, `ACT_CODES`)."""
    math, act = NORM_MATH[norm], ACT_CODES[activation]
    if small_step:
        return LayerOps(
            add_norm=partial(fk.add_rmsnorm, pdl=pdl, weight_fp32=math.weight_fp32, centred=math.centred),
            linear=small_step_linear(pdl),
            gate_up_act=small_step_gate_up_act(pdl, act),
            logits_epilogue=fk.logits_epilogue,
            pdl=pdl,
            qkv_rope_epilogue=True,
            qkv_rope_write=small_step_qkv_rope_write,
            add_norm_fp8=partial(
                fp8_step.fp8_add_rmsnorm, pdl=pdl, weight_fp32=math.weight_fp32, centred=math.centred
            ),
        )
    linear = weight_linear(F.linear)
    if use_triton:
        return LayerOps(
            add_norm=partial(fk.add_rmsnorm, weight_fp32=math.weight_fp32, centred=math.centred),
            linear=linear,
            gate_up_act=gate_up_then_act(linear, partial(fk.act_mul, act=act)),
            logits_epilogue=fk.logits_epilogue,
            add_norm_fp8=partial(fp8_step.fp8_add_rmsnorm, weight_fp32=math.weight_fp32, centred=math.centred),
            gate_up_act_fp8=gate_up_then_act_fp8(linear, act),
        )
    return LayerOps(
        add_norm=partial(fk.add_rmsnorm_ref, norm=NORMS[norm]),
        linear=linear,
        gate_up_act=gate_up_then_act(linear, ACTIVATIONS[activation]),
    )
