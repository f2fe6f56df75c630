"""Records Triton launches under the interpreter as compile specs (see sitecustomize.py), and compiles them for sm90.

The interpreter runs a kernel as Python on numpy, so it accepts code that Triton's compiler refuses (a shape that is
not a constexpr, a dtype mix tl.dot cannot lower, a helper's argument that must be constexpr). The exactness tests
run every CUDA kernel in the interpreter; compiling the same specializations for Hopper (Triton's own compiler and
ptxas, which ship in the triton wheel: no GPU needed) checks that what the interpreter approved also builds.

`RECORDED` names the interpreter tests whose launches are recorded, during their normal run
(tests/worker/engine/conftest.py: `compile_launches_for_hopper`), and the kernels each must launch; after each of
them, `compile_recorded` compiles what it launched."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[2]
HERE = Path(__file__).resolve().parent  # holds sitecustomize.py, which installs the recorder in the subprocesses
RECORD_ENV = "CBQ_RECORD_TRITON_LAUNCHES"

# The kernel-level interpreter tests (tests/worker/engine/FILE::TEST), and the kernels of the CUDA path each must be
# seen to launch (test_kernels_compile_for_hopper.py's MUST_COMPILE; each compiles whatever else it launches too):
# between them every one, and a rename or a test change that stops one being seen fails that test rather than
# passing on fewer kernels.
RECORDED: dict[str, set[str]] = {
    "test_fused_kernels.py::test_fused_kernels_match_references_in_the_interpreter": {
        "_act_mul_kernel", "_add_rmsnorm_kernel", "_decode_gemm_kernel", "_qkv_rope_gemm_kernel",
        "_qkv_rope_write_kernel",
    },
    "test_family_kernels.py::test_family_epilogues_match_references_in_the_interpreter": {
        "_act_mul_kernel", "_add_rmsnorm_kernel", "_decode_gemm_kernel", "_decode_split_kernel",
        "_logits_epilogue_kernel", "_prefill_kernel", "_qkv_rope_write_kernel",
    },
    "test_attention_triton.py::test_kernels_in_triton_interpreter": {
        "_decode_reduce_kernel", "_decode_split_kernel", "_prefill_kernel", "_write_kv_kernel",
    },
    "test_attention_fp8_kv.py::test_fp8_kv_kernels_in_triton_interpreter": {
        "_decode_gemm_kernel", "_decode_reduce_kernel", "_decode_split_kernel", "_prefill_kernel",
        "_qkv_rope_gemm_kernel", "_qkv_rope_write_kernel", "_write_kv_kernel",
    },
    "test_mixed_attention.py::test_mixed_step_split_in_triton_interpreter": {
        "_decode_reduce_kernel", "_decode_split_kernel", "_prefill_kernel",
    },
    "test_quant_kernels.py::test_kernels_match_the_reference_in_the_interpreter": {
        "_act_mul_kernel", "_block_fp8_gemm_kernel", "_per_token_quant_kernel",
    },
    "test_quant_small_step.py::test_fp8_step_kernel_matches_its_twin_and_the_emulation_in_the_interpreter": {
        "_act_mul_kernel", "_add_rmsnorm_kernel", "_fp8_step_gemm_kernel", "_per_token_quant_kernel",
    },
    "test_quant_small_step.py::test_fp8_qkv_rope_kernel_equals_the_gemm_then_qkv_rope_write_in_the_interpreter": {
        "_fp8_qkv_rope_kernel", "_fp8_step_gemm_kernel", "_per_token_quant_kernel", "_qkv_rope_write_kernel",
    },
    "test_moe_triton.py::test_triton_moe_matches_reference_in_the_interpreter": {"_align_kernel", "_expert_gemm_kernel"},
    "test_deterministic_kernels.py::test_kernels_are_row_invariant_in_the_interpreter": {
        "_add_rmsnorm_kernel", "_decode_gemm_kernel", "_prefill_kernel", "_qkv_rope_gemm_kernel",
        "_qkv_rope_write_kernel",
    },
    "test_latent_attention.py::test_latent_decode_kernel_matches_its_twin_in_the_interpreter": {
        "_decode_reduce_kernel", "_latent_decode_kernel",
    },
    "test_latent_attention.py::test_triton_attention_runs_the_latent_cache_shapes_in_the_interpreter": {
        "_decode_split_kernel", "_prefill_kernel", "_write_kv_kernel",
    },
    "test_latent_attention.py::test_latent_attention_through_the_triton_backend_in_the_interpreter": {
        "_latent_decode_kernel", "_prefill_kernel", "_write_kv_kernel",
    },
    "test_w4a16.py::test_w4a16_kernel_matches_its_twin_in_the_interpreter": {
        "_w4a16_dequantize_kernel", "_w4a16_gemm_kernel",
    },
    "test_w4a16.py::test_small_step_layer_ops_run_the_w4a16_kernel_in_the_interpreter": {
        "_w4a16_dequantize_kernel", "_w4a16_gemm_kernel", "_w4a16_qkv_rope_kernel",
    },
    "test_latent_fp8.py::test_latent_decode_kernel_reads_an_fp8_cache_as_its_twin_in_the_interpreter": {
        "_decode_reduce_kernel", "_latent_decode_kernel",
    },
    "test_latent_fp8.py::test_latent_layer_over_an_fp8_cache_through_the_triton_backend_in_the_interpreter": {
        "_latent_decode_kernel", "_prefill_kernel", "_write_kv_kernel",
    },
}

TORCH_TO_TRITON = {
    "torch.bfloat16": "bf16", "torch.float16": "fp16", "torch.float32": "fp32", "torch.float64": "fp64",
    "torch.float8_e4m3fn": "fp8e4nv", "torch.float8_e5m2": "fp8e5", "torch.int8": "i8", "torch.uint8": "u8",
    "torch.int16": "i16", "torch.int32": "i32", "torch.int64": "i64", "torch.bool": "i1",
}  # fmt: skip
LAUNCH_OPTIONS = ("num_warps", "num_stages", "num_ctas", "launch_pdl")


def _constexpr_names(fn) -> set[str]:
    return {
        name
        for name, p in inspect.signature(fn).parameters.items()
        if "constexpr" in str(p.annotation)
    }


def _arg_type(value: Any) -> str | None:
    """The Triton signature type of a runtime argument (None: not recordable)."""
    if hasattr(value, "dtype") and hasattr(value, "data_ptr"):
        dtype = TORCH_TO_TRITON.get(str(value.dtype))
        return None if dtype is None else "*" + dtype
    if isinstance(value, bool):
        return "i1"
    if isinstance(value, int):
        return "i32" if -(2**31) <= value < 2**31 else "i64"
    if isinstance(value, float):
        return "fp32"
    return None


def spec_of(fn, args: tuple, kwargs: dict) -> dict | None:
    """One launch as {module, name, signature, constexprs, options}; None when an argument is not recordable."""
    params = list(inspect.signature(fn).parameters.values())
    constexprs = _constexpr_names(fn)
    bound = {p.name: a for p, a in zip(params, args, strict=False)}  # the rest by name or default
    bound.update({k: v for k, v in kwargs.items() if k not in LAUNCH_OPTIONS})
    signature: dict[str, str] = {}
    values: dict[str, Any] = {}
    for p in params:
        value = bound.get(p.name, p.default)
        if value is inspect.Parameter.empty:
            return None
        if p.name in constexprs or value is None:
            if not isinstance(value, (int, float, str, bool, type(None))):
                return None
            signature[p.name], values[p.name] = "constexpr", value
        else:
            kind = _arg_type(value)
            if kind is None:
                return None
            signature[p.name] = kind
    options = {k: kwargs[k] for k in LAUNCH_OPTIONS if k in kwargs}
    return {"module": fn.__module__, "name": fn.__name__, "signature": signature, "constexprs": values, "options": options}


def install(path: str) -> None:
    """Wrap the interpreter's launch so each one also appends its spec to `path`."""
    import triton.runtime.interpreter as interp

    original = interp.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        spec = spec_of(self.fn, args, kwargs)
        if spec is not None:
            with open(path, "a") as out:
                out.write(json.dumps(spec, sort_keys=True) + "\n")
        return original(self, *args, grid=grid, warmup=warmup, **kwargs)

    interp.InterpretedFunction.run = run


