"""The MoE reference path (worker/engine/moe/reference.py) computes transformers' own sparse blocks, fp32 on
the CPU: Qwen3MoeSparseMoeBlock, Qwen2MoeSparseMoeBlock (shared expert and its gate), MixtralSparseMoeBlock,
GptOssMLP (router bias, expert biases, clamped SwiGLU with interleaved gate/up) and Glm4MoeMoE (grouped sigmoid
routing with a correction bias, an ungated shared expert). Weights go through the
loader (`load_moe_layer`) from the block's own state dict, the way the installed transformers names them."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import Glm4MoeConfig, GptOssConfig, MixtralConfig, Qwen2MoeConfig, Qwen3MoeConfig
from transformers.models.glm4_moe.modeling_glm4_moe import Glm4MoeMoE
from transformers.models.gpt_oss.modeling_gpt_oss import GptOssMLP
from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock
from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeSparseMoeBlock

from worker.engine.moe import forward, load_moe_layer, moe_forward, reference, spec_from_config
from worker.engine.moe.reference import moe_forward_ref, route

HIDDEN = 64


def tiny_config(model_type: str, **overrides):
    """A config shaped like each release in miniature: many experts, top-k 2 to 8."""
    common = dict(
        hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, vocab_size=128
    )
    if model_type == "qwen3_moe":  # Qwen3-30B-A3B: 128 experts, top 8, norm_topk_prob
        kw = dict(num_experts=32, num_experts_per_tok=8, moe_intermediate_size=48, norm_topk_prob=True)
        return Qwen3MoeConfig(**{**common, **kw, **overrides})
    if model_type == "qwen2_moe":  # Qwen1.5-MoE-A2.7B: 60 experts, top 4, no renormalisation, shared expert
        kw = dict(
            num_experts=12,
            num_experts_per_tok=4,
            moe_intermediate_size=40,
            shared_expert_intermediate_size=80,
        )
        return Qwen2MoeConfig(**{**common, **kw, **overrides})
    if model_type == "mixtral":  # 8 experts, top 2
        kw = dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=96)
        return MixtralConfig(**{**common, **kw, **overrides})
    if model_type == "glm4_moe":  # GLM-4.5: 160 experts, top 8, scaling 2.5 (Air: 128, scaling 1); 4 groups here
        kw = dict(
            n_routed_experts=32,
            num_experts_per_tok=8,
            moe_intermediate_size=40,
            n_shared_experts=2,
            n_group=4,
            topk_group=2,
            routed_scaling_factor=2.5,
            norm_topk_prob=True,
        )
        return Glm4MoeConfig(**{**common, **kw, **overrides})
    kw = dict(
        num_local_experts=16, num_experts_per_tok=4, intermediate_size=32, head_dim=16
    )  # gpt-oss-20b: 32, top 4
    return GptOssConfig(**{**common, **kw, **overrides})


BLOCKS = {
    "qwen3_moe": Qwen3MoeSparseMoeBlock,
    "qwen2_moe": Qwen2MoeSparseMoeBlock,
    "mixtral": MixtralSparseMoeBlock,
    "gpt_oss": GptOssMLP,
    "glm4_moe": Glm4MoeMoE,
}


def random_block(model_type: str, seed: int = 0, **overrides):
    """transformers' block with random weights (its experts are torch.empty until initialised). Large enough
    that gpt-oss's SwiGLU clamps some values."""
    config = tiny_config(model_type, **overrides)
    torch.manual_seed(seed)
    block = BLOCKS[model_type](config).eval()
    with torch.no_grad():
        for name, param in block.named_parameters():
            param.normal_(0.0, 0.6 if "gate_up" in name else 0.2)
        for name, buffer in block.named_buffers():  # GLM-4.5's choice bias: zeros at init, trained in releases
            if name.endswith("e_score_correction_bias"):
                buffer.normal_(0.0, 0.3)
    return config, block


def block_output(block, hidden: torch.Tensor) -> torch.Tensor:
    out = block(hidden[None])
    return (out[0] if isinstance(out, tuple) else out)[0]  # GptOssMLP returns (hidden, router scores)


def layer_from_block(block, spec):
    state = {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}
    return load_moe_layer(state, "model.layers.0", spec, torch.float32, "cpu")


def _rel(a, b):
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("model_type", list(BLOCKS))
@pytest.mark.parametrize("num_tokens", [1, 7, 50])
def test_reference_equals_transformers_block(model_type, num_tokens):
    config, block = random_block(model_type)
    spec = spec_from_config(config)
    layer = layer_from_block(block, spec)
    hidden = torch.randn(num_tokens, HIDDEN)
    with torch.no_grad():
        want = block_output(block, hidden)
        got = moe_forward_ref(hidden, layer, spec)
        assert torch.equal(
            moe_forward(hidden, layer, spec), got
        )  # on the CPU the dispatcher is the reference
    assert _rel(got, want) < 1e-6, _rel(got, want)
    # fp32 sums in another order than transformers' (per-expert GEMMs of other shapes): last bits, relative to
    # the output's scale (gpt-oss's outputs reach ~10; an absolute 1e-5 failed at 1.14e-5 on one CPU)
    assert (got - want).abs().max().item() < 1e-5 * max(1.0, want.abs().max().item())


