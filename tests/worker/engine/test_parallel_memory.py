"""memory.py counts every parameter of a real model at TP=1, and splits it as layers/ does at TP=N."""

from __future__ import annotations

import pytest
import torch

from worker.engine.models import preset_config
from worker.engine.parallel.memory import (
    DecoderShape,
    check_fits,
    kv_bytes_per_token_per_rank,
    weight_bytes_per_rank,
)


def num_params(config) -> int:
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    return sum(p.numel() for p in model.parameters())  # a tied lm_head is listed once


@pytest.mark.parametrize(
    ("preset", "flags"),
    [("llama3-8b", {}), ("tiny-qwen2", {"qkv_bias": True}), ("tiny-qwen3", {"qk_norm": True})],
)
def test_tp1_counts_every_parameter(preset, flags):
    config = preset_config(preset)
    shape = DecoderShape.from_config(config, **flags)
    assert weight_bytes_per_rank(shape, 1, 2).total == 2 * num_params(config)


def test_tp1_counts_moe_experts_and_router_and_tied_embeddings():
    from transformers import AutoConfig

    config = AutoConfig.for_model(
        "qwen3_moe", vocab_size=320, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_experts=4, num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, tie_word_embeddings=True,
    )  # fmt: skip
    shape = DecoderShape.from_config(config, qk_norm=True)
    assert weight_bytes_per_rank(shape, 1, 4).total == 4 * num_params(config)


def test_tp1_counts_mixtral_experts_by_their_own_config_names():
    """Mixtral names its experts num_local_experts x intermediate_size: all 8 are counted, not one dense MLP."""
    config = preset_config("tiny-mixtral")
    shape = DecoderShape.from_config(config)
    assert (shape.num_experts, shape.expert_intermediate_size) == (8, 128)
    assert weight_bytes_per_rank(shape, 1, 2).total == 2 * num_params(config)


def test_tp_splits_all_but_norms():
    shape = DecoderShape.from_config(preset_config("llama3-8b"))
    one, two, eight = (weight_bytes_per_rank(shape, n, 2) for n in (1, 2, 8))
    assert one.total / 1e9 == pytest.approx(16.06, abs=0.01)
    assert two.sharded * 2 == one.sharded and eight.sharded * 8 == one.sharded  # 8 KV heads: all split
    assert two.replicated == eight.replicated == one.replicated == (2 * 32 + 1) * 4096 * 2


def test_kv_heads_replicated_beyond_their_count():
    """8 KV heads over 16 ranks: each rank holds one whole KV head (counted as replicated), where at
    TP=8 each rank held one KV head as its shard."""
    shape = DecoderShape.from_config(preset_config("llama3-8b"))
    split, replicated = weight_bytes_per_rank(shape, 8, 2), weight_bytes_per_rank(shape, 16, 2)
    kv_head_bytes = 2 * 128 * 4096 * 2 * 32  # k and v rows of one head, bf16, 32 layers
    assert replicated.replicated - split.replicated == kv_head_bytes
    assert split.sharded - 2 * replicated.sharded == kv_head_bytes  # at TP=8 they were split


def test_vocab_padded_to_the_world_size():
    shape = DecoderShape(64, 128, 1, 4, 2, 16, vocab_size=33, tie_word_embeddings=True)
    no_vocab = weight_bytes_per_rank(DecoderShape(64, 128, 1, 4, 2, 16, 2, True), 2, 1)
    assert weight_bytes_per_rank(shape, 2, 1).sharded - no_vocab.sharded == (17 - 1) * 64


def test_check_fits_says_the_numbers():
    shape = DecoderShape.from_config(preset_config("llama3-8b"))
    with pytest.raises(ValueError, match=r"llama3-8b does not fit 2 GPUs: 8.0 GB of weights per rank \(8.0 GB sharded \+ 0.0 GB replicated\), but rank 1 has 7.0 GB free"):  # fmt: skip
        check_fits(shape, 2, 2, [80 * 10**9, 7 * 10**9], "llama3-8b")
    assert check_fits(shape, 2, 2, [9 * 10**9] * 2, "llama3-8b").total < 9 * 10**9
    with pytest.raises(
        ValueError, match="intermediate_size 14336 is not divisible by the tensor-parallel size 3"
    ):
        weight_bytes_per_rank(DecoderShape(4096, 14336, 1, 48, 48, 128, 1000, False), 3, 2)


