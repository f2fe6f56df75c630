"""The W4A16 GEMM (worker/engine/kernels/w4a16.py) against its twin (quant/int4/linear.py: dequantize + F.linear).

On the CPU the kernel runs in Triton's interpreter in a subprocess (TRITON_INTERPRET must be set before triton is
imported) on tiny shapes: symmetric and asymmetric zeros, groups of 32 and 128, with and without a bias and an
act-order permutation, M = 1, 7, 32 (the small-step launch, split over K too, and the gated launch with SiLU or
GELU-tanh·mul in its epilogue against the twin then act·mul) and 100 (the tiled launch), N not a
multiple of the tile, in fp32 and fp16 (the interpreter computes bf16 operands wrongly, decode_gemm's too, so bf16 is
the `gpu` tests'). The kernel's dequantized weight is the twin's bit for bit and the products are IEEE, so only the
summation order differs; the dequantization kernel (large steps' other path) gives packed.dequantize's bits. The `gpu` tests run the Llama-3-8B shapes in bf16 on CUDA.
"""

from __future__ import annotations

import pytest
import torch

from tests.worker.engine.test_fused_kernels import _interpret
from worker.engine.kernels import fused as fk
from worker.engine.kernels import w4a16
from worker.engine.kernels.pdl import pdl_usable
from worker.engine.quant.int4 import Int4Linear, dequantize, quantize_rtn
from worker.engine.quant.int4.linear import int4_gate_up_act, int4_linear, int4_qkv_rope_write, w4a16_twin

CHECK = r"""
from tests.worker.engine.test_w4a16 import check_kernel
check_kernel("cpu", torch_dtype="float32")
check_kernel("cpu", torch_dtype="float16")
print("w4a16 kernel matches")
"""

LAYER_OPS_CHECK = r"""
from tests.worker.engine.test_w4a16 import check_small_step_layer_ops
check_small_step_layer_ops()
print("w4a16 layer ops match")
"""


def _layer(n: int, k: int, group: int, symmetric: bool, act_order: bool, dtype: torch.dtype, device: str, seed: int):
    gen = torch.Generator().manual_seed(seed)
    weight = torch.randn(n, k, generator=gen) * 0.05
    perm = torch.randperm(k, generator=gen) if act_order else None
    stored = quantize_rtn(weight if perm is None else weight[:, perm], group, symmetric)
    layer = Int4Linear(stored.qweight, stored.scales.to(dtype), stored.zeros, group, perm)
    return layer.to(device)


def _cases():
    for symmetric in (True, False):
        for group in (32, 128):
            for m in (1, 7, 32, 100):
                yield symmetric, group, m, m % 2 == 1, group == 32 and m == 7  # bias on odd M, act order on one


def check_kernel(device: str, torch_dtype: str = "bfloat16") -> None:
    """Every case's kernel output against the twin's; fp32 to summation order, bf16 to its rounding."""
    dtype = getattr(torch, torch_dtype)
    n, k = 96, 256  # N = 1.5 small-step tiles and 0.75 large ones: the row masks are exercised
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=1e-2, rtol=1e-2)
    for i, (symmetric, group, m, with_bias, act_order) in enumerate(_cases()):
        layer = _layer(n, k, group, symmetric, act_order, dtype, device, seed=i)
        gen = torch.Generator().manual_seed(100 + i)
        x = torch.randn(m, k, generator=gen).to(device, dtype)
        bias = (torch.randn(n, generator=gen) * 0.1).to(device, dtype) if with_bias else None
        want = w4a16_twin(x, layer, bias).float()
        xs = x if layer.perm is None else x.index_select(1, layer.perm)
        for unpack in (w4a16.UNPACK_RESHAPE, w4a16.UNPACK_NIBBLES):
            got = w4a16.w4a16_gemm(xs, layer.qweight, layer.scales, layer.zeros, group, bias, unpack=unpack).float()
            torch.testing.assert_close(got, want, **tol, msg=f"case {i}: sym={symmetric} g={group} M={m} {unpack=}")
        stored = w4a16.dequantize_weight(layer.qweight, layer.scales, layer.zeros, group, dtype)
        unpermuted = Int4Linear(layer.qweight, layer.scales, layer.zeros, group)
        assert torch.equal(stored, dequantize(unpermuted, dtype)), f"case {i}: the dequantization kernel's bits"
        for act, act_ref in ((fk.ACT_SILU, fk.silu_mul_ref), (fk.ACT_GELU_TANH, fk.gelu_tanh_mul_ref)):
            if m > w4a16.MAX_TOKENS or (act == fk.ACT_GELU_TANH and m != 7):
                continue  # the gated launch is the small steps'; GELU once
            unpack = w4a16.UNPACK_NIBBLES if act == fk.ACT_SILU else w4a16.UNPACK_RESHAPE
            gated = w4a16.w4a16_gemm(
                xs, layer.qweight, layer.scales, layer.zeros, group, bias, gated_act=act, unpack=unpack
            )
            torch.testing.assert_close(
                gated.float(), act_ref(want.to(dtype)).float(), **tol, msg=f"case {i} gated, act {act}"
            )
        if m <= w4a16.MAX_TOKENS and k // w4a16.launch_config(m, group, dtype)[1] % 2 == 0:  # split over K
            split = w4a16.w4a16_gemm(xs, layer.qweight, layer.scales, layer.zeros, group, bias, split_k=2).float()
            torch.testing.assert_close(split, want, **tol, msg=f"case {i} split in two")


