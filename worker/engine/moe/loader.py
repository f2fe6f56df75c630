"""The one loader of a layer of experts: every expert's gate, up and down read from any checkpoint layout through the
layer's expert method (protocol.py, chosen by methods.py `expert_method_for`), each as one linear's slice ([out, in],
by `quant.protocol.load_parameter`, as the parallel linears read theirs) into its expert's slice of the layer's
stacked parameters. For one process and for a rank alike (`part`: the intermediate features held), on the target
device, one expert's linear at a time: the peak is the stack plus one expert. Owns nothing after loading.

Where a linear comes from is the layout's; how its tensors are read and converted is the method's:
- per-expert linears (the Qwen-MoE and Mixtral releases): `experts.{e}.gate_proj/up_proj/down_proj` or
  `experts.{e}.w1/w3/w2`, each tensor the method's (FP8's `weight` and `weight_scale(_inv)`, kept FP8 by
  `Fp8ExpertMethod`; or dequantized whole, then sliced, by `DequantizedExperts`: FP8 under tensor parallelism or on
  the CPU, INT4's `qweight`/`weight_packed`...);
- stacked, the kernels' layout (transformers' Qwen-MoE and Mixtral modules, the presets): `experts.gate_up_proj`
  [E, 2I, H] ([gate; up] rows) and `experts.down_proj` [E, H, I];
- gpt-oss stacked (transformers' GptOssExperts): `experts.gate_up_proj` [E, H, 2I] with gate and up columns
  interleaved (g0, u0, g1, u1, ...: a rank's features are one contiguous run of columns), `down_proj` [E, I, H], and
  their biases; its MXFP4 release (`experts.gate_up_proj_blocks/_scales`...) is the same tensors to the layout,
  dequantized by the slice as they are read (mxfp4.py `Mxfp4ExpertMethod`, on the target device).

`load_moe_layer` reads a whole sparse layer (router, experts, shared expert) from tensors by name: the owned decoder's
stacking of a transformers model's per-expert modules, and the tests'.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

import torch
from torch import nn

from ..checkpoint import Checkpoint, ModelSource, TensorSlice
from ..quant.methods import UNQUANTIZED_MODEL, LinearMethods
from ..quant.protocol import check_entries, load_parameter, split_of
from .methods import expert_method_for
from .protocol import DOWN, GATE_UP, ExpertMethod, ExpertSizes, expert_params
from .spec import MoeSpec
from .weights import ExpertWeights, MoeLayerWeights, SharedExpertWeights

# the names of the per-expert linears (gate, up, down) in the releases
_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))
# each expert's linears: (which, the stacked projection it lies in, its logical output there)
_LINEARS = (("gate", GATE_UP, 0), ("up", GATE_UP, 1), ("down", DOWN, 0))
# one linear's tensor of a stacked parameter: (expert, which linear, the parameter) -> (slice, checkpoint name)
_Reader = Callable[[int, str, nn.Parameter], tuple[TensorSlice, str]]


def read_layer_experts(
    source: Checkpoint,
    experts: str,
    spec: MoeSpec,
    methods: LinearMethods = UNQUANTIZED_MODEL,
    part: slice | None = None,
    first_rank: bool = True,
    kernel_layout: bool = True,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
) -> ExpertWeights:
    """The layer of experts at checkpoint prefix `experts` ("model.layers.1.mlp.experts") in the kernels' layout,
    through its method from `methods` (FP8 experts kept FP8 carry their scales), in `dtype` on `device`. `part`:
    the intermediate features held (None: all); a down bias is held by the `first_rank` alone (the ranks' outputs
    are summed). `kernel_layout` False: gpt-oss's stacked layout."""
    method = expert_method_for(methods, experts, source, dtype, device, kernel_layout)
    inter, hidden = spec.expert_intermediate_size, spec.hidden_size
    part = slice(0, inter) if part is None else part
    sizes = ExpertSizes(spec.num_experts, hidden, part.stop - part.start)
    layer = nn.Module()
    method.create_weights(layer, sizes, dtype, device)
    read = _linear_reader(source, experts, kernel_layout, (inter, hidden), method, layer)
    for e in range(spec.num_experts):
        for which, projection, shard in _LINEARS:
            rows, cols = (part, slice(0, hidden)) if projection == GATE_UP else (slice(0, hidden), part)
            shape = (inter, hidden) if projection == GATE_UP else (hidden, inter)
            for name, param in expert_params(layer, projection):
                loaded, what = read(e, which, param)
                check_entries(loaded, split_of(param), shape, what)
                load_parameter(
                    method, layer, name, loaded, what, sizes=sizes.linear(projection), rows=rows, cols=cols,
                    weight_shape=shape, shard_index=shard, into=param.data[e],
                )  # fmt: skip
    method.process_after_loading(layer)
    gate_up_bias = down_bias = None
    if spec.has_expert_bias:  # [gate; up]: gpt-oss's interleaved as its gate and up are (the part's pairs)
        bias = source.get_slice(f"{experts}.gate_up_proj_bias")
        if kernel_layout:
            gate_up_bias = torch.cat((bias[:, part], bias[:, inter + part.start : inter + part.stop]), dim=1)
        else:
            pairs = bias[:, 2 * part.start : 2 * part.stop]
            gate_up_bias = torch.cat((pairs[:, 0::2], pairs[:, 1::2]), dim=1)
        gate_up_bias = gate_up_bias.to(dtype=dtype, device=device)
        down_bias = source.get_slice(f"{experts}.down_proj_bias")[:].to(dtype=dtype, device=device)
        if not first_rank:  # summed over the ranks by the all-reduce: held by rank 0 alone
            down_bias = torch.zeros_like(down_bias)
    gate_up, down = layer.get_parameter(GATE_UP).data, layer.get_parameter(DOWN).data
    return ExpertWeights(gate_up, down, gate_up_bias, down_bias, fp8=method.kernel_scales(layer))


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
        # (tensor, first row, rows, step): gpt-oss's are [E, in, out] with gate and up rows interleaved
        step = 1 if kernel_layout else 2
        places = {"gate": (gate_up, 0, inter, step), "up": (gate_up, inter if step == 1 else 1, inter, step)}
        places["down"] = (down, 0, hidden, 1)

        def read(e: int, which: str, param: nn.Parameter) -> tuple[TensorSlice, str]:
            tensor, first, rows, step = places[which]
            name = f"{experts}.{'down' if which == 'down' else 'gate_up'}_proj"
            return _StackedLinear(tensor, e, first, rows, step, not kernel_layout), name

        return read
    names = next((n for n in _PER_EXPERT_NAMES if method.stores_linear(source, f"{experts}.0.{n[0]}")), None)
    if names is None:
        raise ValueError(f"no expert weights under {experts!r} (stacked, per-expert or MXFP4)")
    linear = dict(zip(("gate", "up", "down"), names, strict=True))
    return lambda e, which, param: method.checkpoint_tensor(source, f"{experts}.{e}.{linear[which]}", param)