def test_kv_bytes_per_token_per_rank():
    shape = DecoderShape.from_config(preset_config("llama3-8b"))
    assert kv_bytes_per_token_per_rank(shape, 1, 2) == 128 * 1024  # DESIGN.md's figure for Llama-3-8B
    assert kv_bytes_per_token_per_rank(shape, 2, 2) == 64 * 1024
    # 8 KV heads: from TP=8 on, each rank caches one whole (replicated) head
    assert kv_bytes_per_token_per_rank(shape, 16, 2) == kv_bytes_per_token_per_rank(shape, 8, 2) == 16 * 1024


@pytest.mark.parametrize("world_size", [1, 2])
def test_fp8_linears_count_one_byte_a_weight(world_size):
    """FP8 checkpoints at TP=N: the decoder linears' weights at 1 byte, the rest (embeddings, norms, biases) at
    the model dtype's; at TP=1 the linears are exactly the model's nn.Linear weights but the output head."""
    from transformers import AutoModelForCausalLM

    config = preset_config("tiny-qwen2")
    shape = DecoderShape.from_config(config, qkv_bias=True)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    linears = sum(
        m.weight.numel() for name, m in model.named_modules() if isinstance(m, torch.nn.Linear) and name != "lm_head"
    )
    dense, fp8 = weight_bytes_per_rank(shape, world_size, 2), weight_bytes_per_rank(shape, world_size, 2, 1)
    assert dense.total - fp8.total == linears // world_size


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_tp1_counts_latent_attention_dense_layers_and_shared_experts(name):
    """DeepSeek's shape: the latent attention (q LoRA or not), a dense first layer, the shared experts, the routers."""
    from transformers import AutoConfig

    from tests.fixtures.deepseek_checkpoints import SHAPES

    raw = {k: v for k, v in SHAPES[name].items() if k not in ("model_type", "quantization_config")}
    config = AutoConfig.for_model(SHAPES[name]["model_type"], **raw)
    shape = DecoderShape.from_config(config)
    assert shape.latent is not None and shape.num_dense_layers == 1 and shape.shared_expert_intermediate_size > 0
    assert weight_bytes_per_rank(shape, 1, 2).total == 2 * num_params(config)
    one, two = weight_bytes_per_rank(shape, 1, 2), weight_bytes_per_rank(shape, 2, 2)
    # at two ranks: everything but the norms, the routers and the latent's projections halves
    assert two.replicated == one.replicated and two.sharded * 2 == one.sharded
    # the whole latent on every rank, at any world size: (kv_lora_rank + qk_rope_head_dim) per layer
    width = config.kv_lora_rank + config.qk_rope_head_dim
    assert kv_bytes_per_token_per_rank(shape, 2, 2) == kv_bytes_per_token_per_rank(shape, 1, 2) == 3 * width * 2


def test_deepseek_v3_release_per_rank():
    """V3 / R1's config: 671B at TP=1 (the MoE cost model's count); at TP=8 with FP8 linears kept (1 byte) and its
    experts dequantized to bf16, ~167 GB a rank, which no H200 holds; with the routed experts kept FP8 too (each rank
    its 256 of every expert's 2,048 columns, 1 byte a weight), ~85 GB, which fits (the shared experts stay bf16, as
    every linear under a sparse MLP does); the latent cache is 61 x 576 x 2 = 70,272 bytes a token on every rank
    (docs/operations.md's V3/R1 plan)."""
    from transformers import AutoConfig

    from worker.engine.moe.cost import MoeModelShape

    from .test_deepseek_shapes import DEEPSEEK_V3

    config = AutoConfig.for_model("deepseek_v3", **DEEPSEEK_V3)
    shape = DecoderShape.from_config(config)
    assert weight_bytes_per_rank(shape, 1, 1).total == MoeModelShape.from_config(config).num_params
    assert weight_bytes_per_rank(shape, 8, 2, linear_bytes_per_param=1).total / 1e9 == pytest.approx(167.2, abs=0.1)
    kept = weight_bytes_per_rank(shape, 8, 2, linear_bytes_per_param=1, expert_bytes_per_param=1)
    routed = 58 * 256 * 3 * 7168 * 2048 // 8  # the sparse layers' routed experts, a rank's columns
    assert weight_bytes_per_rank(shape, 8, 2, linear_bytes_per_param=1).total - kept.total == routed
    assert kept.total / 1e9 == pytest.approx(85.4, abs=0.5)
    assert kv_bytes_per_token_per_rank(shape, 8, 2) == 70_272
