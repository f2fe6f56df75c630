"""The expert-method protocol, beside the linear one (quant/protocol.py): how a layer of E routed experts' weights
are created, loaded and made ready for the grouped GEMMs, whatever their format. Owns the protocol (`ExpertMethod`),
the layer's sizes (`ExpertSizes`), the unquantized and the dequantized-at-load methods. The formats' own methods
live with their format (fp8.py `Fp8ExpertMethod`, mxfp4.py `Mxfp4ExpertMethod`); methods.py hands a layer its
method; layers/experts.py is the one loader that drives them, at every world size.

A layer of experts is two stacked projections, each expert's linear under one leading experts dim:
  gate_up  [E, 2I, H]  one expert's is a merged column linear (gate's I rows, then up's) over the hidden size
  down     [E, H, I]   one expert's is a row linear over the intermediate size
An expert method is a linear method (quant/protocol.py) applied to every expert, so a format's checks, scale
layouts and `ParamSplit`s are its linears' own, and a rank's slice of an expert (its I rows of gate and up, its I
columns of down) is mapped through the same splits (block-wise scales by whole blocks, refused where a rank cuts
one). The four verbs, for the layer:

  create_weights(layer, sizes, dtype, device)  each parameter the linear method creates for one expert's
                                               projection, stacked over E: `gate_up`/`down` (the linear's
                                               `weight`), `gate_up_scale`/`down_scale` (`weight_scale`), ...
  load_tensor(layer, name, tensor, what, part) one expert's checkpoint slice checked and converted (the linear
                                               method's); the copy into the expert's slice is
                                               quant.protocol.load_parameter's (`into`)
  process_after_loading(layer)                 what runs once every expert is in (none of today's formats)
  kernel_scales(layer)                         what the grouped GEMMs read beside the stacked matrices (None:
                                               the model dtype; FP8 experts' scales). The experts are applied by
                                               moe_forward's kernels (moe/forward.py), one launch for every
                                               expert, which choose their GEMMs by the weights' dtype and scales:
                                               a method does not multiply, it says what is multiplied

`checkpoint_tensor(source, prefix, name)` is how the method reads one expert's linear from the checkpoint (by slice,
as stored; or whole and dequantized, `DequantizedExperts`); `stacked_tensor(source, name)` how it reads a tensor
that stacks every expert (transformers' layout, gpt-oss's MXFP4 release).

Adding an expert format: one module with its method (a subclass of `ExpertMethod`, usually just its linear method)
and one line in methods.py's `_EXPERT_METHODS`, with its tests.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from ..checkpoint import Checkpoint, TensorSlice
from ..quant.base import QuantConfig
from ..quant.methods import dequantized_weight, linear_method
from ..quant.protocol import (
    UNQUANTIZED,
    LinearMethod,
    LinearSizes,
    WholeTensor,
    add_parameter,
    checkpoint_name,
    split_of,
    split_params,
)

GATE_UP, DOWN = "gate_up", "down"
# a stacked parameter's name in one expert's linear ("weight", "weight_scale")
LINEAR_NAME_ATTR = "cbq_linear_name"


@dataclass(frozen=True)
class ExpertSizes:
    """A layer of `num_experts` experts of hidden size `hidden`, each holding `inter` intermediate features here (the
    rank's: every expert's same slice)."""

    num_experts: int
    hidden: int
    inter: int

    def linear(self, projection: str) -> LinearSizes:
        """One expert's `projection` as a linear: gate_up two outputs of I rows over H, down H rows over I."""
        return (
            LinearSizes(self.hidden, (self.inter, self.inter))
            if projection == GATE_UP
            else LinearSizes(self.inter, (self.hidden,))
        )


def stacked_name(projection: str, linear_name: str) -> str:
    """The layer's name of a linear's parameter stacked over the experts: `weight` -> `gate_up`, `weight_scale` ->
    `gate_up_scale`, else `<projection>_<name>`."""
    if linear_name == "weight":
        return projection
    return f"{projection}_{linear_name.removeprefix('weight_')}"


def expert_params(layer: nn.Module, projection: str) -> list[tuple[str, nn.Parameter]]:
    """The stacked parameters of `projection` (layer name, parameter), the weight first."""
    return [(n, p) for n, p in split_params(layer) if n == projection or n.startswith(f"{projection}_")]


