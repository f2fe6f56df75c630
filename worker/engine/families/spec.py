"""What a model family declares: the typed record that the loader, the owned decoder and the fused weights read.
Owns the declaration types and the list of config fields that change a decoder's math.

A family module (llama.py, gemma2.py, ...) fills in one `Family`: its layers (which checkpoint linears make
each GEMM, and how tensor parallelism will shard each), its norm kind and placement, activation, and a
`read(config)` that turns a transformers config into the numbers the decoder needs (`DecoderArgs`). Nothing
outside the family module names the family.

A linear's quantization and parallel layout are properties of the linear (`LinearSpec`), not of the family:
a quantized checkpoint or a tensor-parallel run changes the `LinearSpec`s the decoder builds, not the model file.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from enum import Enum
from typing import Any


class UnsupportedConfig(ValueError):
    """A config value that changes the math and that the family does not implement (one line, names the field)."""


class Parallel(str, Enum):
    """How tensor parallelism shards a linear (no run shards yet; the layout is declared so it can)."""

    COLUMN = "column"  # output rows split over ranks (q/k/v, gate/up): no communication after
    ROW = "row"  # input columns split, partial outputs summed over ranks (o, down)


class Quant(str, Enum):
    """How a linear's weights are stored and multiplied. A family declares NONE; the loaded model says FP8 where
    the checkpoint's (or --quantization's) config quantized the linear, INT4 where it is kept packed
    (fused_weights.linear_quant)."""

    NONE = "none"
    FP8 = "fp8"  # float8_e4m3fn weight with fp32 scales (quant/), multiplied by the FP8 GEMM
    INT4 = "int4"  # packed 4-bit weight with group scales (quant/int4/), multiplied by the W4A16 GEMM


@dataclass(frozen=True)
class LinearSpec:
    """One GEMM of a decoder layer: the checkpoint linears (attribute paths under the layer) whose output rows it
    stacks, in order. One part: the checkpoint ships it fused (Phi-3's qkv_proj) or it stands alone."""

    parts: tuple[str, ...]
    parallel: Parallel
    quant: Quant = Quant.NONE


class NormKind(str, Enum):
    RMS = "rms"  # Llama: w * (x * rsqrt(mean(x^2) + eps)).to(dtype), statistics in fp32
    RMS_ONE_PLUS = "rms_one_plus"  # Gemma: ((x * rsqrt(...)) * (1 + w)).to(dtype), all in fp32
    RMS_FP32_WEIGHT = "rms_fp32_weight"  # OLMo 2: (w * (x * rsqrt(...))).to(dtype), weight multiply in fp32
    LAYER = "layer"  # Cohere: mean-centred LayerNorm without bias, in fp32


class Activation(str, Enum):
    SILU = "silu"
    GELU_TANH = "gelu_tanh"


# The config spellings of each activation (transformers' ACT2FN names).
ACTIVATIONS = {"silu": Activation.SILU, "swish": Activation.SILU, "gelu_pytorch_tanh": Activation.GELU_TANH}


class QKNormSpan(str, Enum):
    HEAD = "head"  # one RMSNorm over each head's D (Qwen3, Gemma 3)
    FULL = "full"  # one RMSNorm over the whole q / k projection (OLMo 2)


@dataclass(frozen=True)
class LayerSpec:
    """A decoder layer's modules, by attribute path under the transformers layer (None: the layer has none).

    Norm placement: `attn_in` normalises the attention input, `attn_out` the attention output before the
    residual add (Gemma's and OLMo 2's post-attention norm), `mlp_in` / `mlp_out` the same for the MLP."""

    qkv: LinearSpec
    o: LinearSpec
    gate_up: LinearSpec
    down: LinearSpec
    attn_in_norm: str | None
    attn_out_norm: str | None
    mlp_in_norm: str | None
    mlp_out_norm: str | None
    q_norm: str | None = None
    k_norm: str | None = None
    qk_norm_span: QKNormSpan = QKNormSpan.HEAD
    # The q/k norms exist where the config turns them on (GLM-4.5's use_qk_norm: the 355B release on, Air off):
    # a layer without the modules has no q/k norm. False: the declared modules must exist.
    qk_norm_optional: bool = False
    # Attention and MLP read the same normed input and join the residual together (Cohere's parallel block).
    parallel_blocks: bool = False


@dataclass(frozen=True)
class MoeMlpSpec:
    """A sparse MLP (mixture of experts), by attribute path under the transformers layer. Which layers are sparse
    and the routing math come from the config (`moe.moe_layer_ids`, `moe.spec_from_config`); the other layers'
    MLP is the dense one `LayerSpec.gate_up`/`down` declare."""

    router: str  # nn.Linear-like: .weight [E, H] (and .bias where the family has one)
    experts: str  # stacked .gate_up_proj [E, 2I, H] / .down_proj [E, H, I], or a list of per-expert MLPs
    shared_expert: str | None = None  # a dense MLP beside the routed experts (Qwen2-MoE, GLM-4.5)
    shared_expert_gate: str | None = None  # sigmoid(x @ w^T) scales the shared expert's output
    # transformers stacks the experts as the kernels read them ([E, 2I, H], [gate; up] rows): the decoder uses
    # views. False (gpt-oss: [E, H, 2I], gate/up columns interleaved): the decoder's build moves them into the
    # kernels' layout, one layer at a time, and puts `experts_in_kernel_layout(old_module, weights)` in the old
    # module's place: a module that computes transformers' expert math from those tensors, so `model.generate`
    # still runs and every expert is held once.
    kernel_layout: bool = True
    experts_in_kernel_layout: type[Any] | None = None  # called as (transformers' module, ExpertWeights)


@dataclass(frozen=True)
class MlaSpec:
    """Multi-head latent attention (DeepSeek-V2/V3), by attribute path under the transformers layer. The query comes
    from `q_proj`, or where the config sets `q_lora_rank` from `q_a_proj`, `q_a_norm` and `q_b_proj`; `kv_a_proj`
    gives each token's latent (`kv_lora_rank` values, normed by `kv_a_norm`) and its rotary key (`qk_rope_head_dim`,
    shared by the heads); `kv_b_proj` expands the latent into each head's no-rotary key and value."""

    q_proj: str
    q_a_proj: str
    q_a_norm: str
    q_b_proj: str
    kv_a_proj: str
    kv_a_norm: str
    kv_b_proj: str
    o_proj: str


@dataclass(frozen=True)
class DecoderArgs:
    """The numbers a family reads from one config (`Family.read`); neutral values leave the math unchanged."""

    activation: Activation
    attention_scale: float  # multiplies q.k
    attn_softcap: float | None = None  # scores -> cap * tanh(scores / cap)
    final_softcap: float | None = None  # logits -> cap * tanh(logits / cap)
    embed_scale: float | None = None  # embeddings times this (Gemma's sqrt(hidden), Granite's multiplier)
    embed_scale_in_dtype: bool = False  # the scale is rounded to the model dtype before the multiply (Gemma)
    residual_scale: float | None = None  # each block's output times this before the residual add (Granite)
    logits_divisor: float | None = None  # logits / this (Granite's logits_scaling)
    logits_scale: float | None = None  # logits * this (Cohere's logit_scale)
    nope_layers: tuple[int, ...] = ()  # layers whose q and k are not rotated (SmolLM3, Cohere 2's global layers)


class MRopeLayout(str, Enum):
    """Which of the three M-RoPE position rows (temporal, height, width) each rotary frequency j (of D/2) reads,
    with the rotary module's `mrope_section` (s0, s1, s2), s0 + s1 + s2 = D/2; the second half of the head repeats
    the first (image_inputs.py `mrope_axes`)."""

    SECTIONS = "sections"  # Qwen2-VL, Qwen2.5-VL: j < s0 temporal, then s1 height, then s2 width
    INTERLEAVED = "interleaved"  # Qwen3-VL: height where j % 3 == 1 and j < 3 s1, width where j % 3 == 2 and j < 3 s2


@dataclass(frozen=True)
class VisionSpec:
    """A vision-language family's image side. The whole checkpoint loads as transformers' `model_class`; its
    vision tower runs as transformers wrote it, and its language model runs on the owned decoder (image rows as
    input embeddings, `mrope` and `deepstack` below; image_inputs.py) or on decoder "hf" (transformers' layers
    with cbq's paged attention)."""

    model_class: str  # transformers' class of the whole checkpoint
    images: str = "qwen_vl"  # its image processing: multimodal.IMAGE_FORMATS ("qwen_vl", "gemma3", "pixtral")
    # DeepStack (Qwen3-VL): the tower also returns the merged features of some of its blocks, one level each, and
    # level i is added to decoder layer i's output at the image's rows (models/vision.py, multimodal.py).
    deepstack: bool = False
    # Multimodal rotary positions (the image format's positions are [3, T]); None: 1-D rotary (Pixtral, Gemma 3)
    mrope: MRopeLayout | None = None


@dataclass(frozen=True)
class Family:
    """Everything the loader and the owned decoder need to know about one model family."""

    name: str
    model_types: tuple[str, ...]  # config.json's model_type values it runs (one registry line each)
    layer: LayerSpec
    norm: NormKind
    read: Callable[[Any], DecoderArgs]  # raises UnsupportedConfig for a value it does not implement
    handles: frozenset[str] = frozenset()  # the MATH_FIELDS this family reads (all others must be neutral)
    layers_path: str = "model.layers"
    embed_path: str = "model.embed_tokens"
    final_norm_path: str = "model.norm"
    rotary_path: str = "model.rotary_emb"
    # One rotary table per entry of config.layer_types (Gemma 3's local and global bases), read from the
    # rotary module's `{layer_type}_inv_freq`; False: one table for every layer.
    rope_per_layer_type: bool = False
    # Rotary pairs dims (2i, 2i + 1) (GLM, Cohere) instead of (i, i + D/2) (Llama).
    rotary_interleaved: bool = False
    norm_eps_field: str = "rms_norm_eps"  # the config field of the norms' epsilon (Cohere: layer_norm_eps)
    # Multimodal checkpoints whose language model this family runs (text lines only): their model_type ->
    # regex renames of their weight names onto the text model's (the loader reads only those weights).
    wrappers: dict[str, dict[str, str]] = field(default_factory=dict)
    # Multi-head latent attention in place of q/k/v (DeepSeek-V2/V3); None: the attention `layer` declares.
    mla: MlaSpec | None = None
    moe: MoeMlpSpec | None = None  # the sparse MLP of the layers `moe.moe_layer_ids` names (None: all dense)
    # Attention sinks: a learned logit per head in the softmax (gpt-oss), by path under the layer (None: none).
    attention_sinks: str | None = None
    # The family's `generate` recomputes a sequence's whole cache with the long factors when the sequence grows past
    # original_max_position_embeddings (Phi3ForCausalLM.prepare_inputs_for_generation), so cbq runs "longrope"
    # exactly: per sequence, see `longrope_original_len`. False: longrope is refused at load.
    longrope: bool = False
    # Takes images (None: text only; a multimodal checkpoint read through `wrappers` has its text lines only).
    vision: VisionSpec | None = None


def is_neutral(value: Any) -> bool:
    """None, False or the number 1 (True is not neutral, though True == 1)."""
    return value is None or value is False or (not isinstance(value, bool) and value == 1)


# Config fields of transformers' dense families that change the decoder's math. A family that does not list a
# field in `Family.handles` must find it absent or neutral (None, False, 1), or the load fails: never defaulted.
MATH_FIELDS = (
    "hidden_activation",  # Gemma: the MLP activation (not hidden_act)
    "attn_logit_softcapping",
    "final_logit_softcapping",
    "query_pre_attn_scalar",
    "embedding_multiplier",  # Granite
    "residual_multiplier",
    "attention_multiplier",
    "logits_scaling",
    "logit_scale",  # Cohere
    "partial_rotary_factor",  # Phi-3, GLM
    "use_qk_norm",
    "no_rope_layers",  # SmolLM3
    "pretraining_tp",  # Llama 2's sliced linears
    "use_bidirectional_attention",  # Gemma's encoder-style variants
)


def unhandled_fields(config: Any, family: Family) -> list[str]:
    """The math fields `config` sets to a non-neutral value that `family` does not read."""
    values = config.to_dict()
    return [
        f"{name}={values[name]!r}"
        for name in MATH_FIELDS
        if name in values and name not in family.handles and not is_neutral(values[name])
    ]


# Rope types whose frequencies change with the sequence length at run time. transformers switches them on the
# longest position of the whole forward, so in a continuous batch a sequence's rotary would depend on the
# others': cbq refuses them rather than differ from `generate` (vLLM caps or rescales them instead), except longrope
# in a family that declares `Family.longrope`: there each sequence picks its own table (`longrope_original_len`).
RUNTIME_ROPE_TYPES = ("dynamic", "longrope")


def rope_types(config: Any) -> list[str]:
    """The rope_type of each rotary table a config describes (one, or one per layer type as Gemma 3's)."""
    params = getattr(config, "rope_parameters", None) or {}
    if params and all(isinstance(p, dict) for p in params.values()):
        return [p.get("rope_type", "default") for p in params.values()]
    return [params.get("rope_type", "default")]


def runtime_rope_fields(config: Any, family: Family) -> list[str]:
    """The run-time rope types `config` sets that `family` cannot run exactly (one table of longrope it can)."""
    types = rope_types(config)
    runs_longrope = family.longrope and types == ["longrope"]
    return [f"rope_type={t!r}" for t in types if t in RUNTIME_ROPE_TYPES and not (t == "longrope" and runs_longrope)]


def longrope_original_len(config: Any) -> int | None:
    """A longrope model's original_max_position_embeddings: the longest sequence that rotates with the short factors
    (None: not longrope). transformers' rotary takes the long factors when a forward's largest position + 1 exceeds it,
    and Phi-3's `generate` then recomputes the whole cache (all its K/V with the long factors), so in `generate` a
    sequence's K/V all rotate with one table: the long one iff its length exceeds this. cbq applies that per
    sequence: the scheduler restarts a sequence that grows past it (scheduler.py), the decoder keeps both tables."""
    if rope_types(config) != ["longrope"]:
        return None
    # NOTE: Phi-3's cache reset reads the config's top-level field, the rotary this copy: the config's init copies the
    # top-level value here (standardize_rope_params, 5.17 and 5.24), so the two agree.
    return int(config.rope_parameters["original_max_position_embeddings"])


def activation_of(config: Any, field: str) -> Activation:
    """The activation a config names in `field`; an unknown one is an UnsupportedConfig."""
    name = getattr(config, field, None)
    if name not in ACTIVATIONS:
        raise UnsupportedConfig(f"{field}={name!r} (cbq implements {', '.join(ACTIVATIONS)})")
    return ACTIVATIONS[name]


def llama_layer(*, q_norm: str | None = None, k_norm: str | None = None) -> LayerSpec:
    """The Llama layer layout that Mistral, Qwen2, Qwen3 and Granite share: pre-norms, separate q/k/v and
    gate/up linears fused at load."""
    return LayerSpec(
        qkv=LinearSpec(("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), Parallel.COLUMN),
        o=LinearSpec(("self_attn.o_proj",), Parallel.ROW),
        gate_up=LinearSpec(("mlp.gate_proj", "mlp.up_proj"), Parallel.COLUMN),
        down=LinearSpec(("mlp.down_proj",), Parallel.ROW),
        attn_in_norm="input_layernorm",
        attn_out_norm=None,
        mlp_in_norm="post_attention_layernorm",
        mlp_out_norm=None,
        q_norm=q_norm,
        k_norm=k_norm,
    )

