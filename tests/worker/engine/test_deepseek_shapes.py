"""DeepSeek-class shapes in the MoE cost model (moe/cost.py) and the cache: parameter counts equal what transformers
builds for the release-shaped fixtures, the releases' published sizes come out (V2-Lite, V3/R1, Moonlight), and the
cache holds what the attention writes."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from tests.fixtures.deepseek_checkpoints import SHAPES
from worker.engine.models.presets import preset_config
from worker.engine.moe.cost import MoeModelShape

DEEPSEEK_V3 = dict(  # the V3 / R1 release's config.json (the MTP layer aside: transformers does not build it)
    vocab_size=129280, hidden_size=7168, intermediate_size=18432, moe_intermediate_size=2048, num_hidden_layers=61,
    num_attention_heads=128, num_key_value_heads=128, n_shared_experts=1, n_routed_experts=256,
    routed_scaling_factor=2.5, kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, v_head_dim=128,
    qk_nope_head_dim=128, n_group=8, topk_group=4, num_experts_per_tok=8, first_k_dense_replace=3,
    norm_topk_prob=True,
)  # fmt: skip


def _config(name: str):
    raw = {k: v for k, v in SHAPES[name].items() if k not in ("model_type", "quantization_config")}
    return AutoConfig.for_model(SHAPES[name]["model_type"], **raw)


def _active(shape: MoeModelShape) -> float:
    return (shape.dense_params + len(shape.moe_layers) * shape.spec.top_k * shape.spec.params_per_expert) / 1e9


@pytest.mark.parametrize("name", list(SHAPES))
def test_parameter_count_equals_transformers_model(name):
    config = _config(name)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    assert MoeModelShape.from_config(config).num_params == sum(p.numel() for p in model.parameters())


def test_published_sizes():
    """V2-Lite's card: 15.7B total, 2.4B active; V3's: 671B total, 37B active; Moonlight's name: 16B total,
    about 3B active (the active counts without the input embedding)."""
    lite = MoeModelShape.from_config(preset_config("deepseek-v2-lite"))
    assert round(lite.num_params / 1e9, 1) == 15.7 and _active(lite) == pytest.approx(2.4, abs=0.15)
    v3 = MoeModelShape.from_config(AutoConfig.for_model("deepseek_v3", **DEEPSEEK_V3))
    assert v3.num_params / 1e9 == pytest.approx(671, rel=0.01) and _active(v3) == pytest.approx(37, abs=1.5)
    moonlight = MoeModelShape.from_config(preset_config("moonlight-16b-a3b"))
    assert moonlight.num_params / 1e9 == pytest.approx(16, rel=0.05) and 2.2 < _active(moonlight) < 3.1


def test_latent_cache_bytes_beside_llama3_8b():
    """Per token, all layers, bf16: DeepSeek-V2-Lite's latent 27 x (512 + 64) x 2 = 31,104 bytes, its heads expanded
    (decoder "hf") 27 x 2 x 16 x 192 x 2 = 331,776, Llama-3-8B's GQA 32 x 2 x 8 x 128 x 2 = 131,072; V3's latent
    61 x 576 x 2 = 70,272. The MoE floor reads the latent."""
    from worker.engine.kv_cache import kv_bytes_per_block

    lite, llama = preset_config("deepseek-v2-lite"), preset_config("llama3-8b")
    assert kv_bytes_per_block(lite, 1, torch.bfloat16, latent=True) == 31_104
    assert kv_bytes_per_block(lite, 1, torch.bfloat16) == 331_776
    assert kv_bytes_per_block(llama, 1, torch.bfloat16) == 131_072
    v3 = AutoConfig.for_model("deepseek_v3", **DEEPSEEK_V3)
    assert kv_bytes_per_block(v3, 1, torch.bfloat16, latent=True) == 70_272
    shape = MoeModelShape.from_config(lite)
    assert shape.kv_bytes_per_token_per_layer(2) * lite.num_hidden_layers == 31_104
