"""The MoE weight and step-cost model (worker/engine/moe/cost.py): parameter counts equal what transformers
builds, the released models' published sizes come out, the distinct-experts formula matches a simulation, and
a step's bytes and FLOPs add up by hand."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch
from transformers import AutoModelForCausalLM, Glm4MoeConfig, GptOssConfig, MixtralConfig, Qwen3MoeConfig

from worker.engine.moe.cost import (
    MXFP4_BYTES_PER_PARAM,
    MoeModelShape,
    check_weights_fit,
    expected_distinct_experts,
    step_cost,
    weight_bytes,
)
from worker.engine.moe.spec import MoeSpec

from .test_moe_reference import tiny_config

QWEN3_30B_A3B = dict(
    num_hidden_layers=48, hidden_size=2048, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
    moe_intermediate_size=768, num_experts=128, num_experts_per_tok=8, vocab_size=151936, norm_topk_prob=True,
)  # fmt: skip
GLM_45_AIR = dict(
    hidden_size=4096, num_hidden_layers=46, num_attention_heads=96, num_key_value_heads=8, head_dim=128,
    n_routed_experts=128, num_experts_per_tok=8, moe_intermediate_size=1408, n_shared_experts=1,
    first_k_dense_replace=1, intermediate_size=10944, vocab_size=151552, attention_bias=True, use_qk_norm=False,
)  # fmt: skip
GLM_45 = dict(
    GLM_45_AIR, hidden_size=5120, num_hidden_layers=92, n_routed_experts=160, moe_intermediate_size=1536,
    first_k_dense_replace=3, intermediate_size=12288, use_qk_norm=True, routed_scaling_factor=2.5,
)  # fmt: skip
GPT_OSS_20B = dict(num_hidden_layers=24, num_local_experts=32, quantization_config={"quant_method": "mxfp4"})


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("qwen3_moe", {}),
        ("qwen3_moe", dict(attention_bias=True, mlp_only_layers=[0], tie_word_embeddings=True)),
        ("qwen2_moe", dict(decoder_sparse_step=2, intermediate_size=72)),
        ("mixtral", {}),
        ("gpt_oss", {}),
        ("glm4_moe", dict(use_qk_norm=True, attention_bias=True)),  # the shared expert, layer 0 dense
        ("glm4_moe", dict(use_qk_norm=False, first_k_dense_replace=2, n_shared_experts=2)),
    ],
)
def test_parameter_count_equals_transformers_model(model_type, overrides):
    config = tiny_config(model_type, num_hidden_layers=3, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert MoeModelShape.from_config(config).num_params == sum(p.numel() for p in model.parameters())


def test_published_sizes_of_released_models():
    qwen = MoeModelShape.from_config(Qwen3MoeConfig(**QWEN3_30B_A3B))
    active = (
        qwen.dense_params + len(qwen.moe_layers) * 8 * qwen.spec.params_per_expert + qwen.embedding_params
    )
    assert round(qwen.num_params / 1e9, 1) == 30.5  # the card: "30.5B in total, 3.3B activated"
    assert active / 1e9 == pytest.approx(3.3, abs=0.1)
    oss = MoeModelShape.from_config(GptOssConfig(**GPT_OSS_20B))
    assert round(oss.num_params / 1e9, 1) == 20.9 and oss.mxfp4_experts
    assert oss.window_per_layer[:2] == (128, None)  # alternating sliding and full attention
    mixtral = MoeModelShape.from_config(MixtralConfig())
    assert round(mixtral.num_params / 1e9, 1) == 46.7
    # GLM-4.5-Air's card: "106B total parameters and 12B active"; GLM-4.5: 355B and 32B. Without the
    # multi-token-prediction layer (transformers does not build it) and counting the active ones without
    # the input embedding, as the cards do.
    for config, total, active in ((GLM_45_AIR, 106, 12), (GLM_45, 355, 32)):
        glm = MoeModelShape.from_config(Glm4MoeConfig(**config))
        activated = glm.dense_params + len(glm.moe_layers) * 8 * glm.spec.params_per_expert
        assert glm.num_params / 1e9 == pytest.approx(total, rel=0.01)
        assert activated / 1e9 == pytest.approx(active, abs=1)
        assert glm.num_dense_layers == config["first_k_dense_replace"] and glm.spec.has_shared_expert


def test_weight_bytes_mxfp4_and_dequantized():
    oss = MoeModelShape.from_config(GptOssConfig(**GPT_OSS_20B))
    packed, dequantized = weight_bytes(oss, 2, dequantize_mxfp4=False), weight_bytes(oss, 2)
    assert MXFP4_BYTES_PER_PARAM == 17 / 32
    assert packed.experts == oss.expert_matrix_params * 17 / 32 + oss.expert_bias_params * 2
    assert dequantized.experts == oss.expert_params * 2
    assert packed.dense == dequantized.dense == oss.dense_params * 2
    assert packed.total == pytest.approx(13.76e9, rel=1e-3)  # the release's ~13 GB of safetensors
    assert dequantized.total == oss.num_params * 2


def test_check_weights_fit_says_the_numbers():
    oss = MoeModelShape.from_config(GptOssConfig(**GPT_OSS_20B))
    weights = weight_bytes(oss, 2)  # 41.8 GB dequantized
    check_weights_fit(weights, gpu_bytes=80_000_000_000, min_kv_bytes=1_000_000_000)
    with pytest.raises(ValueError, match=r"does not fit: weights 41\.8 GB .* GPU 24\.0 GB, 0\.0 GB left"):
        check_weights_fit(weights, gpu_bytes=24_000_000_000)


def test_expected_distinct_experts_matches_a_simulation():
    assert expected_distinct_experts(1, 128, 8) == pytest.approx(8)
    assert expected_distinct_experts(0, 128, 8) == 0
    assert expected_distinct_experts(4096, 128, 8) == pytest.approx(128)
    assert expected_distinct_experts(5, 8, 8) == 8
    gen = torch.Generator().manual_seed(0)
    for num_tokens, num_experts, top_k in ((4, 128, 8), (32, 128, 8), (16, 32, 4)):
        trials = [
            len(
                {
                    int(e)
                    for _ in range(num_tokens)
                    for e in torch.randperm(num_experts, generator=gen)[:top_k]
                }
            )
            for _ in range(300)
        ]
        assert sum(trials) / len(trials) == pytest.approx(
            expected_distinct_experts(num_tokens, num_experts, top_k), rel=0.02
        )


def _tiny_shape(window_per_layer=(None, 4)) -> MoeModelShape:
    spec = MoeSpec("qwen3_moe", num_experts=4, top_k=2, hidden_size=8, expert_intermediate_size=3)
    return MoeModelShape(
        spec=spec, num_layers=2, vocab_size=10, tie_word_embeddings=False, num_heads=2, num_kv_heads=1,
        head_dim=4, qkv_bias=False, o_bias=False, qk_norm=False, attention_sinks=False,
        window_per_layer=window_per_layer, moe_layers=(1,), dense_intermediate_size=5, mxfp4_experts=False,
    )  # fmt: skip


def test_step_cost_by_hand():
    shape = _tiny_shape()
    # attention per layer: q 8x8, k 8x4, v 8x4, o 8x8, two norms of 8 -> 208; layer 0 dense MLP 3*8*5 = 120;
    # layer 1 router 4*8 = 32; final norm 8; LM head 10*8 = 80
    assert shape.dense_params == 2 * 208 + 120 + 32 + 8 + 80
    cost = step_cost(shape, num_tokens=3, num_seqs=2, context_tokens=20, dtype_bytes=2)
    assert cost.dense_bytes == 656 * 2
    per_expert_bytes = 3 * 8 * 3 * 2
    assert cost.expert_bytes == pytest.approx(4 * (1 - 0.5**3) * per_expert_bytes)
    # layer 0 full: 20 tokens; layer 1 window 4: at most 2 sequences x 4 -> 8; K and V, 1 head of 4, 2 bytes
    assert cost.kv_bytes == (20 + 8) * 2 * 4 * 2
    assert cost.flops == 2 * (
        3 * (656 - 80 + 2 * 72) + 2 * 80
    )  # 2 experts of 72 a token; LM head per sequence
    assert cost.floor_seconds(1e3, 1e12) == pytest.approx(cost.bytes / 1e3)
    assert cost.floor_seconds(1e12, 1.0) == cost.flops


def test_decode_reads_few_experts_and_prefill_reads_all():
    shape = MoeModelShape.from_config(Qwen3MoeConfig(**QWEN3_30B_A3B))
    all_experts = len(shape.moe_layers) * 128 * shape.spec.params_per_expert * 2
    one = step_cost(shape, 1, 1, 1000, 2)
    assert one.expert_bytes == pytest.approx(all_experts * 8 / 128)
    decode = step_cost(shape, 32, 32, 32 * 1024, 2)
    assert 0.8 * all_experts < decode.expert_bytes < all_experts  # 32 x 8 picks over 128 experts: ~87% hit
    prefill = step_cost(shape, 8192, 4, 8192, 2)
    assert prefill.expert_bytes == pytest.approx(all_experts)
    lm_head_flops = 2 * shape.vocab_size * 2048  # a sequence's logits
    # FLOPs follow the active parameters per token, however many experts the step hits
    assert (prefill.flops - 4 * lm_head_flops) / 8192 == (decode.flops - 32 * lm_head_flops) / 32


def test_the_loader_says_an_moe_models_numbers_and_refuses_one_that_does_not_fit():
    """At load on CUDA (`models.loader._check_fit`): the weights from the config alone, before any allocation."""
    from worker.engine.models.loader import ModelLoadError, check_moe_fit, preset_config

    config = preset_config("qwen3-30b-a3b")
    line = check_moe_fit(config, torch.bfloat16, 140 * 10**9)
    assert line.startswith("qwen3_moe: weights 61.1 GB (experts 58.0 GB) in bfloat16, GPU free 140.0 GB, 78.9 GB")
    with pytest.raises(ModelLoadError, match=r"does not fit: weights 61.1 GB \(experts 58.0 GB\), GPU 40.0 GB"):
        check_moe_fit(config, torch.bfloat16, 40 * 10**9)


def test_glm45_air_bench_presets_fit_as_their_comments_say_and_their_floor_counts_the_shared_expert():
    """`glm45-air` is GLM-4.5-Air's shape (more than one H200 holds in bf16); `glm45-air-23l` its first 23 layers,
    which one does. Each step's floor reads and computes the shared expert of every sparse layer and layer 0's
    dense MLP (both in `dense_params`, read whatever the routing)."""
    from worker.engine.models.loader import ModelLoadError, check_moe_fit, preset_config

    with pytest.raises(ModelLoadError, match=r"does not fit: weights 213.7 GB \(experts 199.3 GB\)"):
        check_moe_fit(preset_config("glm45-air"), torch.bfloat16, 140 * 10**9)
    cut = MoeModelShape.from_config(preset_config("glm45-air-23l"))
    assert check_moe_fit(preset_config("glm45-air-23l"), torch.bfloat16, 140 * 10**9).startswith(
        "glm4_moe: weights 106.0 GB"
    )
    hidden, spec = 4096, cut.spec
    assert cut.moe_layers == tuple(range(1, 23)) and spec.shared_expert_intermediate_size == 1408
    without = MoeModelShape(**{**cut.__dict__, "spec": replace(spec, shared_expert_intermediate_size=0)})
    assert cut.dense_params - without.dense_params == 22 * 3 * hidden * 1408
    all_sparse = MoeModelShape(**{**cut.__dict__, "moe_layers": tuple(range(23))})
    assert cut.dense_params - all_sparse.dense_params == 3 * hidden * 10944 - spec.router_params - 3 * hidden * 1408
    one, lm_head = step_cost(cut, 1, 1, 100, 2), 151552 * hidden
    assert one.flops == 2 * (cut.dense_params - lm_head + 22 * 8 * spec.params_per_expert + lm_head)
