"""The FP8 kernels (worker/engine/quant/kernels.py) against the torch reference (fp8.py).

On the CPU they run through Triton's interpreter, in a subprocess since TRITON_INTERPRET must be set before
triton is imported. The interpreter runs fp8 tl.dot (it widens the operands to fp16, exactly), but its
fp32 -> fp8 cast mis-rounds: a value whose mantissa rounds up past 1.75 loses the carry into the exponent
(125.6 becomes 64, not 128) and the cast does not saturate. `exact_interpreter_fp8_casts` replaces that
cast with torch's (round to nearest even, as the GPU's cvt.rn.satfinite does); the kernels are unchanged.
Then the quantization kernels must equal the reference bit for bit and the GEMMs must equal the emulation
up to fp32 summation order. The `gpu` test runs the same checks on CUDA (the H200), where the fp32 division
may round apart in the last bit, so it compares with the tolerances stated there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from worker.engine.quant import ActivationScale, Fp8Linear, Fp8Scheme, WeightScale, fp8_linear
from worker.engine.quant.fp8 import (
    FP8_DTYPE,
    fp8_linear_emulated,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_blocks,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)

REPO_ROOT = Path(__file__).resolve().parents[3]

CHECK = r"""
from tests.worker.engine.test_quant_kernels import check_all, exact_interpreter_fp8_casts

