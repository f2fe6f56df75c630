"""What an MoE model weighs and what one of its steps must read and compute, from its config alone. Owns nothing.

`MoeModelShape.from_config` gathers the few numbers that matter (the MoE spec, which layers are sparse, the
attention's shape, sliding windows). From it:
  - `weight_bytes`: every parameter, split into dense and routed-expert bytes (experts may be stored in
    another format than the rest: MXFP4, or FP8 with its scales, fp8.py), so a load can say "does not fit" with the numbers
    (`check_weights_fit`) before allocating anything;
  - `step_cost`: the floor of one engine step of T tokens: the dense weights (attention, norms, routers,
    shared experts, dense MLPs, the LM head), the experts its tokens hit, the KV it reads, and the FLOPs of
    the parameters its tokens activate. Pure arithmetic, for `bench engine`'s floor ratio.

Distinct experts per layer: with E experts and top-k routing, a token leaves a given expert out with
probability 1 - k/E, so T tokens routed independently and uniformly hit E * (1 - (1 - k/E) ** T) experts on
average. Random-weight benchmark models route close to uniformly; trained ones favour some experts, hit fewer,
and read less.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .fp8 import Fp8ExpertFormat
from .mxfp4 import BYTES_PER_GROUP, VALUES_PER_GROUP
from .spec import MoeSpec, dense_intermediate_size, moe_layer_ids, spec_from_config

# MXFP4 stores 32 values in 16 bytes of codes and 1 byte of scale: 4.25 bits a weight
MXFP4_BYTES_PER_PARAM = (BYTES_PER_GROUP + 1) / VALUES_PER_GROUP


@dataclass(frozen=True)
class MoeModelShape:
    """The parameters of an MoE decoder, as counts, and where its attention reads KV."""

    spec: MoeSpec
    num_layers: int
    vocab_size: int
    tie_word_embeddings: bool
    num_heads: int
    num_kv_heads: int
    head_dim: int
    qkv_bias: bool
    o_bias: bool
    qk_norm: bool  # per-head q/k RMSNorm (Qwen3-MoE; GLM-4.5 where use_qk_norm)
    attention_sinks: bool  # gpt-oss: one learned logit per head
    window_per_layer: tuple[int | None, ...]  # sliding-window size of each layer's attention, None for full
    moe_layers: tuple[int, ...]
    dense_intermediate_size: int  # the MLP of the layers that are not in moe_layers
    mxfp4_experts: bool  # the checkpoint stores the experts' matrices as MXFP4
    # Multi-head latent attention (DeepSeek): its projections' parameters per layer, in place of q/k/v/o's (0: none)
    mla_params: int = 0
    # ... and its cache's values per token per layer, the latent and the shared rotary key (0: per-head K and V)
    latent_width: int = 0

    @classmethod
    def from_config(cls, config: Any) -> MoeModelShape:
        spec = spec_from_config(config)
        model_type = config.model_type
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        window = getattr(config, "sliding_window", None) or None  # Qwen2-MoE writes 0 for "no window"
        layer_types = getattr(config, "layer_types", None)
        if layer_types is not None:
            windows = tuple(window if kind == "sliding_attention" else None for kind in layer_types)
        else:
            windows = (window,) * config.num_hidden_layers
        bias = bool(getattr(config, "attention_bias", False))
        quant = getattr(config, "quantization_config", None)
        quant_method = (
            quant.get("quant_method") if isinstance(quant, dict) else getattr(quant, "quant_method", None)
        )
        return cls(
            spec=spec,
            num_layers=config.num_hidden_layers,
            vocab_size=config.vocab_size,
            tie_word_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            num_heads=config.num_attention_heads,
            num_kv_heads=config.num_key_value_heads,
            head_dim=head_dim,
            qkv_bias=bool(config.qkv_bias) if model_type == "qwen2_moe" else bias,
            o_bias=bias and model_type not in ("qwen2_moe", "glm4_moe"),  # GLM-4.5: q/k/v biases only
            qk_norm=model_type == "qwen3_moe" or (model_type == "glm4_moe" and bool(config.use_qk_norm)),
            attention_sinks=model_type == "gpt_oss",
            window_per_layer=windows,
            moe_layers=moe_layer_ids(config),
            dense_intermediate_size=dense_intermediate_size(config),
            mxfp4_experts=quant_method == "mxfp4",
            mla_params=mla_params_per_layer(config),
            latent_width=config.kv_lora_rank + config.qk_rope_head_dim if getattr(config, "kv_lora_rank", None) else 0,
        )

    @property
    def attention_params_per_layer(self) -> int:
        if self.mla_params:
            return self.mla_params + 2 * self.spec.hidden_size  # and the layer's two RMSNorms
        hidden, q_width, kv_width = (
            self.spec.hidden_size,
            self.num_heads * self.head_dim,
            self.num_kv_heads * self.head_dim,
        )
        params = hidden * (q_width + 2 * kv_width) + q_width * hidden
        params += (q_width + 2 * kv_width) * self.qkv_bias + hidden * self.o_bias
        params += 2 * self.head_dim * self.qk_norm + self.num_heads * self.attention_sinks
        return params + 2 * hidden  # the layer's two RMSNorms

    @property
    def num_dense_layers(self) -> int:
        return self.num_layers - len(self.moe_layers)

    @property
    def dense_params(self) -> int:
        """Everything read in full by every step, the LM head included, the input embedding not (a lookup)."""
        spec = self.spec
        sparse_dense_part = spec.router_params + spec.shared_expert_params
        dense_mlp = 3 * spec.hidden_size * self.dense_intermediate_size
        params = self.num_layers * self.attention_params_per_layer
        params += len(self.moe_layers) * sparse_dense_part + self.num_dense_layers * dense_mlp
        return params + spec.hidden_size + self.vocab_size * spec.hidden_size  # final norm, LM head

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.spec.hidden_size

    @property
    def expert_matrix_params(self) -> int:
        """The routed experts' matrices (what MXFP4 quantizes), all layers."""
        spec = self.spec
        return len(self.moe_layers) * spec.num_experts * 3 * spec.hidden_size * spec.expert_intermediate_size

    @property
    def expert_bias_params(self) -> int:
        spec = self.spec
        per_expert = spec.params_per_expert - 3 * spec.hidden_size * spec.expert_intermediate_size
        return len(self.moe_layers) * spec.num_experts * per_expert

    @property
    def num_params(self) -> int:
        """As transformers counts them (a tied LM head once)."""
        separate_embedding = 0 if self.tie_word_embeddings else self.embedding_params
        return self.dense_params + separate_embedding + self.expert_params

    @property
    def expert_params(self) -> int:
        return self.expert_matrix_params + self.expert_bias_params

    def kv_bytes_per_token_per_layer(self, dtype_bytes: int) -> int:
        """What attention reads per cached token: per-head K and V, or latent attention's one row."""
        if self.latent_width:
            return self.latent_width * dtype_bytes
        return 2 * self.num_kv_heads * self.head_dim * dtype_bytes


