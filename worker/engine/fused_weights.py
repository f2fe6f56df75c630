"""Load-time weight fusion for the owned decoder. Owns nothing after building: the HF model keeps
owning every parameter.

`layer_weights` reads one transformers decoder layer through its family's `LayerSpec` (families/spec.py): each
`LinearSpec` whose parts are several linears reading the same input (q/k/v, gate/up) becomes one weight (and
bias), so each is one GEMM. `fuse_rows` does not copy: the fused tensor is allocated once and each linear's
parameter is rebound to a view of its rows. So the transformers model keeps working (tests use it as the
reference, `model.generate` still runs) and memory holds every weight once. Fusing a model a second time (a
second engine on the same model) finds the views adjacent and allocates nothing.

A linear the loader kept in FP8 (`quant.linear.Fp8LinearModule`, sm89+ CUDA) gives an `Fp8Weight`: its FP8 rows
and scales stacked together (`Fp8Linear.concat`), which the decoder multiplies with the FP8 GEMM. A linear kept as
packed INT4 (`quant.int4.linear.Int4LinearModule`) gives an `Int4Weight` the same way (`Int4Linear.concat`),
multiplied by the W4A16 GEMM.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch import nn

from .families.spec import LayerSpec, LinearSpec, Quant
from .quant.fp8 import Fp8Linear
from .quant.int4 import Int4Linear, dequantize
from .quant.int4.linear import Int4LinearModule, Int4Weight
from .quant.linear import Fp8LinearModule, Fp8Weight

# A GEMM's weight: a plain tensor (F.linear), FP8 with its scales (`Fp8Weight.apply`: the FP8 GEMM), or packed INT4
# with its group scales (`Int4Weight.apply`: the W4A16 GEMM).
Weight = torch.Tensor | Fp8Weight | Int4Weight
QUANTIZED_WEIGHTS = (Fp8Weight, Int4Weight)


@dataclass(frozen=True)
class LayerWeights:
    attn_in_norm: torch.Tensor | None  # before attention (None: OLMo 2 has none)
    attn_out_norm: torch.Tensor | None  # on attention's output, before the residual add (Gemma)
    mlp_in_norm: torch.Tensor | None
    mlp_out_norm: torch.Tensor | None
    qkv_weight: Weight  # [(H + 2 * KVH) * D, hidden]: rows of q, then k, then v
    qkv_bias: torch.Tensor | None  # Qwen2 (and Llama with attention_bias)
    o_weight: Weight
    o_bias: torch.Tensor | None
    gate_up_weight: Weight | None  # [2 * I, hidden]: gate rows, then up rows (None: a sparse layer)
    gate_up_bias: torch.Tensor | None
    down_weight: Weight | None
    down_bias: torch.Tensor | None
    q_norm: torch.Tensor | None  # per-head RMSNorm weights [D] (Qwen3)
    k_norm: torch.Tensor | None

    @property
    def is_quantized(self) -> bool:
        """Whether any of its GEMMs is a quantized linear's (`Fp8Weight`, `Int4Weight`)."""
        return any(isinstance(w, QUANTIZED_WEIGHTS) for w in (self.qkv_weight, self.o_weight, self.gate_up_weight, self.down_weight))


