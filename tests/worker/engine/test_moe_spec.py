"""MoeSpec from transformers' configs (worker/engine/moe/spec.py): the release defaults of each family, which
layers are sparse (as transformers builds them), and one clear line for what the layer does not compute."""

from __future__ import annotations

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    Glm4MoeConfig,
    GptOssConfig,
    LlamaConfig,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from worker.engine.moe import Activation, MoeSpec, RouterScoring, moe_layer_ids, spec_from_config

from .test_moe_reference import BLOCKS, tiny_config


def test_family_specs():
    qwen3 = spec_from_config(Qwen3MoeConfig(norm_topk_prob=True))
    assert (qwen3.num_experts, qwen3.top_k, qwen3.expert_intermediate_size) == (128, 8, 768)
    assert qwen3.scoring is RouterScoring.SOFTMAX and qwen3.norm_topk_prob and not qwen3.has_shared_expert
    qwen2 = spec_from_config(Qwen2MoeConfig())
    assert (
        qwen2.has_shared_expert_gate
        and qwen2.shared_expert_intermediate_size == 5632
        and not qwen2.norm_topk_prob
    )
    mixtral = spec_from_config(MixtralConfig())
    assert (mixtral.num_experts, mixtral.top_k, mixtral.expert_intermediate_size) == (8, 2, 14336)
    assert mixtral.norm_topk_prob and not mixtral.has_router_bias
    oss = spec_from_config(GptOssConfig())
    assert oss.scoring is RouterScoring.SOFTMAX_OVER_TOPK and oss.activation is Activation.CLAMPED_SWIGLU
    assert (
        oss.has_router_bias and oss.has_expert_bias and (oss.swiglu_alpha, oss.swiglu_limit) == (1.702, 7.0)
    )
    assert oss.params_per_expert == 3 * 2880 * 2880 + 2 * 2880 + 2880
    glm = spec_from_config(Glm4MoeConfig())  # GLM-4.5-Air's defaults
    assert (glm.num_experts, glm.top_k, glm.expert_intermediate_size) == (128, 8, 1408)
    assert glm.scoring is RouterScoring.SIGMOID and glm.norm_topk_prob and glm.has_score_correction_bias
    assert (glm.num_groups, glm.topk_groups, glm.routed_scaling_factor) == (1, 1, 1.0)
    assert glm.shared_expert_intermediate_size == 1408 and not glm.has_shared_expert_gate
    # GLM-4.5's (355B) knobs; the multi-token-prediction layer's count is not read (transformers builds none)
    big = spec_from_config(Glm4MoeConfig(n_routed_experts=160, routed_scaling_factor=2.5, num_nextn_predict_layers=1))
    assert big.num_experts == 160 and big.routed_scaling_factor == 2.5
    assert spec_from_config(Glm4MoeConfig(scoring_func="sigmoid", topk_method="noaux_tc")) == glm


@pytest.mark.parametrize(
    "model_type, overrides",
    [
        ("qwen3_moe", dict(mlp_only_layers=[1, 3])),
        ("qwen2_moe", dict(decoder_sparse_step=2)),
        ("qwen3_moe", dict(decoder_sparse_step=3, mlp_only_layers=[2])),
        ("mixtral", {}),
        ("gpt_oss", {}),
        ("glm4_moe", dict(first_k_dense_replace=1)),
        ("glm4_moe", dict(first_k_dense_replace=3)),
    ],
)
def test_sparse_layers_are_where_transformers_puts_them(model_type, overrides):
    config = tiny_config(model_type, num_hidden_layers=6, **overrides)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    sparse = tuple(
        i for i, layer in enumerate(model.model.layers) if isinstance(layer.mlp, BLOCKS[model_type])
    )
    assert moe_layer_ids(config) == sparse


@pytest.mark.parametrize(
    "config, message",
    [
        (Qwen3MoeConfig(hidden_act="gelu"), r"qwen3_moe config field hidden_act='gelu' is not supported"),
        (MixtralConfig(hidden_act="relu"), r"mixtral config field hidden_act='relu'"),
        (
            LlamaConfig(),
            r"model type 'llama' has no MoE spec \(supported: qwen3_moe, qwen2_moe, mixtral, gpt_oss, glm4_moe, deepseek_v2, deepseek_v3\)",
        ),
        (Qwen3MoeConfig(n_group=8), r"qwen3_moe config field n_group=8 .* does not read it"),
        (Qwen2MoeConfig(routed_scaling_factor=2.5), r"routed_scaling_factor=2\.5"),
        (  # per-tensor FP8 (no weight_block_size): refused as on a dense model
            Qwen3MoeConfig(quantization_config={"quant_method": "fp8"}),
            r"quant_method 'fp8' without weight_block_size \(per-tensor FP8\) is not supported",
        ),
        (  # FP8 formats whose experts cbq does not read (fbgemm's per-channel release is Llama's, dense)
            Glm4MoeConfig(quantization_config={"quant_method": "fbgemm_fp8"}),
            r"quant_method 'fbgemm_fp8' on a mixture of experts \(glm4_moe\) is not supported; cbq runs mixtures",
        ),
        (
            Qwen3MoeConfig(quantization_config={"quant_method": "bitsandbytes"}),
            r"quant_method 'bitsandbytes' is not supported",
        ),
        (Glm4MoeConfig(hidden_act="gelu"), r"glm4_moe config field hidden_act='gelu'"),
        (Glm4MoeConfig(scoring_func="softmax"), r"glm4_moe config field scoring_func='softmax' .* does not read it"),
    ],
)
def test_unsupported_fields_refused_in_one_line(config, message):
    with pytest.raises(ValueError, match=message) as err:
        spec_from_config(config)
    assert "\n" not in str(err.value)


def test_gpt_oss_mxfp4_config_accepted_and_scaling_factor_one_ignored():
    assert (
        spec_from_config(GptOssConfig(quantization_config={"quant_method": "mxfp4"})).model_type == "gpt_oss"
    )
    # Qwen3-*-FP8's block-wise experts: read and dequantized at load, the layer's math unchanged
    block = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [128, 128]}
    assert spec_from_config(Qwen3MoeConfig(quantization_config=block)) == spec_from_config(Qwen3MoeConfig())
    assert spec_from_config(Qwen3MoeConfig(routed_scaling_factor=1.0)).routed_scaling_factor == 1.0


def test_spec_checks_itself():
    with pytest.raises(ValueError, match="top_k 9 must be in 1..num_experts"):
        MoeSpec("qwen3_moe", num_experts=8, top_k=9, hidden_size=8, expert_intermediate_size=8)
    with pytest.raises(ValueError, match="shared_expert_gate needs a shared expert"):
        MoeSpec("qwen2_moe", 8, 2, 8, 8, has_shared_expert_gate=True)
    with pytest.raises(ValueError, match="groups and a score correction bias need sigmoid scoring"):
        MoeSpec("qwen3_moe", 8, 2, 8, 8, num_groups=2)
    with pytest.raises(ValueError, match="must hold top_k"):  # 2 groups of 2 experts cannot hold 6
        MoeSpec("glm4_moe", 8, 6, 8, 8, scoring=RouterScoring.SIGMOID, num_groups=4, topk_groups=2)
