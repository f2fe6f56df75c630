"""The MoE layer in plain PyTorch: routing, the experts, the shared expert. Owns nothing.

This is the CPU path and what the Triton path is tested against; it computes what transformers' sparse
blocks compute (Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock, MixtralSparseMoeBlock, GptOssMLP, Glm4MoeMoE),
in the same order, so in fp32 the two agree to rounding. Routing weights stay fp32 from the softmax (or
sigmoid) to the multiply (transformers rounds Qwen's to the model dtype; in fp32 that is the same thing).

`route` is shared by both paths: it has no host syncs (softmax or sigmoid, grouped masks, top-k and a
division), so it runs inside a CUDA graph. `experts_ref` loops over the experts that were hit, which reads
device values (CPU only).

FP8 experts (`ExpertWeights.fp8`, fp8.py) are not on the CPU path by default (the loaders dequantize them there);
where they reach `experts_ref` (transformers' forward of a model that keeps them, `Fp8Experts`; the tests, which
keep them on the CPU) it computes their emulation, `experts_fp8_emulated`: what the FP8 grouped GEMMs
(triton_fp8.py) compute, as the dense FP8 linears' `fp8_linear_emulated` does for theirs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .fp8 import dequantize_down, dequantize_gate_up
from .spec import Activation, MoeSpec, RouterScoring
from .weights import ExpertWeights, MoeLayerWeights, SharedExpertWeights


def route(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    spec: MoeSpec,
    score_correction_bias: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """[T, H] -> (topk_weights [T, k] fp32, topk_ids [T, k] int64). `score_correction_bias` [E]: SIGMOID
    scoring's choice bias (required where the spec has one)."""
    if spec.scoring is RouterScoring.SIGMOID:
        return _route_sigmoid(hidden, router_weight, router_bias, spec, score_correction_bias)
    logits = F.linear(hidden, router_weight, router_bias)
    if spec.scoring is RouterScoring.SOFTMAX_OVER_TOPK:  # gpt-oss: the k largest logits, softmax over them
        top_logits, topk_ids = torch.topk(logits, spec.top_k, dim=-1)
        topk_weights = torch.softmax(top_logits.float(), dim=-1)
    else:
        scores = torch.softmax(logits, dim=-1, dtype=torch.float32)
        topk_weights, topk_ids = torch.topk(scores, spec.top_k, dim=-1)
        if spec.norm_topk_prob:
            topk_weights = topk_weights / topk_weights.sum(dim=-1, keepdim=True)
    if spec.routed_scaling_factor != 1.0:
        topk_weights = topk_weights * spec.routed_scaling_factor
    return topk_weights, topk_ids


def _route_sigmoid(
    hidden: torch.Tensor,
    router_weight: torch.Tensor,
    router_bias: torch.Tensor | None,
    spec: MoeSpec,
    score_correction_bias: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """DeepSeek-V3-style routing, op for op as Glm4MoeTopkRouter computes it (so the choice is the same even
    on near-ties): fp32 logits and sigmoid scores; the choice on scores + correction bias, restricted to the
    `topk_groups` groups whose best two choice scores sum highest; the weights are the chosen experts'
    uncorrected scores. Every op is a fixed-shape tensor op (no host sync, CUDA-graph safe)."""
    bias = None if router_bias is None else router_bias.float()
    scores = F.linear(hidden.float(), router_weight.float(), bias).sigmoid()
    choice = scores
    if spec.has_score_correction_bias:
        assert score_correction_bias is not None, "the spec's routing needs the layer's score correction bias"
        choice = scores + score_correction_bias
    if spec.num_groups > 1:
        num_tokens, per_group = choice.shape[0], spec.num_experts // spec.num_groups
        group_scores = choice.view(num_tokens, spec.num_groups, per_group).topk(2, dim=-1)[0].sum(dim=-1)
        group_ids = torch.topk(group_scores, k=spec.topk_groups, dim=-1, sorted=False)[1]
        kept_groups = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_ids, True)
        kept = kept_groups.unsqueeze(-1).expand(-1, -1, per_group).reshape(num_tokens, spec.num_experts)
        choice = choice.masked_fill(~kept, float("-inf"))
    # sorted=False as transformers: the slot order sets the order of the normalising sum's additions
    topk_ids = torch.topk(choice, k=spec.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_ids)
    if spec.norm_topk_prob:
        topk_weights = topk_weights / (topk_weights.sum(dim=-1, keepdim=True) + 1e-20)  # transformers' epsilon
    return topk_weights * spec.routed_scaling_factor, topk_ids


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
    if experts.fp8 is not None:
        return experts_fp8_emulated(hidden, topk_weights, topk_ids, experts, spec)
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


