"""Presets: named model shapes with random weights, for the tests and the benchmarks (no files, no network).

Owns the PRESETS table: name -> (transformers model_type, config fields). Each small one is a family's shape at a
few layers over the byte tokenizer's vocabulary; the large ones are releases' shapes (random weights) for the GPU
benchmarks. `preset_config(name)` is the transformers config, with the byte tokenizer's special ids.
"""

from __future__ import annotations

from ..tokenizer import ByteTokenizer

_BYTE_VOCAB = 320  # the byte tokenizer needs 259 ids; a multiple of 64 is friendlier to kernels

_TINY = dict(
    vocab_size=_BYTE_VOCAB,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    max_position_embeddings=1024,
    # Random weights at the usual 0.02 give near-uniform logits, so greedy decoding repeats one token
    # and near-ties make exactness tests flaky. A larger scale gives diverse text with clear winners.
    initializer_range=0.25,
    tie_word_embeddings=False,
)

_GLM4_MOE = dict(
    _TINY,
    n_routed_experts=16,
    num_experts_per_tok=4,
    moe_intermediate_size=32,
    n_shared_experts=1,
    first_k_dense_replace=1,
    norm_topk_prob=True,
    attention_bias=True,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5},
)

_GLM45_AIR = dict(
    vocab_size=151552,
    hidden_size=4096,
    intermediate_size=10944,
    moe_intermediate_size=1408,
    num_hidden_layers=46,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    n_routed_experts=128,
    num_experts_per_tok=8,
    n_shared_experts=1,
    first_k_dense_replace=1,
    n_group=1,
    topk_group=1,
    norm_topk_prob=True,
    routed_scaling_factor=1.0,
    attention_bias=True,
    use_qk_norm=False,
    rope_parameters={"rope_type": "default", "rope_theta": 1_000_000.0, "partial_rotary_factor": 0.5},
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    initializer_range=0.02,
    tie_word_embeddings=False,
)

_DEEPSEEK_LITE = dict(  # what DeepSeek-V2-Lite and Moonlight-16B-A3B share
    hidden_size=2048,
    moe_intermediate_size=1408,
    num_hidden_layers=27,
    num_attention_heads=16,
    num_key_value_heads=16,
    n_routed_experts=64,
    num_experts_per_tok=6,
    n_shared_experts=2,
    first_k_dense_replace=1,
    q_lora_rank=None,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_group=1,
    topk_group=1,
    initializer_range=0.02,
    tie_word_embeddings=False,
)

_DEEPSEEK_V2_LITE = dict(
    _DEEPSEEK_LITE,
    vocab_size=102400,
    intermediate_size=10944,
    topk_method="greedy",
    norm_topk_prob=False,
    routed_scaling_factor=1.0,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_parameters={
        "rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 0.707, "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096,
    },  # fmt: skip
)

_MOONLIGHT = dict(
    _DEEPSEEK_LITE,
    vocab_size=163840,
    intermediate_size=11264,
    norm_topk_prob=True,
    routed_scaling_factor=2.446,
    max_position_embeddings=8192,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 50000.0},
)

