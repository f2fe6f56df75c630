"""cbq's one in-memory form of an INT4 weight-only linear, whatever layout its checkpoint shipped. Owns nothing:
plain values and the functions that pack, unpack, dequantize and quantize them.

Every INT4 format module (compressed-tensors pack-quantized, GPTQ, AWQ) turns its release's tensors into an
`Int4Linear`, and every consumer (the CPU's dequantization at load, the W4A16 GEMM kernels) reads only this form:

  qweight  int32 [N, K // 8]   eight 4-bit values per word along the input dim K, value k of a row at bits
                               4 * (k % 8) .. 4 * (k % 8) + 3 of word k // 8 (unsigned, 0..15)
  scales   [N, K // g]         one scale per output row and group of g input columns, in the model dtype
  zeros    uint8 [N, K // g]   the group's zero point (0..15); None: symmetric, every zero is 8
  perm     int64 [K] or None   stored column j holds input feature perm[j] (GPTQ's act-order releases, whose
                               groups follow a permutation of the columns, are stored sorted so each group is
                               contiguous): y = x[:, perm] @ W_stored^T. None: the identity

The weight is w[n, k] = (q[n, k] - zero[n, k // g]) * scale[n, k // g]. Rows are output features, so fusing
q/k/v or gate/up is a concatenation of rows (`Int4Linear.concat`), as for a dense weight.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

PACK = 8  # 4-bit values per int32 word
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit offset of value k % 8 in its word


@dataclass(frozen=True)
class Int4Linear:
    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    group_size: int
    perm: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, words = self.qweight.shape
        k = words * PACK
        assert self.qweight.dtype == torch.int32, f"qweight must be int32, got {self.qweight.dtype}"
        assert k % self.group_size == 0, f"K={k} is not a multiple of the group size {self.group_size}"
        groups = (n, k // self.group_size)
        assert tuple(self.scales.shape) == groups, f"scales {tuple(self.scales.shape)}, expected {groups}"
        if self.zeros is not None:
            assert tuple(self.zeros.shape) == groups, f"zeros {tuple(self.zeros.shape)}, expected {groups}"
            assert self.zeros.dtype == torch.uint8, f"zeros must be uint8, got {self.zeros.dtype}"
        if self.perm is not None:
            assert tuple(self.perm.shape) == (k,), f"perm {tuple(self.perm.shape)}, expected ({k},)"

    @property
    def out_features(self) -> int:
        return int(self.qweight.shape[0])

    @property
    def in_features(self) -> int:
        return int(self.qweight.shape[1]) * PACK

    @property
    def symmetric(self) -> bool:
        return self.zeros is None

    def to(self, device: torch.device | str) -> Int4Linear:
        def move(t: torch.Tensor | None) -> torch.Tensor | None:
            return None if t is None else t.to(device)

        return Int4Linear(self.qweight.to(device), self.scales.to(device), move(self.zeros), self.group_size, move(self.perm))

    @staticmethod
    def concat(parts: Sequence[Int4Linear]) -> Int4Linear:
        """The linears' rows stacked (q/k/v, gate/up): one GEMM over the same input."""
        first = parts[0]
        for p in parts[1:]:
            if p.group_size != first.group_size or p.symmetric != first.symmetric or p.in_features != first.in_features:
                raise ValueError("fused INT4 linears need the same input size, group size and zero-point kind")
            same_order = p.perm is None if first.perm is None else p.perm is not None and torch.equal(p.perm, first.perm)
            if not same_order:
                raise ValueError("fused INT4 linears need the same column order (act-order permutation)")
        zeros = None if first.zeros is None else torch.cat([p.zeros for p in parts])  # type: ignore[misc]
        return Int4Linear(
            torch.cat([p.qweight for p in parts]), torch.cat([p.scales for p in parts]), zeros, first.group_size, first.perm
        )


def pack_int4(values: torch.Tensor) -> torch.Tensor:
    """[N, K] integers in 0..15 -> int32 [N, K // 8], value k at bits 4 * (k % 8)."""
    n, k = values.shape
    assert k % PACK == 0, f"K={k} is not a multiple of {PACK}"
    v = values.to(torch.int32).reshape(n, k // PACK, PACK)
    words = torch.zeros(n, k // PACK, dtype=torch.int64, device=values.device)
    for i in range(PACK):  # int64 so bit 31 does not overflow, then reinterpreted as int32
        words |= (v[..., i].to(torch.int64) & 0xF) << (4 * i)
    return (words - ((words >> 31) << 32)).to(torch.int32)


def unpack_int4(qweight: torch.Tensor) -> torch.Tensor:
    """int32 [N, K // 8] -> uint8 [N, K] (0..15)."""
    shifts = _SHIFTS.to(qweight.device)
    values = (qweight.unsqueeze(-1) >> shifts) & 0xF
    return values.reshape(qweight.shape[0], -1).to(torch.uint8)


def dequantize(layer: Int4Linear, dtype: torch.dtype) -> torch.Tensor:
    """The weight [N, K] in `dtype`, columns in the input's own order: (q - zero) * scale, computed in fp32."""
    q = unpack_int4(layer.qweight).to(torch.float32)
    g = layer.group_size
    zeros = torch.full_like(layer.scales, 8, dtype=torch.float32) if layer.zeros is None else layer.zeros.float()
    scales = layer.scales.float()
    w = (q - zeros.repeat_interleave(g, dim=1)) * scales.repeat_interleave(g, dim=1)
    if layer.perm is not None:
        restored = torch.empty_like(w)
        restored[:, layer.perm] = w
        w = restored
    return w.to(dtype)


def quantize_rtn(weight: torch.Tensor, group_size: int = 128, symmetric: bool = True) -> Int4Linear:
    """Round-to-nearest INT4 of a dense weight [N, K], per output row and group of `group_size` columns: what
    `--quantization int4`-style tests and benchmarks use, and what fixtures pack into each release's layout."""
    n, k = weight.shape
    g = k if group_size == -1 else group_size
    w = weight.float().reshape(n, k // g, g)
    if symmetric:
        scales = (w.abs().amax(dim=-1) / 7.5).clamp(min=1e-8)  # [-8, 7] around zero 8
        q = torch.clamp(torch.round(w / scales[..., None]) + 8, 0, 15)
        zeros = None
    else:
        lo, hi = w.amin(dim=-1), w.amax(dim=-1)
        scales = ((hi - lo) / 15).clamp(min=1e-8)
        zero = torch.clamp(torch.round(-lo / scales), 0, 15)
        q = torch.clamp(torch.round(w / scales[..., None]) + zero[..., None], 0, 15)
        zeros = zero.to(torch.uint8)
    return Int4Linear(pack_int4(q.reshape(n, k)), scales.to(weight.dtype), zeros, g)
