"""Qwen2-MoE (Qwen1.5-MoE-A2.7B, Qwen2-57B-A14B): Qwen2's attention (q/k/v biases) and a sparse MLP: a softmax
router, top-4 (top-8 in 57B) of 60/64 experts, weights not renormalised, plus a shared expert whose output a
sigmoid gate scales."""

from __future__ import annotations

from .qwen3_moe import read
from .spec import Family, MoeMlpSpec, NormKind, llama_layer

FAMILY = Family(
    name="qwen2_moe",
    model_types=("qwen2_moe",),
    layer=llama_layer(),
    norm=NormKind.RMS,
    read=read,
    moe=MoeMlpSpec(
        router="mlp.gate",
        experts="mlp.experts",
        shared_expert="mlp.shared_expert",
        shared_expert_gate="mlp.shared_expert_gate",
    ),
)
