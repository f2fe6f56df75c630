"""What an MoE layer computes, as one frozen dataclass read from a transformers config. Owns nothing mutable.

`MoeSpec` is the math of one sparse layer: how the router scores and picks experts, how the chosen weights
are normalised and scaled, which biases exist, the experts' activation and the shared expert. Weight layout
is not part of it (every family's experts are stored the same way, `weights.py`), nor is the attention.

`spec_from_config` knows seven families (qwen3_moe, qwen2_moe, mixtral, gpt_oss, glm4_moe, deepseek_v2/v3) and refuses, in one
line, any config field that would change the math in a way this package does not compute, and any quantization
whose experts cbq cannot read (quant/config.py `moe_quantization`: FP8 experts kept FP8 on sm89+ GPUs, fp8.py).
`moe_layer_ids` says which decoder layers are sparse (Qwen's `decoder_sparse_step` and `mlp_only_layers`, GLM-4.5's
and DeepSeek's `first_k_dense_replace`); the others are dense MLPs of `dense_intermediate_size`.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..quant.config import has_mxfp4_experts, moe_quantization


class RouterScoring(str, Enum):
    SOFTMAX = "softmax"  # softmax over all experts, then top-k (Qwen, Mixtral)
    SOFTMAX_OVER_TOPK = "softmax_over_topk"  # top-k of the logits, then softmax over those k (gpt-oss)
    # DeepSeek-V3 style (GLM-4.5): fp32 logits, an independent sigmoid per expert; the experts are chosen on the
    # sigmoid plus a per-expert correction bias, within the best `topk_groups` of `num_groups` groups, and
    # weighted by the uncorrected sigmoid
    SIGMOID = "sigmoid"


class Activation(str, Enum):
    SILU_MUL = "silu_mul"  # silu(gate) * up
    # gpt-oss: gate = min(gate, limit), up = clamp(up, -limit, limit), gate * sigmoid(alpha * gate) * (up + 1)
    CLAMPED_SWIGLU = "clamped_swiglu"


SUPPORTED_MODEL_TYPES = ("qwen3_moe", "qwen2_moe", "mixtral", "gpt_oss", "glm4_moe", "deepseek_v2", "deepseek_v3")


@dataclass(frozen=True)
class MoeSpec:
    """One sparse layer. Expert weights are stored [gate; up] concatenated whatever the checkpoint does
    (gpt-oss interleaves its columns; `weights.py` de-interleaves them at load)."""

    model_type: str
    num_experts: int
    top_k: int
    hidden_size: int
    expert_intermediate_size: int
    scoring: RouterScoring = RouterScoring.SOFTMAX
    norm_topk_prob: bool = False  # divide the chosen k weights by their sum (after SOFTMAX or SIGMOID)
    routed_scaling_factor: float = 1.0  # multiplies the chosen weights after normalisation
    has_router_bias: bool = False
    has_expert_bias: bool = False  # gate_up and down biases (gpt-oss)
    activation: Activation = Activation.SILU_MUL
    swiglu_alpha: float = 1.702  # CLAMPED_SWIGLU only
    swiglu_limit: float = 7.0  # CLAMPED_SWIGLU only
    shared_expert_intermediate_size: int = 0  # 0: no shared expert
    has_shared_expert_gate: bool = False  # sigmoid(x @ gate^T) scales the shared expert's output (Qwen2-MoE)
    # SIGMOID only: a per-expert bias added to the scores for choosing, not for weighting (e_score_correction_bias)
    has_score_correction_bias: bool = False
    num_groups: int = 1  # SIGMOID only: experts split into this many groups of consecutive ids
    topk_groups: int = 1  # SIGMOID only: the experts are chosen within this many best groups

    def __post_init__(self) -> None:
        if not 0 < self.top_k <= self.num_experts:
            raise ValueError(f"MoE top_k {self.top_k} must be in 1..num_experts ({self.num_experts})")
        grouped = self.num_groups > 1 or self.topk_groups > 1 or self.has_score_correction_bias
        if grouped and self.scoring is not RouterScoring.SIGMOID:
            raise ValueError("MoE expert groups and a score correction bias need sigmoid scoring")
        if self.num_groups > 1:
            per_group = self.num_experts // self.num_groups
            if self.num_experts % self.num_groups or per_group < 2:  # a group scores as its best two
                raise ValueError(
                    f"MoE n_group {self.num_groups} must split {self.num_experts} experts into groups of 2 or more"
                )
            if not 0 < self.topk_groups <= self.num_groups or self.top_k > self.topk_groups * per_group:
                raise ValueError(
                    f"MoE topk_group {self.topk_groups} must be in 1..n_group ({self.num_groups}) and its groups "
                    f"must hold top_k ({self.top_k}) experts"
                )
        elif self.topk_groups != 1:
            raise ValueError(f"MoE topk_group {self.topk_groups} needs n_group > 1")
        if self.has_shared_expert_gate and not self.shared_expert_intermediate_size:
            raise ValueError(
                "MoE shared_expert_gate needs a shared expert (shared_expert_intermediate_size > 0)"
            )

    @property
    def has_shared_expert(self) -> bool:
        return self.shared_expert_intermediate_size > 0

    @property
    def params_per_expert(self) -> int:
        """Weights (and biases) of one routed expert: gate, up and down projections."""
        hidden, inter = self.hidden_size, self.expert_intermediate_size
        return 3 * hidden * inter + (2 * inter + hidden if self.has_expert_bias else 0)

    @property
    def router_params(self) -> int:
        """The router's parameters (a score correction bias is a buffer, not counted: E numbers)."""
        return self.num_experts * self.hidden_size + (self.num_experts if self.has_router_bias else 0)

    @property
    def shared_expert_params(self) -> int:
        gate = self.hidden_size if self.has_shared_expert_gate else 0
        return 3 * self.hidden_size * self.shared_expert_intermediate_size + gate