@dataclass(frozen=True)
class WeightBytes:
    dense: float  # attention, norms, routers, shared experts, dense MLPs, LM head (tied: counted here)
    embedding: float  # the input embedding (0 when tied to the LM head)
    experts: float  # routed experts, all layers

    @property
    def total(self) -> float:
        return self.dense + self.embedding + self.experts


def weight_bytes(
    shape: MoeModelShape,
    dtype_bytes: int,
    dequantize_mxfp4: bool = True,
    fp8_experts: Fp8ExpertFormat | None = None,
) -> WeightBytes:
    """Bytes of the model's weights on the GPU in `dtype_bytes`-wide parameters; MXFP4 experts stay 4.25 bits a
    weight unless `dequantize_mxfp4` (what cbq does at load today: `weights.py`); `fp8_experts`: the experts are
    kept in that FP8 format (1 byte a weight and fp32 scales: fp8.py; their biases in the model dtype)."""
    matrix_bytes = MXFP4_BYTES_PER_PARAM if shape.mxfp4_experts and not dequantize_mxfp4 else dtype_bytes
    experts = shape.expert_matrix_params * matrix_bytes + shape.expert_bias_params * dtype_bytes
    if fp8_experts is not None:
        per_expert = fp8_experts.bytes_per_expert(shape.spec)
        experts = (
            len(shape.moe_layers) * shape.spec.num_experts * per_expert
            + shape.expert_bias_params * dtype_bytes
        )
    embedding = 0 if shape.tie_word_embeddings else shape.embedding_params * dtype_bytes
    return WeightBytes(dense=shape.dense_params * dtype_bytes, embedding=embedding, experts=experts)


