"""The MoE layer in plain PyTorch: routing, the experts, the shared expert. Owns nothing.

This is the CPU path and what the Triton path is tested against; it computes what transformers' sparse
blocks compute (Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, MixtralSparseMoeBlock, GptOssMLP), in the
same order, so in fp32 the two agree to rounding. Routing weights stay fp32 from the softmax to the multiply
(transformers rounds Qwen's to the model dtype; in fp32 that is the same thing).

`route` is shared by both paths: it has no host syncs (softmax, top-k and a division), so it runs inside a
CUDA graph. `experts_ref` loops over the experts that were hit, which reads device values (CPU only).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .spec import Activation, MoeSpec, RouterScoring
from .weights import ExpertWeights, MoeLayerWeights, SharedExpertWeights


def route(
    hidden: torch.Tensor, router_weight: torch.Tensor, router_bias: torch.Tensor | None, spec: MoeSpec
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64)."""
    logits = F.linear(hidden, router_weight, router_bias)
    if spec.scoring is RouterScoring.SOFTMAX_OVER_TOPK:  # gpt-oss: the k largest logits, softmax over them
        top_logits, topk_ids = torch.topk(logits, spec.top_k, dim=-1)
        topk_weights = torch.softmax(top_logits.float(), dim=-1)
    else:
        if spec.scoring is RouterScoring.SOFTMAX:
            scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        else:
            scores = torch.sigmoid(logits.float())
        topk_weights, topk_ids = torch.topk(scores, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if spec.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * spec.routed_scaling_factor
    return topk_weights, topk_ids


def activation_ref(gate_up: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    """[..., 2I] ([gate; up]) -> [..., I]."""
    gate, up = gate_up.chunk(2, dim=-1)
    if spec.activation is Activation.SILU_MUL:
        return F.silu(gate) * up
    gate = gate.clamp(max=spec.swiglu_limit)
    up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))


def experts_ref(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: ExpertWeights,
    spec: MoeSpec,
) -> torch.Tensor:
    """sum over k of topk_weights[t, k] * expert_{topk_ids[t, k]}(hidden[t]), as [T, H] in hidden's dtype."""
    out = torch.zeros_like(hidden)
    hit = torch.zeros(spec.num_experts, dtype=torch.bool, device=hidden.device)
    hit[topk_ids.flatten()] = True
    for expert in hit.nonzero().flatten().tolist():  # host sync: the CPU path only
        token_ids, slot = torch.where(topk_ids == expert)
        x = hidden[token_ids]
        gate_up_bias = None if experts.gate_up_bias is None else experts.gate_up_bias[expert]
        down_bias = None if experts.down_bias is None else experts.down_bias[expert]
        gate_up = F.linear(x, experts.gate_up[expert], gate_up_bias)
        y = F.linear(activation_ref(gate_up, spec), experts.down[expert], down_bias)
        out.index_add_(0, token_ids, (y * topk_weights[token_ids, slot, None]).to(out.dtype))
    return out


def shared_expert_forward(hidden: torch.Tensor, shared: SharedExpertWeights) -> torch.Tensor:
    """Qwen2-MoE's shared expert (a dense SiLU MLP), scaled by its sigmoid gate where it has one. No host
    syncs: the CUDA path uses it as is (cuBLAS GEMMs)."""
    gate, up = F.linear(hidden, shared.gate_up).chunk(2, dim=-1)
    out = F.linear(F.silu(gate) * up, shared.down)
    if shared.gate is not None:
        out = torch.sigmoid(F.linear(hidden, shared.gate)) * out
    return out


def moe_forward_ref(hidden: torch.Tensor, layer: MoeLayerWeights, spec: MoeSpec) -> torch.Tensor:
    """The whole sparse layer on [T, H], in plain PyTorch."""
    topk_weights, topk_ids = route(hidden, layer.router_weight, layer.router_bias, spec)
    out = experts_ref(hidden, topk_weights, topk_ids, layer.experts, spec)
    if layer.shared is not None:
        out = out + shared_expert_forward(hidden, layer.shared)
    return out
