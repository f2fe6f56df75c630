"""Triton paged-attention kernels vs the torch reference (worker/engine/attention.py).

Two ways to run the same checks:
  - on CUDA (`@pytest.mark.gpu`, skipped without a device or without triton);
  - on CPU through Triton's interpreter, in a subprocess with TRITON_INTERPRET=1 (this module sets no
    environment itself), with tiny sizes; skipped when triton is not installed (CI).
Run the interpreter variant by hand with:  TRITON_INTERPRET=1 python tests/worker/engine/test_attention_triton.py
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.engine.attention import paged_attention_ref, write_kv_ref
from worker.engine.kernels import attention as at

REPO_ROOT = Path(__file__).resolve().parents[3]
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}

needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and at.HAVE_TRITON), reason="needs a CUDA device and triton"
)


# ------------------------------------------------------------------------------------------------
# Case builders and checks (shared by the GPU tests and the interpreter run)
# ------------------------------------------------------------------------------------------------


def _rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    out, ref = out.double(), ref.double()
    return ((out - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def make_case(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed):
    """Random paged cache with shuffled, non-contiguous blocks.

    Cache slots at or past a sequence's context length, and spare blocks, hold NaN: a kernel that reads
    (rather than masks) them poisons its output. Unused block-table entries are -1.
    """
    gen = torch.Generator().manual_seed(seed)
    num_seqs = len(ctx_lens)
    blocks_per_seq = [-(-c // block_size) for c in ctx_lens]
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq + [1]) + 2
    block_tables = torch.full((num_seqs, max_blocks), -1, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, head_dim), float("nan"))
    v_cache = torch.full_like(k_cache, float("nan"))
    used = 0
    for b, (ctx, nb) in enumerate(zip(ctx_lens, blocks_per_seq, strict=True)):
        blocks = perm[used : used + nb]
        used += nb
        block_tables[b, :nb] = blocks.to(torch.int32)
        flat_k = k_cache[blocks].reshape(-1, num_kv_heads, head_dim)
        flat_v = v_cache[blocks].reshape(-1, num_kv_heads, head_dim)
        flat_k[:ctx] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        flat_v[:ctx] = torch.randn(ctx, num_kv_heads, head_dim, generator=gen)
        k_cache[blocks] = flat_k.reshape(nb, block_size, num_kv_heads, head_dim)
        v_cache[blocks] = flat_v.reshape(nb, block_size, num_kv_heads, head_dim)
    num_tokens = sum(q_lens)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen)
    cu = [0]
    for n in q_lens:
        cu.append(cu[-1] + n)
    return dict(
        q=q.to(dtype).to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        block_tables=block_tables.to(device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(ctx_lens, dtype=torch.int32, device=device),
        scale=head_dim**-0.5,
    )


def _reference(*args, sliding_window=0, sinks=None):
    """paged_attention_ref with full-precision fp32 matmuls, whatever another test set globally (TF32)."""
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")
    try:
        return paged_attention_ref(*args, sliding_window=sliding_window, sinks=sinks)
    finally:
        torch.set_float32_matmul_precision(prev)


def _reference_of_case(c: dict, q: torch.Tensor, sliding_window: int, sinks=None) -> torch.Tensor:
    cache_and_layout = (c[k] for k in ("k_cache", "v_cache", "block_tables", "cu_seqlens_q", "context_lens"))
    return _reference(q, *cache_and_layout, c["scale"], sliding_window=sliding_window, sinks=sinks)


def _assert_close(out, ref, dtype, what):
    assert not torch.isnan(out).any(), f"{what}: NaN in output (element not written, or poisoned cache read)"
    err = _rel_err(out, ref)
    assert err < TOL[dtype], f"{what}: relative error {err:.3g} >= {TOL[dtype]}"
    return err


def check_decode(ctx_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0, **kw):
    c = make_case(
        ctx_lens, [1] * len(ctx_lens), num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed
    )
    ref = _reference_of_case(c, c["q"], kw.get("sliding_window", 0), kw.get("sinks"))
    out = torch.full_like(c["q"], float("nan"))
    res = at.paged_decode_attention(
        c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["context_lens"], c["scale"], out=out, **kw
    )
    assert res is out
    what = f"decode ctx={ctx_lens} H={num_heads} KVH={num_kv_heads} D={head_dim} bs={block_size} {dtype} {kw}"
    err = _assert_close(out, ref, dtype, what)
    zero_rows = [b for b, n in enumerate(ctx_lens) if n == 0]
    if zero_rows:
        assert (out[zero_rows] == 0).all(), f"{what}: context_len 0 rows must be zeros"
    return err


def check_prefill(
    ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=0, pad_rows=0, **kw
):
    c = make_case(ctx_lens, q_lens, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed)
    q = c["q"]
    if pad_rows:  # rows past cu_seqlens_q[-1] (padding of a graph bucket): must come back as zeros
        q = torch.cat([q, torch.randn(pad_rows, num_heads, head_dim).to(dtype).to(device)])
    ref = _reference_of_case(c, q, kw.get("sliding_window", 0), kw.get("sinks"))
    out = torch.full_like(q, float("nan"))
    res = at.paged_prefill_attention(
        q,
        c["k_cache"],
        c["v_cache"],
        c["block_tables"],
        c["cu_seqlens_q"],
        c["context_lens"],
        c["scale"],
        out=out,
        **kw,
    )
    assert res is out
    what = f"prefill ctx={ctx_lens} q={q_lens} H={num_heads} KVH={num_kv_heads} D={head_dim} bs={block_size} {dtype} {kw}"
    err = _assert_close(out, ref, dtype, what)
    if pad_rows:
        assert (out[-pad_rows:] == 0).all(), f"{what}: padding rows must be zeros"
    return err


def check_write_kv(num_tokens, num_kv_heads, head_dim, block_size, dtype, device, seed=0):
    gen = torch.Generator().manual_seed(seed)
    num_blocks = -(-num_tokens // block_size) + 2
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    # real rows write distinct slots past the scratch block 0; padding rows all write scratch slot 0
    slots = block_size + torch.randperm((num_blocks - 1) * block_size, generator=gen)[:num_tokens]
    slots[torch.arange(num_tokens) % 3 == 1] = 0
    slots = slots.to(torch.int32).to(device)
    # key: a view into a fused qkv-like buffer (row stride != KVH * D); value: the transposed view
    # transformers hands over ([1, KVH, T, D] -> [T, KVH, D], head stride T * D)
    fused = torch.randn(num_tokens, 3 * num_kv_heads, head_dim, generator=gen).to(dtype).to(device)
    key = fused[:, :num_kv_heads]
    hf_value = torch.randn(1, num_kv_heads, num_tokens, head_dim, generator=gen).to(dtype).to(device)
    value = hf_value[0].transpose(0, 1)
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    write_kv_ref(key, value, k_ref, v_ref, slots)
    at.write_kv(key, value, k_cache, v_cache, slots)
    # block 0 is scratch: several padding rows race for slot 0 there, so only the real blocks are compared
    assert torch.equal(k_cache[1:], k_ref[1:]), "write_kv: K cache differs from reference"
    assert torch.equal(v_cache[1:], v_ref[1:]), "write_kv: V cache differs from reference"
    # int64 slots and a cache of another dtype (cast on store) also work
    k32 = torch.zeros(k_cache.shape, dtype=torch.float32, device=device)
    v32 = torch.zeros_like(k32)
    k32_ref, v32_ref = k32.clone(), v32.clone()
    write_kv_ref(key, value, k32_ref, v32_ref, slots)
    at.write_kv(key, value, k32, v32, slots.long())
    assert torch.equal(k32[1:], k32_ref[1:]) and torch.equal(v32[1:], v32_ref[1:]), "int64 slots / fp32 cache"


# Context-length mixes: 1, exactly a block multiple, just past one, long; 0 = padding row of a graph bucket.
def _decode_ctx(block_size, long):
    return [1, block_size, 4 * block_size, 4 * block_size + 1, long, 0, 3, long // 2 + 7]


def _prefill_mix(block_size, long):
    # (ctx_lens, q_lens): first chunk, later chunk over a cached prefix, exact-block chunk, decode rows
    ctx = [37, long, 2 * block_size, 5, 1, long // 2 + 3, 0]
    ql = [37, 67, 2 * block_size, 1, 1, 1, 0]
    return ctx, ql


def check_sliding_window(num_heads, num_kv_heads, head_dim, block_size, dtype, device, windows) -> list[float]:
    """Decode and prefill with windows narrower than a tile, about a block, and wider than every context."""
    errs = []
    ctx, ql = _prefill_mix(block_size, long=90)
    for window in windows:
        for max_num_splits in (1, 4):
            errs.append(
                check_decode(
                    _decode_ctx(block_size, long=150), num_heads, num_kv_heads, head_dim, block_size, dtype,
                    device, sliding_window=window, max_num_splits=max_num_splits,
                )
            )  # fmt: skip
        errs.append(
            check_prefill(
                ctx, ql, num_heads, num_kv_heads, head_dim, block_size, dtype, device, pad_rows=2,
                sliding_window=window, max_query_len=max(ql),
            )
        )  # fmt: skip
        # one long first chunk: several query tiles, each with its own window edge
        errs.append(
            check_prefill(
                [130], [130], num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                sliding_window=window, max_query_len=130,
            )
        )  # fmt: skip
    return errs


def check_sinks(num_heads, num_kv_heads, head_dim, block_size, dtype, device) -> list[float]:
    """gpt-oss's attention sinks (a logit per head, some large enough to take most of the probability) through
    the decode kernel with and without splits (the reduce adds the sink once) and the prefill kernel, with and
    without a sliding window."""
    sinks = (torch.randn(num_heads, generator=torch.Generator().manual_seed(1)) * 3).to(device)
    errs = []
    for window in (0, 17):
        for max_num_splits in (1, 2, at.DEFAULT_MAX_NUM_SPLITS):
            errs.append(check_decode(
                _decode_ctx(block_size, long=150), num_heads, num_kv_heads, head_dim, block_size, dtype, device,
                sliding_window=window, max_num_splits=max_num_splits, sinks=sinks,
            ))  # fmt: skip
        ctx, ql = _prefill_mix(block_size, long=90)
        errs.append(check_prefill(
            ctx, ql, num_heads, num_kv_heads, head_dim, block_size, dtype, device, pad_rows=3,
            sliding_window=window, max_query_len=max(ql), sinks=sinks,
        ))  # fmt: skip
    return errs


def check_key_limits(num_heads, num_kv_heads, head_dim, block_size, dtype, device) -> list[float]:
    """Gemma 3's bidirectional image rows (`key_limits`: a row of an image sees to the image's last token, past its
    own position) through the prefill kernel, as the torch reference computes them: a decode, a chunk on a cached
    prefix holding an image of 20 tokens, a whole prompt with two images (one at its start, one ending the chunk),
    with and without a sliding window narrower than an image; rows past the step come back as zeros."""
    ctx, ql = [37, 70, 61], [1, 40, 61]
    images = {1: [(35, 20)], 2: [(0, 12), (45, 16)]}  # sequence -> (first position, tokens) of each image
    c = make_case(ctx, ql, num_heads, num_kv_heads, head_dim, block_size, dtype, device, seed=3)
    limits = []
    for b, (n, q_len) in enumerate(zip(ctx, ql, strict=True)):
        seq = list(range(n - q_len, n))
        for start, tokens in images.get(b, []):
            seq = [start + tokens - 1 if start <= p < start + tokens else p for p in seq]
        limits += seq
    key_limits = torch.tensor(limits + [0, 0], dtype=torch.int64, device=device)  # two padding rows
    q = torch.cat([c["q"], torch.randn(2, num_heads, head_dim).to(dtype).to(device)])
    errs = []
    for window in (0, 9):
        layout = (c[k] for k in ("k_cache", "v_cache", "block_tables", "cu_seqlens_q", "context_lens"))
        prev = torch.get_float32_matmul_precision()
        torch.set_float32_matmul_precision("highest")
        try:
            ref = paged_attention_ref(q, *layout, c["scale"], sliding_window=window, key_limits=key_limits)
        finally:
            torch.set_float32_matmul_precision(prev)
        causal = _reference_of_case(c, q, window)
        assert not torch.allclose(ref, causal), "the image rows were meant to see past their own positions"
        out = at.paged_prefill_attention(
            q, c["k_cache"], c["v_cache"], c["block_tables"], c["cu_seqlens_q"], c["context_lens"], c["scale"],
            max_query_len=max(ql), sliding_window=window, key_limits=key_limits,
        )  # fmt: skip
        errs.append(_assert_close(out, ref, dtype, f"key limits, window {window}, {dtype}"))
        assert (out[sum(ql) :] == 0).all(), "padding rows are zeros"
    return errs


def test_reference_sinks_take_their_share_of_the_softmax():
    """One key: without a sink the output is its value; a sink s scales it by e^0 / (e^0 + e^s) (scores 0)."""
    k_cache = torch.zeros(2, 4, 1, 2)
    v_cache = torch.ones(2, 4, 1, 2)
    args = (torch.zeros(1, 1, 2), k_cache, v_cache, torch.tensor([[1]]), torch.tensor([0, 1]), torch.tensor([1]), 1.0)
    assert torch.equal(paged_attention_ref(*args), torch.ones(1, 1, 2))
    out = paged_attention_ref(*args, sinks=torch.tensor([1.0]))
    torch.testing.assert_close(out, torch.full((1, 1, 2), 1 / (1 + math.e)))


def test_reference_sliding_window_sees_only_the_last_window_keys():
    """The reference's window against a dense softmax written out here (key p visible to row r iff r - W < p <= r)."""
    window, ctx = 5, 13
    c = make_case([ctx], [ctx], 2, 1, 8, 4, torch.float32, "cpu", seed=3)
    out = _reference(
        c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["cu_seqlens_q"], c["context_lens"], c["scale"],
        sliding_window=window,
    )  # fmt: skip
    blocks = c["block_tables"][0, : -(-ctx // 4)].long()
    keys = c["k_cache"][blocks].reshape(-1, 1, 8)[:ctx, 0]
    values = c["v_cache"][blocks].reshape(-1, 1, 8)[:ctx, 0]
    for r in range(ctx):
        for h in range(2):
            lo = max(0, r - window + 1)
            probs = torch.softmax(keys[lo : r + 1] @ c["q"][r, h] * c["scale"], dim=0)
            torch.testing.assert_close(out[r, h], probs @ values[lo : r + 1])


# ------------------------------------------------------------------------------------------------
# Host-side logic (runs everywhere, triton or not)
# ------------------------------------------------------------------------------------------------


def test_module_imports_and_split_heuristic():
    assert isinstance(at.HAVE_TRITON, bool)
    bf16 = torch.bfloat16
    for batch in (1, 8, 32, 256, 1024):
        for ctx in (1, 16, 100, 1024, 8192):
            for max_splits in (1, 4, at.DEFAULT_MAX_NUM_SPLITS):
                s = at.decode_num_splits(batch, 8, 128, bf16, ctx, max_num_splits=max_splits)
                assert 1 <= s <= max_splits
                assert s <= max(1, -(-ctx // 16))  # never more splits than 16-token tiles (tiles are >= 16)
    # more sequences never means more splits
    seq = [at.decode_num_splits(b, 8, 128, bf16, 4096) for b in (1, 2, 4, 8, 16, 32, 64, 128, 256)]
    assert seq == sorted(seq, reverse=True)
    assert at.decode_workspace_numel(4, 32, 128, 1) == 0
    assert at.decode_workspace_numel(4, 32, 128, 8) == 4 * 32 * 8 * 129


def test_prefill_pipelines_deeper_only_where_shared_memory_allows(monkeypatch):
    """5 stages (one K/V tile in flight during the compute) on GPUs with the shared memory for it; 3 elsewhere."""
    bf16, cuda = torch.bfloat16, torch.device("cuda", 0)
    monkeypatch.setattr(at, "_max_shared_memory", lambda index: 227 * 1024)  # H100/H200
    assert at._prefill_config(128, bf16, cuda) == (128, 64, 8, 5)
    assert at._prefill_config(128, torch.float32, cuda)[3] == 2  # fp32 tiles are unchanged
    monkeypatch.setattr(at, "_max_shared_memory", lambda index: 99 * 1024)  # sm_86/89
    assert at._prefill_config(128, bf16, cuda) == (128, 64, 8, 3)
    assert at._prefill_config(128, bf16, torch.device("cpu")) == (128, 64, 8, 3)  # the interpreter
    assert at._prefill_config(128, bf16) == (128, 64, 8, 3)


# ------------------------------------------------------------------------------------------------
# GPU tests
# ------------------------------------------------------------------------------------------------

GPU_DTYPES = [torch.float32, torch.bfloat16, torch.float16]


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (16, 4)])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_decode(dtype, head_dim, num_heads, num_kv_heads, block_size):
    ctx = _decode_ctx(block_size, long=1500)
    for max_num_splits in (1, 2, at.DEFAULT_MAX_NUM_SPLITS):
        check_decode(
            ctx, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", max_num_splits=max_num_splits
        )


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_decode_hints(dtype):
    check_decode([700, 1, 0, 512, 33], 32, 8, 128, 16, dtype, "cuda", max_context_len=700)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", [(8, 8), (16, 4)])
@pytest.mark.parametrize("block_size", [16, 128])
def test_gpu_prefill(dtype, head_dim, num_heads, num_kv_heads, block_size):
    ctx, ql = _prefill_mix(block_size, long=1100)
    check_prefill(ctx, ql, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", pad_rows=5)
    check_prefill(
        ctx, ql, num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", max_query_len=max(ql)
    )
    # a single long first chunk (many query tiles)
    check_prefill(
        [600], [600], num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", max_query_len=600
    )
    # an all-decode batch through the prefill kernel (small M tiles)
    check_prefill(
        [1, 40, 300], [1, 1, 1], num_heads, num_kv_heads, head_dim, block_size, dtype, "cuda", max_query_len=1
    )


def test_prefill_tiles_fit_the_shared_memory_of_an_h100_at_every_head_dim():
    """The prefill tile of every head width up to the latent cache's (kv_lora 512 + rope 64 = 576, one shared head)
    stays inside sm_90's 227 KiB: a (64, 32) tile at 576 asked 384 KiB and could not compile on the H100."""
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for head_dim in (16, 64, 80, 128, 192, 256, 320, 576, 1024):
            assert at.prefill_shared_memory(head_dim, dtype) <= 227 * 1024, (head_dim, dtype)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_prefill_over_the_latent_cache_width(dtype):
    # DeepSeek-V2/V3's latent cache through the prefill kernel: one shared head of 576 under 16 query heads
    check_prefill([70, 9, 300], [50, 4, 1], 16, 1, 576, 16, dtype, "cuda", pad_rows=2)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
def test_gpu_odd_shapes(dtype):
    # small head dims of tiny test models, a non-power-of-two head dim, a non-power-of-two GQA group, block 8
    check_decode([1, 9, 100, 0], 4, 1, 16, 8, dtype, "cuda")
    check_decode([1, 9, 100, 0], 6, 2, 32, 8, dtype, "cuda")
    check_decode([1, 64, 333], 12, 4, 80, 32, dtype, "cuda")
    check_prefill([20, 9, 1], [20, 4, 1], 4, 1, 16, 8, dtype, "cuda")
    check_prefill([70, 9, 1], [50, 4, 1], 6, 2, 32, 8, dtype, "cuda", pad_rows=2)
    check_prefill([200, 64, 333], [130, 64, 1], 12, 4, 80, 32, dtype, "cuda")
    check_prefill([130, 5], [129, 5], 28, 4, 128, 16, dtype, "cuda")  # Qwen2-7B-like group of 7


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("head_dim,block_size", [(128, 16), (64, 128), (16, 8)])
def test_gpu_sliding_window(dtype, head_dim, block_size):
    check_sliding_window(16, 4, head_dim, block_size, dtype, "cuda", windows=(1, 5, 17, 64, 100, 4096))


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_sinks(dtype):
    check_sinks(64, 8, 64, 16, dtype, "cuda")  # gpt-oss-20b's heads


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_gpu_key_limits(dtype):
    check_key_limits(8, 4, 256, 16, dtype, "cuda")  # Gemma 3 27B's head width


@pytest.mark.gpu
@needs_cuda
def test_gpu_prefill_config_reads_the_devices_shared_memory():
    """The driver's figure is what the 5-stage rule compares: Hopper (227 KiB per program) pipelines deeper."""
    device = torch.device("cuda")
    smem = at._device_shared_memory(device)
    assert smem > 0
    stages = at._prefill_config(128, torch.bfloat16, device)[3]
    assert stages == (5 if smem >= at.PIPELINED_PREFILL_SMEM else 3)
    if torch.cuda.get_device_capability(device)[0] == 9:
        assert stages == 5


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("dtype", GPU_DTYPES, ids=str)
@pytest.mark.parametrize("num_kv_heads,head_dim,block_size", [(8, 128, 16), (1, 16, 8), (2, 64, 128)])
def test_gpu_write_kv(dtype, num_kv_heads, head_dim, block_size):
    check_write_kv(37, num_kv_heads, head_dim, block_size, dtype, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_gpu_decode_cuda_graph_capture():
    """Decode captures into a CUDA graph and replays correctly with new device-side context lengths."""
    dtype, h, kvh, d, bs = torch.bfloat16, 32, 8, 128, 16
    c = make_case([300, 16, 0, 900], [1] * 4, h, kvh, d, bs, dtype, "cuda", seed=1)
    out = torch.empty_like(c["q"])
    args = (c["q"], c["k_cache"], c["v_cache"], c["block_tables"], c["context_lens"], c["scale"])
    at.paged_decode_attention(*args, out=out)  # compile outside capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        at.paged_decode_attention(*args, out=out)
    # new metadata, same buffers; contexts stay within each sequence's written cache
    c["context_lens"].copy_(torch.tensor([299, 0, 0, 17], dtype=torch.int32))
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    cu = torch.arange(5, dtype=torch.int32, device="cuda")
    ref = _reference(c["q"], c["k_cache"], c["v_cache"], c["block_tables"], cu, c["context_lens"], c["scale"])
    _assert_close(out, ref, dtype, "decode after graph replay")
    assert (out[1:3] == 0).all()


# ------------------------------------------------------------------------------------------------
# Interpreter variant (CPU, tiny sizes)
# ------------------------------------------------------------------------------------------------


def _interpreter_checks() -> None:
    """The same checks on CPU tensors, tiny sizes; meant to run with TRITON_INTERPRET=1."""
    torch.manual_seed(0)
    errs = []
    cases = [  # (H, KVH, D, block_size, dtype): MHA, GQA 4, padded head dim with a group of 3
        (4, 4, 16, 8, torch.float32),
        (8, 2, 32, 16, torch.float32),
        (6, 2, 24, 16, torch.float32),
        (8, 2, 32, 16, torch.bfloat16),
        (6, 2, 24, 16, torch.float16),
    ]
    for h, kvh, d, bs, dtype in cases:
        ctx = _decode_ctx(bs, long=150)
        for max_num_splits in (1, 2, at.DEFAULT_MAX_NUM_SPLITS):
            errs.append(check_decode(ctx, h, kvh, d, bs, dtype, "cpu", max_num_splits=max_num_splits))
        ctx, ql = _prefill_mix(bs, long=90)
        errs.append(check_prefill(ctx, ql, h, kvh, d, bs, dtype, "cpu", pad_rows=3))
        errs.append(check_prefill(ctx, ql, h, kvh, d, bs, dtype, "cpu", max_query_len=max(ql)))
        check_write_kv(11, kvh, d, bs, dtype, "cpu")
    # a block size above the KV tile, and a decode-only batch through the prefill kernel
    errs.append(check_decode([1, 128, 129, 300], 4, 2, 16, 128, torch.float32, "cpu", max_num_splits=4))
    errs.append(check_prefill([3, 128, 200], [1, 1, 1], 4, 2, 16, 128, torch.float32, "cpu", max_query_len=1))
    # sliding windows: narrower than a KV tile, about a block, wider than every context
    errs += check_sliding_window(4, 2, 16, 8, torch.float32, "cpu", windows=(1, 5, 17, 40, 1000))
    errs += check_sliding_window(6, 2, 24, 16, torch.bfloat16, "cpu", windows=(7, 33))
    errs += check_sinks(8, 2, 16, 8, torch.float32, "cpu")
    errs += check_key_limits(4, 2, 16, 8, torch.float32, "cpu")
    errs += check_key_limits(8, 4, 32, 16, torch.bfloat16, "cpu")
    print(f"interpreter checks passed: {len(errs)} attention checks, max relative error {max(errs):.3g}")


def _patch_triton_interpreter() -> None:
    """Work around two Triton 3.6 interpreter gaps, for this process only (no effect on compiled kernels):
    - loop bounds loaded from memory are 1-element arrays, which numpy >= 2.4 refuses to turn into ints;
    - tl.dot on bf16 operands multiplies their raw uint16 storage.
    """
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    orig_patch = interp._patch_lang_tensor

    def patch_lang_tensor(tensor, scope):
        orig_patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(np.asarray(self.handle.data).reshape(-1)[0]))

    interp._patch_lang_tensor = patch_lang_tensor

    orig_dot = interp.InterpreterBuilder.create_dot

    def widen(h):
        if getattr(h.dtype, "scalar", h.dtype) == tl.bfloat16:
            return interp.TensorHandle((h.data.astype(np.uint32) << 16).view(np.float32), tl.float32)
        return h

    def create_dot(self, a, b, d, *rest):
        return orig_dot(self, widen(a), widen(b), d, *rest)

    interp.InterpreterBuilder.create_dot = create_dot


def _triton_installed() -> bool:
    try:
        return importlib.util.find_spec("triton") is not None
    except (ImportError, ValueError):
        return False


@pytest.mark.skipif(not _triton_installed(), reason="triton not installed")
def test_kernels_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, f"interpreter checks failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert "interpreter checks passed" in proc.stdout


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    if not at.HAVE_TRITON:
        sys.exit("triton is not installed")
    _patch_triton_interpreter()
    _interpreter_checks()
