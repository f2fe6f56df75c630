"""GLM-4.5, GLM-4.5-Air, GLM-4.6 (Glm4MoeForCausalLM): Llama's layer layout (two pre-norms, separate q/k/v and
gate/up linears), q/k/v biases without an o bias, per-head q/k RMSNorms where `use_qk_norm` (the 355B releases;
Air leaves them off), and partial rotary: the first half of each head, rotated Llama-style ((i, i + d/2) pairs
within it; GLM-4's own family pairs (2i, 2i + 1)). The sparse MLP: fp32 sigmoid router scores, the experts
chosen on the scores plus `e_score_correction_bias` within the best `topk_group` of `n_group` groups, weighted
by the uncorrected scores (renormalised, times `routed_scaling_factor`), plus an ungated shared MLP; the first
`first_k_dense_replace` layers are dense MLPs of `intermediate_size`. The multi-token-prediction layer
(`num_nextn_predict_layers`) is not part of the model transformers builds: its weights are not loaded."""

from __future__ import annotations

from dataclasses import replace

from .qwen3_moe import read
from .spec import Family, MoeMlpSpec, NormKind, llama_layer

FAMILY = Family(
    name="glm4_moe",
    model_types=("glm4_moe",),
    layer=replace(llama_layer(q_norm="self_attn.q_norm", k_norm="self_attn.k_norm"), qk_norm_optional=True),
    norm=NormKind.RMS,
    read=read,
    moe=MoeMlpSpec(router="mlp.gate", experts="mlp.experts", shared_expert="mlp.shared_experts"),
    # partial_rotary_factor: as glm4.py (the rotary table covers the rotated part; transformers up to 5.17 also
    # sets it at the top level); use_qk_norm: the optional q/k norms above
    handles=frozenset({"partial_rotary_factor", "use_qk_norm"}),
)
