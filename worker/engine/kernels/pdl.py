"""Programmatic dependent launch (PDL, sm90+): whether it is available, and the in-kernel handshake.

A kernel launched with `launch_pdl=True` may be placed on the SMs while the kernel before it in the stream
is still running (once every program of that one has released it). It must therefore run
`pdl_wait_and_release` in every program before it reads anything an earlier kernel wrote or writes
anything at all; only data no kernel of the step writes (weights) may be read before. Every program
waits, even one with nothing to do: a kernel that could finish before its predecessor would let the
kernel after it overtake that predecessor. Kernels launched without PDL (cuBLAS, torch) wait for
everything before them as usual, so PDL and non-PDL kernels mix freely in one stream or CUDA graph.
"""

from __future__ import annotations

import functools

import torch

from .common import HAVE_TRITON, tl, triton


@functools.cache
def pdl_supported(device_index: int) -> bool:
    """sm90+ and a Triton with the griddepcontrol intrinsics."""
    if not HAVE_TRITON or not torch.cuda.is_available():
        return False
    cuda_extra = getattr(getattr(tl, "extra", None), "cuda", None)
    has_gdc = hasattr(cuda_extra, "gdc_wait") and hasattr(cuda_extra, "gdc_launch_dependents")
    return has_gdc and torch.cuda.get_device_capability(device_index)[0] >= 9


def pdl_usable(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    return pdl_supported(device.index if device.index is not None else torch.cuda.current_device())


if HAVE_TRITON:

    @triton.jit
    def pdl_wait_and_release(USE_PDL: tl.constexpr):
        """Wait until the kernel before has finished (its writes are then visible), then let the next
        kernel be placed on the SMs as soon as every program of this one has got here."""
        if USE_PDL:
            tl.extra.cuda.gdc_wait()
            tl.extra.cuda.gdc_launch_dependents()
