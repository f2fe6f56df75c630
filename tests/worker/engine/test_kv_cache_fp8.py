"""`--kv-cache-dtype fp8`: an e4m3 KV cache with per-tensor scales in the torch attention (the CPU path), its
block count, and the checkpoint's scales.

The cache stores K / scale and V / scale rounded to e4m3 and saturated (never NaN); attention over it equals
attention over the same values kept in fp32 and rounded the same way, and stays within FP8's precision of the
unrounded attention; an engine runs with it (half the cache's bytes of bf16) and mostly decodes the tokens an
fp32 cache gives. The Triton kernels' side is test_attention_fp8_kv.py.
"""

from __future__ import annotations

import pytest
import torch

from worker.engine.attention import paged_attention_ref, write_kv_ref
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.kv_cache import (
    KV_FP8_DTYPE,
    KV_SCALES_ATTR,
    check_kv_cache_dtype,
    kv_bytes_per_block,
    kv_cache_dtype,
    kv_scales_of,
    num_blocks_from_memory,
)
from worker.engine.models.quant_loader import read_kv_scales
from worker.engine.quant.fp8 import FP8_MAX, to_fp8
from worker.engine.quant.methods import Fp8CheckpointError

from .conftest import make_requests

KVH, D, BLOCK = 2, 16, 4


