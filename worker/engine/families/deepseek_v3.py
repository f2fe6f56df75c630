"""DeepSeek-V3, R1, Kimi K2, Moonlight (DeepseekV3ForCausalLM): DeepSeek-V2's latent attention (deepseek_v2.py)
with the low-rank query of the large releases, rotated in (2i, 2i + 1) pairs (`rope_interleave`, transformers'
default, as the releases' weights are laid out), and GLM-4.5's routing: fp32 sigmoid scores, the experts chosen on
the scores plus `e_score_correction_bias` within the best `topk_group` of `n_group` groups, weighted by the
uncorrected scores (renormalised where `norm_topk_prob`, times `routed_scaling_factor`), plus the shared experts.
The first `first_k_dense_replace` layers are dense. The multi-token-prediction layer (`num_nextn_predict_layers`,
model.layers.{num_hidden_layers}) is not part of the model transformers builds: its weights are not loaded. The FP8
releases are block-wise FP8 (`weight_scale_inv`, [128, 128] blocks), which quant/ reads."""

from __future__ import annotations

import dataclasses

from . import deepseek_v2
from .deepseek_v2 import read
from .spec import UnsupportedConfig


def read_v3(config):
    """deepseek_v2's numbers; the Llama-style (i, i + d/2) rotary of `rope_interleave: false` is not declared."""
    if not getattr(config, "rope_interleave", True):
        raise UnsupportedConfig("rope_interleave=False (cbq runs DeepSeek-V3's interleaved rotary)")
    return read(config)


# V2's layers, latent attention and experts; only the name and the config check differ.
FAMILY = dataclasses.replace(deepseek_v2.FAMILY, name="deepseek_v3", model_types=("deepseek_v3",), read=read_v3)
