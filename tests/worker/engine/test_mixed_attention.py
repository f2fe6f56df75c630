"""Mixed steps: the Triton backend runs the leading single-row sequences (decodes) through the split-K
decode kernel and the rest through the varlen kernel; together they equal the torch reference.
Checked on CPU through Triton's interpreter (subprocess); gpu-marked on CUDA."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.engine.kernels import attention as at

REPO_ROOT = Path(__file__).resolve().parents[3]

CHECK = r"""
import torch
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from tests.worker.engine.test_mixed_attention import check_mixed

_patch_triton_interpreter()
for num_decode in (0, 3, 5):
    check_mixed("cpu", torch.float32, num_decode)
print("mixed attention matches")
"""


def check_mixed(device: str, dtype: torch.dtype, num_decode: int) -> None:
    from tests.worker.engine.test_attention_triton import _assert_close, _reference, make_case
    from worker.engine.attention_backend import AttentionMetadata, TritonAttentionBackend

    # 5 decode rows first (one of them a 1-token prefill chunk: same math), then prefill chunks.
    ctx = [9, 40, 1, 17, 33, 37, 70, 16]
    q_lens = [1, 1, 1, 1, 1, 37, 30, 16]
    c = make_case(ctx, q_lens, 8, 2, 32, 16, dtype, device, seed=num_decode)
    ctx_t = c["context_lens"]
    meta = AttentionMetadata(
        kv_caches=[],
        slot_mapping=torch.empty(0),
        block_tables=c["block_tables"],
        cu_seqlens_q=c["cu_seqlens_q"],
        context_lens=c["context_lens"],
        max_query_len=max(q_lens),
        max_context_len=max(ctx),
        is_decode_only=False,
        backend=TritonAttentionBackend(),
        num_decode_seqs=num_decode,
        sliding_windows=(0, 12),  # layer 1 slides: both kernels of the split must apply its window
    )
    for layer_idx, window in enumerate(meta.sliding_windows):
        ref = _reference(
            *(c[k] for k in ("q", "k_cache", "v_cache", "block_tables", "cu_seqlens_q")),
            ctx_t,
            c["scale"],
            sliding_window=window,
        )
        out = meta.backend.attend(c["q"], c["k_cache"], c["v_cache"], meta, c["scale"], layer_idx)
        _assert_close(out, ref, dtype, f"mixed step with {num_decode} leading decode rows, window {window}")


@pytest.mark.skipif(not at.HAVE_TRITON, reason="triton is not installed")
def test_mixed_step_split_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "mixed attention matches" in proc.stdout


def test_batch_meta_counts_leading_single_row_chunks():
    import numpy as np

    from worker.engine.batch import _num_leading_single_rows

    assert _num_leading_single_rows(np.array([1, 1, 5, 1])) == 2
    assert _num_leading_single_rows(np.array([3, 1])) == 0
    assert _num_leading_single_rows(np.array([1, 1])) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and at.HAVE_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_mixed_step_split(dtype):
    for num_decode in (0, 3, 5):
        check_mixed("cuda", dtype, num_decode)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and at.HAVE_TRITON), reason="needs CUDA and triton")
def test_gpu_prefill_kernel_compiles_once_for_any_split_and_counts():
    """A mixed step slices its metadata after the decode rows, and its sequence and token counts vary: none of
    that may make Triton compile a new prefill variant mid-run (it stalled a measured W1 step 1.4 s)."""
    import triton

    compiles: list[str] = []

    def count(*_args, **kwargs):
        compiles.append(str(kwargs.get("repr", ""))[:40])
        return None

    torch.manual_seed(0)
    block, kvh, heads, dim = 16, 2, 4, 64
    k_cache = torch.randn(64, block, kvh, dim, device="cuda", dtype=torch.bfloat16)
    v_cache = torch.randn_like(k_cache)
    tables = torch.arange(1, 61, dtype=torch.int32, device="cuda").view(12, 5)
    ctx = torch.tensor([70, 9, 33, 17, 64, 5, 40, 21, 2, 77, 50, 30], dtype=torch.int32, device="cuda")
    q_lens = [1, 1, 1, 1, 1, 9, 17, 21, 2, 16, 32, 3]
    cu = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32, device="cuda")
    q = torch.randn(int(cu[-1]), heads, dim, device="cuda", dtype=torch.bfloat16)
    previous, triton.knobs.runtime.jit_cache_hook = triton.knobs.runtime.jit_cache_hook, count
    try:
        for num_decode in (0, 1, 2, 3, 4, 5):  # every alignment of the sliced rows, odd and even counts
            for num_seqs in (len(q_lens) - num_decode, 3):
                at.paged_prefill_attention(
                    q,
                    k_cache,
                    v_cache,
                    tables[num_decode:][:num_seqs],
                    cu[num_decode:][: num_seqs + 1],
                    ctx[num_decode:][:num_seqs],
                    dim**-0.5,
                    max_query_len=32,
                )
        torch.cuda.synchronize()
    finally:
        triton.knobs.runtime.jit_cache_hook = previous
    assert len([c for c in compiles if c.startswith("_prefill_kernel")]) <= 1, compiles
