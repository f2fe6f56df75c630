"""One rank's slice of a sparse layer's experts (tensor-parallel experts), read from any checkpoint layout through the
layer's expert method (moe/protocol.py, chosen by moe/methods.py `expert_method_for` from the model's
`LinearMethods`): the one loader of experts, for one process (a world of one) and for every rank alike.

Owns nothing after loading: returns the tensors, `ExpertWeights` in the kernels' layout (`load_experts`), or in the
shard model's own (transformers') parameter layout for shard_model.py to bind (`read_experts`). Each rank holds every
expert's slice of the intermediate dimension: the rows of gate and up (and of their biases) for its features, the
columns of down for them. The router is replicated, so every rank routes alike; the decoder's one all-reduce after
the MLP sums the ranks' partial down outputs. A down bias (gpt-oss) is summed in that all-reduce too, so rank 0
holds it and the others hold zeros: it is added once.

Every expert's gate, up and down is read as one linear's slice ([out, in], by `quant.protocol.load_parameter`, as the
parallel linears read theirs), into its expert's slice of the layer's stacked parameters. Where a linear comes from is
the layout's; how its tensors are read and converted is the method's:
- per-expert linears (the Qwen-MoE and Mixtral releases): `experts.{e}.gate_proj/up_proj/down_proj` or
  `experts.{e}.w1/w3/w2`, each tensor the method's (FP8's `weight` and `weight_scale(_inv)`, kept FP8 by
  `Fp8ExpertMethod`; or dequantized whole, then sliced, by `DequantizedExperts`: FP8 under tensor parallelism or on
  the CPU, INT4's `qweight`/`weight_packed`...);
- stacked, the kernels' layout (transformers' Qwen-MoE and Mixtral modules, the presets): `experts.gate_up_proj`
  [E, 2I, H] ([gate; up] rows) and `experts.down_proj` [E, H, I];
- gpt-oss stacked (transformers' GptOssExperts): `experts.gate_up_proj` [E, H, 2I] with gate and up columns
  interleaved (g0, u0, g1, u1, ...: a rank's features are one contiguous run of columns), `down_proj` [E, I, H], and
  their biases; its MXFP4 release (`experts.gate_up_proj_blocks/_scales`...) is the same tensors to the layout,
  dequantized by the slice as they are read (moe/mxfp4.py `Mxfp4ExpertMethod`, on the rank's device).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ..checkpoint import Checkpoint, TensorSlice
from ..families.spec import MoeMlpSpec
from ..moe.methods import expert_method_for
from ..moe.protocol import DOWN, GATE_UP, ExpertMethod, ExpertSizes, expert_params
from ..moe.spec import MoeSpec
from ..moe.weights import ExpertWeights
from ..parallel.group import ParallelState
from ..parallel.memory import shard_for
from ..quant.methods import UNQUANTIZED_MODEL, LinearMethods
from ..quant.protocol import check_entries, load_parameter, split_of

# The MLP's name in checkpoints (Mixtral's releases keep `block_sparse_moe`, which transformers renames `mlp`), and
# the names of the per-expert linears (gate, up, down).
_MLP_NAMES = ("mlp", "block_sparse_moe")
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# each expert's linears: (which, the stacked projection it lies in, its logical output there)
_LINEARS = (("gate", GATE_UP, 0), ("up", GATE_UP, 1), ("down", DOWN, 0))
# one linear's tensor of a stacked parameter: (expert, which linear, the parameter) -> (slice, checkpoint name)
_Reader = Callable[[int, str, nn.Parameter], tuple[TensorSlice, str]]


def load_expert_shard(
    source: Checkpoint,
    layer_prefix: str,
    moe: MoeMlpSpec,
    spec: MoeSpec,
    state: ParallelState,
    methods: LinearMethods = UNQUANTIZED_MODEL,
    **kw: Any,
) -> dict[str, torch.Tensor]:
    """The shard model's parameters of one sparse layer's router and experts in the model dtype (full names ->
    tensors in `kw`'s dtype and device; the experts through their method from `methods`). Raises ValueError naming
    the layer when no layout above matches."""
    weights = load_experts(source, layer_prefix, moe, spec, state, methods, **kw)
    return expert_tensors(weights, layer_prefix, moe) | router_tensors(source, layer_prefix, moe, **kw)


def router_tensors(
    source: Checkpoint, layer_prefix: str, moe: MoeMlpSpec, **kw: Any
) -> dict[str, torch.Tensor]:
    """The router's weight and bias (replicated), by the model's names, in `kw`'s dtype and device."""
    params = {}
    model_mlp = moe.experts.rpartition(".")[0]  # the experts' and the router's parent in the model ("mlp")
    ckpt_mlp = _checkpoint_mlp(source, layer_prefix, moe)
    router = moe.router.rpartition(".")[2]
    for leaf in ("weight", "bias"):
        name = f"{ckpt_mlp}.{router}.{leaf}"
        if name in source:
            params[f"{layer_prefix}.{model_mlp}.{router}.{leaf}"] = source.get_slice(name)[:].to(**kw)
    return params


def expert_tensors(weights: ExpertWeights, layer_prefix: str, moe: MoeMlpSpec) -> dict[str, torch.Tensor]:
    """Experts in the model dtype as the transformers module holds them (full model names -> tensors)."""
    assert weights.fp8 is None, (
        "experts kept FP8 take the model's experts module's place (fp8_experts.Fp8Experts)"
    )
    tensors = {"gate_up_proj": weights.gate_up, "down_proj": weights.down}
    if not moe.kernel_layout:  # gpt-oss: transformers' own layout, biased
        tensors = _gpt_oss_layout(weights)
    return {f"{layer_prefix}.{moe.experts}.{name}": t for name, t in tensors.items()}


def load_experts(
    source: Checkpoint,
    layer_prefix: str,
    moe: MoeMlpSpec,
    spec: MoeSpec,
    state: ParallelState,
    methods: LinearMethods = UNQUANTIZED_MODEL,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ExpertWeights:
    """The rank's slice of one sparse layer's experts in the kernels' layout, read through the layer's expert method
    (FP8 experts kept FP8 carry their scales), on `device`, one expert's linear at a time."""
    ckpt_mlp = _checkpoint_mlp(source, layer_prefix, moe)
    experts = f"{ckpt_mlp}.{moe.experts.rpartition('.')[2]}"
    method = expert_method_for(methods, experts, source, dtype, device, moe.kernel_layout)
    inter, hidden = spec.expert_intermediate_size, spec.hidden_size
    part = shard_for(inter, state.rank, state.world_size, "the experts' intermediate size")
    sizes = ExpertSizes(spec.num_experts, hidden, part.stop - part.start)
    layer = nn.Module()
    method.create_weights(layer, sizes, dtype, device)
    read = _linear_reader(source, experts, moe.kernel_layout, (inter, hidden), method, layer)
    for e in range(spec.num_experts):
        for which, projection, shard in _LINEARS:
            rows, cols = (part, slice(0, hidden)) if projection == GATE_UP else (slice(0, hidden), part)
            for name, param in expert_params(layer, projection):
                loaded, what = read(e, which, param)
                shape = (inter, hidden) if projection == GATE_UP else (hidden, inter)
                check_entries(loaded, split_of(param), shape, what)
                load_parameter(
                    method, layer, name, loaded, what, sizes=sizes.linear(projection), rows=rows, cols=cols,
                    weight_shape=shape, shard_index=shard,
                    into=param.data[e],
                )  # fmt: skip
    method.process_after_loading(layer)
    gate_up_bias = down_bias = None
    if spec.has_expert_bias:  # gpt-oss's, interleaved as its gate and up are: the rank's pairs, [gate; up]
        pairs = source.get_slice(f"{experts}.gate_up_proj_bias")[:, 2 * part.start : 2 * part.stop]
        gate_up_bias = torch.cat((pairs[:, 0::2], pairs[:, 1::2]), dim=1).to(dtype=dtype, device=device)
        down_bias = source.get_slice(f"{experts}.down_proj_bias")[:].to(dtype=dtype, device=device)
        if not state.is_first_rank:  # summed over the ranks by the all-reduce: held by rank 0 alone
            down_bias = torch.zeros_like(down_bias)
    return ExpertWeights(
        layer.gate_up.data, layer.down.data, gate_up_bias, down_bias, fp8=method.kernel_scales(layer)
    )


def _checkpoint_mlp(source: Checkpoint, layer_prefix: str, moe: MoeMlpSpec) -> str:
    router = moe.router.rpartition(".")[2]
    for mlp in _MLP_NAMES:
        if f"{layer_prefix}.{mlp}.{router}.weight" in source:
            return f"{layer_prefix}.{mlp}"
    raise ValueError(
        f"no MoE router at {layer_prefix!r} (looked for {', '.join(f'{m}.{router}' for m in _MLP_NAMES)})"
    )


def _linear_reader(
    source: Checkpoint,
    experts: str,
    kernel_layout: bool,
    sizes: tuple[int, int],
    method: ExpertMethod,
    layer: nn.Module,
) -> _Reader:
    """Where each expert's linear lies in this checkpoint (the layouts of the module docstring); `sizes`: the whole
    intermediate and hidden sizes."""
    inter, hidden = sizes
    stacked = {p: method.stacked_tensor(source, f"{experts}.{p}_proj") for p in (GATE_UP, DOWN)}
    gate_up, down = stacked[GATE_UP], stacked[DOWN]
    if gate_up is not None and down is not None:
        if len(expert_params(layer, GATE_UP)) > 1:
            raise ValueError(
                f"{experts}.gate_up_proj is stacked and quantized; cbq reads those experts one linear an expert"
            )
        if kernel_layout:
            rows = {
                "gate": _ExpertRows(gate_up, 0),
                "up": _ExpertRows(gate_up, inter),
                "down": _ExpertRows(down, 0),
            }
        else:  # gpt-oss: [E, in, out], gate and up interleaved
            rows = {
                "gate": _ExpertRows(gate_up, 0, 2, True),
                "up": _ExpertRows(gate_up, 1, 2, True),
                "down": _ExpertRows(down, 0, 1, True),
            }
        out = {"gate": inter, "up": inter, "down": hidden}
        return lambda e, which, param: (
            rows[which].expert(e, out[which]),
            f"{experts}.{'down' if which == 'down' else 'gate_up'}_proj",
        )
    names = next((n for n in _PER_EXPERT_NAMES if method.stores_linear(source, f"{experts}.0.{n[0]}")), None)
    if names is None:
        raise ValueError(f"no expert weights under {experts!r} (stacked, per-expert or MXFP4)")
    linear = dict(zip(("gate", "up", "down"), names, strict=True))
    return lambda e, which, param: method.checkpoint_tensor(source, f"{experts}.{e}.{linear[which]}", param)


class _ExpertRows:
    """Where one linear of each expert lies in a tensor stacking every expert: rows `first`, `first + step`, ... of
    [E, out, in], or of the transpose of [E, in, out] (`transposed`: transformers' gpt-oss layout)."""

    def __init__(self, stacked: TensorSlice, first: int, step: int = 1, transposed: bool = False):
        self.stacked, self.first, self.step, self.transposed = stacked, first, step, transposed

    def expert(self, e: int, rows: int) -> _StackedLinear:
        return _StackedLinear(self, e, rows)


class _StackedLinear:
    """Expert `e`'s linear [rows, in] of `_ExpertRows`, read by slice like a checkpoint tensor of its own."""

    def __init__(self, place: _ExpertRows, e: int, rows: int):
        self.place, self.e, self.rows = place, e, rows

    def get_shape(self) -> list[int]:
        shape = self.place.stacked.get_shape()
        return [self.rows, shape[1] if self.place.transposed else shape[2]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = index
        start, stop, _ = rows.indices(self.rows)
        place, expert = self.place, slice(self.e, self.e + 1)
        if place.step == 1:
            span, pick = slice(place.first + start, place.first + stop), slice(None)
        else:  # the pairs holding the rows (gate's and up's the same span: a dequantizing slice reads it once)
            span, pick = slice(start * place.step, stop * place.step), slice(place.first, None, place.step)
        if place.transposed:
            return place.stacked[expert, cols, span][0][:, pick].t()
        return place.stacked[expert, span, cols][0][pick]


def _gpt_oss_layout(weights: ExpertWeights) -> dict[str, torch.Tensor]:
    """Experts in the kernels' layout -> transformers' GptOssExperts': gate_up [E, H, 2I] with gate and up columns
    interleaved, down [E, I, H], and their biases (the same peak as models/moe_from_model.py's move back: the layer's
    experts twice, a layer at a time)."""
    num_experts, two_inter, hidden = weights.gate_up.shape
    inter = two_inter // 2
    gate_up = weights.gate_up.new_empty(num_experts, hidden, two_inter)
    gate_up[..., 0::2], gate_up[..., 1::2] = (
        weights.gate_up[:, :inter].transpose(1, 2),
        weights.gate_up[:, inter:].transpose(1, 2),
    )
    assert weights.gate_up_bias is not None and weights.down_bias is not None, "gpt-oss's experts are biased"
    bias = weights.gate_up_bias.new_empty(num_experts, two_inter)
    bias[:, 0::2], bias[:, 1::2] = weights.gate_up_bias[:, :inter], weights.gate_up_bias[:, inter:]
    down = weights.down.transpose(1, 2).contiguous()
    return {
        "gate_up_proj": gate_up,
        "down_proj": down,
        "gate_up_proj_bias": bias,
        "down_proj_bias": weights.down_bias,
    }
