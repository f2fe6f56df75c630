"""GLM-4 (GLM-4-9B-0414, GLM-4-32B-0414; Glm4ForCausalLM): four RMSNorms per layer (before and after attention,
before and after the MLP), gate/up shipped fused (gate_up_proj), q/k/v biases, and interleaved partial rotary
(pairs (2i, 2i + 1) over the first half of each head)."""

from __future__ import annotations

from dataclasses import replace

from .llama import read
from .spec import Family, LinearSpec, NormKind, Parallel, llama_layer

FAMILY = Family(
    name="glm4",
    model_types=("glm4",),
    layer=replace(
        llama_layer(),
        gate_up=LinearSpec(("mlp.gate_up_proj",), Parallel.COLUMN),
        attn_out_norm="post_self_attn_layernorm",
        mlp_out_norm="post_mlp_layernorm",
    ),
    norm=NormKind.RMS,
    read=read,
    rotary_interleaved=True,
    # transformers up to 5.17 also sets it at the top level (later versions inside rope_parameters only): the
    # rotary module's inv_freq covers only the rotated dimensions, and the decoder rotates as many as it has.
    handles=frozenset({"partial_rotary_factor"}),
)
