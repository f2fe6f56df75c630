"""Engine configuration: one frozen dataclass, derived values as properties."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

MODES = ("sync", "async")
DECODERS = ("auto", "owned", "hf")
DECODE_GEMMS = ("auto", "triton", "cublas")
QUANTIZATIONS = ("fp8",)  # --quantization: weights quantized at load (quant/config.py parses it)
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass(frozen=True)
class EngineConfig:
    mode: str = "async"  # "sync": CPU waits for step N before preparing N+1; "async": overlapped
    device: str = "auto"  # "auto" -> cuda if available, else cpu
    dtype: str = "auto"  # "auto" -> bfloat16 on cuda, float32 on cpu
    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # explicit cache size; None -> sized from memory
    # CUDA: the fraction of the device's total memory this engine may hold, weights, activations and KV
    # cache together (vLLM's meaning); the KV cache gets what is left of it once the model is loaded.
    # Memory other processes hold counts against it.
    gpu_memory_utilization: float = 0.90
    kv_cache_bytes_cpu: int = 256 << 20  # cache budget on CPU when num_kv_blocks is None
    # Bulk generation wants big steps: on an H200 with an 8B model, W2 ran 21% faster at 1024 / 8192
    # than at 512 / 4096 (benchmarks/README.md). Memory for activations is reserved for these sizes.
    max_num_batched_tokens: int = 8192  # token budget per step (decodes + prefill chunks)
    max_num_seqs: int = 1024  # running requests at most
    max_model_len: int | None = None  # None -> the model's max_position_embeddings
    use_cuda_graphs: bool = True  # decode steps replay captured graphs (CUDA only)
    fused_kernels: bool = True  # CUDA: the owned decoder's Triton element-wise kernels (kernels/fused.py)
    attention_backend: str = "auto"  # "auto" -> triton on cuda, torch reference on cpu
    decoder: str = "auto"  # "owned": cbq's fused decoder.py; "hf": transformers'; "auto": owned on cuda (and longrope)
    # The owned decoder's steps of at most 32 tokens: "triton" runs their weight GEMMs as Triton kernels
    # with SiLU·mul fused and every kernel of the layer chained by programmatic dependent launch
    # (kernels/decode_gemm.py; sm90+, bf16/fp16), FP8 linears too (quant/small_step.py: x quantized inside the
    # GEMM); "cublas" keeps cuBLAS; "auto": triton where it can run (for FP8 models too: 1.357x W1's FP8
    # throughput of the quantization kernel + cuBLASLt pair on the H200, 2026-12-03).
    decode_gemm: str = "auto"
    seed: int = 0  # base for requests without a seed
    # Full KV blocks are kept after their request finishes and shared by any prompt that starts with the
    # same tokens (block_manager.py). Off: every prompt is computed whole (parallel samples still share).
    enable_prefix_caching: bool = True
    # Fields a request leaves unset (temperature, top_p, top_k, max_new_tokens) take the checkpoint's
    # generation_config.json values, as in `generate()` and vLLM; False: cbq's built-in defaults.
    generation_config_defaults: bool = True
    # "fp8": an unquantized checkpoint's linears quantized at load (per-channel FP8 weights, dynamic per-token
    # activations); an FP8 checkpoint runs its own format either way. None: the checkpoint's dtype.
    quantization: str | None = None
    # "auto": the KV cache in the model dtype. "fp8": e4m3 with per-tensor scales (half bf16's bytes), in the
    # torch attention (CPU) only so far: the model runner refuses it on CUDA (kv_cache.py).
    kv_cache_dtype: str = "auto"
    # Batch-invariant arithmetic (deterministic.py): a request's tokens are bitwise the same alone or in any
    # batch, sync or async, with any token budget, prefix cache on or off. Costs speed; needs the owned decoder.
    deterministic: bool = False
    # Ranks (GPUs of one host) one model replica is split over (parallel/): each holds its share of the heads,
    # the MLP and the vocabulary. 1: the whole model in this process (data parallelism is more workers).
    tensor_parallel_size: int = 1

    def __post_init__(self) -> None:
        # NOTE: user-reachable (`cbq worker` options, `Engine.from_model(**overrides)`): raise, never assert.
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {self.mode!r}")
        if self.block_size <= 0 or self.block_size & (self.block_size - 1):
            raise ValueError(f"block_size must be a power of two, got {self.block_size}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.decoder not in DECODERS:
            raise ValueError(f"decoder must be one of {DECODERS}, got {self.decoder!r}")
        if self.decode_gemm not in DECODE_GEMMS:
            raise ValueError(f"decode_gemm must be one of {DECODE_GEMMS}, got {self.decode_gemm!r}")
        if self.num_kv_blocks is not None and self.num_kv_blocks < 2:
            raise ValueError(f"num_kv_blocks must be >= 2, got {self.num_kv_blocks}")
        if not 0 < self.gpu_memory_utilization <= 1:
            raise ValueError(f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {QUANTIZATIONS} or None, got {self.quantization!r}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {KV_CACHE_DTYPES}, got {self.kv_cache_dtype!r}")
        if self.tensor_parallel_size < 1:
            raise ValueError(f"tensor_parallel_size must be >= 1, got {self.tensor_parallel_size}")
        if self.max_model_len is not None and self.max_model_len < 2:
            raise ValueError(f"max_model_len must be >= 2, got {self.max_model_len}")

    @property
    def is_async(self) -> bool:
        return self.mode == "async"


def context_len(config: EngineConfig, model_config: Any, num_kv_blocks: int) -> int:
    """The context length: the configured one (else the model's), capped so that a lone sequence always fits in
    the cache (or preemption could never make room for it)."""
    model_len = config.max_model_len or model_config.max_position_embeddings
    return min(model_len, (num_kv_blocks - 1) * config.block_size)
