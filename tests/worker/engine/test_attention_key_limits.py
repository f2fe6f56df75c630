"""Attention rows that see past themselves (`key_limits`: a Gemma 3 image's tokens in prefill see their whole image):
the torch reference equals a dense softmax under transformers' rule, AND(sliding window, OR(causal, image block)),
over a paged cache; and the Triton backend hands such steps whole to its prefill kernel, with the limits."""

from __future__ import annotations

import pytest
import torch

from worker.engine.attention import paged_attention_ref, write_kv_ref
from worker.engine.attention_backend import AttentionBackend, AttentionMetadata

BLOCK, HEADS, KV_HEADS, DIM = 4, 4, 2, 8


def dense(q, k, v, visible, scale):
    """[T, H, D] attention of every query over every key where `visible` [T, T] holds."""
    k = k.repeat_interleave(HEADS // KV_HEADS, dim=1)
    v = v.repeat_interleave(HEADS // KV_HEADS, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores.masked_fill(~visible[None], float("-inf"))
    return torch.einsum("hqk,khd->qhd", torch.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("window", [0, 5])
def test_rows_of_an_image_block_see_the_whole_block_within_the_window(window):
    torch.manual_seed(0)
    length, image = 14, (3, 10)  # tokens 3..9 are one image
    q, k, v = (torch.randn(length, n, DIM) for n in (HEADS, KV_HEADS, KV_HEADS))
    k_cache = torch.zeros(8, BLOCK, KV_HEADS, DIM)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.tensor([[5, 2, 7, 1]], dtype=torch.int32)
    slots = torch.tensor([int(blocks[0, i // BLOCK]) * BLOCK + i % BLOCK for i in range(length)])
    write_kv_ref(k, v, k_cache, v_cache, slots)
    positions = torch.arange(length)
    limits = positions.clone()
    limits[image[0] : image[1]] = image[1] - 1
    cu = torch.tensor([0, length], dtype=torch.int32)
    lens = torch.tensor([length], dtype=torch.int32)
    got = paged_attention_ref(q, k_cache, v_cache, blocks, cu, lens, 0.3, sliding_window=window, key_limits=limits)

    is_image = (positions >= image[0]) & (positions < image[1])
    in_block = is_image[:, None] & is_image[None, :]
    visible = (positions[None, :] <= positions[:, None]) | in_block
    if window:
        visible &= positions[None, :] > positions[:, None] - window
    assert torch.allclose(got, dense(q, k, v, visible, 0.3), atol=1e-6)
    causal = paged_attention_ref(q, k_cache, v_cache, blocks, cu, lens, 0.3, sliding_window=window)
    assert not torch.allclose(got[image[0] : image[1] - 1], causal[image[0] : image[1] - 1])  # the block shows


def test_the_triton_backend_runs_a_step_with_key_limits_through_the_prefill_kernel(monkeypatch):
    """A step with key limits goes whole (its decode rows too) to the prefill kernel, limits and all (the kernel's
    own arithmetic against the reference: test_attention_triton.py's interpreter checks)."""
    pytest.importorskip("triton")
    from worker.engine.attention_backend import TritonAttentionBackend

    torch.manual_seed(1)
    length = 6
    q = torch.randn(length, HEADS, DIM)
    k_cache, v_cache = torch.randn(4, BLOCK, KV_HEADS, DIM), torch.randn(4, BLOCK, KV_HEADS, DIM)
    meta = AttentionMetadata(
        kv_caches=[(k_cache, v_cache)],
        slot_mapping=torch.arange(length),
        block_tables=torch.tensor([[1, 3]], dtype=torch.int32),
        cu_seqlens_q=torch.tensor([0, length], dtype=torch.int32),
        context_lens=torch.tensor([length], dtype=torch.int32),
        max_query_len=length,
        max_context_len=length,
        is_decode_only=False,
        backend=AttentionBackend(),
        key_limits=torch.tensor([0, 4, 4, 4, 4, 5], dtype=torch.int32),
    )
    calls = []

    class Kernels:  # records the call, computes the reference's answer
        def paged_prefill_attention(self, q, k_cache, v_cache, block_tables, cu_seqlens_q, context_lens, scale, **kw):
            calls.append(kw)
            return AttentionBackend().attend(q, k_cache, v_cache, meta, scale, 0)

        def paged_decode_attention(self, *args, **kwargs):
            raise AssertionError("a step with key limits runs no decode kernel")

    backend = TritonAttentionBackend()
    monkeypatch.setattr(backend, "_k", Kernels())
    got = backend.attend(q, k_cache, v_cache, meta, 0.25, 0)
    assert torch.equal(got, AttentionBackend().attend(q, k_cache, v_cache, meta, 0.25, 0))
    (kwargs,) = calls
    assert kwargs["key_limits"] is meta.key_limits and kwargs["max_query_len"] == length
