"""The owned decoder's Triton kernels compute their torch references (which are transformers'
functions). Checked on CPU through Triton's interpreter, in a subprocess since TRITON_INTERPRET must be
set before triton is imported; the GPU check is in test_decoder_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.engine import fused_kernels

CHECK = r"""
import torch
from worker.engine import fused_kernels as fk
from worker.engine.attention import write_kv_ref

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm().clamp(min=1e-30)).item()

torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
    x, res, w = torch.randn(5, 96).to(dtype), torch.randn(5, 96).to(dtype), torch.randn(96).to(dtype)
    want_normed, want_res = fk.add_rmsnorm_ref(x, res, w, 1e-5)
    got_normed, got_res = fk.add_rmsnorm(x, res.clone(), w, 1e-5)
    assert rel(got_res, want_res) < tol / 2, dtype  # one rounding (the interpreter may round bf16 differently)
    assert rel(got_normed, want_normed) < tol, (dtype, rel(got_normed, want_normed))
    got_normed, got_res = fk.add_rmsnorm(x, None, w, 1e-5)
    assert got_res is x and rel(got_normed, fk.rmsnorm_ref(x, w, 1e-5)) < tol

    gate_up = torch.randn(3, 2 * 200).to(dtype)
    assert rel(fk.silu_mul(gate_up), fk.silu_mul_ref(gate_up)) < tol, dtype

    # head_dim 24: a non-power-of-two half; 4 q heads, 2 kv heads; one padding row (slot -1)
    for head_dim, with_norm in ((32, False), (32, True), (24, True)):
        num_heads, num_kv, block_size, num_blocks, T = 4, 2, 4, 6, 5
        qkv = torch.randn(T, (num_heads + 2 * num_kv) * head_dim).to(dtype)
        positions = torch.tensor([0, 3, 7, 2, 9], dtype=torch.int32)
        angles = torch.rand(16, head_dim // 2).repeat(1, 2) * 6.3
        cos, sin = angles.cos().to(dtype), angles.sin().to(dtype)
        q_norm = torch.randn(head_dim).to(dtype) if with_norm else None
        k_norm = torch.randn(head_dim).to(dtype) if with_norm else None
        slots = torch.tensor([1, 6, 13, -1, 22], dtype=torch.int32)
        caches = [torch.zeros(num_blocks, block_size, num_kv, head_dim, dtype=dtype) for _ in range(4)]

        def write_ref(k, v):
            write_kv_ref(k, v, caches[0], caches[1], slots)

        want_q = fk.qkv_rope_write_ref(qkv, positions, cos, sin, q_norm, k_norm, 1e-6, num_heads, num_kv, write_ref)
        got_q = fk.qkv_rope_write(
            qkv, positions, cos, sin, q_norm, k_norm, 1e-6, num_heads, num_kv, caches[2], caches[3], slots
        )
        # transformers rounds after each rotary product, the kernel once: allow two roundings' worth
        assert got_q.shape == want_q.shape and rel(got_q, want_q) < 2 * tol, (dtype, head_dim, rel(got_q, want_q))
        assert rel(caches[2], caches[0]) < 2 * tol, (dtype, head_dim, rel(caches[2], caches[0]))
        assert torch.equal(caches[3], caches[1])  # v is copied, not computed
print("fused kernels match")
"""

DECODER_CHECK = r"""
import torch
from worker.engine.attention_backend import AttentionBackend, AttentionMetadata
from worker.engine.decoder import OwnedDecoder
from worker.engine.model_runner import allocate_kv_cache
from worker.engine.models import load_model

# The whole owned forward with the Triton element-wise kernels (interpreted) equals its torch twin.
for name in ("tiny-qwen3", "tiny-qwen2"):
    model, _ = load_model(name, torch.device("cpu"), torch.float32)
    outs = []
    for use_triton in (False, True):
        decoder = OwnedDecoder(model, 64, use_triton=use_triton)
        assert decoder.use_triton == use_triton
        caches = allocate_kv_cache(model.config, 8, 16, torch.float32, torch.device("cpu"))
        ids = torch.tensor([1, 5, 9, 77, 4, 8, 2], dtype=torch.int32)
        meta = AttentionMetadata(
            kv_caches=caches,
            slot_mapping=torch.tensor([16, 17, 18, 19, 32, 33, 34], dtype=torch.int32),
            block_tables=torch.tensor([[1], [2]], dtype=torch.int32),
            cu_seqlens_q=torch.tensor([0, 4, 7], dtype=torch.int32),
            context_lens=torch.tensor([4, 3], dtype=torch.int32),
            max_query_len=4,
            max_context_len=4,
            is_decode_only=False,
            backend=AttentionBackend(),
        )
        positions = torch.tensor([0, 1, 2, 3, 0, 1, 2], dtype=torch.int32)
        with torch.inference_mode():
            outs.append(decoder(ids, positions, meta, torch.tensor([3, 6])))
    err = (outs[0] - outs[1]).abs().max().item()
    assert outs[0].shape == (2, model.config.vocab_size) and err < 1e-4, (name, err)
print("decoder matches")
"""


def _interpret(code: str, marker: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert marker in proc.stdout


needs_triton = pytest.mark.skipif(not fused_kernels.HAVE_TRITON, reason="triton is not installed")


@needs_triton
def test_fused_kernels_match_references_in_the_interpreter():
    _interpret(CHECK, "fused kernels match")


@needs_triton
def test_owned_decoder_with_triton_kernels_matches_torch_path_in_the_interpreter():
    _interpret(DECODER_CHECK, "decoder matches")
