"""What every Triton kernel module shares: whether Triton is there, and the small launch-size helpers.
Owns nothing.

`HAVE_TRITON` is False on installs without Triton (or with one that fails to import); the kernel modules
then import fine, define no kernels, and the engine keeps its torch paths. `triton` and `tl` are None then.
"""

from __future__ import annotations

import torch

try:  # CPU-only CI may have no Triton; the engine calls the kernels only on CUDA (or the interpreter in tests)
    import triton
    import triton.language as tl
    from triton.runtime.errors import OutOfResources

    HAVE_TRITON = True
except Exception:  # ImportError, or a broken install: either way, no kernels
    triton = None
    tl = None
    HAVE_TRITON = False

    class OutOfResources(Exception):  # type: ignore[no-redef]  # never raised without Triton
        """Triton's error for a launch configuration that does not fit the GPU (shared memory, registers)."""


def next_pow2(x: int) -> int:
    """The smallest power of two >= x (1 for x <= 1): Triton block sizes must be powers of two."""
    return 1 if x <= 1 else 1 << (x - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def require_triton(what: str) -> None:
    if not HAVE_TRITON:
        raise RuntimeError(f"{what} needs triton; the torch reference runs without it")


def dot_precision(dtype: torch.dtype, low_precision: str | None) -> str | None:
    """`tl.dot`'s input_precision: "ieee" for fp32 operands, so the fp32 tests track torch to ~1e-6 (no tf32);
    `low_precision` for bf16/fp16 operands, where Triton ignores the setting. Callers name theirs: the
    attention kernels pass "tf32", the weight GEMMs None (Triton's default); both compute the same."""
    return "ieee" if dtype == torch.float32 else low_precision


if HAVE_TRITON:

    @triton.jit
    def to_kv_cache(x, inv_scale, cache_ptr, model_dtype):
        """`x` as the paged cache at `cache_ptr` stores it. An e4m3 cache (`--kv-cache-dtype fp8`) holds x rounded
        to `model_dtype` (as the unfused path's K/V tensors are), times 1 / scale in fp32, saturated at ±448: e4m3
        has no infinity, and a cast of an overflow may give NaN. Any other cache: a cast (`inv_scale` unused).
        The same math as attention.to_cache, so every writer stores the same bits."""
        dtype = cache_ptr.dtype.element_ty
        if dtype == tl.float8e4nv:
            y = tl.clamp(x.to(model_dtype).to(tl.float32) * inv_scale, -448.0, 448.0).to(dtype)
        else:
            y = x.to(dtype)
        return y

    @triton.jit
    def quantize_to_fp8(x, scale, FP8_MAX: tl.constexpr):
        """quant/fp8.py's to_fp8(x / scale): clamped first (e4m3 has no infinity), then the round-to-nearest-even
        cast. div_rn: IEEE round-to-nearest, as torch divides; Triton's `/` on CUDA is the approximate division,
        whose last bit can tip an e4m3 rounding (the H200 run of test_quant_small_step.py, 2026-12-01). Shared by
        every kernel that quantizes activations (quant/kernels.py, quant/small_step.py, fused.add_rmsnorm's FP8
        output), which must round alike."""
        q = tl.minimum(tl.maximum(tl.math.div_rn(x, scale), -FP8_MAX), FP8_MAX)
        return q.to(tl.float8e4nv)

    @triton.jit
    def fp8_row_scale(absmax, scale_ub, HAS_UB: tl.constexpr, FP8_MAX: tl.constexpr, MIN_ABSMAX: tl.constexpr):
        """A row's per-token scale from its absmax: fp8.scale_from_absmax's max(absmax, MIN_ABSMAX) * (1 / FP8_MAX),
        the absmax first capped at `scale_ub` with HAS_UB (fbgemm's activation_scale_ub). A product by the fp32
        reciprocal, as there: torch on CUDA divides by a Python number that way, so a division here (div_rn or
        not) was a bit off the reference's scale now and then, and x / scale then tipped e4m3 roundings (the H200
        run of test_quant_kernels.py, 2026-12-01)."""
        if HAS_UB:
            absmax = tl.minimum(absmax, scale_ub)
        return tl.maximum(absmax, MIN_ABSMAX) * (1.0 / FP8_MAX)
