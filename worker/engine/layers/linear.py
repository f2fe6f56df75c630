"""Tensor-parallel layers: each knows which part of the full weight it holds and loads only that part.

Owns each layer's shard of its weights (and biases). The arithmetic of the split lives in the
`*_shard` functions below, used by the loaders, by memory.py and by the tests, so all agree.

- ColumnParallelLinear: output features split; each rank computes its slice of y (optionally
  all-gathered). MergedColumnParallelLinear (gate/up) and QKVParallelLinear (q/k/v by head) are
  column-parallel layers over several checkpoint tensors, each rank holding matching slices of each.
- RowParallelLinear: input features split; partial products summed by an all-reduce; the bias is
  replicated and added once, after the sum.
- VocabParallelEmbedding: vocabulary rows split (padded to a multiple of the world size); a rank
  looks up the ids it holds, zeros the rest, and an all-reduce fills in the others.
- ParallelLMHead: the same vocabulary split; logits of each rank's rows are gathered on rank 0
  (which samples) and trimmed to the real vocabulary; the other ranks get None.

At world_size 1 every layer is a plain linear/embedding with no collective, so a model file written
with these layers does not change with the number of GPUs.

Quantization: a linear layer holds the method its config gave it (`quant/protocol.py`'s `LinearMethod`, from
`LinearMethods.method_for(prefix)`), which creates the layer's parameters, converts each checkpoint slice and
applies the GEMM; unquantized is F.linear. Every parameter says how it follows the weight's rows and columns
(`ParamSplit`: per-channel scales with their rows, block-wise scales by their blocks, per-tensor ones replicated),
so these layers read any format's slices with the same code (`load_parameter`), and call the method's
`process_after_loading` once every tensor of the layer is in.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ..checkpoint import RowBlock, SliceSource, TensorSlice
from ..parallel.group import ParallelState, all_gather, all_reduce
from ..parallel.memory import head_shard, shard_for
from ..quant.protocol import (
    UNQUANTIZED,
    LinearMethod,
    LinearSizes,
    check_entries,
    checkpoint_name,
    load_parameter,
    split_of,
    split_params,
)

# --- loading ----------------------------------------------------------------------------------------


def copy_into(param: torch.Tensor, loaded: torch.Tensor, what: str) -> None:
    if tuple(param.shape) != tuple(loaded.shape):
        raise ValueError(
            f"{what}: the checkpoint's slice {tuple(loaded.shape)} does not fit {tuple(param.shape)}"
        )
    param.copy_(loaded)


def check_dim(loaded: TensorSlice, dim: int, expected: int, what: str) -> None:
    shape = loaded.get_shape()
    if len(shape) <= dim or shape[dim] != expected:
        raise ValueError(f"{what}: checkpoint shape {shape}, expected {expected} along dim {dim}")


def _rows_of(fused: TensorSlice, param: torch.Tensor, start: int, stop: int, total: int, name: str) -> TensorSlice:
    """Rows [start, stop) of a fused weight as a tensor of their own, for parameter `param`: its own entries
    (a block-wise scale's blocks, a packed tensor's words, along whichever dim follows the rows), or the whole tensor
    where it does not follow the rows (a per-tensor scale)."""
    split = split_of(param)
    if split.output_dim is None:
        return fused
    entries = split.mapped(slice(start, stop), total, split.output_block, name.rpartition(".")[0], "rows")
    return RowBlock(fused, entries.start, entries.stop, name, split.output_dim)


# --- linear layers ----------------------------------------------------------------------------------


class _ParallelLinear(nn.Module):
    """A linear layer holding [output_size_per_rank, input_size_per_rank] of a bigger one, its parameters the
    method's (`sizes`: the rows of each logical output it stacks, its columns)."""

    bias: torch.Tensor | None
    input_size: int  # the whole weight's columns

    def __init__(
        self,
        state: ParallelState,
        sizes: LinearSizes,
        bias_size: int | None,
        dtype: torch.dtype | None,
        device: torch.device | None,
        method: LinearMethod | None,
    ):
        super().__init__()
        self.state = state
        self.sizes = sizes
        self.input_size_per_rank = sizes.input_size
        self.output_size_per_rank = sizes.output_size
        self.method = method or UNQUANTIZED
        dtype = dtype or torch.get_default_dtype()
        self.method.create_weights(self, sizes, dtype, device)
        bias = None
        if bias_size is not None:
            bias = nn.Parameter(torch.empty(bias_size, dtype=dtype, device=device), requires_grad=False)
        self.register_parameter("bias", bias)

    def _load_weights(
        self, source: SliceSource, prefix: str, total: int, rows: slice, cols: slice, shard_index: int = 0,
        fused: tuple[int, int, int] | None = None,
    ) -> None:  # fmt: skip
        """Every parameter the method created, from `{prefix}.<its checkpoint name>`: rows `rows` and columns `cols`
        of a weight [total, input_size] (logical output `shard_index`). `fused` (start, stop, fused_total): that
        output is rows [start, stop) of a checkpoint tensor holding several."""
        for name, param in split_params(self):
            what = f"{prefix}.{checkpoint_name(name, param)}"
            if split_of(param).optional and what not in source:  # type: ignore[operator]
                continue
            loaded = source.get_slice(what)
            check_entries(loaded, split_of(param), (total if fused is None else fused[2], self.input_size), what)
            if fused is not None:
                loaded = _rows_of(loaded, param, *fused, what)
            load_parameter(
                self.method, self, name, loaded, what, sizes=self.sizes, weight_shape=(total, self.input_size),
                rows=rows, cols=cols, shard_index=shard_index,
            )  # fmt: skip

    def finish_loading(self) -> None:
        """The method's work once every tensor is in (quantizing at load, dequantizing, fusing scales)."""
        self.method.process_after_loading(self)


class ColumnParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's rows (output features) split; `gather_output` all-gathers y."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        state: ParallelState,
        *,
        bias: bool = False,
        gather_output: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        method: LinearMethod | None = None,
        output_sizes_per_rank: Sequence[int] | None = None,  # for the merged subclasses, which split differently
    ):
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        if output_sizes_per_rank is None:
            rows = shard_for(output_size, state.rank, state.world_size, "output features")
            output_sizes_per_rank = [rows.stop - rows.start]
        sizes = LinearSizes(input_size, tuple(output_sizes_per_rank))
        bias_size = sizes.output_size if bias else None
        super().__init__(state, sizes, bias_size, dtype, device, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.method.apply(self, x, self.bias)
        return all_gather(self.state, y, dim=-1) if self.gather_output else y

    def _load_output(
        self, source: SliceSource, prefix: str, shard_id: int, total: int, rows: slice,
        fused: tuple[int, int, int] | None = None,
    ) -> None:  # fmt: skip
        """Logical output `shard_id` (`total` rows in the checkpoint; this rank holds `rows` of them) from
        `{prefix}`: the method's parameters, then the bias rows into their place."""
        self._load_weights(source, prefix, total, rows, slice(0, self.input_size), shard_id, fused)
        if self.bias is not None:
            bias = source.get_slice(f"{prefix}.bias")
            if fused is not None:
                bias = RowBlock(bias, fused[0], fused[1], f"{prefix}.bias")
            offset = sum(self.sizes.output_sizes[:shard_id])
            size = self.sizes.output_sizes[shard_id]
            copy_into(self.bias.data[offset : offset + size], bias[rows], f"{prefix}.bias")

    def load_from(self, source: SliceSource, prefix: str) -> None:
        """Load `{prefix}.weight` (and the method's other tensors, and `.bias`), reading only this rank's rows."""
        rows = shard_for(self.output_size, self.state.rank, self.state.world_size, f"{prefix}.weight")
        self._load_output(source, prefix, 0, self.output_size, rows)
        self.finish_loading()


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs of one input as one GEMM (gate and up): each rank holds its
    slice of each, stacked in order: [gate rows of this rank; up rows of this rank]."""

    def __init__(
        self,
        input_size: int,
        output_sizes: Sequence[int],
        state: ParallelState,
        *,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        method: LinearMethod | None = None,
    ):
        self.output_sizes = list(output_sizes)
        self.row_shards = [
            shard_for(size, state.rank, state.world_size, f"output {i} features")
            for i, size in enumerate(output_sizes)
        ]
        self.output_sizes_per_rank = [rows.stop - rows.start for rows in self.row_shards]
        super().__init__(
            input_size, sum(output_sizes), state, bias=bias, dtype=dtype, device=device,
            method=method, output_sizes_per_rank=self.output_sizes_per_rank,
        )  # fmt: skip

    def load_from(self, source: SliceSource, prefix: str) -> None:
        raise TypeError("a merged layer loads several tensors: call load_merged(source, prefixes)")

    def load_merged(self, source: SliceSource, prefixes: Sequence[str]) -> None:
        """Load each prefix p's (gate_proj, up_proj) tensors into its place."""
        assert len(prefixes) == len(self.output_sizes), f"{len(self.output_sizes)} prefixes, got {prefixes}"
        for shard_id, prefix in enumerate(prefixes):
            self._load_output(source, prefix, shard_id, self.output_sizes[shard_id], self.row_shards[shard_id])
        self.finish_loading()

    def load_fused(self, source: SliceSource, prefix: str) -> None:
        """Load `{prefix}`'s tensors that the checkpoint ships fused, its outputs' rows stacked in order (Phi-3's
        and GLM-4's gate_up_proj: gate rows, then up rows): each output's rows are read as a tensor of their own,
        so the rank reads only its slice of each."""
        offset = 0
        for shard_id, size in enumerate(self.output_sizes):
            fused = (offset, offset + size, self.output_size)
            self._load_output(source, prefix, shard_id, size, self.row_shards[shard_id], fused)
            offset += size
        self.finish_loading()


class QKVParallelLinear(ColumnParallelLinear):
    """q, k and v projections as one GEMM, split by attention head (`head_shard`): each rank holds
    [its q heads; its KV heads of k; its KV heads of v], with KV heads replicated when there are
    fewer of them than ranks."""

    SHARD_IDS = ("q", "k", "v")

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        state: ParallelState,
        *,
        bias: bool = False,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        method: LinearMethod | None = None,
    ):
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.heads = head_shard(num_heads, num_kv_heads, state.rank, state.world_size)
        self.q_size_per_rank = self.heads.num_q_heads * head_dim
        self.kv_size_per_rank = self.heads.num_kv_heads * head_dim
        self.output_sizes_per_rank = [self.q_size_per_rank, self.kv_size_per_rank, self.kv_size_per_rank]
        super().__init__(
            hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, state, bias=bias, dtype=dtype, device=device,
            method=method, output_sizes_per_rank=self.output_sizes_per_rank,
        )  # fmt: skip

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's q, k, v from the layer's output."""
        kv = self.kv_size_per_rank
        q, k, v = qkv.split([self.q_size_per_rank, kv, kv], dim=-1)
        return q, k, v

    def _rows(self, shard_id: str) -> tuple[int, slice]:
        """(rows of q_proj, k_proj or v_proj in the checkpoint, this rank's heads' rows of them)."""
        heads = self.heads.q_heads if shard_id == "q" else self.heads.kv_heads
        total_heads = self.num_heads if shard_id == "q" else self.num_kv_heads
        return total_heads * self.head_dim, slice(heads.start * self.head_dim, heads.stop * self.head_dim)

    def load_from(self, source: SliceSource, prefix: str) -> None:
        raise TypeError(
            "a QKV layer loads three tensors: call load_qkv(source, q_prefix, k_prefix, v_prefix)"
        )

    def load_qkv(self, source: SliceSource, q_prefix: str, k_prefix: str, v_prefix: str) -> None:
        """Load q/k/v's tensors (and `.bias`, as Qwen2 has) reading only this rank's heads."""
        for index, prefix in enumerate((q_prefix, k_prefix, v_prefix)):
            total, rows = self._rows(self.SHARD_IDS[index])
            self._load_output(source, prefix, index, total, rows)
        self.finish_loading()

    def load_fused_qkv(self, source: SliceSource, prefix: str) -> None:
        """Load `{prefix}`'s tensors that the checkpoint ships fused (Phi-3's qkv_proj: all q rows, then k, then v),
        reading only this rank's heads of each."""
        offset = 0
        for index, shard_id in enumerate(self.SHARD_IDS):
            total, rows = self._rows(shard_id)
            self._load_output(source, prefix, index, total, rows, (offset, offset + total, self.output_size))
            offset += total
        self.finish_loading()


