"""The paged KV cache's shape and size: owns the head-dim formula, the cache's element type, the bytes per block,
the number of blocks that fit in memory, and the cache allocation (the model runner holds the tensors it returns).

`--kv-cache-dtype fp8` stores K and V as float8_e4m3fn, divided by a per-tensor scale on write and multiplied by
it on read: the torch attention (attention.py) and every Triton writer and attention kernel (kernels/attention.py,
the fused QKV epilogues). One byte per element, so the same memory holds twice the blocks of a bf16 cache. The
scales are static, one (k_scale, v_scale) pair per layer (`kv_scales_of`): 1.0, as vLLM without calibrated
scales, or a checkpoint's. Static per-tensor scales keep a cached prefix block valid for any later request
(dynamic or per-block scales would have to travel with the block) and cost nothing in the kernels (folded into
the softmax scale and the output); bf16 K/V of a Llama-shaped model sit well inside e4m3's ±448, and e4m3's
relative precision (2^-4) does not depend on the magnitude within its normal range.

Layout: one tensor [layers, 2, num_blocks, block_size, num_kv_heads, head_dim]; layer i's (K, V) are views. Multi-head
latent attention (DeepSeek) keeps one row of kv_lora_rank + qk_rope_head_dim values per token per layer instead
(`uses_latent_cache`): [layers, num_blocks, block_size, 1, width], each layer's K and V views the same rows. In
e4m3 the latent row (the latent and the rotary key) takes one per-tensor scale per layer, the checkpoint's k_scale
or 1.0 (`kv_scales_of`). Against the model dtype's latent cache it costs what the FP8 K/V cache costs against the
model dtype's on the same model (measured on the CPU fixtures: docs/performance.md, test_latent_fp8.py).
"""

from __future__ import annotations

from typing import Any

import torch

from .config import EngineConfig

# CUDA: room for activations, logits and graphs beside the KV cache (sized for the largest step budget).
ACTIVATION_RESERVE_BYTES = 6 << 30

KVCaches = list[tuple[torch.Tensor, torch.Tensor]]  # per layer (k_cache, v_cache)


KV_FP8_DTYPE = torch.float8_e4m3fn