def check_small_step_layer_ops() -> None:
    """`int4_linear` (its device check lifted, so the interpreter runs the kernels) at a small and a large step, by the
    tiled kernel and by dequantization then a matmul, with act-order and a bias; and the small-step LayerOps
    (layer_ops.py) give an `Int4Weight` the W4A16 kernel: QKV with the rotary + KV write after it, O, gate/up with act·mul, each equal in fp32 to the
    same ops over the dequantized weight (decode_gemm's kernels) to summation order."""
    from worker.engine import layer_ops
    from worker.engine.quant.int4.linear import Int4Weight

    w4a16.usable = lambda device, dtype: True  # this process only: the interpreter stands in for CUDA
    # int4_linear's three launches: small step (M <= 32), tiled large step, dequantization then a matmul
    big = torch.randn(100, 128, generator=torch.Generator().manual_seed(5))
    layer = _layer(96, 128, 32, False, True, torch.float32, "cpu", seed=30)
    bias = torch.randn(96, generator=torch.Generator().manual_seed(6))
    want = w4a16_twin(big, layer, bias)
    for dequantize_from in (None, 64):
        w4a16.DEQUANTIZE_FROM_M = dequantize_from
        assert w4a16.large_step_kernel(100, 96, 128) == (dequantize_from is None)
        torch.testing.assert_close(int4_linear(big, layer, bias), want, atol=1e-4, rtol=1e-4)
    torch.testing.assert_close(int4_linear(big[:7], layer, bias), want[:7], atol=1e-4, rtol=1e-4)
    ops = layer_ops.layer_ops(True, small_step=True, pdl=False)
    heads, kv_heads, head_dim, hidden, m = 2, 1, 64, 128, 5
    gen = torch.Generator().manual_seed(11)
    x = torch.randn(m, hidden, generator=gen)
    tol = dict(atol=1e-4, rtol=1e-4)
    for i, rows in enumerate(((heads + 2 * kv_heads) * head_dim, 2 * 96)):
        layer = _layer(rows, hidden, 128 if i == 0 else 32, i == 0, False, torch.float32, "cpu", seed=20 + i)
        packed, dense = Int4Weight(layer), dequantize(layer, torch.float32)
        torch.testing.assert_close(ops.linear(x, packed, None), ops.linear(x, dense, None), **tol)
        if i == 1:
            torch.testing.assert_close(ops.gate_up_act(x, packed, None), ops.gate_up_act(x, dense, None), **tol)
            continue
        pos = torch.arange(m) + 3
        inv = 1.0 / (10000 ** (torch.arange(0, head_dim, 2).float() / head_dim))
        angles = torch.outer(torch.arange(64).float(), inv)
        cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
        for unpack in (w4a16.UNPACK_RESHAPE, w4a16.UNPACK_NIBBLES):  # the QKV launch's K tile, both ways
            w4a16.UNPACK = unpack  # this process only
            outputs = []
            for weight in (packed, dense):
                caches = torch.zeros(2, 4, 16, kv_heads, head_dim)
                q = ops.qkv_rope_write(
                    x, weight, None, pos, cos, sin, heads, kv_heads, caches[0], caches[1], torch.arange(m) + 16,
                    pdl=False,
                )  # fmt: skip
                outputs.append((q, caches))
            torch.testing.assert_close(outputs[0][0], outputs[1][0], **tol, msg=f"{unpack=}")
            torch.testing.assert_close(outputs[0][1], outputs[1][1], **tol, msg=f"{unpack=}")


def test_launch_config_tiles_each_group_size():
    assert w4a16.launch_config(1, 128, torch.bfloat16)[1] == 128
    assert w4a16.launch_config(1, 32, torch.bfloat16)[1] == 32
    assert w4a16.launch_config(100, 128, torch.bfloat16)[1] == 64
    assert w4a16.launch_config(1, 96, torch.bfloat16)[1] == 32  # the largest power of two dividing the group
    assert w4a16.launch_config(1, 8, torch.bfloat16) is None  # below the MMA's K: the twin runs