class _StackedLinear:
    """Expert `e`'s linear [rows, in] in a tensor stacking every expert, read by slice like a checkpoint tensor of
    its own: rows `first`, `first + step`, ... of [E, out, in], or of the transpose of [E, in, out] (`transposed`:
    transformers' gpt-oss layout)."""

    def __init__(self, stacked: TensorSlice, e: int, first: int, rows: int, step: int, transposed: bool):
        self.stacked, self.e, self.first, self.rows, self.step, self.transposed = (
            stacked,
            e,
            first,
            rows,
            step,
            transposed,
        )

    def get_shape(self) -> list[int]:
        return [self.rows, self.stacked.get_shape()[1 if self.transposed else 2]]

    def __getitem__(self, index: Any) -> torch.Tensor:
        rows, cols = index
        start, stop, _ = rows.indices(self.rows)
        if self.step == 1:
            span, pick = slice(self.first + start, self.first + stop), slice(None)
        else:  # the pairs holding the rows (gate's and up's the same span: a dequantizing slice reads it once)
            span, pick = slice(start * self.step, stop * self.step), slice(self.first, None, self.step)
        expert = slice(self.e, self.e + 1)
        if self.transposed:
            return self.stacked[expert, cols, span][0][:, pick].t()
        return self.stacked[expert, span, cols][0][pick]


