"""The one linear-method protocol: how a linear layer's weights are created, loaded and multiplied, whatever
their format. Owns the protocol (`LinearMethod`), the description of how each parameter follows the layer's
split (`ParamSplit`), the layer's sizes (`LinearSizes`), the unquantized method, and the one loader that copies
a checkpoint slice into a parameter (`load_parameter`).

A method object answers four things for the linears of its format (one object per format and scheme; it holds
no tensors: the layer does):

  create_weights(layer, sizes, dtype, device)  registers the layer's parameters, each tagged with its
                                               `ParamSplit` (how it follows the weight's rows and columns)
  load_tensor(layer, name, tensor)             one checkpoint slice checked and converted into what the
                                               parameter holds (dtype, scale layouts); the copy is
                                               `load_parameter`'s, the same for every format
  process_after_loading(layer)                 what runs once every slice is in: quantizing at load, fusing
                                               per-shard scales, dequantizing where FP8 is not kept
  apply(layer, x, bias)                        the GEMM

A parameter's `ParamSplit` says which of its dims follows the weight's output rows and which its input columns,
and how many weight rows or columns one entry covers: 1 for the weight itself and per-channel scales, the block
for block-wise scales ([ceil(N / bn), ceil(K / bk)]), the pack factor for packed weights (INT4's qweight [N, K / 8])
and the group for per-group scales ([N, K / group]). So a rank's slice of a parameter is its slice of the weight
mapped through the split, refused in one line where the rank's rows or columns cut an entry. A per-tensor value
is replicated (no split dim), or one per logical output of a merged layer (`per_shard`: q, k and v's own scales).

The parallel layers (layers/linear.py) take their method from a config's `method_for(prefix)` (quant/methods.py)
and call `load_parameter` for each parameter and each checkpoint tensor, at every world size. A layer of experts
(moe/protocol.py) applies a linear method to each of its experts and loads each expert's slices with the same
`load_parameter` (`into`: the expert's part of a stacked parameter).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import TensorSlice, WholeTensor, read_view

FP8_DTYPES = (torch.float8_e4m3fn, torch.float8_e5m2)
SPLIT_ATTR = "cbq_split"  # the attribute a parameter's ParamSplit is kept under


class LinearLoadError(ValueError):
    """A checkpoint tensor does not fit the parameter it is loaded into; the message names the tensor."""


@dataclass(frozen=True)
class LinearSizes:
    """What a linear layer holds of its weight [N, K]: `input_size` columns and, for each logical output it
    stacks (q, k, v; gate, up; one for a plain linear), that output's rows on this rank."""

    input_size: int
    output_sizes: tuple[int, ...]

    @property
    def output_size(self) -> int:
        return sum(self.output_sizes)


