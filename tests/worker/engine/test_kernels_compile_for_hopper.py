"""Every Triton kernel variant the interpreter tests run also compiles for Hopper (sm90), without a GPU.

Triton's interpreter runs a kernel as Python on numpy and accepts what the compiler refuses (a shape from a runtime
value, an argument a helper needs as a constexpr, a dot it cannot lower), so a kernel can pass every CPU test and fail
to build on the H200. This test reruns the kernel-level interpreter tests with a recorder (tests/hopper_compile/:
each launch's argument dtypes, constexprs and launch options), then compiles each recorded variant with Triton's
compiler and ptxas for sm90 (both ship in the triton wheel). It needs no GPU: it proves the code builds, not that it
is fast or right (the interpreter tests and the `gpu` suite do that)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[3]
ENGINE_TESTS = "tests/worker/engine"
# The kernel-level interpreter tests: between them they launch every kernel of the CUDA path.
RECORDED = [
    "test_fused_kernels.py::test_fused_kernels_match_references_in_the_interpreter",
    "test_family_kernels.py::test_family_epilogues_match_references_in_the_interpreter",
    "test_attention_triton.py::test_kernels_in_triton_interpreter",
    "test_attention_fp8_kv.py::test_fp8_kv_kernels_in_triton_interpreter",
    "test_mixed_attention.py::test_mixed_step_split_in_triton_interpreter",
    "test_quant_kernels.py::test_kernels_match_the_reference_in_the_interpreter",
    "test_quant_small_step.py::test_fp8_step_kernel_matches_its_twin_and_the_emulation_in_the_interpreter",
    "test_quant_small_step.py::test_fp8_qkv_rope_kernel_equals_the_gemm_then_qkv_rope_write_in_the_interpreter",
    "test_moe_triton.py::test_triton_moe_matches_reference_in_the_interpreter",
    "test_deterministic_kernels.py::test_kernels_are_row_invariant_in_the_interpreter",
    "test_latent_attention.py::test_latent_decode_kernel_matches_its_twin_in_the_interpreter",
    "test_latent_attention.py::test_triton_attention_runs_the_latent_cache_shapes_in_the_interpreter",
    "test_latent_attention.py::test_latent_attention_through_the_triton_backend_in_the_interpreter",
    "test_w4a16.py::test_w4a16_kernel_matches_its_twin_in_the_interpreter",
    "test_w4a16.py::test_small_step_layer_ops_run_the_w4a16_kernel_in_the_interpreter",
]
# Kernels that must have been recorded: if a rename or a test change stops one being seen, this test says so
# rather than passing on fewer kernels.
MUST_COMPILE = {
    "_decode_gemm_kernel", "_qkv_rope_gemm_kernel", "_add_rmsnorm_kernel", "_act_mul_kernel", "_qkv_rope_write_kernel",
    "_logits_epilogue_kernel", "_write_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel",
    "_fp8_step_gemm_kernel", "_fp8_qkv_rope_kernel", "_per_token_quant_kernel", "_block_fp8_gemm_kernel",
    "_expert_gemm_kernel", "_align_kernel", "_latent_decode_kernel", "_w4a16_gemm_kernel", "_w4a16_dequantize_kernel",
    "_w4a16_qkv_rope_kernel",
}  # fmt: skip


def _have_hopper_compiler() -> bool:
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


@pytest.mark.skipif(not _have_hopper_compiler(), reason="needs triton with its bundled ptxas")
def test_every_interpreted_kernel_variant_compiles_for_hopper(tmp_path):
    launches = tmp_path / "launches.jsonl"
    path = os.pathsep.join(filter(None, [str(REPO_ROOT / "tests" / "hopper_compile"), str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, CBQ_RECORD_TRITON_LAUNCHES=str(launches), PYTHONPATH=path, OMP_NUM_THREADS="1")
    tests = [f"{ENGINE_TESTS}/{t}" for t in RECORDED]
    run = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests],
        cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert run.returncode == 0, run.stdout[-4000:]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    code = f"from tests.hopper_compile.recorder import main; main({str(launches)!r})"
    built = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert built.returncode == 0, built.stderr[-4000:]
    report = json.loads(built.stdout.strip().splitlines()[-1])
    assert not report["failures"], json.dumps(report["failures"][:3], indent=1)
    assert MUST_COMPILE <= set(report["kernels"]), f"not recorded: {sorted(MUST_COMPILE - set(report['kernels']))}"
    print(f"{report['compiled']} kernel variants of {len(report['kernels'])} kernels compiled for sm90")
