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


def _meta(caches, positions: range, blocks: list[int], backend=None) -> AttentionMetadata:
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
        backend=backend or AttentionBackend(),
    )


@pytest.mark.parametrize("name", list(SHAPES))
def test_latent_attention_equals_expanded_attention(name, backend=None):
    """`backend`: the Triton one, in the interpreter (test below): its decode step runs the latent decode kernel."""
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
            meta = _meta(caches, span, blocks, backend)
            out, _ = attention(hidden[rows], position_embeddings=part_rotary, attention_mask=None, cbq=meta)
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


LATENT_KERNEL_CHECK = r"""
import torch
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from worker.engine.kernels.latent_attention import latent_decode_attention
from worker.engine.latent_attention import latent_decode_attention_ref

_patch_triton_interpreter()
torch.manual_seed(0)
block = 16
for heads, latent, rope, ctx_lens, splits, dtype in (
    # two head blocks (the second masked), a padded rope width, an empty sequence
    (20, 32, 8, [37, 1, 0, 70], 32, torch.float32),
    (16, 64, 16, [5, 48], 1, torch.float32),  # one split: the kernel writes the output itself
    (16, 512, 64, [40, 3], 32, torch.bfloat16),  # the releases' widths (V2-Lite's 16 heads), as the H200 runs them
):
    num_seqs = len(ctx_lens)
    cache = torch.randn(24, block, 1, latent + rope).to(dtype)
    tables = torch.randperm(23)[: num_seqs * 5].reshape(num_seqs, 5).add(1).to(torch.int32)
    ctx = torch.tensor(ctx_lens, dtype=torch.int32)
    q_latent = torch.randn(num_seqs, heads, latent).to(dtype)
    q_rope = torch.randn(num_seqs, heads, rope).to(dtype)
    scale = 0.2 if dtype == torch.float32 else 0.05
    out = latent_decode_attention(q_latent, q_rope, cache, tables, ctx, scale, max_context_len=80, max_num_splits=splits)
    ref = latent_decode_attention_ref(q_latent.float(), q_rope.float(), cache.float(), tables, ctx, scale)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float(), ref, rtol=tol, atol=tol)
    assert out[ctx == 0].abs().sum() == 0
print("latent kernel matches")
"""


@needs_triton
def test_latent_decode_kernel_matches_its_twin_in_the_interpreter():
    _interpret(LATENT_KERNEL_CHECK, "latent kernel matches")


TRITON_LAYER_CHECK = r"""
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from tests.worker.engine.test_latent_attention import test_latent_attention_equals_expanded_attention
from worker.engine.attention_backend import TritonAttentionBackend

_patch_triton_interpreter()
for name in ("v2-lite", "v3"):
    test_latent_attention_equals_expanded_attention(name, TritonAttentionBackend())
print("triton latent layer matches")
"""


@needs_triton
def test_latent_attention_through_the_triton_backend_in_the_interpreter():
    """The CUDA path's wiring: the latent row written by the Triton writer, prefill chunks through the varlen kernel,
    the decode step through the latent decode kernel; equal to transformers' expanded attention."""
    _interpret(TRITON_LAYER_CHECK, "triton latent layer matches")
