"""`--kv-cache-dtype fp8`: an e4m3 KV cache with per-tensor scales in the torch attention (the CPU path).

The cache stores K / scale and V / scale rounded to e4m3 and saturated (never NaN); attention over it equals
attention over the same values kept in fp32 and rounded the same way, and stays within FP8's precision of the
unrounded attention; an engine runs with it (half the cache's bytes of bf16) and mostly decodes the tokens an
fp32 cache gives. CUDA refuses it in one line until the Triton kernels read FP8.
"""

from __future__ import annotations

import pytest
import torch

from worker.engine.attention import paged_attention_ref, write_kv_ref
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.kv_cache import KV_FP8_DTYPE, check_kv_cache_dtype, kv_bytes_per_block, kv_cache_dtype
from worker.engine.quant.fp8 import FP8_MAX, to_fp8

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


def test_cuda_refuses_an_fp8_kv_cache_in_one_line():
    config = EngineConfig(kv_cache_dtype="fp8")
    check_kv_cache_dtype(config, torch.device("cpu"))
    with pytest.raises(ValueError, match=r"^--kv-cache-dtype fp8 is not supported on CUDA yet") as info:
        check_kv_cache_dtype(config, torch.device("cuda"))
    assert "\n" not in str(info.value)
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        EngineConfig(kv_cache_dtype="int8")
