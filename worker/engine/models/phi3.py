"""Phi-3 and Phi-4 (Phi3ForCausalLM: Phi-3-mini/medium 4k, Phi-4 14B, Phi-4-mini): Llama's math with q/k/v
and gate/up shipped fused (qkv_proj, gate_up_proj, gate rows first), and partial rotary where
rope_parameters set partial_rotary_factor (Phi-4-mini's). NOTE: the 128k releases (Phi-3-mini-128k,
Phi-3.5-mini, Phi-4-mini) set longrope, which the loader refuses (spec.RUNTIME_ROPE_TYPES says why)."""

from __future__ import annotations

from .llama import read
from .spec import Family, LayerSpec, LinearSpec, NormKind, Parallel

FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    layer=LayerSpec(
        qkv=LinearSpec(("self_attn.qkv_proj",), Parallel.COLUMN),
        o=LinearSpec(("self_attn.o_proj",), Parallel.ROW),
        gate_up=LinearSpec(("mlp.gate_up_proj",), Parallel.COLUMN),
        down=LinearSpec(("mlp.down_proj",), Parallel.ROW),
        attn_in_norm="input_layernorm",
        attn_out_norm=None,
        mlp_in_norm="post_attention_layernorm",
        mlp_out_norm=None,
    ),
    norm=NormKind.RMS,
    read=read,
)
