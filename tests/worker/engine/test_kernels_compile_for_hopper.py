"""Every Triton kernel variant the interpreter tests run also compiles for Hopper (sm90), without a GPU.

Triton's interpreter runs a kernel as Python on numpy and accepts what the compiler refuses (a shape from a runtime
value, an argument a helper needs as a constexpr, a dot it cannot lower), so a kernel can pass every CPU test and fail
to build on the H200. The kernel-level interpreter tests (tests/hopper_compile/recorder.py's `RECORDED`) therefore
record their launches as they run (each launch's argument dtypes, constexprs and launch options), and after each of
them the fixture `compile_launches_for_hopper` (tests/worker/engine/conftest.py) compiles the recorded variants with
Triton's compiler and ptxas for sm90 (both ship in the triton wheel) and checks the kernels that test must launch. It
proves the code builds, not that it is fast or right (the interpreter tests and the `gpu` suite do that).

This module checks the list itself: that it names tests that exist and that, between them, they must launch every
kernel of the CUDA path."""

from __future__ import annotations

import ast
import json
from pathlib import Path

import pytest

from tests.hopper_compile.recorder import RECORDED, compile_recorded, have_hopper_compiler

ENGINE_TESTS = Path(__file__).resolve().parent
# Every kernel of the CUDA path: some recorded test must launch each, or a rename or a test change could stop one
# being compiled without anything failing.
MUST_COMPILE = {
    "_decode_gemm_kernel", "_qkv_rope_gemm_kernel", "_add_rmsnorm_kernel", "_act_mul_kernel", "_qkv_rope_write_kernel",
    "_logits_epilogue_kernel", "_write_kv_kernel", "_decode_split_kernel", "_decode_reduce_kernel", "_prefill_kernel",
    "_fp8_step_gemm_kernel", "_fp8_qkv_rope_kernel", "_per_token_quant_kernel", "_block_fp8_gemm_kernel",
    "_expert_gemm_kernel", "_align_kernel", "_latent_decode_kernel", "_w4a16_gemm_kernel", "_w4a16_dequantize_kernel",
    "_w4a16_qkv_rope_kernel",
}  # fmt: skip


def _test_functions(file_name: str) -> set[str]:
    tree = ast.parse((ENGINE_TESTS / file_name).read_text())
    return {node.name for node in tree.body if isinstance(node, ast.FunctionDef) and node.name.startswith("test_")}


def test_the_recorded_tests_exist() -> None:
    missing = [test for test in RECORDED if test.split("::")[1] not in _test_functions(test.split("::")[0])]
    assert missing == []


def test_the_recorded_tests_must_launch_every_kernel_of_the_cuda_path() -> None:
    must_launch = set().union(*RECORDED.values())
    assert MUST_COMPILE <= must_launch, f"no recorded test must launch {sorted(MUST_COMPILE - must_launch)}"


@pytest.mark.skipif(not have_hopper_compiler(), reason="needs triton with its bundled ptxas")
def test_a_variant_the_compiler_refuses_is_reported(tmp_path) -> None:
    """What the fixture relies on: a recorded launch that cannot build for sm90 comes back as a failure (here a
    block of 3 elements, which tl.arange refuses and the interpreter would run), a valid one as compiled."""
    spec = {
        "module": "worker.engine.kernels.fused", "name": "_act_mul_kernel",
        "signature": {"gu_ptr": "*fp32", "out_ptr": "*fp32", "inter": "i32", "ACT": "constexpr", "BLOCK": "constexpr",
                      "USE_PDL": "constexpr"},
        "constexprs": {"ACT": 0, "BLOCK": 256, "USE_PDL": False}, "options": {"num_warps": 4},
    }  # fmt: skip
    # other launch options: `one_per_variant` counts launches differing only in integer constexprs once
    refused = {**spec, "constexprs": {**spec["constexprs"], "BLOCK": 3}, "options": {"num_warps": 2}}
    launches = tmp_path / "launches.jsonl"
    launches.write_text("".join(json.dumps(s, sort_keys=True) + "\n" for s in (spec, refused)))
    report = compile_recorded(launches)
    assert report["compiled"] == 1
    assert [f["constexprs"]["BLOCK"] for f in report["failures"]] == [3]