@dataclass(frozen=True)
class ParamSplit:
    """How one parameter of a linear follows the weight's rows (output) and columns (input)."""

    output_dim: int | None = 0  # the parameter's dim along the weight's rows (None: not split by rows)
    input_dim: int | None = 1  # its dim along the weight's columns (None: not split by columns)
    output_block: int = 1  # weight rows one entry covers (a block-wise scale: bn)
    input_block: int = (
        1  # weight columns one entry covers (block scale: bk; packed INT4: 8; group scales: group)
    )
    per_shard: bool = False  # one entry per logical output of the layer (q/k/v's own per-tensor scales)
    checkpoint_name: str = ""  # its name under the linear's prefix in a checkpoint ("": the parameter's)
    what: str = "entries"  # what its blocks are, for the one-line refusal of a split that cuts one
    optional: bool = False  # a checkpoint may leave it out (GPTQ's g_idx without act-order): then not read

    def entries(self, size: int, block: int) -> int:
        return -(-size // block)

    def mapped(self, part: slice, total: int, block: int, prefix: str, axis: str) -> slice:
        """The entries holding weight rows/columns `part` of `total`; a part that starts or ends inside an entry is
        refused (another rank holds the rest of that entry)."""
        if block == 1:
            return part
        if part.start % block or (part.stop % block and part.stop != total):
            raise LinearLoadError(
                f"tensor parallelism: {prefix}'s {axis} [{part.start}, {part.stop}) of {total} cut its {self.what} "
                f"of {block}: a rank's slice must start and end on a block (choose a tensor-parallel size that "
                f"splits the heads and the intermediate size into multiples of {block})"
            )
        return slice(part.start // block, self.entries(part.stop, block))


def add_parameter(layer: nn.Module, name: str, tensor: torch.Tensor, split: ParamSplit) -> nn.Parameter:
    """Registers `tensor` as the layer's parameter `name`, tagged with how it splits."""
    param = nn.Parameter(tensor, requires_grad=False)
    setattr(param, SPLIT_ATTR, split)
    layer.register_parameter(name, param)
    return param


def split_of(param: torch.Tensor) -> ParamSplit:
    return getattr(param, SPLIT_ATTR, None) or ParamSplit()


def split_params(layer: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """The parameters a method created (those with a split; a layer's bias is the layer's own)."""
    return [(n, p) for n, p in layer.named_parameters(recurse=False) if hasattr(p, SPLIT_ATTR)]


class LinearMethod:
    """The protocol every format implements (see the module docstring). The defaults: nothing to convert,
    nothing to do after loading."""

    def create_weights(
        self, layer: nn.Module, sizes: LinearSizes, dtype: torch.dtype, device: torch.device | None
    ) -> None:
        raise NotImplementedError

    def load_tensor(
        self, layer: nn.Module, name: str, tensor: torch.Tensor, what: str, part: tuple[int, int]
    ) -> torch.Tensor:
        """Checkpoint slice `tensor` of parameter `name` (`what`: its checkpoint name) as the parameter holds it;
        `part`: the [rows, columns] of the weight the slice belongs to (what its scales' shapes follow)."""
        return tensor

    def process_after_loading(self, layer: nn.Module) -> None:
        return None

    def apply(self, layer: Any, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError

    def tensor_names(self, prefix: str) -> list[str]:
        """The checkpoint tensors of linear `prefix` the method reads (the first: its weight, whose presence says
        the linear is stored in this format), from the parameters it creates."""
        probe = nn.Module()
        self.create_weights(probe, LinearSizes(1, (1,)), torch.float32, torch.device("meta"))
        return [f"{prefix}.{checkpoint_name(name, param)}" for name, param in split_params(probe)]


class UnquantizedLinearMethod(LinearMethod):
    """Weights in the model dtype, F.linear."""

    def create_weights(self, layer, sizes, dtype, device) -> None:
        weight = torch.empty(sizes.output_size, sizes.input_size, dtype=dtype, device=device)
        add_parameter(layer, "weight", weight, ParamSplit())

    def load_tensor(self, layer, name, tensor, what, part):
        if tensor.dtype in FP8_DTYPES:  # bare FP8 values are not a weight without their scales
            raise LinearLoadError(
                f"{what} is FP8 ({tensor.dtype}), but the checkpoint's quantization_config leaves it unquantized"
            )
        return tensor

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


def check_entries(loaded: TensorSlice, split: ParamSplit, weight_shape: tuple[int, int], what: str) -> None:
    """Checkpoint tensor `loaded` is the whole weight's [N, K] (`weight_shape`) along each dim the parameter splits
    by (its entries' count there), else a rank's slice of a tensor of other sizes would pass unnoticed."""
    shape = loaded.get_shape()
    for dim, size, block in (
        (split.output_dim, weight_shape[0], split.output_block),
        (split.input_dim, weight_shape[1], split.input_block),
    ):
        if dim is not None and dim < len(shape) and shape[dim] != split.entries(size, block):
            raise LinearLoadError(
                f"{what}: checkpoint shape {shape}, expected {split.entries(size, block)} along dim {dim}"
            )


class ConvertsSlices(Protocol):
    """What `load_parameter` asks of a method: a linear's (`LinearMethod`) or a layer of experts' (moe/protocol.py)."""

    def load_tensor(
        self, layer: nn.Module, name: str, tensor: torch.Tensor, what: str, part: tuple[int, int]
    ) -> torch.Tensor: ...


def load_parameter(
    method: ConvertsSlices,
    layer: nn.Module,
    name: str,
    loaded: TensorSlice,
    what: str,
    *,
    sizes: LinearSizes,
    weight_shape: tuple[int, int],
    rows: slice,
    cols: slice,
    shard_index: int = 0,
    into: torch.Tensor | None = None,
) -> None:
    """Copies the part of checkpoint tensor `loaded` (named `what`) that this layer holds into its parameter
    `name`. `weight_shape`: the checkpoint weight's [N, K] that `loaded` belongs to (one logical output's);
    `rows`, `cols`: the rows and columns of that weight this layer holds; `shard_index`: which of the layer's
    logical outputs they are (their rows go after the earlier outputs'). `into`: the part of the parameter that
    `loaded` belongs in, where that is not the whole (one expert's slice of a layer of experts' stacked parameter,
    split as one expert's linear is)."""
    param = layer.get_parameter(name)
    split = split_of(param)
    prefix = what.rpartition(".")[0]
    index: list[Any] = [slice(None)] * len(loaded.get_shape())
    dst = param.data if into is None else into
    if split.output_dim is not None:
        src_rows = split.mapped(rows, weight_shape[0], split.output_block, prefix, "rows")
        before = sum(split.entries(size, split.output_block) for size in sizes.output_sizes[:shard_index])
        dst = dst.narrow(
            split.output_dim, before, split.entries(sizes.output_sizes[shard_index], split.output_block)
        )
        if split.output_dim < len(index):
            index[split.output_dim] = src_rows
    elif split.per_shard:
        dst = dst[shard_index]
    if split.input_dim is not None:
        src_cols = split.mapped(cols, weight_shape[1], split.input_block, prefix, "columns")
        if split.input_dim < len(index):
            index[split.input_dim] = src_cols
    # the slice is copied straight from the file's mapping into the parameter (no copy of its own in between)
    with read_view(loaded, tuple(index) if index else ...) as tensor:
        tensor = method.load_tensor(
            layer, name, tensor, what, (rows.stop - rows.start, cols.stop - cols.start)
        )
        fits = tuple(tensor.shape) in (tuple(dst.shape), (*dst.shape, 1)) or (
            dst.dim() == 0 and tensor.numel() == 1
        )
        if not fits:
            raise LinearLoadError(
                f"{what}: the checkpoint's slice {tuple(tensor.shape)} does not fit {tuple(dst.shape)}"
            )
        dst.copy_(tensor.reshape(dst.shape))


def checkpoint_name(name: str, param: torch.Tensor) -> str:
    return split_of(param).checkpoint_name or name


def load_whole_linear(
    method: LinearMethod,
    tensors: Mapping[str, torch.Tensor] | Any,
    prefix: str,
    weight_shape: Sequence[int],
    dtype: torch.dtype,
    missing: type[Exception] = LinearLoadError,
    device: torch.device | None = None,
) -> nn.Module:
    """Linear `prefix` whole (a world of one) from `tensors` (by checkpoint name) through `method`: its
    parameters created at `weight_shape` [N, K] on `device` (the CPU: None), each loaded, then processed. What the
    one-process readers of a single linear use (an expert's linear, `--quantization fp8` on a model in memory, which
    passes its weight's device so that the quantized linear stays there)."""
    n, k = weight_shape
    layer = nn.Module()
    sizes = LinearSizes(k, (n,))
    method.create_weights(layer, sizes, dtype, device)
    for name, param in split_params(layer):
        what = f"{prefix}.{checkpoint_name(name, param)}"
        if what not in tensors and split_of(param).optional:
            continue
        if what not in tensors:
            raise missing(f"the checkpoint has no {what}, which its quantization_config needs")
        load_parameter(
            method, layer, name, WholeTensor(tensors[what]), what, sizes=sizes, weight_shape=(n, k),
            rows=slice(0, n), cols=slice(0, k),
        )  # fmt: skip
    method.process_after_loading(layer)
    return layer
