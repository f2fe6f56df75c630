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
