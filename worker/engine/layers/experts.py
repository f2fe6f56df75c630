"""One rank's slice of a sparse layer's experts (tensor-parallel experts), read through the layer's expert method
(moe/protocol.py, chosen from the model's `LinearMethods` by moe/methods.py `expert_method_for`) by the one loader of
experts (moe/loader.py, every checkpoint layout), for one process (a world of one) and for every rank alike.

Owns nothing after loading: returns the tensors, `ExpertWeights` in the kernels' layout (`load_experts`: FP8 experts
kept FP8 with their scales), or in the model dtype in the shard model's own (transformers') parameter layout for
shard_build.py to bind (`load_expert_shard`, `expert_tensors`, `router_tensors`). Each rank holds every expert's
slice of the intermediate dimension: the rows of gate and up (and of their biases) for its features, the columns of
down for them. The router is replicated, so every rank routes alike; the decoder's one all-reduce after the MLP sums
the ranks' partial down outputs. A down bias (gpt-oss) is summed in that all-reduce too, so rank 0 holds it and the
others hold zeros: it is added once.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoint import Checkpoint
from ..families.spec import MoeMlpSpec
from ..moe.loader import mlp_prefix, read_layer_experts
from ..moe.spec import MoeSpec
from ..moe.weights import ExpertWeights
from ..parallel.group import ParallelState
from ..parallel.memory import shard_for
from ..quant.methods import UNQUANTIZED_MODEL, LinearMethods


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
    part = shard_for(
        spec.expert_intermediate_size, state.rank, state.world_size, "the experts' intermediate size"
    )
    return read_layer_experts(
        source,
        experts,
        spec,
        methods,
        part,
        state.is_first_rank,
        moe.kernel_layout,
        dtype=dtype,
        device=device,
    )


def _checkpoint_mlp(source: Checkpoint, layer_prefix: str, moe: MoeMlpSpec) -> str:
    return mlp_prefix(source, layer_prefix, (moe.router.rpartition(".")[2],))


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
