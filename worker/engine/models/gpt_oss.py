"""gpt-oss (20b, 120b): attention with a learned sink logit per head, q/k/v/o biases, sliding-window (128) and
full layers alternating, YaRN rotary; RMSNorm with the weight multiplied in fp32 (the norms stay fp32); a sparse
MLP in every layer: the top-4 router logits (with a bias) softmaxed over those four, experts with biases and the
clamped SwiGLU. Released checkpoints store the experts in MXFP4: cbq dequantizes them to the model dtype at load,
in one process as under tensor parallelism (parallel/shard_experts.py; loader.py reads the release as the one rank
of a world of one), into transformers' GptOssExperts parameters; the owned decoder copies them once into the
kernels' [gate; up] layout (moe/from_model.py)."""

from __future__ import annotations

from .qwen3_moe import read
from .spec import Family, MoeMlpSpec, NormKind, llama_layer

FAMILY = Family(
    name="gpt_oss",
    model_types=("gpt_oss",),
    layer=llama_layer(),
    norm=NormKind.RMS_FP32_WEIGHT,
    read=read,
    moe=MoeMlpSpec(router="mlp.router", experts="mlp.experts", kernel_layout=False),
    attention_sinks="self_attn.sinks",
)