def test_gpt_oss_swiglu_clamp_is_exercised():
    config, block = random_block("gpt_oss")
    spec = spec_from_config(config)
    layer = layer_from_block(block, spec)
    hidden = torch.randn(50, HIDDEN)
    gate_up = hidden @ layer.experts.gate_up[0].T + layer.experts.gate_up_bias[0]
    assert (gate_up.abs() > spec.swiglu_limit).any(), "the test weights never reach the clamp"


@pytest.mark.parametrize("norm_topk_prob", [False, True])
def test_qwen3_norm_topk_prob_both_ways(norm_topk_prob):
    config, block = random_block("qwen3_moe", norm_topk_prob=norm_topk_prob)
    spec = spec_from_config(config)
    hidden = torch.randn(9, HIDDEN)
    weights, _ = route(hidden, block.gate.weight, None, spec)
    sums = weights.sum(-1)
    assert torch.allclose(sums, torch.ones_like(sums)) == norm_topk_prob
    with torch.no_grad():
        assert (
            _rel(moe_forward_ref(hidden, layer_from_block(block, spec), spec), block_output(block, hidden))
            < 1e-6
        )


def test_router_picks_what_transformers_picks():
    for model_type in BLOCKS:
        config, block = random_block(model_type, seed=3)
        spec = spec_from_config(config)
        router = block.router if model_type == "gpt_oss" else block.gate
        hidden = torch.randn(20, HIDDEN)
        with torch.no_grad():
            _, want_weights, want_ids = router(hidden)
            correction_bias = getattr(router, "e_score_correction_bias", None)
            weights, ids = route(hidden, router.weight, getattr(router, "bias", None), spec, correction_bias)
        assert torch.equal(ids, want_ids), model_type
        assert torch.allclose(weights, want_weights.float(), atol=1e-7), model_type


GLM_ROUTINGS = [
    dict(),  # 4 groups, the best 2 searched, renormalised, scaled by 2.5
    dict(n_group=1, topk_group=1, routed_scaling_factor=1.0),  # GLM-4.5-Air's
    dict(n_group=8, topk_group=3, norm_topk_prob=False),  # DeepSeek-V3's 8 groups (of 4 here), not renormalised
]


@pytest.mark.parametrize("overrides", GLM_ROUTINGS)
def test_glm4_moe_routing_is_transformers_router(overrides):
    """Glm4MoeTopkRouter's choice exactly (ids in its slot order) and its weights to 1e-6, on random inputs."""
    config, block = random_block("glm4_moe", seed=5, **overrides)
    spec = spec_from_config(config)
    hidden = torch.randn(200, HIDDEN)
    with torch.no_grad():
        _, want_weights, want_ids = block.gate(hidden)
        weights, ids = route(hidden, block.gate.weight, None, spec, block.gate.e_score_correction_bias)
    assert torch.equal(ids, want_ids)
    assert (weights - want_weights).abs().max().item() < 1e-6


def test_glm4_moe_correction_bias_and_groups_change_the_choice():
    """The test weights make both knobs matter: without the correction bias, or without the group restriction,
    other experts would be chosen for some tokens; the weights are the uncorrected sigmoid scores."""
    config, block = random_block("glm4_moe", seed=5)
    spec = spec_from_config(config)
    router, bias = block.gate, block.gate.e_score_correction_bias
    hidden = torch.randn(200, HIDDEN)
    with torch.no_grad():
        weights, ids = route(hidden, router.weight, None, spec, bias)
        _, unbiased_ids = route(hidden, router.weight, None, spec, torch.zeros_like(bias))
        _, ungrouped_ids = route(hidden, router.weight, None, replace(spec, num_groups=1, topk_groups=1), bias)
        scores = torch.sigmoid(hidden @ router.weight.T).gather(1, ids)
    assert (ids.sort(-1).values != unbiased_ids.sort(-1).values).any(dim=-1).sum() > 20
    assert (ids.sort(-1).values != ungrouped_ids.sort(-1).values).any(dim=-1).sum() > 20
    groups = ids // (spec.num_experts // spec.num_groups)
    assert all(len(set(row)) <= spec.topk_groups for row in groups.tolist())
    want = scores / scores.sum(-1, keepdim=True) * spec.routed_scaling_factor
    assert torch.allclose(weights, want, atol=1e-6)


def test_the_cuda_path_routes_with_the_reference_router():
    """Routing is torch code shared by the CPU and the Triton paths (no host sync, so CUDA graphs capture it):
    the dispatcher calls the very function the tests above check against transformers."""
    assert forward.route is reference.route


def test_glm4_moe_config_errors_name_the_field():
    with pytest.raises(ValueError, match="n_group 5 must split 32 experts"):
        spec_from_config(tiny_config("glm4_moe", n_group=5))
    with pytest.raises(ValueError, match="topk_group 5 must be in 1..n_group"):
        spec_from_config(tiny_config("glm4_moe", topk_group=5))
    with pytest.raises(ValueError, match="hidden_act"):
        spec_from_config(tiny_config("glm4_moe", hidden_act="gelu"))