def load_moe_layer(
    tensors: Mapping[str, torch.Tensor],
    layer_prefix: str,
    spec: MoeSpec,
    dtype: torch.dtype,
    device: torch.device | str,
) -> MoeLayerWeights:
    """One sparse layer's weights from tensors by name (any mapping: a dict, a lazy safetensors view), in `dtype` on
    `device`, in the stacked layout (weights.py); its experts by `read_layer_experts`. Names understood
    (`layer_prefix` e.g. "model.layers.3", "" for a layer's own state dict): the MLP `mlp` or Mixtral's
    `block_sparse_moe`; the router `gate` or gpt-oss's `router` (with its bias); Qwen2-MoE's shared expert
    `shared_expert.{gate,up,down}_proj` and `shared_expert_gate`, GLM-4.5's `shared_experts.*` (ungated) and its
    router's `e_score_correction_bias` [E] (kept fp32, as the release ships it and the routing computes)."""
    source = ModelSource(tensors)
    mlp = mlp_prefix(source, layer_prefix)

    def to_device(t: torch.Tensor) -> torch.Tensor:
        return t.to(device=device, dtype=dtype)

    experts = read_layer_experts(
        source, f"{mlp}.experts", spec, kernel_layout=spec.model_type != "gpt_oss", dtype=dtype, device=device
    )
    router = f"{mlp}.router" if f"{mlp}.router.weight" in tensors else f"{mlp}.gate"
    router_bias = to_device(tensors[f"{router}.bias"]) if spec.has_router_bias else None
    correction_bias = None
    if spec.has_score_correction_bias:
        correction_bias = tensors[f"{router}.e_score_correction_bias"].to(device=device, dtype=torch.float32)
    shared = None
    if spec.has_shared_expert:
        prefix = (
            f"{mlp}.shared_experts"
            if f"{mlp}.shared_experts.gate_proj.weight" in tensors
            else f"{mlp}.shared_expert"
        )
        shared_gate_up = torch.cat(
            (tensors[f"{prefix}.gate_proj.weight"], tensors[f"{prefix}.up_proj.weight"])
        )
        gate = to_device(tensors[f"{mlp}.shared_expert_gate.weight"]) if spec.has_shared_expert_gate else None
        shared = SharedExpertWeights(
            to_device(shared_gate_up), to_device(tensors[f"{prefix}.down_proj.weight"]), gate
        )
    layer = MoeLayerWeights(
        to_device(tensors[f"{router}.weight"]),
        router_bias,
        experts,
        shared,
        correction_bias,
    )
    layer.check(spec)
    return layer


MLP_NAMES = (
    "mlp",
    "block_sparse_moe",
)  # Mixtral's releases keep `block_sparse_moe`, which transformers renames `mlp`


def mlp_prefix(source: Checkpoint, layer_prefix: str, routers: tuple[str, ...] = ("gate", "router")) -> str:
    """The sparse MLP's checkpoint prefix under `layer_prefix` ("" for a layer's own tensors), found by its router."""
    for name in MLP_NAMES:
        prefix = f"{layer_prefix}.{name}" if layer_prefix else name
        if any(f"{prefix}.{router}.weight" in source for router in routers):
            return prefix
    looked = ", ".join(f"{mlp}.{router}" for mlp in MLP_NAMES for router in routers)
    raise ValueError(f"no MoE router at {layer_prefix!r} (looked for {looked})")
