"""The small step's L2 prefetch (worker/engine/kernels/l2_prefetch.py): how much each launch asks for (CPU), and on
an sm90 GPU that asking changes no bit of any FP8 small-step kernel's output."""

from __future__ import annotations

import pytest
import torch

from worker.engine.kernels import fused as fk
from worker.engine.kernels import l2_prefetch
from worker.engine.quant.config import ActivationScale, Fp8Scheme, WeightScale
from worker.engine.quant.fp8 import Fp8Linear, quantize_weight_per_channel

MB = 1024 * 1024
CUDA = torch.device("cuda", 0)  # only named: prefetch_chunk reads the L2 size through l2_bytes, patched below


@pytest.fixture
def l2_of_50_mb(monkeypatch):
    monkeypatch.setattr(l2_prefetch, "l2_bytes", lambda index: 50 * MB)
    monkeypatch.setattr(l2_prefetch, "L2_PREFETCH_FRACTION", 0.5)


def test_a_weight_within_the_budget_is_prefetched_whole(l2_of_50_mb):
    # Llama-3-8B's FP8 O projection, 16 MB: each program asks for all 4,096 bytes of each row, in 4 chunks
    assert l2_prefetch.prefetch_chunk(16 * MB, 4096, 1, CUDA, pdl=True) == 1024
    # split over 2 programs, each asks for its own half of the row
    assert l2_prefetch.prefetch_chunk(16 * MB, 2048, 1, CUDA, pdl=True) == 512


def test_a_larger_weight_gets_the_first_part_of_each_row_in_whole_l2_lines(l2_of_50_mb):
    # gate/up, 112 MB against a 25 MB budget: 25 / 112 of each 4,096-byte row, rounded down to 128-byte lines
    chunk = l2_prefetch.prefetch_chunk(112 * MB, 4096, 1, CUDA, pdl=True)
    assert chunk * l2_prefetch.PREFETCH_CHUNKS <= 4096 * 25 / 112
    assert chunk % 128 == 0 and chunk > 0
    # two-byte elements: lines of 64 elements
    chunk = l2_prefetch.prefetch_chunk(224 * MB, 4096, 2, CUDA, pdl=True)
    assert chunk % 64 == 0 and chunk * 4 * 2 <= 8192 * 25 / 224
    # the whole launch stays within the budget
    rows = 28672
    assert rows * chunk * l2_prefetch.PREFETCH_CHUNKS * 2 <= 25 * MB


def test_no_prefetch_without_a_window_or_a_budget(l2_of_50_mb, monkeypatch):
    assert l2_prefetch.prefetch_chunk(16 * MB, 4096, 1, CUDA, pdl=False) == 0  # no PDL: no wait to fill
    assert l2_prefetch.prefetch_chunk(16 * MB, 4096, 1, torch.device("cpu"), pdl=True) == 0  # the interpreter
    assert l2_prefetch.prefetch_chunk(16 * MB, 4096, 1, CUDA, pdl=True, fraction=0.0) == 0
    monkeypatch.setattr(l2_prefetch, "L2_PREFETCH_FRACTION", 0.0)
    assert l2_prefetch.prefetch_chunk(16 * MB, 4096, 1, CUDA, pdl=True) == 0


needs_sm90 = pytest.mark.skipif(
    not (fk.HAVE_TRITON and torch.cuda.is_available() and torch.cuda.get_device_capability() >= (9, 0)),
    reason="needs an sm90+ GPU and triton",
)


