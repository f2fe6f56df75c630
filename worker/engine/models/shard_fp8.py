"""FP8 linears on a tensor-parallel shard (issue 27): each rank's quantized linears hold their slice of the weight
with the scales of that slice, equal to the matching rows/blocks of one process's. Owns nothing after loading.

An FP8 checkpoint (`Fp8ShardSource`): the parallel layers read `<linear>.weight` by slice as for any checkpoint;
for a quantized linear the slice comes back dequantized (w_fp8 * scale, exactly one process's values), or with
`keep_fp8` its FP8 slice and scales are kept and `keep_fp8_linears` swaps in `Fp8LinearModule`s, layer by layer:
  per-channel  a column-parallel rank's rows keep their rows' scales; a row-parallel rank (o, down) holds whole
               rows' worth of scales (every scale: a row's scale covers all its columns, on every rank)
  per-tensor   the one scale, replicated (q/k/v with different scales become per-channel when fused, as in one
               process: fused_weights / `Fp8Linear.concat`)
  block-wise   the rank's [128, 128] blocks: its slice must start and end on block boundaries, refused in one
               line where the shard boundary cuts a block (e.g. 64-dim KV heads split between ranks)
  input_scale  a static per-tensor activation scale, replicated

`--quantization fp8` (`quantize_shard`): per output channel, the scale is the row's absmax / 448. A column-parallel
rank holds whole rows, so its own absmax is one process's. A row-parallel rank holds part of each row: its own
absmax would give another scale (a finer one: other FP8 values than one process's, and greedy output that
drifts from it), so the ranks take the largest of their row absmaxes (one all-gather of [N] floats per linear, at load) and every rank quantizes its
columns with the whole row's scale, exactly one process's weights.

Not one process's bits: a row-parallel linear's dynamic per-token activation scale (`ActivationScale.TOKEN`:
per-channel and `--quantization fp8`) is taken over the rank's slice of the input, as vLLM does (at least as
fine as one process's, at no collective per GEMM). Per-token-group activations (block-wise: groups of 128 inside
a rank's aligned columns) and static ones are one process's.

Mixtures of experts: every linear under a sparse MLP stays in the model dtype (`stays_dense`), as in one process
(models/quant_loader.py): cbq's MoE kernels multiply plain weights. The experts are read by layers/experts.py from the
inner checkpoint, each expert's FP8 weight dequantized whole and then sliced (its blocks need not align with the
rank's columns); a shared expert and the router read by slice, dequantized.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..checkpoint import Checkpoint, TensorSlice
from ..parallel.group import ParallelState, all_gather
from ..quant.config import Fp8Config, WeightScale
from ..quant.fp8 import Fp8Linear, quantize_weight_per_channel
from ..quant.linear import Fp8LinearModule, replace_module
from ..quant.methods import Fp8LinearMethod, fp8_linear_method
from .errors import ModelLoadError


class Fp8ShardSource:
    """A checkpoint whose quantized linears' weights read, by slice, dequantized to fp32 (the layers cast them).
    With `keep_fp8`, each slice's `Fp8Linear` is kept in `kept[module]`, in the order read (a fused q/k/v
    checkpoint's q, k and v rows of one tensor: three pieces), and the layers get the bare FP8 values, a
    placeholder that `keep_fp8_linears` replaces before anything runs. `stays_dense`: modules read dequantized
    even with `keep_fp8` (a mixture of experts' sparse MLPs)."""

    def __init__(
        self, inner: Checkpoint, quant: Fp8Config, keep_fp8: bool, stays_dense: Callable[[str], bool] = lambda _: False
    ):
        self.inner, self.quant, self.keep_fp8, self.stays_dense = inner, quant, keep_fp8, stays_dense
        self.kept: dict[str, list[Fp8Linear]] = {}
        self.methods: dict[str, Fp8LinearMethod] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.inner

    def get_slice(self, name: str) -> TensorSlice:
        module = name.removesuffix(".weight")
        method = fp8_linear_method(self.quant, module) if name.endswith(".weight") else None
        if method is None or f"{module}.{method.weight_scale_name}" not in self.inner:
            weight = self.inner.get_slice(name)
            if _is_fp8(weight):
                raise ModelLoadError(
                    f"tensor parallelism: the checkpoint has {name} in FP8 but no scale cbq reads"
                )
            return weight
        self.methods[module] = method
        return _Fp8WeightSlice(self, module, method)


class _Fp8WeightSlice:
    """`<module>.weight` of an FP8 checkpoint read by slice: the FP8 values and the scales of those rows/columns."""

    def __init__(self, source: Fp8ShardSource, module: str, method: Fp8LinearMethod):
        self.source, self.module, self.method = source, module, method
        self.weight = source.inner.get_slice(f"{module}.weight")

    def get_shape(self) -> list[int]:
        return self.weight.get_shape()

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = (index + (slice(None),))[:2] if isinstance(index, tuple) else (index, slice(None))
        n, k = self.get_shape()
        rows, cols = _contiguous(rows, n, self.module), _contiguous(cols, k, self.module)
        inner, prefix, scheme = self.source.inner, self.module, self.method.scheme
        scale = inner.get_slice(f"{prefix}.{self.method.weight_scale_name}")
        if scheme.weight is WeightScale.CHANNEL:
            scale_part = scale[rows]  # [N] or [N, 1]: the rows' scales; a row's covers all its columns
        elif scheme.weight is WeightScale.BLOCK:
            assert scheme.block_shape is not None
            bn, bk = scheme.block_shape
            _check_blocks(prefix, "rows", rows, n, bn)
            _check_blocks(prefix, "columns", cols, k, bk)
            scale_part = scale[rows.start // bn : -(-rows.stop // bn), cols.start // bk : -(-cols.stop // bk)]
        else:
            scale_part = scale[:] if scale.get_shape() else scale[...]
        tensors = {
            f"{prefix}.weight": self.weight[rows, cols],
            f"{prefix}.{self.method.weight_scale_name}": scale_part,
        }
        if f"{prefix}.input_scale" in inner:
            input_scale = inner.get_slice(f"{prefix}.input_scale")
            tensors[f"{prefix}.input_scale"] = input_scale[:] if input_scale.get_shape() else input_scale[...]
        # checks the slice's scale shapes as one process's load does
        layer = self.method.load(tensors, prefix)
        if self.source.keep_fp8 and not self.source.stays_dense(prefix):  # dropped for an Fp8LinearModule
            self.source.kept.setdefault(prefix, []).append(layer)
            return layer.weight
        return self.method.dequantize(layer, torch.float32)


def _contiguous(index: Any, size: int, module: str) -> slice:
    if not isinstance(index, slice) or index.step not in (None, 1):
        raise TypeError(f"{module}.weight: an FP8 weight is read by contiguous slices, got {index!r}")
    start, stop, _ = index.indices(size)
    return slice(start, max(start, stop))


def _check_blocks(module: str, what: str, part: slice, size: int, block: int) -> None:
    if part.start % block or (part.stop % block and part.stop != size):
        raise ModelLoadError(
            f"tensor parallelism: {module}'s {what} [{part.start}, {part.stop}) of {size} cut its block-wise FP8 "
            f"blocks of {block}: a rank's slice must start and end on a block (choose a tensor-parallel size "
            f"that splits the heads and the intermediate size into multiples of {block})"
        )


def _is_fp8(weight: TensorSlice) -> bool:
    get_dtype = getattr(weight, "get_dtype", None)  # safetensors' slices say their dtype before any read
    return get_dtype is not None and str(get_dtype()).startswith("F8")


def keep_fp8_linears(model: nn.Module, source: Fp8ShardSource) -> None:
    """Each quantized linear read since the last call becomes an `Fp8LinearModule` holding the rank's FP8 slice
    and its scales (the placeholder weight the layers loaded is dropped with the module). Run after each layer."""
    for module_name, pieces in list(source.kept.items()):
        del source.kept[module_name]
        layer = pieces[0] if len(pieces) == 1 else Fp8Linear.concat(pieces)
        linear = model.get_submodule(module_name)
        assert isinstance(linear, nn.Linear), f"{module_name} is read as a linear"
        bias = None if linear.bias is None else linear.bias.detach()
        layer = layer.to(linear.weight.device)
        replace_module(model, module_name, Fp8LinearModule(source.methods[module_name], layer, bias))


def quantize_shard(
    model: nn.Module,
    quant: Fp8Config,
    state: ParallelState,
    row_parallel: frozenset[str],
    keep_fp8: bool,
    stays_dense: Callable[[str], bool] = lambda _: False,
) -> None:
    """`--quantization fp8` on a rank's shard, in place: each linear the config quantizes rounded per output
    channel with one process's scales (`row_parallel`: the linears holding part of each row, whose absmax is the
    largest over the ranks), kept as `Fp8LinearModule` (`keep_fp8`) or dequantized back into its weight.
    `stays_dense`: linears left as they are (a mixture of experts' sparse MLPs, as quant/linear.quantize_linears)."""
    assert not quant.is_serialized, "a checkpoint's FP8 weights are read by Fp8ShardSource"
    for name, module in list(model.named_modules()):
        method = fp8_linear_method(quant, name)  # None for the output head
        if not isinstance(module, nn.Linear) or method is None or stays_dense(name):
            continue
        weight = module.weight.detach()
        absmax = None
        if name in row_parallel:
            absmax = all_gather(state, weight.abs().amax(dim=-1).float()[None], dim=0).amax(dim=0)
        w_fp8, scale = quantize_weight_per_channel(weight, absmax)
        layer = Fp8Linear(w_fp8, scale, method.scheme)
        if keep_fp8:
            bias = None if module.bias is None else module.bias.detach()
            replace_module(model, name, Fp8LinearModule(method, layer, bias))
        else:
            with torch.no_grad():
                module.weight.copy_(method.dequantize(layer, module.weight.dtype))
