"""The fused RMSNorm and rotary kernels compute transformers' functions. Checked on CPU through Triton's
interpreter (in a subprocess, since TRITON_INTERPRET must be set before triton is imported); the GPU
check is in test_engine_gpu.py."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from worker.engine import fused_ops

CHECK = r"""
import torch
from transformers.models.llama.modeling_llama import LlamaRMSNorm, apply_rotary_pos_emb
from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm
from worker.engine.fused_ops import rmsnorm, rotary

def rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()

torch.manual_seed(0)
for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 1e-2)):
    for cls, shape in ((LlamaRMSNorm, (1, 7, 96)), (Qwen3RMSNorm, (1, 5, 4, 16))):
        norm = cls(shape[-1], eps=1e-5).to(dtype)
        norm.weight.data = torch.randn(shape[-1]).to(dtype)
        x = torch.randn(shape).to(dtype)
        got = rmsnorm(x, norm.weight, norm.variance_epsilon)
        assert got.dtype == norm(x).dtype and got.shape == x.shape
        assert rel(got, norm(x)) < tol, (cls.__name__, dtype, rel(got, norm(x)))
    q = torch.randn(2, 9, 4, 32).to(dtype).transpose(1, 2)  # [B, H, T, D] as the attention layer has it
    k = torch.randn(2, 9, 2, 32).to(dtype).transpose(1, 2)
    cos, sin = torch.randn(2, 9, 32).to(dtype), torch.randn(2, 9, 32).to(dtype)
    ref_q, ref_k = apply_rotary_pos_emb(q, k, cos, sin)
    assert rel(rotary(q, cos, sin), ref_q) < tol and rel(rotary(k, cos, sin), ref_k) < tol
print("fused ops match")
"""


@pytest.mark.skipif(not fused_ops.HAVE_TRITON, reason="triton is not installed (the CI installs it)")
def test_fused_ops_match_transformers_in_the_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    proc = subprocess.run([sys.executable, "-c", CHECK], env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "fused ops match" in proc.stdout


@pytest.mark.skipif(not fused_ops.HAVE_TRITON, reason="triton is not installed (the CI installs it)")
def test_install_swaps_every_rmsnorm_and_rotary_falls_back_off_cuda():
    import torch
    from transformers.models.qwen3 import modeling_qwen3

    from worker.engine.models import load_model

    model, _ = load_model("tiny-qwen3", torch.device("cpu"), torch.float32)
    norms = [m for m in model.modules() if type(m).__name__ == "Qwen3RMSNorm"]
    assert (
        fused_ops.install_fused_rmsnorm(model) == len(norms) == 2 * 4 + 1
    )  # 2 layers x (input, post, q, k) + final
    assert all("forward" in vars(m) for m in norms)
    original = modeling_qwen3.apply_rotary_pos_emb
    try:
        assert fused_ops.install_fused_rotary(model)
        patched = modeling_qwen3.apply_rotary_pos_emb
        assert patched is not original and not fused_ops.install_fused_rotary(model)  # idempotent
        q, k = torch.randn(1, 4, 3, 16), torch.randn(1, 2, 3, 16)
        cos, sin = torch.randn(1, 3, 16), torch.randn(1, 3, 16)
        for got, want in zip(patched(q, k, cos, sin), original(q, k, cos, sin), strict=True):
            assert torch.equal(got, want)  # CPU tensors take transformers' own code
    finally:
        modeling_qwen3.apply_rotary_pos_emb = original
