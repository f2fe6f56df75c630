"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414; Glm4ForCausalLM): four RMSNorms per layer (before and after attention,
before and after the MLP), gate/up shipped fused (gate_up_proj), q/k/v biases, and interleaved partial rotary
(pairs (2i, 2i + 1) over the first half of each head)."""

from __future__ import annotations

from .llama import read
from .spec import Family, LayerSpec, LinearSpec, NormKind, Parallel

FAMILY = Family(
    name="glm4",
    model_types=("glm4",),
    layer=LayerSpec(
        qkv=LinearSpec(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), Parallel.COLUMN),
        o=LinearSpec(("self_attn.o_proj",), Parallel.ROW),
        gate_up=LinearSpec(("mlp.gate_up_proj",), Parallel.COLUMN),
        down=LinearSpec(("mlp.down_proj",), Parallel.ROW),
        attn_in_norm="input_layernorm",
        attn_out_norm="post_self_attn_layernorm",
        mlp_in_norm="post_attention_layernorm",
        mlp_out_norm="post_mlp_layernorm",
    ),
    norm=NormKind.RMS,
    read=read,
    rotary_interleaved=True,
)
