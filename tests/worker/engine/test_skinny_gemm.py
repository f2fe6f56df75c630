"""The skinny decode GEMM (worker/engine/skinny_gemm.py) vs a float64 reference.

Host-side choice of kernel everywhere; the kernel itself on CPU through Triton's interpreter (in a
subprocess, TRITON_INTERPRET must be set before triton is imported) and on CUDA (`gpu`), at the
Llama-3-8B decode shapes, eagerly and replayed from a CUDA graph. Outputs are poisoned with NaN first,
so an unwritten element fails.
Run the interpreter variant by hand with:  TRITON_INTERPRET=1 python tests/worker/engine/test_skinny_gemm.py
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from worker.engine import skinny_gemm as sg

REPO_ROOT = Path(__file__).resolve().parents[3]
needs_cuda = pytest.mark.skipif(
    not (torch.cuda.is_available() and sg.HAVE_TRITON), reason="needs a CUDA device and triton"
)


def check_case(m: int, n: int, k: int, dtype: torch.dtype, device: str, bias: bool, config=None) -> float:
    """Relative error of skinny_linear against float64, on fresh random inputs; every output written."""
    x = torch.randn(m, k, device=device).to(dtype)
    w = (torch.randn(n, k, device=device) * k**-0.5).to(dtype)
    b = torch.randn(n, device=device).to(dtype) if bias else None
    out = torch.full((m, n), float("nan"), device=device, dtype=dtype)
    got = sg.skinny_linear(x, w, b, out=out, config=config)
    assert got.data_ptr() == out.data_ptr()
    ref = F.linear(x.double(), w.double(), b.double() if bias else None)
    assert not torch.isnan(got).any(), "unwritten or NaN outputs"
    return ((got.double() - ref).norm() / ref.norm()).item()


def test_pick_config_chooses_cublas_outside_the_measured_range():
    bf16 = torch.bfloat16
    if not sg.HAVE_TRITON:
        assert sg.pick_config(32, 4096, 4096, bf16) is None
        return
    assert sg.pick_config(32, 6144, 4096, bf16) == sg.DEFAULT_CONFIG  # Llama-3-8B QKV at W1's batch
    assert sg.pick_config(1, 128256, 4096, torch.float16) == sg.DEFAULT_CONFIG  # lm_head
    assert sg.pick_config(33, 6144, 4096, bf16) is None  # more rows: cuBLAS
    assert sg.pick_config(0, 6144, 4096, bf16) is None
    assert sg.pick_config(32, 4096, 14336, bf16) is None  # the down projection: cuBLAS measured faster
    assert sg.pick_config(32, 6144, 4096, torch.float32) is None  # fp32: exact cuBLAS path
    assert sg.pick_config(32, 6100, 4096, bf16) is None  # N not a multiple of the tile
    assert sg.pick_config(32, 6144, 4000, bf16) is None  # K not a multiple of the tile


def test_linear_falls_back_to_torch_on_cpu():
    x, w, b = torch.randn(3, 64), torch.randn(128, 64), torch.randn(128)
    assert torch.equal(sg.linear(x, w, b), F.linear(x, w, b))


def _interpreter_checks() -> None:
    errs = []
    for dtype, tol in ((torch.float32, 1e-5), (torch.float16, 2e-3), (torch.bfloat16, 1e-2)):
        for m in (1, 5, 32):
            for bias in (False, True):
                err = check_case(m, 128, 192, dtype, "cpu", bias, config=(64, 64, 4, 8))
                assert err < tol, f"{dtype} m={m} bias={bias}: rel err {err}"
                errs.append(err)
    err = check_case(7, 96, 256, torch.float32, "cpu", True, config=(32, 128, 4, 4))  # another tiling
    assert err < 1e-5, err
    print(f"interpreter checks passed: {len(errs) + 1} cases, max relative error {max(errs + [err]):.3g}")


@pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton not installed")
def test_kernel_in_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(REPO_ROOT), env.get("PYTHONPATH")]))
    proc = subprocess.run(
        [sys.executable, str(Path(__file__).resolve())],
        cwd=REPO_ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, f"interpreter checks failed:\n{proc.stdout}\n{proc.stderr[-6000:]}"
    assert "interpreter checks passed" in proc.stdout


LLAMA3_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (128256, 4096)]  # QKV, O, gate/up, lm_head


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("m", [1, 17, 32])
def test_gpu_llama_shapes(m):
    for n, k in LLAMA3_8B:
        assert sg.pick_config(m, n, k, torch.bfloat16) is not None
        for bias in (False, True):
            err = check_case(m, n, k, torch.bfloat16, "cuda", bias)
            assert err < 1e-2, f"M={m} N={n} K={k} bias={bias}: rel err {err}"


@pytest.mark.gpu
@needs_cuda
def test_gpu_graph_replay_matches_eager():
    x = torch.randn(32, 4096, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(6144, 4096, device="cuda", dtype=torch.bfloat16) * 0.02
    eager = sg.linear(x, w)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = sg.linear(x, w)
    x.copy_(torch.randn_like(x))
    graph.replay()
    assert torch.equal(captured, sg.linear(x, w))
    assert not torch.equal(captured, eager)


if __name__ == "__main__":
    if os.environ.get("TRITON_INTERPRET") != "1":
        sys.exit("run with TRITON_INTERPRET=1")
    if not sg.HAVE_TRITON:
        sys.exit("triton is not installed")
    from tests.worker.engine.test_attention_triton import _patch_triton_interpreter

    _patch_triton_interpreter()
    _interpreter_checks()
