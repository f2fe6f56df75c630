"""Phi-3 and Phi-4 (Phi3ForCausalLM: Phi-3-mini/medium 4k, Phi-4 14B, Phi-4-mini): Llama's math with q/k/v
and gate/up shipped fused (qkv_proj, gate_up_proj, gate rows first), and partial rotary where
rope_parameters set partial_rotary_factor (Phi-4-mini's). NOTE: the 128k releases (Phi-3-mini-128k, Phi-3.5-mini,
Phi-4-mini) set longrope: a sequence longer than original_max_position_embeddings rotates with the long factors, and
Phi-3's `generate` recomputes a sequence's whole cache when it grows past that length. cbq does the same per
sequence (spec.longrope_original_len), on the owned decoder only: transformers' forward picks one table per batch."""

from __future__ import annotations

from dataclasses import replace

from .llama import read
from .spec import Family, LinearSpec, NormKind, Parallel, llama_layer

FAMILY = Family(
    name="phi3",
    model_types=("phi3",),
    layer=replace(
        llama_layer(),
        qkv=LinearSpec(("self_attn.qkv_proj",), Parallel.COLUMN),
        gate_up=LinearSpec(("mlp.gate_up_proj",), Parallel.COLUMN),
    ),
    norm=NormKind.RMS,
    read=read,
    handles=frozenset({"partial_rotary_factor"}),  # as glm4.py: the rotary table's width is the rotated part
    longrope=True,
)