def _get(config: Any, name: str, default: Any = None) -> Any:
    return getattr(config, name, default)


def _refuse(model_type: str, field: str, value: Any, why: str) -> ValueError:
    return ValueError(
        f"{model_type} config field {field}={value!r} is not supported by cbq's MoE layer: {why}"
    )


def _check_silu(config: Any, model_type: str) -> None:
    act = _get(config, "hidden_act", "silu")
    if act not in ("silu", "swish"):
        raise _refuse(model_type, "hidden_act", act, "experts compute silu(gate) * up")


# Fields that change routing in families outside the four, should they ever appear on one of these configs
# (a config.json edited by hand, or a new transformers release): transformers' four classes ignore them, so
# silently ignoring them here could be right or wrong; refuse instead.
_FOREIGN_ROUTING_FIELDS = ("n_group", "topk_group", "topk_method", "scoring_func", "routed_scaling_factor")
# glm4_moe reads n_group, topk_group and routed_scaling_factor; its router always computes what DeepSeek-V3's
# configs call these, so only these values pass
_GLM4_MOE_FIXED = {"topk_method": "noaux_tc", "scoring_func": "sigmoid"}
# What each family's router computes, in DeepSeek's config names; the other routing fields are read below.
# DeepSeek-V2's "group_limited_greedy" (the 236B release: the best topk_group groups by their best softmax score) is
# not computed here.
_FIXED = {
    "glm4_moe": _GLM4_MOE_FIXED,
    "deepseek_v3": _GLM4_MOE_FIXED,
    "deepseek_v2": {"topk_method": "greedy", "scoring_func": "softmax"},
}
_READS = {  # routing fields a family reads (the rest of _FOREIGN_ROUTING_FIELDS must be absent, 1.0, or _FIXED's)
    "glm4_moe": ("n_group", "topk_group", "routed_scaling_factor"),
    "deepseek_v3": ("n_group", "topk_group", "routed_scaling_factor"),
    # greedy top-k ignores the groups (DeepseekV2TopkRouter)
    "deepseek_v2": ("n_group", "topk_group", "routed_scaling_factor"),
}


