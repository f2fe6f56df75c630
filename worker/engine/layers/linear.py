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

Quantization: a linear layer holds a `linear_method` that creates its weights and applies the GEMM
(`apply(layer, x, bias)`); `UnquantizedLinearMethod` is F.linear. A quantized method registers its
own parameters (e.g. FP8 weights and per-output-channel scales); the loaders shard every parameter
along the layer's split dimension (dim 0 for column layers; dim 1 of 2-D and none of 1-D parameters
for row layers), so per-channel scales follow their rows. Block-wise scales would need the method to
say how its scale grid maps to rows: not built yet.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from ..checkpoint import RowBlock, SliceSource, TensorSlice
from ..parallel.group import ParallelState, all_gather, all_reduce
from ..parallel.memory import head_shard, shard_for

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


# --- linear layers ----------------------------------------------------------------------------------


class LinearMethod(Protocol):
    """How a linear layer's weights are stored and multiplied (one object per format)."""

    def create_weights(
        self,
        layer: nn.Module,
        input_size: int,
        output_size: int,
        dtype: torch.dtype,
        device: torch.device | None,
    ) -> None: ...

    def apply(self, layer: nn.Module, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor: ...


class UnquantizedLinearMethod:
    """Weights in the model dtype, F.linear."""

    def create_weights(self, layer, input_size, output_size, dtype, device) -> None:
        weight = torch.empty(output_size, input_size, dtype=dtype, device=device)
        layer.register_parameter("weight", nn.Parameter(weight, requires_grad=False))

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight, bias)


UNQUANTIZED = UnquantizedLinearMethod()