def fuse_rows(linears: list[nn.Linear]) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(weight, bias) of the linears stacked along the output dim; the linears then view into them."""
    weight = _fuse_param(linears, "weight")
    has_bias = [lin.bias is not None for lin in linears]
    assert all(has_bias) or not any(has_bias), "fused linears must all have a bias or none"
    return weight, (_fuse_param(linears, "bias") if has_bias[0] else None)


def fuse_fp8(modules: list[Fp8LinearModule]) -> Fp8Weight:
    """FP8 linears' rows stacked into one FP8 GEMM, their scales with them (`Fp8Linear.concat`). As `fuse_rows`,
    each module's weight is then a view of the fused weight's rows, so memory holds each FP8 weight once."""
    if len(modules) == 1:
        return Fp8Weight(modules[0].method, modules[0].layer)
    fused = Fp8Linear.concat([m.layer for m in modules])
    weights = [m.weight for m in modules]
    if _are_adjacent_rows(weights):  # fused before (a second engine on the model): view the same bytes
        shape = tuple(fused.weight.shape)
        fused = replace(fused, weight=weights[0].as_strided(shape, fused.weight.stride()))
    else:
        offset = 0
        for module in modules:
            module.weight = fused.weight[offset : offset + module.out_features]
            offset += module.out_features
    return Fp8Weight(modules[0].method, fused)


def fuse_int4(modules: list[Int4LinearModule]) -> Int4Weight | torch.Tensor:
    """Packed INT4 linears' rows stacked into one W4A16 GEMM (`Int4Linear.concat`: words, scales and zeros). Each
    module's buffers then view the fused ones' rows, so memory holds each weight once (as `fuse_fp8`).
    Act-order linears whose column permutations differ cannot share one gather of x: their fused weight is then
    dequantized to the scales' dtype (a plain GEMM, and a second copy of those weights in memory). GPTQ computes the
    order from the layer input's statistics, which q/k/v (and gate/up) share, so releases normally agree."""
    if len(modules) == 1:
        return Int4Weight(modules[0].layer)
    parts = [m.layer for m in modules]
    orders = [p.perm for p in parts]
    if any(o is not None for o in orders) and not all(
        o is not None and torch.equal(o, orders[0]) for o in orders  # type: ignore[arg-type]
    ):
        return torch.cat([dequantize(p, p.scales.dtype) for p in parts])
    zeros = [p.zeros for p in parts if p.zeros is not None]
    tensors = [[p.qweight for p in parts], [p.scales for p in parts], *([zeros] if zeros else [])]
    if all(_are_adjacent_rows(t) for t in tensors):  # fused before (a second engine on the model): view the same bytes
        qweight, scales, *fused_zeros = (_adjacent_rows_view(t) for t in tensors)
        first = parts[0]
        return Int4Weight(Int4Linear(qweight, scales, fused_zeros[0] if zeros else None, first.group_size, first.perm))
    fused = Int4Linear.concat(parts)
    offset = 0
    for module in modules:
        rows = slice(offset, offset + module.out_features)
        module.qweight, module.scales = fused.qweight[rows], fused.scales[rows]
        if fused.zeros is not None:
            module.zeros = fused.zeros[rows]
        offset += module.out_features
    return Int4Weight(fused)


def _fuse_param(linears: list[nn.Linear] | list[Fp8LinearModule] | list[Int4LinearModule], name: str) -> torch.Tensor:
    parts = [getattr(lin, name) for lin in linears]
    rows = sum(p.shape[0] for p in parts)
    shape = (rows, *parts[0].shape[1:])
    if _are_adjacent_rows(parts):
        return parts[0].detach().as_strided(shape, torch.empty(shape, device="meta").stride())
    fused = torch.cat([p.detach() for p in parts], dim=0)
    offset = 0
    for lin, part in zip(linears, parts, strict=True):
        n = part.shape[0]
        setattr(lin, name, nn.Parameter(fused[offset : offset + n], requires_grad=False))
        offset += n
    return fused


def _adjacent_rows_view(parts: list[torch.Tensor]) -> torch.Tensor:
    """Tensors that `_are_adjacent_rows` as one tensor of their rows, viewing the same bytes."""
    shape = (sum(p.shape[0] for p in parts), *parts[0].shape[1:])
    return parts[0].as_strided(shape, torch.empty(shape, device="meta").stride())


def _are_adjacent_rows(parts: list[torch.Tensor]) -> bool:
    first = parts[0]
    offset = first.storage_offset()
    for p in parts:
        same = (
            p.is_contiguous()
            and p.dtype == first.dtype
            and p.shape[1:] == first.shape[1:]
            and p.untyped_storage().data_ptr() == first.untyped_storage().data_ptr()
            and p.storage_offset() == offset
        )
        if not same:
            return False
        offset += p.numel()
    return True


def submodule(root: Any, path: str) -> Any:
    """`root.a.b` for path "a.b"."""
    for name in path.split("."):
        root = getattr(root, name)
    return root


QUANTIZED_MODULES = {Quant.FP8: Fp8LinearModule, Quant.INT4: Int4LinearModule}


