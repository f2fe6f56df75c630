"""Latent attention (worker/engine/latent_attention.py) against transformers' own DeepSeek attention: one layer's
output over a paged latent cache equals the expanded per-head attention (fp32, to rounding), through a prefill in
two chunks and a decode step, for V2's full q projection and V3's q LoRA; and the Triton paged-attention kernels run
the latent cache's shapes (one shared head, K and V the same rows, kv_lora_rank + qk_rope_head_dim wide) as the
torch reference does, in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.deepseek_checkpoints import SHAPES, _transformers_config, randomize_unit_parameters
from worker.engine.attention_backend import AttentionBackend, AttentionMetadata
from worker.engine.kv_cache import allocate_kv_cache
from worker.engine.latent_attention import install_latent_attention, is_latent_cache

from .test_fused_kernels import _interpret, needs_triton

BLOCK = 4


def _model(name: str):
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    config = _transformers_config(dict(SHAPES[name], num_hidden_layers=2, first_k_dense_replace=2))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    randomize_unit_parameters(model)
    return model


def _meta(caches, positions: range, blocks: list[int]) -> AttentionMetadata:
    slots = torch.tensor([blocks[p // BLOCK] * BLOCK + p % BLOCK for p in positions], dtype=torch.int32)
    return AttentionMetadata(
        kv_caches=caches,
        slot_mapping=slots,
        block_tables=torch.tensor([blocks], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, len(positions)], dtype=torch.int32),
        context_lens=torch.tensor([positions.stop], dtype=torch.int32),
        max_query_len=len(positions),
        max_context_len=positions.stop,
        is_decode_only=len(positions) == 1,
        backend=AttentionBackend(),
    )


@pytest.mark.parametrize("name", list(SHAPES))
def test_latent_attention_equals_expanded_attention(name):
    model = _model(name)
    attention = model.model.layers[1].self_attn
    hidden = torch.randn(1, 11, model.config.hidden_size)
    positions = torch.arange(11)[None]
    rotary = model.model.rotary_emb(hidden, positions)
    with torch.no_grad():
        mask = torch.full((11, 11), float("-inf")).triu(1)[None, None]
        expected, _ = attention(hidden, position_embeddings=rotary, attention_mask=mask)
        caches = allocate_kv_cache(model.config, 6, BLOCK, torch.float32, torch.device("cpu"), latent=True)
        assert is_latent_cache(*caches[1])
        install_latent_attention(model)
        blocks = [5, 2, 3]  # out of order, as the block manager hands them out
        parts = []
        for span in (range(0, 6), range(6, 10), range(10, 11)):  # two prefill chunks, then a decode step
            rows = (slice(None), slice(span.start, span.stop))
            part_rotary = tuple(t[rows] for t in rotary) if isinstance(rotary, tuple) else rotary[rows]
            out, _ = attention(hidden[rows], position_embeddings=part_rotary, attention_mask=None, cbq=_meta(caches, span, blocks))
            parts.append(out)
    torch.testing.assert_close(torch.cat(parts, dim=1), expected, rtol=1e-5, atol=1e-5)
    width = model.config.kv_lora_rank + model.config.qk_rope_head_dim
    assert caches[1][0].shape == (6, BLOCK, 1, width) and caches[0][0].abs().sum() == 0  # layer 0 never ran


LATENT_SHAPES_CHECK = r"""
import torch
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from worker.engine.attention import paged_attention_ref, write_kv_ref
from worker.engine.kernels import attention as at

_patch_triton_interpreter()

torch.manual_seed(0)
heads, width, block = 16, 40, 16  # V2-Lite's 16 heads over one shared latent row (32 + 8 at tiny size)
ctx_lens, q_lens = [37, 5, 20], [1, 5, 3]
cache = torch.randn(12, block, 1, width)
tables = torch.tensor([[3, 7, 1], [9, 0, 0], [4, 11, 0]], dtype=torch.int32)
ctx = torch.tensor(ctx_lens, dtype=torch.int32)
row = torch.randn(3, 1, width)
slots = torch.tensor([3 * block + 2, 9 * block + 4, 4 * block + 5], dtype=torch.int32)
ref_cache = cache.clone()
write_kv_ref(row, row, ref_cache, ref_cache, slots)
at.write_kv(row, row, cache, cache, slots)
assert torch.equal(cache, ref_cache), "latent rows written"
q = torch.randn(3, heads, width)
out = at.paged_decode_attention(q, cache, cache, tables, ctx, 0.3, max_context_len=37)
cu = torch.tensor([0, 1, 2, 3], dtype=torch.int32)
ref = paged_attention_ref(q, cache, cache, tables, cu, ctx, 0.3)
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
q = torch.randn(sum(q_lens), heads, width)
cu = torch.tensor([0, 1, 6, 9], dtype=torch.int32)
out = at.paged_prefill_attention(q, cache, cache, tables, cu, ctx, 0.3, max_query_len=5)
ref = paged_attention_ref(q, cache, cache, tables, cu, ctx, 0.3)
torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
print("latent shapes match")
"""


@needs_triton
def test_triton_attention_runs_the_latent_cache_shapes_in_the_interpreter():
    _interpret(LATENT_SHAPES_CHECK, "latent shapes match")