def kv_cache_dtype(config: EngineConfig, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element type: the model dtype, or e4m3 for `--kv-cache-dtype fp8`."""
    return KV_FP8_DTYPE if config.kv_cache_dtype == "fp8" else model_dtype


def check_kv_cache_dtype(config: EngineConfig, device: torch.device) -> None:
    """A ValueError (one line) for a cache dtype this device's attention cannot read: Triton converts to and
    from e4m3 on sm89+ (Ada, Hopper) only."""
    if config.kv_cache_dtype == "fp8" and device.type == "cuda":
        capability = torch.cuda.get_device_capability(device)
        if capability < (8, 9):
            raise ValueError(
                f"--kv-cache-dtype fp8 needs an sm89+ GPU (Ada, Hopper); this one is sm{capability[0]}{capability[1]}"
            )


# A model's per-layer FP8 KV scales, set by the checkpoint loader (models/quant_loader.py) when the checkpoint has them.
KV_SCALES_ATTR = "cbq_kv_scales"


def kv_scales_of(model: Any, config: EngineConfig, latent: bool = False) -> tuple[tuple[float, float], ...]:
    """Each layer's (k_scale, v_scale) for an FP8 cache: the checkpoint's (its kv_cache_scheme), else () (every
    scale 1.0). A cache in the model dtype is never scaled. `latent` (`uses_latent_cache`): one row is both K and
    V, written and read with one scale, the layer's k_scale: (k_scale, k_scale)."""
    if config.kv_cache_dtype != "fp8":
        return ()
    scales = tuple(getattr(model, KV_SCALES_ATTR, ()))
    if latent:
        return tuple((k_scale, k_scale) for k_scale, _ in scales)
    return scales


def head_dim_of(model_config: Any) -> int:
    """The attention head size: the config's `head_dim` when it has one (Qwen3, Llama-3), else hidden / heads."""
    return getattr(model_config, "head_dim", None) or model_config.hidden_size // model_config.num_attention_heads


def cache_head_dim(model_config: Any) -> int:
    """The width of one head's K (and V) in the cache: the attention head size, or for multi-head latent attention
    (DeepSeek-V2/V3, `kv_lora_rank` set) each head's expanded key, qk_nope_head_dim + qk_rope_head_dim, its value
    (v_head_dim, no wider) padded to it (attention_backend.py)."""
    if getattr(model_config, "kv_lora_rank", None):
        qk_head_dim = model_config.qk_nope_head_dim + model_config.qk_rope_head_dim
        return max(qk_head_dim, model_config.v_head_dim)
    return head_dim_of(model_config)


def uses_latent_cache(model_config: Any, config: EngineConfig) -> bool:
    """Multi-head latent attention (`kv_lora_rank` set) keeps its latent in the cache, except under decoder "hf"
    (transformers' attention, which hands cbq each head's expanded K and V)."""
    return bool(getattr(model_config, "kv_lora_rank", None)) and config.decoder != "hf"


def latent_width(model_config: Any) -> int:
    """A latent cache's values per token per layer: the normed latent and the rotated shared key."""
    return int(model_config.kv_lora_rank + model_config.qk_rope_head_dim)


def kv_bytes_per_block(model_config: Any, block_size: int, dtype: torch.dtype, latent: bool = False) -> int:
    """`latent`: the cache of `uses_latent_cache` (one row per token per layer, K and V the same values)."""
    if latent:
        per_token = model_config.num_hidden_layers * latent_width(model_config)
    else:
        per_token = 2 * model_config.num_hidden_layers * model_config.num_key_value_heads * cache_head_dim(model_config)
    return per_token * block_size * torch.empty((), dtype=dtype).element_size()


def num_blocks_from_memory(
    model_config: Any, dtype: torch.dtype, device: torch.device, config: EngineConfig
) -> int:
    """Blocks that fit the budget: on CUDA `kv_budget_bytes` of the device as it is now (the model loaded),
    on the CPU `kv_cache_bytes_cpu`. Raises ValueError when not even two blocks fit."""
    per_block = kv_bytes_per_block(model_config, config.block_size, dtype, uses_latent_cache(model_config, config))
    if device.type == "cuda":
        import gc

        gc.collect()  # an engine this process dropped may still hold its KV cache until collected
        free_bytes, total_bytes = torch.cuda.mem_get_info(device)
        # Blocks PyTorch's allocator keeps cached (freed by an earlier engine of this process) are reusable here.
        free_bytes += torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        budget = kv_budget_bytes(total_bytes, free_bytes, config.gpu_memory_utilization)
    else:
        budget = config.kv_cache_bytes_cpu
    if budget < 2 * per_block:
        raise ValueError(
            f"no room for the KV cache on {device}: {budget / 2**30:.2f} GiB left for it, and one block takes "
            f"{per_block / 2**20:.2f} MiB (raise --gpu-memory-utilization, or set --num-kv-blocks)"
        )
    return budget // per_block


def kv_budget_bytes(total_bytes: int, free_bytes: int, gpu_memory_utilization: float) -> int:
    """What the KV cache may take: the engine's share of the device (`gpu_memory_utilization` of its total),
    less what is in use already (the model's weights, and whatever other processes hold), less the
    activation reserve."""
    in_use_bytes = total_bytes - free_bytes
    return int(total_bytes * gpu_memory_utilization) - in_use_bytes - ACTIVATION_RESERVE_BYTES


def allocate_kv_cache(
    model_config: Any, num_blocks: int, block_size: int, dtype: torch.dtype, device: torch.device, latent: bool = False
) -> KVCaches:
    """`latent`: [layers, num_blocks, block_size, 1, latent_width] and each layer's K and V the same view (one shared
    head: latent_attention.py); else per-head K and V."""
    num_layers = model_config.num_hidden_layers
    if latent:
        latent_cache = torch.zeros((num_layers, num_blocks, block_size, 1, latent_width(model_config)), dtype=dtype, device=device)
        return [(latent_cache[i], latent_cache[i]) for i in range(num_layers)]
    shape = (num_layers, 2, num_blocks, block_size, model_config.num_key_value_heads, cache_head_dim(model_config))
    cache = torch.zeros(shape, dtype=dtype, device=device)
    return [(cache[i, 0], cache[i, 1]) for i in range(num_layers)]
