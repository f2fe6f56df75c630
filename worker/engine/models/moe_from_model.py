"""An MoE layer's weights read from a loaded transformers decoder layer, for the owned decoder. Owns nothing
after building: the transformers model keeps owning every parameter, so `model.generate` still runs.

transformers 5.x already holds each layer's experts stacked, `experts.gate_up_proj` [E, 2I, H] ([gate; up] rows)
and `experts.down_proj` [E, H, I], the layout the kernels read: those are used as they are, no copy. A model
whose experts are per-expert modules (`experts.{e}.gate_proj/up_proj/down_proj` or Mixtral's `w1/w3/w2`, as
older transformers built them) is stacked once with `load_moe_layer`, and each expert's linears are then rebound
to views of the stack, so memory holds every expert once and no per-expert module is on the hot path.
A stacked layout that is not the kernels' (gpt-oss's [E, H, 2I], interleaved) is moved into theirs: the layer's
experts are copied once, the family's `experts_in_kernel_layout` module takes transformers' module's place (it
computes the same expert math from the new tensors), and the old tensors go with the old module. So the peak is one
layer's experts above the model, and a later build on the same model finds the kernels' layout and takes views.
Experts the loader kept in FP8 (`fp8_experts.Fp8Experts`, CUDA) are its e4m3 tensors and scales, taken as they are.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..families.spec import MoeMlpSpec
from ..fused_weights import fuse_rows, submodule
from ..moe.fp8_experts import Fp8Experts
from ..moe.loader import load_moe_layer
from ..moe.spec import MoeSpec
from ..moe.weights import ExpertWeights, MoeLayerWeights, SharedExpertWeights

_PER_EXPERT_NAMES = (("gate_proj", "up_proj", "down_proj"), ("w1", "w3", "w2"))


def moe_layer_weights(layer: Any, mlp: MoeMlpSpec, spec: MoeSpec) -> MoeLayerWeights:
    """The sparse MLP of one transformers decoder layer, as `mlp` (the family's declaration) places it."""
    router = submodule(layer, mlp.router)
    experts = submodule(layer, mlp.experts)
    stacked = getattr(experts, "gate_up_proj", None)
    num_experts, hidden, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
    if isinstance(experts, Fp8Experts):  # kept in FP8 at load (CUDA): the FP8 grouped GEMMs read them as they are
        expert_weights = experts.weights
    elif mlp.experts_in_kernel_layout is not None and isinstance(experts, mlp.experts_in_kernel_layout):
        expert_weights = experts.weights  # moved by an earlier build on this model
    elif mlp.kernel_layout and isinstance(stacked, torch.Tensor) and stacked.shape == (num_experts, 2 * inter, hidden):
        expert_weights = ExpertWeights(stacked.detach(), experts.down_proj.detach())
    else:
        expert_weights = _stack_per_expert(layer, mlp, spec)
    shared = None
    if mlp.shared_expert is not None:
        shared_mlp = submodule(layer, mlp.shared_expert)
        shared_gate_up, _ = fuse_rows([shared_mlp.gate_proj, shared_mlp.up_proj])
        gate = None if mlp.shared_expert_gate is None else submodule(layer, mlp.shared_expert_gate).weight
        shared = SharedExpertWeights(shared_gate_up, shared_mlp.down_proj.weight, gate)
    correction_bias = getattr(router, "e_score_correction_bias", None) if spec.has_score_correction_bias else None
    weights = MoeLayerWeights(router.weight, getattr(router, "bias", None), expert_weights, shared, correction_bias)
    weights.check(spec)
    return weights


def _stack_per_expert(layer: Any, mlp: MoeMlpSpec, spec: MoeSpec) -> ExpertWeights:
    """Per-expert modules -> one stack (allocated once, in the model's dtype), the modules rebound to its views."""
    tensors = {name: param.detach() for name, param in layer.named_parameters()}
    router = submodule(layer, mlp.router).weight
    # load_moe_layer finds the router and the experts by their checkpoint names under the layer
    stacked = load_moe_layer(tensors, "", spec, router.dtype, router.device).experts
    del tensors  # the layer's old expert tensors are held by its module alone from here
    experts = submodule(layer, mlp.experts)
    if not isinstance(experts, nn.ModuleList):
        # a stacked layout other than the kernels' (gpt-oss's transposed, interleaved one): the family's module in
        # the kernels' layout replaces transformers' one, whose tensors are freed with it
        assert mlp.experts_in_kernel_layout is not None, f"{type(experts).__name__}: no module reads the kernels' layout"
        parent, _, name = mlp.experts.rpartition(".")
        setattr(submodule(layer, parent) if parent else layer, name, mlp.experts_in_kernel_layout(experts, stacked))
        return stacked
    names = next((n for n in _PER_EXPERT_NAMES if hasattr(experts[0], n[0])), None)
    assert names is not None, "load_moe_layer read per-expert linears by one of these names"
    gate, up, down = names
    inter = spec.expert_intermediate_size
    for e, expert in enumerate(experts):
        for name, view in ((gate, stacked.gate_up[e, :inter]), (up, stacked.gate_up[e, inter:]), (down, stacked.down[e])):
            submodule(expert, name).weight = nn.Parameter(view, requires_grad=False)
    return stacked
