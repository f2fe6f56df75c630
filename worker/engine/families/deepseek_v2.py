"""DeepSeek-V2 and V2-Lite (DeepseekV2ForCausalLM): multi-head latent attention and a DeepSeekMoE MLP.

Attention: q from a full projection (`q_lora_rank` null: V2-Lite) or a low-rank one (q_a_proj, its RMSNorm,
q_b_proj: V2); K and V from one latent per token: kv_a_proj_with_mqa gives `kv_lora_rank` latent values (then
kv_a_layernorm) and a `qk_rope_head_dim` rotary key shared by every head; kv_b_proj expands the latent into each
head's `qk_nope_head_dim` key and `v_head_dim` value. Each head's query and key are [nope; rope], rotated in
(2i, 2i + 1) pairs (V2's complex rotary, V3's `rope_interleave`). The softmax scale is qk_head_dim^-0.5 times
YaRN's mscale(factor, mscale_all_dim)^2 where the config sets it (transformers' `yarn_apply_mscale`).

MLP: the first `first_k_dense_replace` layers are dense (`intermediate_size`); the others route each token to
`num_experts_per_tok` of `n_routed_experts` by a softmax over all of them (`topk_method` "greedy", the chosen
weights not renormalised, times `routed_scaling_factor`) and add `n_shared_experts` ungated shared experts.

transformers' model runs with cbq's paged attention ("hf"): the cache holds each head's expanded K and V (V padded
to the key's width, `kv_cache.cache_head_dim`). "auto" runs its layers with cbq's latent attention
(latent_attention.py); "owned" runs the owned decoder, `Family.mla` read by latent_layer.py."""

from __future__ import annotations

import math

from ..moe import spec_from_config
from .spec import (
    DecoderArgs,
    Family,
    LayerSpec,
    LinearSpec,
    MlaSpec,
    MoeMlpSpec,
    NormKind,
    Parallel,
    UnsupportedConfig,
    activation_of,
)


def mla_softmax_scale(config) -> float:
    """What multiplies q.k: qk_head_dim^-0.5, times YaRN's mscale(factor, mscale_all_dim)^2 where set."""
    qk_head_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
    # Written out rather than imported: transformers' `yarn_apply_mscale` is newer than 5.17 (the H200's).
    scale = qk_head_dim**-0.5
    rope = config.rope_parameters
    mscale_all_dim = rope.get("mscale_all_dim", 0) if rope.get("rope_type", "default") != "default" else 0
    if mscale_all_dim and rope["factor"] > 1:
        mscale = 0.1 * mscale_all_dim * math.log(rope["factor"]) + 1.0  # YaRN's get_mscale
        scale *= mscale * mscale
    return float(scale)


def read(config) -> DecoderArgs:
    """The MLA scale and the MLP activation; the MoE fields must be ones `moe.spec_from_config` computes."""
    try:
        spec_from_config(config)
    except ValueError as exc:
        raise UnsupportedConfig(str(exc)) from exc
    for name in ("qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "kv_lora_rank"):
        if not getattr(config, name, 0):
            raise UnsupportedConfig(f"{name}={getattr(config, name, None)!r} (latent attention needs it > 0)")
    return DecoderArgs(activation=activation_of(config, "hidden_act"), attention_scale=mla_softmax_scale(config))


# The attention's linears are `MLA`'s; `qkv` names the query projection alone and `o` the output one, so that a
# reader of LayerSpec's GEMMs finds the right modules (the owned decoder stacks the q and kv_a projections into its
# `qkv` GEMM: latent_layer.latent_layer_spec).
LAYER = LayerSpec(
    qkv=LinearSpec(("self_attn.q_proj",), Parallel.COLUMN),
    o=LinearSpec(("self_attn.o_proj",), Parallel.ROW),
    gate_up=LinearSpec(("mlp.gate_proj", "mlp.up_proj"), Parallel.COLUMN),
    down=LinearSpec(("mlp.down_proj",), Parallel.ROW),
    attn_in_norm="input_layernorm",
    attn_out_norm=None,
    mlp_in_norm="post_attention_layernorm",
    mlp_out_norm=None,
)

MLA = MlaSpec(
    q_proj="self_attn.q_proj",
    q_a_proj="self_attn.q_a_proj",
    q_a_norm="self_attn.q_a_layernorm",
    q_b_proj="self_attn.q_b_proj",
    kv_a_proj="self_attn.kv_a_proj_with_mqa",
    kv_a_norm="self_attn.kv_a_layernorm",
    kv_b_proj="self_attn.kv_b_proj",
    o_proj="self_attn.o_proj",
)

MOE = MoeMlpSpec(router="mlp.gate", experts="mlp.experts", shared_expert="mlp.shared_experts")

FAMILY = Family(
    name="deepseek_v2",
    model_types=("deepseek_v2",),
    layer=LAYER,
    norm=NormKind.RMS,
    read=read,
    moe=MOE,
    mla=MLA,
    rotary_interleaved=True,
)