class _ParallelLinear(nn.Module):
    """A linear layer holding [output_size_per_rank, input_size_per_rank] of a bigger one."""

    bias: torch.Tensor | None

    def __init__(
        self,
        state: ParallelState,
        input_size_per_rank: int,
        output_size_per_rank: int,
        bias_size: int | None,
        dtype: torch.dtype | None,
        device: torch.device | None,
        linear_method: LinearMethod | None,
    ):
        super().__init__()
        self.state = state
        self.input_size_per_rank = input_size_per_rank
        self.output_size_per_rank = output_size_per_rank
        self.linear_method = linear_method or UNQUANTIZED
        dtype = dtype or torch.get_default_dtype()
        self.linear_method.create_weights(self, input_size_per_rank, output_size_per_rank, dtype, device)
        bias = None
        if bias_size is not None:
            bias = nn.Parameter(torch.empty(bias_size, dtype=dtype, device=device), requires_grad=False)
        self.register_parameter("bias", bias)

    def _params_to_load(self, prefix: str) -> list[tuple[str, nn.Parameter]]:
        """(checkpoint name, parameter) of every parameter the layer holds, weight first."""
        return [(f"{prefix}.{name}", param) for name, param in self.named_parameters(recurse=False)]


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
        linear_method: LinearMethod | None = None,
        output_size_per_rank: int | None = None,  # for the merged subclasses, which split differently
    ):
        self.input_size = input_size
        self.output_size = output_size
        self.gather_output = gather_output
        if output_size_per_rank is None:
            rows = shard_for(output_size, state.rank, state.world_size, "output features")
            output_size_per_rank = rows.stop - rows.start
        bias_size = output_size_per_rank if bias else None
        super().__init__(state, input_size, output_size_per_rank, bias_size, dtype, device, linear_method)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.linear_method.apply(self, x, self.bias)
        return all_gather(self.state, y, dim=-1) if self.gather_output else y

    def weight_loader(self, param: torch.Tensor, loaded: TensorSlice, what: str = "weight") -> None:
        """Copy this rank's rows of the full checkpoint tensor `loaded` into `param`."""
        check_dim(loaded, 0, self.output_size, what)
        rows = shard_for(self.output_size, self.state.rank, self.state.world_size, what)
        copy_into(param.data, loaded[rows], what)

    def load_from(self, source: SliceSource, prefix: str) -> None:
        """Load `{prefix}.weight` (and `.bias`) from the checkpoint, reading only this rank's rows."""
        for name, param in self._params_to_load(prefix):
            self.weight_loader(param, source.get_slice(name), name)


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
        linear_method: LinearMethod | None = None,
    ):
        self.output_sizes = list(output_sizes)
        self.row_shards = [
            shard_for(size, state.rank, state.world_size, f"output {i} features")
            for i, size in enumerate(output_sizes)
        ]
        self.output_sizes_per_rank = [rows.stop - rows.start for rows in self.row_shards]
        super().__init__(
            input_size, sum(output_sizes), state, bias=bias, dtype=dtype, device=device,
            linear_method=linear_method, output_size_per_rank=sum(self.output_sizes_per_rank),
        )  # fmt: skip

    def weight_loader(
        self, param: torch.Tensor, loaded: TensorSlice, what: str = "weight", shard_id: int = 0
    ) -> None:
        """Copy this rank's rows of output `shard_id` (0: gate, 1: up) into their place in `param`."""
        check_dim(loaded, 0, self.output_sizes[shard_id], what)
        offset = sum(self.output_sizes_per_rank[:shard_id])
        size = self.output_sizes_per_rank[shard_id]
        copy_into(param.data[offset : offset + size], loaded[self.row_shards[shard_id]], what)

    def load_from(self, source: SliceSource, prefix: str) -> None:
        raise TypeError("a merged layer loads several tensors: call load_merged(source, prefixes)")

    def load_merged(self, source: SliceSource, prefixes: Sequence[str]) -> None:
        """Load `{p}.weight` (and `.bias`) for each prefix p (gate_proj, up_proj) into its place."""
        assert len(prefixes) == len(self.output_sizes), f"{len(self.output_sizes)} prefixes, got {prefixes}"
        for shard_id, prefix in enumerate(prefixes):
            for name, param in self._params_to_load(prefix):
                self.weight_loader(param, source.get_slice(name), name, shard_id)

    def load_fused(self, source: SliceSource, prefix: str) -> None:
        """Load `{prefix}.weight` (and `.bias`) that the checkpoint ships fused, its outputs' rows stacked in order
        (Phi-3's and GLM-4's gate_up_proj: gate rows, then up rows): each output's rows are read as a tensor of
        their own, so the rank reads only its slice of each."""
        for name, param in self._params_to_load(prefix):
            fused, offset = source.get_slice(name), 0
            check_dim(fused, 0, self.output_size, name)
            for shard_id, size in enumerate(self.output_sizes):
                self.weight_loader(param, RowBlock(fused, offset, offset + size, name), name, shard_id)
                offset += size


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
        linear_method: LinearMethod | None = None,
    ):
        self.head_dim = head_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.heads = head_shard(num_heads, num_kv_heads, state.rank, state.world_size)
        self.q_size_per_rank = self.heads.num_q_heads * head_dim
        self.kv_size_per_rank = self.heads.num_kv_heads * head_dim
        super().__init__(
            hidden_size, (num_heads + 2 * num_kv_heads) * head_dim, state, bias=bias, dtype=dtype, device=device,
            linear_method=linear_method, output_size_per_rank=self.q_size_per_rank + 2 * self.kv_size_per_rank,
        )  # fmt: skip

    def split(self, qkv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's q, k, v from the layer's output."""
        kv = self.kv_size_per_rank
        q, k, v = qkv.split([self.q_size_per_rank, kv, kv], dim=-1)
        return q, k, v

    def weight_loader(
        self, param: torch.Tensor, loaded: TensorSlice, what: str = "weight", shard_id: str = "q"
    ) -> None:
        """Copy this rank's heads of q_proj, k_proj or v_proj (`shard_id`) into their place in `param`."""
        heads = self.heads.q_heads if shard_id == "q" else self.heads.kv_heads
        total_heads = self.num_heads if shard_id == "q" else self.num_kv_heads
        check_dim(loaded, 0, total_heads * self.head_dim, what)
        offset = {"q": 0, "k": self.q_size_per_rank, "v": self.q_size_per_rank + self.kv_size_per_rank}[
            shard_id
        ]
        size = (heads.stop - heads.start) * self.head_dim
        rows = slice(heads.start * self.head_dim, heads.stop * self.head_dim)
        copy_into(param.data[offset : offset + size], loaded[rows], what)

    def load_from(self, source: SliceSource, prefix: str) -> None:
        raise TypeError(
            "a QKV layer loads three tensors: call load_qkv(source, q_prefix, k_prefix, v_prefix)"
        )

    def load_qkv(self, source: SliceSource, q_prefix: str, k_prefix: str, v_prefix: str) -> None:
        """Load q/k/v `.weight` (and `.bias`, as Qwen2 has) reading only this rank's heads."""
        for shard_id, prefix in zip(self.SHARD_IDS, (q_prefix, k_prefix, v_prefix), strict=True):
            for name, param in self._params_to_load(prefix):
                self.weight_loader(param, source.get_slice(name), name, shard_id)

    def load_fused_qkv(self, source: SliceSource, prefix: str) -> None:
        """Load `{prefix}.weight` (and `.bias`) that the checkpoint ships fused (Phi-3's qkv_proj: all q rows, then
        k, then v), reading only this rank's heads of each."""
        q_rows, kv_rows = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        blocks = {"q": (0, q_rows), "k": (q_rows, q_rows + kv_rows), "v": (q_rows + kv_rows, q_rows + 2 * kv_rows)}
        for name, param in self._params_to_load(prefix):
            fused = source.get_slice(name)
            check_dim(fused, 0, self.output_size, name)
            for shard_id in self.SHARD_IDS:
                self.weight_loader(param, RowBlock(fused, *blocks[shard_id], name), name, shard_id)


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
        linear_method: LinearMethod | None = None,
    ):
        self.input_size = input_size
        self.output_size = output_size
        self.input_is_parallel = input_is_parallel
        self.reduce_results = reduce_results
        self.cols = shard_for(input_size, state.rank, state.world_size, "input features")
        bias_size = output_size if bias else None
        super().__init__(
            state, self.cols.stop - self.cols.start, output_size, bias_size, dtype, device, linear_method
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.input_is_parallel:
            x = x[..., self.cols]
        if not self.reduce_results:
            return self.linear_method.apply(self, x, self.bias if self.state.is_first_rank else None)
        y = all_reduce(self.state, self.linear_method.apply(self, x, None))
        return y if self.bias is None else y + self.bias

    def weight_loader(self, param: torch.Tensor, loaded: TensorSlice, what: str = "weight") -> None:
        """2-D parameters: this rank's columns; 1-D (bias): the whole tensor, replicated."""
        if param.dim() == 1:
            check_dim(loaded, 0, self.output_size, what)
            copy_into(param.data, loaded[:], what)
            return
        check_dim(loaded, 1, self.input_size, what)
        copy_into(param.data, loaded[:, self.cols], what)

    def load_from(self, source: SliceSource, prefix: str) -> None:
        """Load `{prefix}.weight` (this rank's columns) and `.bias` (whole)."""
        for name, param in self._params_to_load(prefix):
            self.weight_loader(param, source.get_slice(name), name)