exact_interpreter_fp8_casts()
check_all("cpu", exact=True)
print("fp8 kernels match")
"""


def exact_interpreter_fp8_casts() -> None:
    """Make the interpreter's fp32 -> float8e4nv cast torch's (this process only); see the module docstring."""
    import numpy as np
    import triton.language as tl
    import triton.runtime.interpreter as interp

    original = interp._convert_float

    def convert(data, input_dtype, output_dtype, rounding_mode):
        if output_dtype == tl.float8e4nv and input_dtype == tl.float32:
            wide = torch.from_numpy(np.ascontiguousarray(data, dtype=np.float32))
            return wide.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8).numpy()
        return original(data, input_dtype, output_dtype, rounding_mode)

    interp._convert_float = convert


def _assert_fp8_close(got: torch.Tensor, want: torch.Tensor, exact: bool, what: str) -> None:
    if exact:
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), what
    else:  # one e4m3 step apart at most (a last-bit difference in the scale can tip a rounding)
        diff = (got.float() - want.float()).abs()
        assert (diff <= want.float().abs() * 2**-3 + 2**-9).all(), what


def check_activation_quant(device: str, exact: bool) -> None:
    from worker.engine.quant import kernels

    torch.manual_seed(0)
    # a row in one pass from registers (kernels.ONE_PASS_MAX_K; 4103 a ragged one), 70 rows too; 16,500 columns:
    # column passes
    for m, k in ((1, 64), (5, 300), (3, 4103), (2, 16500), (70, 300)):
        for dtype in (torch.float32, torch.bfloat16):
            x = (torch.randn(m, k) * torch.logspace(-3, 3, m)[:, None]).to(device, dtype)
            x[0, :7] = 0.0
            for ub in (None, 5.0):
                got, got_scale = kernels.per_token_quant(x, ub)
                want, want_scale = quantize_per_token(x, ub)
                what = f"per token {m}x{k} {dtype} ub={ub}"
                assert got.dtype == FP8_DTYPE and got_scale.dtype == torch.float32, what
                assert torch.allclose(got_scale, want_scale, rtol=0 if exact else 1e-6, atol=0), what
                _assert_fp8_close(got, want, exact, what)
            for group in (128, 64):
                got, got_scale = kernels.per_token_group_quant(x, group)
                want, want_scale = quantize_per_token_group(x, group)
                what = f"per token group {group} {m}x{k} {dtype}"
                assert got_scale.shape == want_scale.shape, what
                assert torch.allclose(got_scale, want_scale, rtol=0 if exact else 1e-6, atol=0), what
                _assert_fp8_close(got, want, exact, what)
    zero_rows = torch.zeros(0, 64, device=device)
    assert kernels.per_token_quant(zero_rows)[0].shape == (0, 64)


def _layers(n: int, k: int, device: str) -> dict[str, Fp8Linear]:
    """One layer per scheme fp8_linear dispatches on."""
    torch.manual_seed(1)
    w = torch.randn(n, k) * torch.linspace(0.05, 2.0, n)[:, None]
    block = Fp8Scheme(WeightScale.BLOCK, ActivationScale.TOKEN_GROUP, block_shape=(128, 128))
    token = Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)
    capped = Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN, activation_scale_ub=2.0)
    input_scale = torch.tensor(3.0 / 448)
    layers = {
        "block": Fp8Linear(*quantize_weight_blocks(w, (128, 128)), block),
        "channel-token": Fp8Linear(*quantize_weight_per_channel(w), token),
        "channel-token-ub": Fp8Linear(*quantize_weight_per_channel(w), capped),
        "tensor-static": Fp8Linear(
            *quantize_weight_per_tensor(w), Fp8Scheme(WeightScale.TENSOR, ActivationScale.STATIC), input_scale
        ),
        "channel-static": Fp8Linear(
            *quantize_weight_per_channel(w), Fp8Scheme(WeightScale.CHANNEL, ActivationScale.STATIC), input_scale
        ),
        "tensor-token": Fp8Linear(*quantize_weight_per_tensor(w), Fp8Scheme(WeightScale.TENSOR, ActivationScale.TOKEN)),
    }
    return {name: layer.to(device) for name, layer in layers.items()}


def check_gemms(device: str, exact: bool) -> None:
    """fp8_linear's kernels against the emulation. fp32 in and out (the block GEMM): equal up to fp32
    summation order. bf16 (cuBLASLt row-wise scaling writes bf16): one bf16 rounding apart at most."""
    for n, k in ((384, 256), (300, 200)):  # 300 x 200: partial weight blocks and K groups
        for name, layer in _layers(n, k, device).items():
            if layer.scheme.weight is not WeightScale.BLOCK and (n % 16 or k % 16):
                continue  # cuBLASLt wants N and K in multiples of 16 (every real shape is)
            for m in (1, 5, 70):
                torch.manual_seed(m)
                for dtype in (torch.float32, torch.bfloat16):
                    x = torch.randn(m, k, device=device).to(dtype)
                    bias = torch.randn(n, device=device).to(dtype) if m == 5 else None
                    got = fp8_linear(x, layer, bias, backend="kernels")
                    want = fp8_linear_emulated(x, layer, bias)
                    what = f"{name} m={m} n={n} k={k} {dtype}"
                    assert got.shape == want.shape and got.dtype == want.dtype, what
                    rowwise_bf16 = name not in ("block", "tensor-static")  # the tensor-wise path writes any dtype
                    tight = dtype == torch.float32 and not rowwise_bf16
                    tol = 2e-5 if tight and exact else (1e-3 if tight else 2**-7)
                    scale = want.float().abs().amax().clamp(min=1)
                    err = ((got.float() - want.float()).abs() / scale).max().item()
                    assert err <= tol, f"{what}: {err} > {tol}"


def check_rows(device: str, exact: bool) -> None:
    """act_mul_per_token_quant gives the bits of fused.act_mul then per_token_quant (one pass and two, SiLU and
    GELU-tanh, fbgemm's cap); fp8_linear reading Fp8Rows gives the bits of fp8_linear quantizing x itself, on the
    kernels and in the emulation."""
    from worker.engine.kernels import fused
    from worker.engine.quant import kernels
    from worker.engine.quant.fp8 import Fp8Rows

    torch.manual_seed(4)
    for m, inter in ((1, 96), (5, 1000), (2, 16500), (70, 1000)):  # one pass, two (columns), one (70 rows)
        for dtype in (torch.float32, torch.bfloat16):
            gate_up = (torch.randn(m, 2 * inter) * 3).to(device, dtype)
            for act in (fused.ACT_SILU, fused.ACT_GELU_TANH):
                for ub in (None, 2.0):
                    rows = kernels.act_mul_per_token_quant(gate_up, act, ub)
                    want, want_scale = kernels.per_token_quant(fused.act_mul(gate_up, act=act), ub)
                    what = f"act_mul quant {m}x{inter} {dtype} act={act} ub={ub}"
                    assert rows.dtype == dtype and torch.equal(rows.scale, want_scale), what
                    assert torch.equal(rows.x.view(torch.uint8), want.view(torch.uint8)), what
    layers = _layers(384, 256, device)
    for name in ("channel-token", "channel-token-ub", "tensor-token"):
        layer = layers[name]
        for m in (1, 5):
            x = torch.randn(m, 256, device=device).to(torch.bfloat16)
            bias = torch.randn(384, device=device).to(torch.bfloat16) if m == 5 else None
            rows = Fp8Rows(*kernels.per_token_quant(x, layer.scheme.activation_scale_ub), x.dtype)
            for backend in ("kernels", "emulated"):
                got, want = fp8_linear(rows, layer, bias, backend=backend), fp8_linear(x, layer, bias, backend=backend)
                assert got.dtype == want.dtype and torch.equal(got, want), (name, m, backend)


def check_all(device: str, exact: bool) -> None:
    check_activation_quant(device, exact)
    check_gemms(device, exact)
    check_rows(device, exact)


def test_kernels_match_the_reference_in_the_interpreter():
    pytest.importorskip("triton")
    path = os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=path)
    proc = subprocess.run(
        [sys.executable, "-c", CHECK], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=600
    )
    assert proc.returncode == 0 and "fp8 kernels match" in proc.stdout, proc.stdout + proc.stderr[-4000:]


def test_auto_runs_the_emulation_off_cuda():
    layer = _layers(384, 256, "cpu")["block"]
    x = torch.randn(3, 4, 256)
    assert torch.equal(fp8_linear(x, layer), fp8_linear_emulated(x, layer))
    assert fp8_linear(x, layer).shape == (3, 4, 384)
    with pytest.raises(AssertionError, match="backend must be one of"):
        fp8_linear(x, layer, backend="cuda")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_kernels_match_the_reference_on_the_gpu():
    prev = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # the emulation's fp32 GEMM must not run in TF32
    try:
        check_all("cuda", exact=False)
    finally:
        torch.set_float32_matmul_precision(prev)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_gemms_at_the_llama_3_8b_shape_agree_with_the_emulation():
    """The issue's tolerance for the H200 comparison: bf16 outputs within 1% of the output's scale."""
    torch.manual_seed(0)
    for name, layer in _layers(4096, 4096, "cuda").items():
        for m in (1, 32, 512):
            x = torch.randn(m, 4096, device="cuda", dtype=torch.bfloat16)
            got = fp8_linear(x, layer)
            want = fp8_linear_emulated(x, layer)
            err = ((got.float() - want.float()).abs().max() / want.float().abs().max()).item()
            assert err < 1e-2, f"{name} m={m}: {err}"