def check_weights_fit(weights: WeightBytes, gpu_bytes: int, min_kv_bytes: int = 0) -> None:
    """Raise ValueError, with the numbers, when the weights leave less than `min_kv_bytes` of the GPU for KV."""
    left = gpu_bytes - weights.total
    if left < min_kv_bytes:
        gb = 1e9
        raise ValueError(
            f"model does not fit: weights {weights.total / gb:.1f} GB (experts {weights.experts / gb:.1f} GB), "
            f"GPU {gpu_bytes / gb:.1f} GB, {max(left, 0) / gb:.1f} GB left for the KV cache "
            f"(at least {min_kv_bytes / gb:.1f} GB needed)"
        )


def expected_distinct_experts(num_tokens: int, num_experts: int, top_k: int) -> float:
    """Experts one layer's T tokens hit, on average, under uniform independent top-k routing."""
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


@dataclass(frozen=True)
class StepCost:
    dense_bytes: float
    expert_bytes: float
    kv_bytes: float
    flops: float  # 2 per multiply-add of the parameters the step's tokens activate

    @property
    def bytes(self) -> float:
        return self.dense_bytes + self.expert_bytes + self.kv_bytes

    def floor_seconds(self, bandwidth_bytes_per_s: float, peak_flops_per_s: float) -> float:
        """The least time the step can take: streaming its bytes or computing its FLOPs, whichever is slower."""
        return max(self.bytes / bandwidth_bytes_per_s, self.flops / peak_flops_per_s)


def step_cost(
    shape: MoeModelShape,
    num_tokens: int,
    num_seqs: int,
    context_tokens: int,
    dtype_bytes: int,
    expert_bytes_per_param: float | None = None,
) -> StepCost:
    """The floor of one step of `num_tokens` tokens from `num_seqs` sequences whose attention reads
    `context_tokens` cached tokens in all (the engine's step log has these three). A sliding-window layer
    reads at most `num_seqs * window` of them (exact when every sequence's context is beyond the window or
    none is). Logits are computed for one token per sequence. `expert_bytes_per_param` defaults to the
    dtype's (experts dequantized at load); FP8 experts pass `fp8_expert_bytes_per_param`, MXFP4 experts read as
    such would pass MXFP4_BYTES_PER_PARAM."""
    spec = shape.spec
    per_expert_bytes = spec.params_per_expert * (expert_bytes_per_param or dtype_bytes)
    experts_hit = expected_distinct_experts(num_tokens, spec.num_experts, spec.top_k)
    expert_bytes = len(shape.moe_layers) * experts_hit * per_expert_bytes
    tokens_read = sum(
        context_tokens if window is None else min(context_tokens, num_seqs * window)
        for window in shape.window_per_layer
    )
    kv_bytes = tokens_read * shape.kv_bytes_per_token_per_layer(dtype_bytes)
    lm_head = shape.vocab_size * spec.hidden_size
    active_per_token = (
        shape.dense_params - lm_head + len(shape.moe_layers) * spec.top_k * spec.params_per_expert
    )
    flops = 2.0 * (num_tokens * active_per_token + num_seqs * lm_head)
    return StepCost(
        dense_bytes=shape.dense_params * dtype_bytes,
        expert_bytes=expert_bytes,
        kv_bytes=kv_bytes,
        flops=flops,
    )


def fp8_expert_bytes_per_param(spec: MoeSpec, fmt: Fp8ExpertFormat) -> float:
    """`step_cost`'s `expert_bytes_per_param` for FP8 experts: an expert's e4m3 matrices and scales over its
    parameters (kept FP8, experts have no biases: gpt-oss's, the biased ones, stay in the model dtype)."""
    return fmt.bytes_per_expert(spec) / spec.params_per_expert


def mla_params_per_layer(config: Any) -> int:
    """Multi-head latent attention's parameters in one layer (0 without it): the query (full, or q_a, its norm and
    q_b), kv_a_proj_with_mqa (latent and rotary key), the latent's norm, kv_b_proj (each head's key and value), o."""
    kv_lora = getattr(config, "kv_lora_rank", None)
    if not kv_lora:
        return 0
    hidden, heads = config.hidden_size, config.num_attention_heads
    qk_head = config.qk_nope_head_dim + config.qk_rope_head_dim
    q_lora = getattr(config, "q_lora_rank", None)
    query = hidden * q_lora + q_lora + q_lora * heads * qk_head if q_lora else hidden * heads * qk_head
    kv_b = kv_lora * heads * (config.qk_nope_head_dim + config.v_head_dim)
    kv = hidden * (kv_lora + config.qk_rope_head_dim) + kv_lora + kv_b
    return query + kv + heads * config.v_head_dim * hidden