def linear_quant(layer: Any, spec: LinearSpec) -> LinearSpec:
    """`spec` with the quantization its linears were loaded with (the loader made them `Fp8LinearModule`s, or
    `Int4LinearModule`s)."""
    modules = [submodule(layer, part) for part in spec.parts]
    for quant, module_type in QUANTIZED_MODULES.items():
        kept = [isinstance(m, module_type) for m in modules]
        assert all(kept) or not any(kept), f"fused linears {spec.parts} must all be {quant.value} or none"
        if kept[0]:
            return replace(spec, quant=quant)
    return replace(spec, quant=Quant.NONE)


def linear_weights(layer: Any, spec: LinearSpec) -> tuple[Weight, torch.Tensor | None]:
    """The (weight, bias) of one GEMM as `spec` declares it: its parts' rows stacked (fused at load); FP8
    weights with their scales (`fuse_fp8`), INT4 with theirs (`fuse_int4`), plain ones as views (`fuse_rows`)."""
    linears = [submodule(layer, part) for part in spec.parts]
    if spec.quant in (Quant.FP8, Quant.INT4):
        has_bias = [lin.bias is not None for lin in linears]
        assert all(has_bias) or not any(has_bias), "fused linears must all have a bias or none"
        bias = None if not has_bias[0] else linears[0].bias if len(linears) == 1 else _fuse_param(linears, "bias")
        return (fuse_fp8(linears) if spec.quant == Quant.FP8 else fuse_int4(linears)), bias
    assert spec.quant == Quant.NONE, f"quantization {spec.quant} has no weight loader"
    if len(linears) == 1:
        return linears[0].weight, linears[0].bias
    return fuse_rows(linears)


def _norm_weight(layer: Any, path: str | None, optional: bool = False) -> torch.Tensor | None:
    """The norm's weight at `path`; None where there is none (no path, or an `optional` one the layer lacks)."""
    if path is None:
        return None
    try:
        return submodule(layer, path).weight
    except AttributeError:
        if optional:
            return None
        raise


NORM_FIELDS = ("attn_in_norm", "attn_out_norm", "mlp_in_norm", "mlp_out_norm", "q_norm", "k_norm")


def fold_norms(weights: LayerWeights, fold: Callable[[torch.Tensor], torch.Tensor] | None) -> LayerWeights:
    """`weights` with every norm weight passed through `fold` (Gemma's 1 + w, kept as new fp32 tensors: the HF
    model's parameters are not touched); None: unchanged."""
    if fold is None:
        return weights
    folded: dict[str, Any] = {}
    for name in NORM_FIELDS:
        weight = getattr(weights, name)
        folded[name] = None if weight is None else fold(weight)
    return replace(weights, **folded)


def layer_weights(layer: Any, spec: LayerSpec, dense_mlp: bool = True) -> LayerWeights:
    """Fused weights of one transformers decoder layer, read as its family's `spec` says (each linear with its
    quantization). `dense_mlp` False: the layer's MLP is sparse (`moe_layer_weights` reads it) and the dense
    MLP's weights are None."""
    qkv_weight, qkv_bias = linear_weights(layer, linear_quant(layer, spec.qkv))
    o_weight, o_bias = linear_weights(layer, linear_quant(layer, spec.o))
    gate_up_weight = gate_up_bias = down_weight = down_bias = None
    if dense_mlp:
        gate_up_weight, gate_up_bias = linear_weights(layer, linear_quant(layer, spec.gate_up))
        down_weight, down_bias = linear_weights(layer, linear_quant(layer, spec.down))
    return LayerWeights(
        attn_in_norm=_norm_weight(layer, spec.attn_in_norm),
        attn_out_norm=_norm_weight(layer, spec.attn_out_norm),
        mlp_in_norm=_norm_weight(layer, spec.mlp_in_norm),
        mlp_out_norm=_norm_weight(layer, spec.mlp_out_norm),
        qkv_weight=qkv_weight,
        qkv_bias=qkv_bias,
        o_weight=o_weight,
        o_bias=o_bias,
        gate_up_weight=gate_up_weight,
        gate_up_bias=gate_up_bias,
        down_weight=down_weight,
        down_bias=down_bias,
        q_norm=_norm_weight(layer, spec.q_norm, optional=spec.qk_norm_optional),
        k_norm=_norm_weight(layer, spec.k_norm, optional=spec.qk_norm_optional),
    )