def _caches(num_blocks: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    return torch.zeros(num_blocks, BLOCK, KVH, D, dtype=dtype), torch.zeros(num_blocks, BLOCK, KVH, D, dtype=dtype)


@pytest.mark.parametrize("scale", [1.0, 0.25])
def test_writes_round_to_e4m3_by_the_scale_and_saturate(scale):
    gen = torch.Generator().manual_seed(0)
    key, value = torch.randn(6, KVH, D, generator=gen) * 3, torch.randn(6, KVH, D, generator=gen)
    key[0, 0, 0], value[1, 1, 1] = 1e4, -1e4  # past e4m3's range even unscaled
    k_cache, v_cache = _caches(4, KV_FP8_DTYPE)
    slots = torch.tensor([5, 6, 7, 8, 9, 15], dtype=torch.int32)
    write_kv_ref(key, value, k_cache, v_cache, slots, k_scale=scale, v_scale=scale)
    stored_k = k_cache.view(-1, KVH, D)[slots.long()]
    assert torch.equal(stored_k.float(), to_fp8(key / scale).float())
    assert not torch.isnan(k_cache.float()).any() and not torch.isnan(v_cache.float()).any()
    assert float(stored_k[0, 0, 0]) == FP8_MAX and float(v_cache.view(-1, KVH, D)[6, 1, 1]) == -FP8_MAX
    assert (k_cache.view(-1, KVH, D)[:5].float() == 0).all(), "other slots untouched"


def test_attention_over_an_fp8_cache_reads_the_rounded_values_back():
    gen = torch.Generator().manual_seed(1)
    num_heads, ctx = 4, 13
    key, value = torch.randn(ctx, KVH, D, generator=gen), torch.randn(ctx, KVH, D, generator=gen)
    q = torch.randn(3, num_heads, D, generator=gen)
    tables = torch.tensor([[2, 0, 3, 1]], dtype=torch.int32)
    positions = torch.arange(ctx)
    slots = tables[0].long()[positions // BLOCK] * BLOCK + positions % BLOCK
    args = (tables, torch.tensor([0, 3], dtype=torch.int32), torch.tensor([ctx], dtype=torch.int32), D**-0.5)
    scale = 0.5
    fp8 = _caches(4, KV_FP8_DTYPE)
    write_kv_ref(key, value, *fp8, slots.int(), k_scale=scale, v_scale=scale)
    out = paged_attention_ref(q, *fp8, *args, k_scale=scale, v_scale=scale)
    rounded = _caches(4, torch.float32)  # the same rounding, kept in fp32
    write_kv_ref(to_fp8(key / scale).float() * scale, to_fp8(value / scale).float() * scale, *rounded, slots.int())
    torch.testing.assert_close(out, paged_attention_ref(q, *rounded, *args), rtol=1e-6, atol=1e-6)
    exact = _caches(4, torch.float32)
    write_kv_ref(key, value, *exact, slots.int())
    reference = paged_attention_ref(q, *exact, *args)
    rel = float((out - reference).norm() / reference.norm())
    assert 0 < rel < 0.05, rel


def test_an_engine_runs_with_an_fp8_kv_cache_on_the_cpu():
    fp8 = Engine.from_model("tiny-llama", device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64)
    exact = Engine.from_model("tiny-llama", device="cpu", num_kv_blocks=64)
    assert fp8.runner.kv_caches[0][0].dtype == KV_FP8_DTYPE
    config = fp8.model.config
    assert kv_bytes_per_block(config, 16, kv_cache_dtype(fp8.config, torch.bfloat16)) * 2 == kv_bytes_per_block(
        config, 16, torch.bfloat16
    )
    reqs = make_requests(fp8.tokenizer, 8, seed=3, max_prompt=80, max_new=12)
    got = [r.token_ids for r in fp8.generate(reqs)]
    want = [r.token_ids for r in exact.generate(reqs)]
    assert all(g for g in got)
    firsts = sum(g[:1] == w[:1] for g, w in zip(got, want, strict=True))
    assert firsts >= 6, f"first tokens agree on {firsts} of 8"


def test_an_fp8_cache_is_refused_only_where_triton_has_no_e4m3(monkeypatch):
    """The Triton kernels convert e4m3 on sm89+ (Ada, Hopper): older GPUs get one line; the CPU always runs it."""
    config = EngineConfig(kv_cache_dtype="fp8")
    check_kv_cache_dtype(config, torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 0))
    check_kv_cache_dtype(config, torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (8, 0))
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype fp8 needs an sm89\+ GPU") as info:
        check_kv_cache_dtype(config, torch.device("cuda"))
    assert "\n" not in str(info.value)
    check_kv_cache_dtype(EngineConfig(), torch.device("cuda"))  # a bf16 cache runs anywhere
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")


def test_the_same_budget_holds_twice_the_blocks_in_fp8():
    model_config = Engine.from_model("tiny-llama", device="cpu", num_kv_blocks=8).model.config
    bf16 = num_blocks_from_memory(model_config, torch.bfloat16, torch.device("cpu"), EngineConfig())
    fp8 = num_blocks_from_memory(model_config, KV_FP8_DTYPE, torch.device("cpu"), EngineConfig(kv_cache_dtype="fp8"))
    assert fp8 == 2 * bf16


def test_checkpoint_kv_scales_are_read_per_layer():
    tensors = {
        "model.layers.0.self_attn.k_scale": torch.tensor(0.25),
        "model.layers.0.self_attn.v_scale": torch.tensor([0.5]),
        "model.layers.2.self_attn.kv_scale": torch.tensor(0.125),  # AutoFP8: one for K and V
        "model.layers.0.mlp.down_proj.weight": torch.zeros(2, 2),
    }
    assert read_kv_scales(tensors, 3) == ((0.25, 0.5), (1.0, 1.0), (0.125, 0.125))
    assert read_kv_scales({"model.layers.0.mlp.down_proj.weight": torch.zeros(1)}, 3) == ()
    with pytest.raises(Fp8CheckpointError, match="layers.5"):
        read_kv_scales({"model.layers.5.self_attn.k_scale": torch.tensor(1.0)}, 3)
    with pytest.raises(Fp8CheckpointError, match="positive"):
        read_kv_scales({"model.layers.0.self_attn.k_scale": torch.tensor(0.0)}, 3)


def test_an_engine_writes_and_reads_with_the_models_kv_scales():
    """Scales the loader found (kv_cache.KV_SCALES_ATTR) reach every layer's write and read: the cache holds
    K / k_scale, and the tokens are those of an fp32 cache (within FP8's rounding); a bf16 cache ignores them."""
    fp8 = Engine.from_model("tiny-llama", device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64)
    num_layers = fp8.model.config.num_hidden_layers
    scales = tuple((0.5, 0.25) for _ in range(num_layers))
    setattr(fp8.model, KV_SCALES_ATTR, scales)
    assert kv_scales_of(fp8.model, fp8.config) == scales
    assert kv_scales_of(fp8.model, EngineConfig()) == ()
    scaled = Engine(fp8.model, fp8.tokenizer, EngineConfig(device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64))
    assert scaled.runner.kv_scales == scales
    exact = Engine.from_model("tiny-llama", device="cpu", num_kv_blocks=64)
    reqs = make_requests(exact.tokenizer, 6, seed=4, max_prompt=60, max_new=8)
    got = [r.token_ids for r in scaled.generate(reqs)]
    want = [r.token_ids for r in exact.generate(reqs)]
    firsts = sum(g[:1] == w[:1] for g, w in zip(got, want, strict=True))
    assert firsts >= 5, f"first tokens agree on {firsts} of 6"
    # the cache holds K / 0.5: twice what an unscaled write stores, so its largest value is larger
    unscaled = Engine(fp8.model, fp8.tokenizer, EngineConfig(device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64))
    unscaled.runner.kv_scales = ()
    unscaled.generate(reqs[:1])
    scaled_fresh = Engine(fp8.model, fp8.tokenizer, EngineConfig(device="cpu", kv_cache_dtype="fp8", num_kv_blocks=64))
    scaled_fresh.generate(reqs[:1])
    k_unscaled = unscaled.runner.kv_caches[0][0].float()
    k_scaled = scaled_fresh.runner.kv_caches[0][0].float()
    torch.testing.assert_close(k_scaled, to_fp8(k_unscaled * 2).float(), atol=0.07, rtol=0.07)