class ExpertMethod:
    """The protocol (module docstring); by default a linear method applied to each expert."""

    def __init__(self, linear: LinearMethod = UNQUANTIZED):
        self.linear = linear

    def create_weights(
        self, layer: nn.Module, sizes: ExpertSizes, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        for projection in (GATE_UP, DOWN):
            probe = nn.Module()  # one expert's projection, on meta: its parameters' shapes, dtypes and splits
            self.linear.create_weights(probe, sizes.linear(projection), dtype, torch.device("meta"))
            for name, param in split_params(probe):
                stacked = torch.empty(sizes.num_experts, *param.shape, dtype=param.dtype, device=device)
                setattr(
                    add_parameter(layer, stacked_name(projection, name), stacked, split_of(param)),
                    LINEAR_NAME_ATTR,
                    name,
                )

    def load_tensor(
        self, layer: nn.Module, name: str, tensor: torch.Tensor, what: str, part: tuple[int, int]
    ) -> torch.Tensor:
        return self.linear.load_tensor(
            layer, getattr(layer.get_parameter(name), LINEAR_NAME_ATTR), tensor, what, part
        )

    def process_after_loading(self, layer: nn.Module) -> None:
        """Nothing: the linear's own processing is not run per expert (the formats kept as experts need none; one
        that does, per-tensor scales or quantizing at load, overrides this)."""
        return None

    def kernel_scales(self, layer: nn.Module) -> Any | None:
        """What the grouped GEMMs read beside `gate_up` and `down` (fp8.py's `ExpertFp8Scales`), None: nothing."""
        return None

    # -- reading the checkpoint
    def checkpoint_tensor(
        self, source: Checkpoint, prefix: str, param: nn.Parameter
    ) -> tuple[TensorSlice, str]:
        """One expert's linear `prefix`'s tensor of `param` (one of the layer's stacked parameters), and its name."""
        name = f"{prefix}.{checkpoint_name(getattr(param, LINEAR_NAME_ATTR), param)}"
        return source.get_slice(name), name

    def stores_linear(self, source: Checkpoint, prefix: str) -> bool:
        """Whether the checkpoint holds linear `prefix` in this method's format."""
        return f"{prefix}.weight" in source

    def stacked_tensor(self, source: Checkpoint, name: str) -> TensorSlice | None:
        """Tensor `name` stacking every expert ([E, ...], as transformers' modules hold it), None where the
        checkpoint has none. Read as the unquantized linear's weight (an FP8 one is refused): the releases ship
        quantized experts one linear an expert (gpt-oss's MXFP4 excepted, mxfp4.py)."""
        return source.get_slice(name) if name in source else None


UNQUANTIZED_EXPERTS = ExpertMethod()


class DequantizedExperts(ExpertMethod):
    """A quantized checkpoint's experts run in the model dtype (the CPU, tensor parallelism, INT4, scales the FP8
    grouped GEMMs do not compute): each expert's linear read whole and dequantized (quant.methods'
    `dequantized_weight`, the linears' own), then the rank's rows or columns taken, so a rank's slice may cut a
    block of scales. A linear the config leaves unquantized is read as stored."""

    def __init__(self, quant: QuantConfig, dtype: torch.dtype):
        super().__init__()
        self.quant, self.dtype = quant, dtype

    def checkpoint_tensor(self, source, prefix, param):
        return WholeTensor(
            dequantized_weight(WholeTensors(source), self.quant, prefix, self.dtype)
        ), f"{prefix}.weight"

    def stores_linear(self, source, prefix):
        method = linear_method(self.quant, prefix)
        return super().stores_linear(source, prefix) or (
            method is not None and method.tensor_names(prefix)[0] in source
        )


class WholeTensors(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors read whole by name, for the linear methods' whole-linear readers."""

    def __init__(self, source: Checkpoint):
        self.source = source

    def __getitem__(self, name: str) -> torch.Tensor:
        if name not in self.source:
            raise KeyError(name)
        return self.source.get_slice(name)[...]

    def __contains__(self, name: object) -> bool:
        return isinstance(name, str) and name in self.source

    def __iter__(self) -> Iterator[str]:
        raise TypeError("a checkpoint read by slice is not listed")

    def __len__(self) -> int:
        raise TypeError("a checkpoint read by slice is not counted")