class RowParallelLinear(_ParallelLinear):
    """y = x W^T + b with W's columns (input features) split: each rank multiplies its slice of x
    (the column-parallel layer before it left x split that way), an all-reduce sums the parts, and
    the replicated bias is added once, after the sum. `reduce_results=False` leaves the sum to the
    caller (e.g. to fuse it with others); the bias then goes on rank 0's part only."""

    def __init__(
        self,
        input_size: int,
        output_size: int,
        state: ParallelState,
        *,
        bias: bool = False,
        input_is_parallel: bool = True,
        reduce_results: bool = True,
        dtype: torch.dtype | None = None,
        device: torch.device | None = None,
        method: LinearMethod | None = None,
    ):
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.cols = shard_for(input_size, state.rank, state.world_size, "input features")
        bias_size = output_size if bias else None
        sizes = LinearSizes(self.cols.stop - self.cols.start, (output_size,))
        super().__init__(state, sizes, bias_size, dtype, device, method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x[..., self.cols]
        if not self.reduce_results:
            return self.method.apply(self, x, self.bias if self.state.is_first_rank else None)
        y = all_reduce(self.state, self.method.apply(self, x, None))
        return y if self.bias is None else y + self.bias

    def row_absmax(self, weight: torch.Tensor) -> torch.Tensor:
        """Each row's absmax over every rank's columns (this rank holds part of each row): what a method that
        quantizes per output channel at load needs for one process's scales (one all-gather of [N] floats)."""
        return all_gather(self.state, weight.abs().amax(dim=-1).float()[None], dim=0).amax(dim=0)

    def load_from(self, source: SliceSource, prefix: str) -> None:
        """Load `{prefix}`'s tensors (this rank's columns; a scale per row whole) and `.bias` (whole)."""
        self._load_weights(source, prefix, self.output_size, slice(0, self.output_size), self.cols)
        if self.bias is not None:
            bias = source.get_slice(f"{prefix}.bias")
            check_dim(bias, 0, self.output_size, f"{prefix}.bias")
            copy_into(self.bias.data, bias[:], f"{prefix}.bias")
        self.finish_loading()