def experts_fp8_emulated(
    hidden: torch.Tensor,
    topk_weights: torch.Tensor,
    topk_ids: torch.Tensor,
    experts: ExpertWeights,
    spec: MoeSpec,
) -> torch.Tensor:
    """FP8 experts' layer as the grouped GEMMs compute it, in plain torch: x quantized as the format says (per token,
    or per token and group of bk columns), both operands dequantized and multiplied in fp64 on the CPU (fp32 on a
    GPU, as `fp8_linear_emulated`), each projection rounded to the model dtype (the bias added before), the
    activation's output quantized again for down, the routing weight applied to down's rounded output and the
    k pairs of a token summed in fp32 and rounded once: the kernels' order of roundings."""
    assert experts.fp8 is not None, "experts_fp8_emulated multiplies FP8 experts"
    fmt, dtype = experts.fp8.format, hidden.dtype
    acc = torch.float64 if hidden.device.type == "cpu" else torch.float32
    x_fp8, x_scale = fmt.quantize_input(hidden)
    x = _dequantize_input(x_fp8, x_scale, fmt.block_shape).to(acc)
    out = torch.zeros(hidden.shape, dtype=torch.float32, device=hidden.device)
    hit = torch.zeros(spec.num_experts, dtype=torch.bool, device=hidden.device)
    hit[topk_ids.flatten()] = True
    for expert in hit.nonzero().flatten().tolist():  # host sync: not a CUDA-graph path
        token_ids, slot = torch.where(topk_ids == expert)
        gate_up_w = dequantize_gate_up(experts.gate_up[expert], experts.fp8.gate_up[expert], fmt).to(acc)
        gate_up = _round(x[token_ids] @ gate_up_w.t(), experts.gate_up_bias, expert, dtype)
        activated = _activation_as_kernels(gate_up, spec)
        a_fp8, a_scale = fmt.quantize_input(activated)
        down_w = dequantize_down(experts.down[expert], experts.fp8.down[expert], fmt).to(acc)
        a = _dequantize_input(a_fp8, a_scale, fmt.block_shape).to(acc)
        y = _round(a @ down_w.t(), experts.down_bias, expert, dtype)
        weighted = (y.float() * topk_weights[token_ids, slot, None].float()).to(dtype)
        out.index_add_(0, token_ids, weighted.float())
    return out.to(dtype)


def _dequantize_input(
    x_fp8: torch.Tensor, scale: torch.Tensor, block_shape: tuple[int, int] | None
) -> torch.Tensor:
    """Inverse of `Fp8ExpertFormat.quantize_input`, in fp32."""
    if block_shape is None:
        return x_fp8.float() * scale[:, None]
    return x_fp8.float() * scale.repeat_interleave(block_shape[1], dim=-1)[:, : x_fp8.shape[1]]


def _round(product: torch.Tensor, bias: torch.Tensor | None, expert: int, dtype: torch.dtype) -> torch.Tensor:
    """A projection's fp32 result (plus its bias, in fp32) rounded to the model dtype, as the kernels store it."""
    out = product.float()
    if bias is not None:
        out = out + bias[expert].float()
    return out.to(dtype)


def _activation_as_kernels(gate_up: torch.Tensor, spec: MoeSpec) -> torch.Tensor:
    """`activation_ref` with the kernels' roundings: fp32 math on the rounded projections, SiLU's output rounded
    before the multiply (as F.silu rounds), the product rounded to the model dtype."""
    gate, up = gate_up.float().chunk(2, dim=-1)
    if spec.activation is Activation.SILU_MUL:
        return (F.silu(gate).to(gate_up.dtype).float() * up).to(gate_up.dtype)
    gate = gate.clamp(max=spec.swiglu_limit)
    up = up.clamp(min=-spec.swiglu_limit, max=spec.swiglu_limit)
    return ((up + 1) * (gate * torch.sigmoid(gate * spec.swiglu_alpha))).to(gate_up.dtype)


def shared_expert_forward(hidden: torch.Tensor, shared: SharedExpertWeights) -> torch.Tensor:
    """The shared expert (a dense SiLU MLP: Qwen2-MoE's, GLM-4.5's), scaled by its sigmoid gate where it has one
    (Qwen2-MoE). No host syncs: the CUDA path uses it as is (cuBLAS GEMMs)."""
    gate, up = F.linear(hidden, shared.gate_up).chunk(2, dim=-1)
    out = F.linear(F.silu(gate) * up, shared.down)
    if shared.gate is not None:
        out = torch.sigmoid(F.linear(hidden, shared.gate)) * out
    return out


def moe_forward_ref(hidden: torch.Tensor, layer: MoeLayerWeights, spec: MoeSpec) -> torch.Tensor:
    """The whole sparse layer on [T, H], in plain PyTorch."""
    topk_weights, topk_ids = route(
        hidden, layer.router_weight, layer.router_bias, spec, layer.score_correction_bias
    )
    out = experts_ref(hidden, topk_weights, topk_ids, layer.experts, spec)
    if layer.shared is not None:
        out = out + shared_expert_forward(hidden, layer.shared)
    return out