@pytest.mark.gpu
@needs_sm90
def test_gpu_prefetch_changes_no_bit_of_the_fp8_small_step(monkeypatch):
    """Llama-3-8B's four projections at M = 32 under PDL (the down projection split over K), the gated gate/up
    and the fused QKV + rotary + KV write: the same bits with the prefetch on (whole weights and part of each row)
    as with it off."""
    from worker.engine.quant import small_step

    torch.manual_seed(0)
    token = Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)

    def fp8(n, k):
        return Fp8Linear(*quantize_weight_per_channel(torch.randn(n, k, device="cuda") * 0.02), token)

    qkv, o, gate_up, down = fp8(6144, 4096), fp8(4096, 4096), fp8(28672, 4096), fp8(4096, 14336)
    x, h = (torch.randn(32, k, device="cuda", dtype=torch.bfloat16) for k in (4096, 14336))
    heads, kv_heads, head_dim = 32, 8, 128
    angles = torch.rand(4096, head_dim // 2, device="cuda").repeat(1, 2) * 6.3
    positions = torch.randint(0, 4096, (32,), dtype=torch.int32, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:32].to(torch.int32)
    rope = (positions, angles.cos().bfloat16(), angles.sin().bfloat16(), heads, kv_heads)

    def outputs():
        caches = [torch.zeros(64, 16, kv_heads, head_dim, dtype=torch.float8_e4m3fn, device="cuda") for _ in "kv"]
        q = small_step.fp8_step_qkv_rope_write(x, qkv, None, *rope, *caches, slots, pdl=True, kv_scale=(0.1, 0.2))
        return [
            small_step.fp8_step_linear(x, o, pdl=True),
            small_step.fp8_step_linear(h, down, pdl=True, split_k=2),
            small_step.fp8_step_linear(h, down, pdl=True, split_k=1),
            small_step.fp8_step_gate_up_act(x, gate_up, pdl=True),
            q,
            *(c.view(torch.uint8) for c in caches),
        ]

    monkeypatch.setattr(l2_prefetch, "L2_PREFETCH_FRACTION", 0.0)
    want = outputs()
    for share in (0.1, 1.0):
        monkeypatch.setattr(l2_prefetch, "L2_PREFETCH_FRACTION", share)
        assert l2_prefetch.weight_prefetch_chunk(gate_up.weight, 1, True) > 0
        for got, expected in zip(outputs(), want, strict=True):
            assert torch.equal(got, expected), share


@pytest.mark.gpu
@needs_sm90
def test_gpu_prefetch_changes_no_bit_of_the_bf16_small_step(monkeypatch):
    """decode_gemm's kernels at Llama-3-8B's QKV (with rotary and the KV write), O and gate/up, M = 32, PDL: the
    same bits with the prefetch on as off."""
    from worker.engine.kernels import decode_gemm as dg

    torch.manual_seed(0)
    qkv, o, gate_up = (torch.randn(n, 4096, device="cuda", dtype=torch.bfloat16) * 0.02 for n in (6144, 4096, 28672))
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    heads, kv_heads, head_dim = 32, 8, 128
    angles = torch.rand(4096, head_dim // 2, device="cuda").repeat(1, 2) * 6.3
    positions = torch.randint(0, 4096, (32,), dtype=torch.int32, device="cuda")
    slots = torch.randperm(64 * 16, device="cuda")[:32].to(torch.int32)
    rope = (positions, angles.cos().bfloat16(), angles.sin().bfloat16(), heads, kv_heads)

    def outputs():
        caches = [torch.zeros(64, 16, kv_heads, head_dim, dtype=torch.bfloat16, device="cuda") for _ in "kv"]
        q = dg.decode_qkv_rope_write(x, qkv, None, *rope, *caches, slots, pdl=True)
        return [dg.decode_linear(x, o, pdl=True), dg.decode_gate_up_silu(x, gate_up, pdl=True), q, *caches]

    monkeypatch.setattr(l2_prefetch, "L2_PREFETCH_FRACTION", 0.0)
    want = outputs()
    monkeypatch.setattr(l2_prefetch, "L2_PREFETCH_FRACTION", 0.5)
    assert l2_prefetch.weight_prefetch_chunk(o, 1, True) > 0
    for got, expected in zip(outputs(), want, strict=True):
        assert torch.equal(got, expected)
