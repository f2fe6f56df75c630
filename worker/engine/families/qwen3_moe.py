"""Qwen3-MoE (Qwen3-30B-A3B, Qwen3-235B-A22B): Qwen3's attention (per-head q/k RMSNorm, no biases) and a sparse
MLP: a softmax router over 128 experts, top-8, the chosen weights renormalised (`norm_topk_prob`), no shared
expert. `decoder_sparse_step` and `mlp_only_layers` may leave some layers a dense MLP (the releases set none)."""

from __future__ import annotations

from ..moe import spec_from_config
from .llama import read as read_dense
from .spec import DecoderArgs, Family, MoeMlpSpec, NormKind, UnsupportedConfig, llama_layer


def read(config) -> DecoderArgs:
    """Llama's numbers; the MoE fields must be ones `moe.spec_from_config` computes (its refusal, as one line)."""
    try:
        spec_from_config(config)
    except ValueError as exc:
        raise UnsupportedConfig(str(exc)) from exc
    return read_dense(config)


FAMILY = Family(
    name="qwen3_moe",
    model_types=("qwen3_moe",),
    layer=llama_layer(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"),
    norm=NormKind.RMS,
    read=read,
    moe=MoeMlpSpec(router="mlp.gate", experts="mlp.experts"),
)