def test_int4_linear_on_the_cpu_is_the_twin_with_act_order():
    """Off CUDA `int4_linear` is the twin; the twin honours the act-order permutation (x[:, perm] @ stored^T)."""
    layer = _layer(16, 128, 32, False, True, torch.float32, "cpu", seed=3)
    stored = Int4Linear(layer.qweight, layer.scales, layer.zeros, layer.group_size)
    x = torch.randn(5, 128)
    torch.testing.assert_close(int4_linear(x, layer), w4a16_twin(x[:, layer.perm], stored))


@pytest.mark.skipif(not w4a16.HAVE_TRITON, reason="triton is not installed")
def test_w4a16_kernel_matches_its_twin_in_the_interpreter():
    _interpret(CHECK, "w4a16 kernel matches")


@pytest.mark.skipif(not w4a16.HAVE_TRITON, reason="triton is not installed")
def test_small_step_layer_ops_run_the_w4a16_kernel_in_the_interpreter():
    _interpret(LAYER_OPS_CHECK, "w4a16 layer ops match")


# Llama-3-8B's projections: QKV, O, fused gate/up, down ([N, K])
LLAMA_3_8B = {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)}


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and w4a16.HAVE_TRITON), reason="needs CUDA, triton")
@pytest.mark.parametrize("shape", sorted(LLAMA_3_8B))
def test_gpu_w4a16_at_the_llama_3_8b_shapes(shape):
    """bf16, group 128, symmetric and asymmetric, small steps with and without PDL and the tiled launch, against the
    twin (the same dequantized bf16 weight through cuBLAS): within bf16's accumulation-order noise."""
    n, k = LLAMA_3_8B[shape]
    pdl = pdl_usable(torch.device("cuda"))
    for symmetric in (True, False):
        layer = _layer(n, k, 128, symmetric, False, torch.bfloat16, "cuda", seed=n + k)
        for m in (1, 7, 32, 100, 512, 2048):  # above 32: dequantization then cuBLAS (w4a16.DEQUANTIZE_FROM_M)
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            want = w4a16_twin(x, layer)
            got = int4_linear(x, layer, pdl=pdl).float()
            rel = float((got - want.float()).norm() / want.float().norm())
            assert rel < 5e-3, f"{shape} M={m} sym={symmetric}: relative error {rel}"
            if shape == "gate_up" and m <= w4a16.MAX_TOKENS:  # the gated launch, act·mul in its epilogue
                gated = int4_gate_up_act(x, layer, pdl=pdl, act=fk.ACT_SILU).float()
                ref = fk.silu_mul_ref(want).float()
                rel = float((gated - ref).norm() / ref.norm())
                assert rel < 1e-2, f"gated M={m} sym={symmetric}: relative error {rel}"
    torch.cuda.synchronize()


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and w4a16.HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_w4a16_small_step_captures_in_a_cuda_graph():
    n, k = LLAMA_3_8B["down"]
    layer = _layer(n, k, 128, True, False, torch.bfloat16, "cuda", seed=7)
    x = torch.randn(32, k, device="cuda", dtype=torch.bfloat16)
    pdl = pdl_usable(torch.device("cuda"))
    eager = int4_linear(x, layer, pdl=pdl)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = int4_linear(x, layer, pdl=pdl)
    for _ in range(3):  # the split-K tile counters rest at 0 between replays
        graph.replay()
        torch.testing.assert_close(out, eager, atol=0, rtol=0)


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and w4a16.HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_w4a16_qkv_rope_write_at_the_llama_3_8b_shape():
    """The QKV launch with rotary and the KV write in its epilogue against the twin's QKV, then qkv_rope_write."""
    heads, kv_heads, head_dim = 32, 8, 128
    n, k = LLAMA_3_8B["qkv"]
    layer = _layer(n, k, 128, True, False, torch.bfloat16, "cuda", seed=9)
    m = 32
    x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
    pos = torch.arange(m, device="cuda") * 3
    inv = 1.0 / (500000 ** (torch.arange(0, head_dim, 2, device="cuda").float() / head_dim))
    angles = torch.outer(torch.arange(256, device="cuda").float(), inv)
    cos, sin = torch.cat([angles.cos()] * 2, -1), torch.cat([angles.sin()] * 2, -1)
    slots = torch.arange(m, device="cuda") + 16
    assert w4a16.rope_launch_fits(heads, kv_heads, head_dim, m, 128, torch.bfloat16)
    outputs = []
    for fused in (True, False):
        caches = torch.zeros(2, 8, 16, kv_heads, head_dim, device="cuda", dtype=torch.bfloat16)
        args = (pos, cos, sin, heads, kv_heads, caches[0], caches[1], slots)
        if fused:
            q = int4_qkv_rope_write(x, layer, None, *args, pdl=pdl_usable(x.device))
        else:
            q = fk.qkv_rope_write(w4a16_twin(x, layer), *args[:3], None, None, 0.0, *args[3:])
        outputs.append((q.float(), caches.float()))
    for got, want in zip(outputs[0], outputs[1], strict=True):
        rel = float((got - want).norm() / want.norm())
        assert rel < 5e-3, rel