def spec_from_config(config: Any) -> MoeSpec:
    """The MoE layer spec of a transformers config (Qwen3MoeConfig, Qwen2MoeConfig, MixtralConfig,
    GptOssConfig, or anything with their fields and `model_type`)."""
    model_type = _get(config, "model_type", "")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise ValueError(
            f"model type {model_type!r} has no MoE spec (supported: {', '.join(SUPPORTED_MODEL_TYPES)})"
        )
    for field in _FOREIGN_ROUTING_FIELDS:
        value = _get(config, field)
        if value is None or (field == "routed_scaling_factor" and value == 1.0):
            continue
        fixed = _FIXED.get(model_type, {})
        if field in _READS.get(model_type, ()) or fixed.get(field, object()) == value:
            continue  # read below, or DeepSeek's name for what the family's router computes
        raise _refuse(model_type, field, value, f"{model_type} in transformers does not read it")
    quant = _get(config, "quantization_config")
    if quant is not None and not has_mxfp4_experts(config):
        # the experts' formats cbq reads (FP8 or dequantized at load); the one-line refusal names what it runs
        moe_quantization(quant, model_type)
    family: dict[str, Any]
    if model_type in ("qwen3_moe", "qwen2_moe"):
        _check_silu(config, model_type)
        family = dict(
            num_experts=config.num_experts,
            expert_intermediate_size=config.moe_intermediate_size,
            norm_topk_prob=bool(config.norm_topk_prob),
        )
        if model_type == "qwen2_moe":  # Qwen2MoeSparseMoeBlock always builds the shared expert and its gate
            family |= dict(
                shared_expert_intermediate_size=config.shared_expert_intermediate_size,
                has_shared_expert_gate=True,
            )
    elif model_type == "mixtral":
        _check_silu(config, model_type)
        family = dict(
            num_experts=config.num_local_experts,
            expert_intermediate_size=config.intermediate_size,
            norm_topk_prob=True,  # MixtralTopKRouter always renormalises the chosen weights
        )
    elif model_type == "deepseek_v2":
        _check_silu(config, model_type)
        family = dict(
            num_experts=config.n_routed_experts,
            expert_intermediate_size=config.moe_intermediate_size,
            # DeepseekV2TopkRouter: softmax over all experts, top-k, never renormalised (norm_topk_prob unread)
            routed_scaling_factor=float(config.routed_scaling_factor),
            shared_expert_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
        )
    elif model_type in ("glm4_moe", "deepseek_v3"):
        _check_silu(config, model_type)
        family = dict(
            # n_routed_experts: the release's name (transformers 5.24 also maps num_local_experts onto it)
            num_experts=config.n_routed_experts,
            expert_intermediate_size=config.moe_intermediate_size,
            scoring=RouterScoring.SIGMOID,
            norm_topk_prob=bool(config.norm_topk_prob),
            routed_scaling_factor=float(config.routed_scaling_factor),
            # Glm4MoeMoE / DeepseekV3MoE always build their shared MLP (ungated), n_shared_experts experts wide
            shared_expert_intermediate_size=config.moe_intermediate_size * config.n_shared_experts,
            has_score_correction_bias=True,  # their routers always have one (zeros where not trained)
            num_groups=int(config.n_group),
            topk_groups=int(config.topk_group),
        )
    else:  # gpt_oss: hidden_act is not read by its experts (they use the clamped SwiGLU)
        family = dict(
            num_experts=config.num_local_experts,
            expert_intermediate_size=config.intermediate_size,
            scoring=RouterScoring.SOFTMAX_OVER_TOPK,
            has_router_bias=True,
            has_expert_bias=True,
            activation=Activation.CLAMPED_SWIGLU,
            # transformers 5.17's GptOssConfig has neither swiglu_alpha nor swiglu_limit (its experts hard-code
            # the release's 1.702 and 7.0); later versions name them in the config. The values are the
            # release's either way.
            swiglu_alpha=float(getattr(config, "swiglu_alpha", 1.702)),
            swiglu_limit=float(getattr(config, "swiglu_limit", 7.0)),
        )
    return MoeSpec(
        model_type=model_type, top_k=config.num_experts_per_tok, hidden_size=config.hidden_size, **family
    )


def moe_layer_ids(config: Any) -> tuple[int, ...]:
    """Decoder layers whose MLP is sparse, as transformers builds them; the rest are dense MLPs."""
    num_layers = config.num_hidden_layers
    # the first k layers dense (GLM-4.5-Air, DeepSeek-V2-Lite: 1, GLM-4.5, DeepSeek-V3: 3); transformers' DeepSeek
    # models do not read moe_layer_freq (every release sets 1)
    if config.model_type in ("glm4_moe", "deepseek_v2", "deepseek_v3"):
        return tuple(range(config.first_k_dense_replace, num_layers))
    if config.model_type not in ("qwen3_moe", "qwen2_moe"):
        return tuple(range(num_layers))  # Mixtral and gpt-oss: every layer
    dense = set(_get(config, "mlp_only_layers") or ())
    step = _get(config, "decoder_sparse_step", 1)
    if config.num_experts <= 0:
        return ()
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


def dense_intermediate_size(config: Any) -> int:
    """Intermediate size of the dense MLP in the layers `moe_layer_ids` leaves out (0 where none can exist)."""
    with_dense = ("qwen3_moe", "qwen2_moe", "glm4_moe", "deepseek_v2", "deepseek_v3")
    return int(config.intermediate_size) if config.model_type in with_dense else 0