PRESETS: dict[str, tuple[str, dict]] = {
    "tiny-llama": ("llama", dict(_TINY)),
    "tiny-qwen3": ("qwen3", dict(_TINY)),
    "tiny-mistral": ("mistral", dict(_TINY, sliding_window=None)),
    "tiny-qwen2": ("qwen2", dict(_TINY)),
    # Gemma 2's knobs at tiny size: a q scale that is not the head size (as 27B's), soft-caps that bind at
    # this init scale, alternating sliding windows shorter than the tests' sequences. Untied (the releases tie):
    # tied random embeddings times sqrt(hidden) make greedy decoding echo its input token.
    "tiny-gemma2": (
        "gemma2",
        dict(
            _TINY,
            query_pre_attn_scalar=24,
            attn_logit_softcapping=5.0,
            final_logit_softcapping=8.0,
            sliding_window=32,
            num_hidden_layers=4,
        ),
    ),
    # Gemma 3's: three local layers with a 10k rotary base and a short window, one global layer with a 1M base
    # and linear scaling (as 4B-27B set), q/k norms; no soft-caps. Untied, as tiny-gemma2.
    "tiny-gemma3": (
        "gemma3_text",
        dict(
            _TINY,
            query_pre_attn_scalar=24,
            sliding_window=32,
            num_hidden_layers=4,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
            },
        ),
    ),
    # Granite 3's multipliers as the 8B instruct release sets them (attention: 1 / head_dim, not its root).
    "tiny-granite": (
        "granite",
        dict(
            _TINY,
            embedding_multiplier=12.0,
            attention_multiplier=1 / 16,
            residual_multiplier=0.22,
            logits_scaling=4.0,
        ),
    ),
    "tiny-olmo2": ("olmo2", dict(_TINY, initializer_range=0.4)),  # at 0.02 its greedy output repeats one token
    # Phi-4-mini's partial rotary (3/4 of each head); q/k/v and gate/up ship fused.
    "tiny-phi3": (
        "phi3",
        dict(_TINY, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.75}),
    ),
    # Phi-4-mini's longrope (Phi-3.5-mini's too, with full rotary) at tiny size: the short factors up to 64 positions
    # (the releases' 4,096), the long ones past it (max_position_embeddings 1,024: the releases' 131,072), so the
    # tests' prompts sit on either side and their decodes cross it. Factors of distinct sizes per frequency, as the
    # releases' (1 to ~1.3 short, 1 to ~50 long), so the two tables differ in every column pair.
    "tiny-phi3-longrope": (
        "phi3",
        dict(
            _TINY,
            original_max_position_embeddings=64,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10_000.0,
                "partial_rotary_factor": 0.75,
                "short_factor": [1.0, 1.02, 1.05, 1.1, 1.2, 1.3],  # head_dim 16 * 0.75 / 2 frequencies
                "long_factor": [1.0, 1.5, 3.0, 8.0, 20.0, 48.0],
            },
        ),
    ),
    # SmolLM3's NoPE: every fourth layer has no rotary.
    "tiny-smollm3": ("smollm3", dict(_TINY, num_hidden_layers=4, no_rope_layer_interval=4)),
    # Command R7B's pattern: three sliding (rotary) layers, then a global NoPE one; its logit scale.
    "tiny-cohere2": (
        "cohere2",
        dict(
            _TINY,
            num_hidden_layers=4,
            sliding_window=32,
            layer_types=["sliding_attention"] * 3 + ["full_attention"],
            logit_scale=0.25,
        ),
    ),
    # GLM-4-0414's: interleaved rotary over half of each head, q/k/v biases, four norms per layer.
    "tiny-glm4": (
        "glm4",
        dict(_TINY, attention_bias=True, rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.5}),
    ),
    # Ministral-8B's: sliding-window layers interleaved with full ones.
    "tiny-ministral": (
        "ministral",
        dict(_TINY, num_hidden_layers=4, sliding_window=32, layer_types=["sliding_attention", "full_attention"] * 2),
    ),
    # Mixtures of experts, release-shaped in what routes: Qwen3-MoE's top-8 of many experts, renormalised (as
    # 30B-A3B and 235B-A22B); Qwen2-MoE's top-4 not renormalised, q/k/v biases and a gated shared expert (as
    # Qwen1.5-MoE-A2.7B), with layer 0 a dense MLP (`mlp_only_layers`, which the releases leave empty) so a
    # model with both kinds runs; Mixtral's top-2 of 8, renormalised.
    "tiny-qwen3-moe": (
        "qwen3_moe",
        dict(_TINY, num_experts=16, num_experts_per_tok=8, norm_topk_prob=True, moe_intermediate_size=32),
    ),
    "tiny-qwen2-moe": (
        "qwen2_moe",
        dict(
            _TINY,
            num_experts=16,
            num_experts_per_tok=4,
            norm_topk_prob=False,
            moe_intermediate_size=32,
            shared_expert_intermediate_size=96,
            qkv_bias=True,
            mlp_only_layers=[0],
        ),
    ),
    # GLM-4.5's routing at tiny size: sigmoid scores, 16 experts in 4 groups of which the best 2 are searched (the
    # GLM releases set one group, DeepSeek-V3 eight: groups are exercised here), top-4 renormalised and scaled
    # by 2.5 (the 355B release's and DeepSeek-V3's factor), a shared expert, layer 0 dense; q/k/v biases, q/k
    # norms (as the 355B release) and rotary over half of each head. Random init leaves the routers'
    # e_score_correction_bias at zero: the tests' fixture sets it (conftest.randomize_score_correction_bias).
    # The "-air" one as GLM-4.5-Air: one group, scaling 1.0, no q/k norms.
    "tiny-glm4-moe": ("glm4_moe", dict(_GLM4_MOE, n_group=4, topk_group=2, routed_scaling_factor=2.5, use_qk_norm=True)),
    "tiny-glm4-moe-air": ("glm4_moe", dict(_GLM4_MOE, n_group=1, topk_group=1, routed_scaling_factor=1.0, use_qk_norm=False)),
    "tiny-mixtral": ("mixtral", dict(_TINY, num_local_experts=8, num_experts_per_tok=2, sliding_window=None)),
    # gpt-oss's: top-4 of 16 experts (20b: of 32), expert biases, the clamped SwiGLU, attention sinks, q/k/v/o
    # biases, a sliding window (shorter than the tests' sequences) in every other layer, its YaRN rotary.
    "tiny-gpt-oss": (
        "gpt_oss",
        dict(
            _TINY,
            num_local_experts=16,
            num_experts_per_tok=4,
            intermediate_size=32,
            sliding_window=32,
            # the release's YaRN (factor 32 over 4,096 positions), scaled to the tiny context
            rope_parameters=dict(
                rope_type="yarn",
                rope_theta=150_000.0,
                factor=32.0,
                beta_fast=32.0,
                beta_slow=1.0,
                truncate=False,
                original_max_position_embeddings=32,
            ),
        ),
    ),
    # Small but GPU-sized: for GPU correctness tests (fast to build, real head_dim).
    "small-llama": (
        "llama",
        dict(
            vocab_size=_BYTE_VOCAB,
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=4,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=64,
            max_position_embeddings=4096,
            initializer_range=0.08,
            tie_word_embeddings=False,
        ),
    ),
    # The Llama-3-8B shape, for benchmarks (random weights: EOS is ignored there).
    "llama3-8b": (
        "llama",
        dict(
            vocab_size=128256,
            hidden_size=4096,
            intermediate_size=14336,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            max_position_embeddings=8192,
            rope_theta=500000.0,
            rms_norm_eps=1e-5,
            initializer_range=0.02,
            tie_word_embeddings=False,
        ),
    ),
    # The Gemma 3 12B text shape (the language model of google/gemma-3-12b-it), for benchmarks: 48 layers, five
    # sliding (1,024-token window, rotary base 10k) to one global (base 1M, linear scaling 8), head_dim 256,
    # GELU-tanh, (1 + w) sandwich norms, q/k norms, sqrt(hidden) embedding scale, tied embeddings.
    "gemma3-12b": (
        "gemma3_text",
        dict(
            vocab_size=262208,
            hidden_size=3840,
            intermediate_size=15360,
            num_hidden_layers=48,
            num_attention_heads=16,
            num_key_value_heads=8,
            head_dim=256,
            query_pre_attn_scalar=256,
            sliding_window=1024,
            layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
            rope_parameters={
                "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0},
                "full_attention": {"rope_type": "linear", "rope_theta": 1_000_000.0, "factor": 8.0},
            },
            max_position_embeddings=131072,
            rms_norm_eps=1e-6,
            initializer_range=0.02,
            tie_word_embeddings=True,
        ),
    ),
    # The Phi-4 shape (microsoft/phi-4, Phi3ForCausalLM, 14.7B): fused qkv_proj and gate_up_proj, full rotary.
    "phi4-14b": (
        "phi3",
        dict(
            vocab_size=100352,
            hidden_size=5120,
            intermediate_size=17920,
            num_hidden_layers=40,
            num_attention_heads=40,
            num_key_value_heads=10,
            max_position_embeddings=16384,
            original_max_position_embeddings=16384,
            rope_parameters={"rope_type": "default", "rope_theta": 250_000.0},
            rms_norm_eps=1e-5,
            initializer_range=0.02,
            tie_word_embeddings=False,
        ),
    ),
    # The Qwen3-30B-A3B shape (48 layers, 128 experts of 768, top-8 renormalised), for benchmarks.
    "qwen3-30b-a3b": (
        "qwen3_moe",
        dict(
            vocab_size=151936,
            hidden_size=2048,
            intermediate_size=6144,
            moe_intermediate_size=768,
            num_hidden_layers=48,
            num_attention_heads=32,
            num_key_value_heads=4,
            head_dim=128,
            num_experts=128,
            num_experts_per_tok=8,
            norm_topk_prob=True,
            max_position_embeddings=40960,
            rope_theta=1_000_000.0,
            rms_norm_eps=1e-6,
            initializer_range=0.02,
            tie_word_embeddings=False,
        ),
    ),
    # The GLM-4.5-Air shape (46 layers, 128 experts of 1408, top-8 renormalised, one shared expert, layer 0 a dense
    # MLP of 10944, rotary over half of each head, q/k/v biases, no q/k norms), for benchmarks. 106.9B parameters:
    # 214 GB in bf16, more than one H200 holds (the load says so with the numbers), so one GPU runs the
    # "-23l" cut: its first 23 layers, the same per-layer shape (53B, 106 GB in bf16).
    "glm45-air": ("glm4_moe", _GLM45_AIR),
    "glm45-air-23l": ("glm4_moe", dict(_GLM45_AIR, num_hidden_layers=23)),
    # DeepSeek-class shapes (multi-head latent attention: 512 latent + 64 rotary values per token per layer), for
    # benchmarks. DeepSeek-V2-Lite: 15.7B, 2.4B active (64 experts of 1408, softmax top-6, two shared experts, layer
    # 0 a dense MLP of 10944, no q LoRA, YaRN 40x with mscale 0.707). Moonlight-16B-A3B: V3-shaped (sigmoid routing
    # with the correction bias, one group, top-6 of 64 renormalised and scaled by 2.446, two shared experts).
    "deepseek-v2-lite": ("deepseek_v2", _DEEPSEEK_V2_LITE),
    "moonlight-16b-a3b": ("deepseek_v3", _MOONLIGHT),
    # The gpt-oss-20b shape (24 layers, 32 experts of 2880, top-4, sinks, 128-token windows every other layer), for
    # benchmarks; its experts in bf16 (the release's MXFP4 is dequantized at load).
    "gptoss-20b": (
        "gpt_oss",
        dict(
            vocab_size=201088,
            hidden_size=2880,
            intermediate_size=2880,
            num_hidden_layers=24,
            num_attention_heads=64,
            num_key_value_heads=8,
            head_dim=64,
            num_local_experts=32,
            num_experts_per_tok=4,
            sliding_window=128,
            max_position_embeddings=131072,
            rms_norm_eps=1e-5,
            initializer_range=0.02,
            tie_word_embeddings=False,
        ),
    ),
}


def preset_config(name: str):
    """The transformers config of a preset, with the byte tokenizer's special ids."""
    from transformers import AutoConfig

    model_type, kwargs = PRESETS[name]
    tok = ByteTokenizer()
    return AutoConfig.for_model(
        model_type,
        bos_token_id=tok.bos_token_id,
        eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id,
        **kwargs,
    )