def compile_for_hopper(spec: dict) -> None:
    """Compiles one recorded specialization for sm90 (raises what the compiler raises)."""
    import importlib

    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    fn = getattr(importlib.import_module(spec["module"]), spec["name"])
    names = fn.arg_names
    constexprs = {(names.index(k),): v for k, v in spec["constexprs"].items()}
    source = ASTSource(fn=fn, signature=spec["signature"], constexprs=constexprs)
    options = dict(spec["options"])
    triton.compile(source, target=GPUTarget("cuda", 90, 32), options=options)


def one_per_variant(lines: list[str]) -> list[dict]:
    """The recorded launches, one per kernel variant: the same kernel with the same argument dtypes, non-integer
    constexprs (flags, precisions) and launch options counts once, whatever its sizes (the first seen)."""
    seen: dict[str, dict] = {}
    for line in sorted(set(lines)):
        spec = json.loads(line)
        flags = {k: v for k, v in spec["constexprs"].items() if isinstance(v, bool) or not isinstance(v, int)}
        key = json.dumps([spec["module"], spec["name"], spec["signature"], flags, spec["options"]], sort_keys=True)
        seen.setdefault(key, spec)
    return list(seen.values())


def main(path: str) -> None:
    """Compiles every variant recorded in `path` for sm90; prints a JSON report {compiled, failures}."""
    failures = []
    specs = one_per_variant(open(path).read().splitlines())
    for spec in specs:
        try:
            compile_for_hopper(spec)
        except Exception as exc:  # the compiler's error, reported per variant
            failures.append({"kernel": spec["name"], "constexprs": spec["constexprs"], "error": str(exc)[-1500:]})
    print(json.dumps({"compiled": len(specs) - len(failures), "kernels": sorted({s["name"] for s in specs}),
                      "failures": failures}))  # fmt: skip


def have_hopper_compiler() -> bool:
    """Triton with the ptxas its wheel ships: what compiling for sm90 without a GPU needs."""
    try:
        import triton
    except ImportError:
        return False
    return (Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "ptxas").exists()


def recording_env(launches: Path) -> dict[str, str]:
    """The environment variables that make every Python subprocess started with them record its interpreter
    launches into `launches` (sitecustomize.py, first on PYTHONPATH)."""
    path = os.pathsep.join(filter(None, [str(HERE), str(REPO_ROOT), os.environ.get("PYTHONPATH")]))
    return {RECORD_ENV: str(launches), "PYTHONPATH": path}


def compile_recorded(launches: Path) -> dict:
    """Compile every variant recorded in `launches` for sm90, in a process without TRITON_INTERPRET (there
    `triton.jit` gives compilable kernels); returns `main`'s report."""
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    env.pop("TRITON_INTERPRET", None)
    env.pop(RECORD_ENV, None)
    code = f"from tests.hopper_compile.recorder import main; main({str(launches)!r})"
    built = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=1200
    )
    assert built.returncode == 0, built.stderr[-4000:]
    return json.loads(built.stdout.strip().splitlines()[-1])
