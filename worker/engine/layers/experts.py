"""One rank's slice of a sparse layer's experts (tensor-parallel experts), read from any checkpoint layout.

Owns nothing after loading: returns the tensors, in the shard model's own (transformers') parameter layout, for
shard_model.py to bind. Each rank holds every expert's slice of the intermediate dimension: the rows of gate and
up (and of their biases) for its features, the columns of down for them. The router is replicated, so every rank
routes alike; the decoder's one all-reduce after the MLP sums the ranks' partial down outputs. A down bias
(gpt-oss) is summed in that all-reduce too, so rank 0 holds it and the others hold zeros: it is added once.

Layouts read (`layer_prefix` e.g. "model.layers.3"; the checkpoint's MLP is `mlp` or Mixtral's `block_sparse_moe`):
- stacked, the kernels' layout (transformers' Qwen-MoE and Mixtral modules, the presets): `experts.gate_up_proj`
  [E, 2I, H] ([gate; up] rows) and `experts.down_proj` [E, H, I];
- per-expert linears (the Qwen-MoE and Mixtral releases): `experts.{e}.gate_proj/up_proj/down_proj` or
  `experts.{e}.w1/w3/w2`, stacked here into the layout above;
- gpt-oss stacked (transformers' GptOssExperts): `experts.gate_up_proj` [E, H, 2I] with gate and up columns
  interleaved (g0, u0, g1, u1, ...: a rank's features are one contiguous run of columns), `down_proj` [E, I, H],
  and their biases;
- gpt-oss released, MXFP4 (`experts.gate_up_proj_blocks/_scales`, `down_proj_blocks/_scales`, rows [out, in]):
  the rank's rows of gate/up, and the 32-value groups of down's input that cover its columns, dequantized
  (mxfp4.py) one expert at a time on the rank's device, straight into transformers' gpt-oss layout. This is cbq's
  one reader of MXFP4 checkpoints: the one-process loader reads the release as the one rank of a world of one.
- per-expert FP8 linears (Qwen3-*-FP8's block-wise `weight` + `weight_scale_inv`, GLM-4.5-Air-FP8's per-channel
  compressed-tensors `weight_scale`), given the checkpoint's `quant`: each expert's linear dequantized to the model
  dtype (quant.methods.dequantized_weight, the linears' own dequantization) before its rows or columns are taken.
  Under tensor parallelism the experts run so, in the model dtype, twice the bytes of the release's. In one process
  on CUDA the one-process loader keeps them FP8 instead (`read_fp8_experts`: every expert whole, its e4m3 bytes and
  scales stacked as they are, for the FP8 grouped GEMMs, moe/triton_fp8.py).
- per-expert INT4 linears (GPTQ's `qweight`/`qzeros`/`scales`, AWQ GEMM's, compressed-tensors' `weight_packed`...:
  quant/int4/), given the checkpoint's `quant`: dequantized to the model dtype alike, one expert's linear at a time.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

import torch

from ..checkpoint import Checkpoint
from ..families.spec import MoeMlpSpec
from ..moe.fp8 import Fp8ExpertFormat, stack_expert_linears
from ..moe.mxfp4 import VALUES_PER_GROUP, dequantize_mxfp4
from ..moe.spec import MoeSpec
from ..moe.weights import ExpertWeights
from ..parallel.group import ParallelState
from ..parallel.memory import shard_for
from ..quant.base import QuantConfig
from ..quant.config import Fp8Config
from ..quant.fp8 import FP8_DTYPE, Fp8Linear
from ..quant.methods import Fp8LinearMethod, dequantized_weight, linear_method

# The MLP's name in checkpoints (Mixtral's releases keep `block_sparse_moe`, which transformers renames `mlp`), and
# the names of the per-expert linears (gate, up, down).
_MLP_NAMES = ("mlp", "block_sparse_moe")
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def load_expert_shard(
    source: Checkpoint,
    layer_prefix: str,
    moe: MoeMlpSpec,
    spec: MoeSpec,
    state: ParallelState,
    quant: QuantConfig | None = None,
    **kw: Any,
) -> dict[str, torch.Tensor]:
    """The shard model's parameters of one sparse layer's router and experts (full names -> tensors in `kw`'s dtype
    and device; `quant`: the checkpoint's FP8 format, whose per-expert linears are dequantized). Raises ValueError
    naming the layer when no layout above matches."""
    params = read_experts(source, layer_prefix, moe, spec, state, quant, **kw)
    model_mlp = moe.experts.rpartition(".")[0]  # the experts' and the router's parent in the model ("mlp")
    ckpt_mlp = _checkpoint_mlp(source, layer_prefix, moe)
    router = moe.router.rpartition(".")[2]
    for leaf in ("weight", "bias"):  # replicated
        name = f"{ckpt_mlp}.{router}.{leaf}"
        if name in source:
            params[f"{layer_prefix}.{model_mlp}.{router}.{leaf}"] = source.get_slice(name)[:].to(**kw)
    return params


def read_experts(
    source: Checkpoint,
    layer_prefix: str,
    moe: MoeMlpSpec,
    spec: MoeSpec,
    state: ParallelState,
    quant: QuantConfig | None = None,
    **kw: Any,
) -> dict[str, torch.Tensor]:
    """The rank's slice of one sparse layer's experts alone (full model names -> tensors in `kw`'s dtype and device),
    in any layout above; `quant`: the checkpoint's FP8 format, whose per-expert linears are dequantized."""
    ckpt_mlp = _checkpoint_mlp(source, layer_prefix, moe)
    experts, ckpt_experts = f"{layer_prefix}.{moe.experts}", f"{ckpt_mlp}.{moe.experts.rpartition('.')[2]}"
    inter = spec.expert_intermediate_size
    part = shard_for(inter, state.rank, state.world_size, "the experts' intermediate size")
    if not moe.kernel_layout:  # gpt-oss: transformers' own layout, biased
        tensors = _gpt_oss_experts(source, ckpt_experts, part, kw.get("dtype", torch.float32), kw.get("device", "cpu"))
        if not state.is_first_rank:  # summed over the ranks by the all-reduce: held by rank 0 alone
            tensors["down_proj_bias"] = torch.zeros_like(tensors["down_proj_bias"])
    elif f"{ckpt_experts}.gate_up_proj" in source:
        gate_up = source.get_slice(f"{ckpt_experts}.gate_up_proj")
        up = slice(inter + part.start, inter + part.stop)
        tensors = {
            "gate_up_proj": torch.cat([gate_up[:, part], gate_up[:, up]], dim=1),
            "down_proj": source.get_slice(f"{ckpt_experts}.down_proj")[:, :, part],
        }
        if tensors["gate_up_proj"].dtype == FP8_DTYPE:  # its scales would be another layout again: none ships it
            raise ValueError(f"{ckpt_experts}.gate_up_proj is stacked FP8; cbq reads FP8 experts one linear an expert")
    else:
        tensors = _stack_per_expert(source, ckpt_experts, part, spec, quant, kw.get("dtype", torch.float32))
    return {f"{experts}.{name}": t.to(**kw).contiguous() for name, t in tensors.items()}


def read_fp8_experts(
    source: Checkpoint, layer_prefix: str, moe: MoeMlpSpec, spec: MoeSpec, quant: Fp8Config, fmt: Fp8ExpertFormat
) -> ExpertWeights:
    """One sparse layer's per-expert FP8 linears kept in FP8 (a world of one: every expert whole), stacked in the
    kernels' layout with their scales (moe/fp8.py), on the CPU, one expert's tensors read at a time. Raises
    ValueError naming the layer or the linear where the checkpoint is not per-expert FP8 linears in `fmt`."""
    ckpt_mlp = _checkpoint_mlp(source, layer_prefix, moe)
    experts = f"{ckpt_mlp}.{moe.experts.rpartition('.')[2]}"
    names = next((n for n in _PER_EXPERT_NAMES if f"{experts}.0.{n[0]}.weight" in source), None)
    if names is None:
        raise ValueError(f"no per-expert FP8 linears under {experts!r} (cbq reads FP8 experts one linear an expert)")
    whole = _WholeTensors(source)

    def linear(prefix: str) -> Fp8Linear:
        method = linear_method(quant, prefix)
        if not isinstance(method, Fp8LinearMethod):
            raise ValueError(f"{prefix} is not quantized by the checkpoint's quantization_config; its layer's experts are")
        return method.load(whole, prefix)

    def read(e: int) -> tuple[Fp8Linear, Fp8Linear, Fp8Linear]:
        gate, up, down = (linear(f"{experts}.{e}.{name}") for name in names)
        return gate, up, down

    gate_up, down, scales = stack_expert_linears(spec.num_experts, read, fmt)
    return ExpertWeights(gate_up, down, fp8=scales)


def _checkpoint_mlp(source: Checkpoint, layer_prefix: str, moe: MoeMlpSpec) -> str:
    router = moe.router.rpartition(".")[2]
    for mlp in _MLP_NAMES:
        if f"{layer_prefix}.{mlp}.{router}.weight" in source:
            return f"{layer_prefix}.{mlp}"
    raise ValueError(f"no MoE router at {layer_prefix!r} (looked for {', '.join(f'{m}.{router}' for m in _MLP_NAMES)})")


def _stack_per_expert(
    source: Checkpoint, experts: str, part: slice, spec: MoeSpec, quant: QuantConfig | None, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    names = next((n for n in _PER_EXPERT_NAMES if _stores_linear(source, f"{experts}.0.{n[0]}", quant)), None)
    if names is None:
        raise ValueError(f"no expert weights under {experts!r} (stacked, per-expert or MXFP4)")
    gate, up, down = names
    whole = _WholeTensors(source)

    def read(e: int, linear: str, index: Any) -> torch.Tensor:
        prefix = f"{experts}.{e}.{linear}"
        if quant is None:
            return source.get_slice(f"{prefix}.weight")[index]
        # FP8 scales cover blocks or rows of the whole weight: dequantized whole (one expert's), then sliced
        return dequantized_weight(whole, quant, prefix, dtype)[index]

    experts_range = range(spec.num_experts)
    return {
        "gate_up_proj": torch.stack([torch.cat([read(e, gate, part), read(e, up, part)]) for e in experts_range]),
        "down_proj": torch.stack([read(e, down, (slice(None), part)) for e in experts_range]),
    }


def _stores_linear(source: Checkpoint, prefix: str, quant: QuantConfig | None) -> bool:
    """Whether the checkpoint holds linear `prefix`: its `weight`, or the packed tensor of its quantized format (an
    INT4 release has `qweight` or `weight_packed` in its place)."""
    if f"{prefix}.weight" in source:
        return True
    method = None if quant is None else linear_method(quant, prefix)
    return method is not None and method.tensor_names(prefix)[0] in source


class _WholeTensors(Mapping[str, torch.Tensor]):
    """A checkpoint's tensors read whole by name, for the quantization methods (which read a linear's weight and
    scales by name)."""

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


def _gpt_oss_experts(
    source: Checkpoint, experts: str, part: slice, dtype: torch.dtype, device: torch.device | str
) -> dict[str, torch.Tensor]:
    """[E, H, 2I_rank] gate/up (interleaved, as transformers' GptOssExperts), [E, I_rank, H] down, and biases."""
    pairs = slice(2 * part.start, 2 * part.stop)  # features j in `part` are columns 2j (gate) and 2j + 1 (up)
    tensors = {
        "gate_up_proj_bias": source.get_slice(f"{experts}.gate_up_proj_bias")[:, pairs],
        "down_proj_bias": source.get_slice(f"{experts}.down_proj_bias")[:],
    }
    if f"{experts}.gate_up_proj_blocks" in source:  # the release: MXFP4, rows [out, in]
        tensors["gate_up_proj"] = _read_mxfp4(source, f"{experts}.gate_up_proj", pairs, slice(None), dtype, device)
        tensors["down_proj"] = _read_mxfp4(source, f"{experts}.down_proj", slice(None), part, dtype, device)
    elif f"{experts}.gate_up_proj" in source:
        tensors["gate_up_proj"] = source.get_slice(f"{experts}.gate_up_proj")[:, :, pairs]
        tensors["down_proj"] = source.get_slice(f"{experts}.down_proj")[:, part]
    else:
        raise ValueError(f"no gpt-oss expert weights under {experts!r} (stacked or MXFP4)")
    return tensors


def _read_mxfp4(
    source: Checkpoint, name: str, rows: slice, columns: slice, dtype: torch.dtype, device: torch.device | str
) -> torch.Tensor:
    """Every expert's `rows` x `columns` of the MXFP4 matrix `{name}_blocks` [E, out, in / 32, 16] with
    `{name}_scales` [E, out, in / 32], dequantized to `dtype` (exact in bf16 and fp32) and returned transposed,
    [E, columns, rows] contiguous on `device`: transformers' gpt-oss layout (x @ w[e]).

    One expert at a time, on `device`: the dequantizer's temporaries (its int64 codes are 8 bytes a value) are one
    expert's, never the layer's. Columns are read as the whole 32-value groups that cover them, since a rank's
    columns may start or end inside a group (TP=4 of gpt-oss's 2880)."""
    if f"{name}_scales" not in source:
        raise ValueError(f"{name}_blocks has no {name}_scales beside it (MXFP4 stores codes and scales in two tensors)")
    blocks, scales = source.get_slice(f"{name}_blocks"), source.get_slice(f"{name}_scales")
    num_experts, num_rows, num_groups, _ = blocks.get_shape()
    row_start, row_stop, row_step = rows.indices(num_rows)
    col_start, col_stop, col_step = columns.indices(num_groups * VALUES_PER_GROUP)
    assert row_step == col_step == 1, "a rank reads contiguous rows and columns"
    groups = slice(col_start // VALUES_PER_GROUP, -(-col_stop // VALUES_PER_GROUP))
    first = groups.start * VALUES_PER_GROUP
    out = torch.empty(num_experts, col_stop - col_start, row_stop - row_start, dtype=dtype, device=device)
    for e in range(num_experts):
        index = (slice(e, e + 1), slice(row_start, row_stop), groups)
        values = dequantize_mxfp4(blocks[index].to(device), scales[index].to(device), dtype)[0]  # [rows, groups * 32]
        out[e].copy_(values[:, col_start - first : col_stop - first].t())
    return out
