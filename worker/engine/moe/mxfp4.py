"""MXFP4 (OCP microscaling FP4) to bf16/fp16/fp32, as gpt-oss's released checkpoints store their experts, and the
format's expert method (`Mxfp4ExpertMethod`: the experts dequantized at load, by the rank's slice). Owns nothing.

Layout (the one transformers' mxfp4 integration reads): `blocks` uint8 [..., G, 16] holds 32 FP4 values per
group, two per byte, the low nibble first; `scales` uint8 [..., G] is one E8M0 exponent per group (the
group's values are multiplied by 2 ** (scale - 127)). The output is [..., G * 32].

An FP4 value is E2M1: bit 3 the sign, bits 2..1 the exponent (bias 1), bit 0 the mantissa; exponent 0 is
subnormal (0 or 0.5). Every product of an E2M1 value and a power of two in bf16's range is exact in bf16, so
dequantizing loses nothing.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checkpoint import Checkpoint, TensorSlice
from .protocol import ExpertMethod

VALUES_PER_GROUP = 32
BYTES_PER_GROUP = VALUES_PER_GROUP // 2
SCALE_BIAS = 127


def e2m1_value(code: int) -> float:
    """The real number an FP4 E2M1 code (0..15) stands for."""
    sign = -1.0 if code & 0b1000 else 1.0
    exponent, mantissa = (code >> 1) & 0b11, code & 1
    if exponent == 0:
        return sign * 0.5 * mantissa
    return sign * 2.0 ** (exponent - 1) * (1.0 + 0.5 * mantissa)


E2M1_TABLE = tuple(e2m1_value(code) for code in range(16))  # 0, .5, 1, 1.5, 2, 3, 4, 6, then negated


def dequantize_mxfp4(
    blocks: torch.Tensor,
    scales: torch.Tensor,
    dtype: torch.dtype = torch.bfloat16,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """[..., G, 16] uint8 codes and [..., G] uint8 exponents -> [..., G * 32] `dtype` (written into `out` if
    given, which lets a loader fill one expert's slice of a stacked tensor without a temporary of its size)."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BYTES_PER_GROUP or blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {tuple(blocks.shape)} do not match scales {tuple(scales.shape)}")
    table = torch.tensor(E2M1_TABLE, dtype=dtype, device=blocks.device)
    codes = torch.stack((blocks & 0x0F, blocks >> 4), dim=-1).flatten(-2)  # [..., G, 32], low nibble first
    values = table[codes.long()]
    # 2 ** (scale - 127) is exact in fp32 and in bf16 (same exponent range), so the product is exact too
    group_scale = torch.exp2(scales.to(torch.float32) - SCALE_BIAS).to(dtype)
    result = (values * group_scale.unsqueeze(-1)).flatten(-2)
    if out is None:
        return result
    out.copy_(result)
    return out


class Mxfp4ExpertMethod(ExpertMethod):
    """gpt-oss's release: `<name>_blocks` [E, out, in / 32, 16] and `<name>_scales` [E, out, in / 32] for each
    stacked projection, dequantized to the model dtype at load (exact in bf16 and fp32) and run as unquantized
    experts. Read one expert's rows at a time on `device`, so the dequantizer's temporaries (its int64 codes are 8
    bytes a value) are one expert's, never the layer's."""

    def __init__(self, dtype: torch.dtype, device: torch.device | str):
        super().__init__()
        self.dtype, self.device = dtype, device

    @staticmethod
    def stored(source: Checkpoint, experts: str) -> bool:
        return f"{experts}.gate_up_proj_blocks" in source

    def stacked_tensor(self, source, name):
        if f"{name}_blocks" not in source:
            return None
        if f"{name}_scales" not in source:
            raise ValueError(f"{name}_blocks has no {name}_scales beside it (MXFP4 stores codes and scales in two tensors)")
        return DequantizedMxfp4(source.get_slice(f"{name}_blocks"), source.get_slice(f"{name}_scales"), self.dtype, self.device)


class DequantizedMxfp4:
    """A stacked MXFP4 matrix read by slice as the dequantized tensor transformers' gpt-oss module holds, [E, in,
    out] (x @ w[e]). An index's input columns are read as the whole 32-value groups that cover them, since a rank's
    columns may start or end inside a group (TP=4 of gpt-oss's 2880); the last read is kept, so gate and up, read
    from the same interleaved rows, are dequantized once."""

    def __init__(self, blocks: TensorSlice, scales: TensorSlice, dtype: torch.dtype, device: torch.device | str):
        self.blocks, self.scales, self.dtype, self.device = blocks, scales, dtype, device
        self.last: tuple[Any, torch.Tensor] | None = None

    def get_shape(self) -> list[int]:
        num_experts, rows, groups, _ = self.blocks.get_shape()
        return [num_experts, groups * VALUES_PER_GROUP, rows]

    def __getitem__(self, index: Any) -> torch.Tensor:
        experts, columns, rows = index  # contiguous slices, as the expert loader reads
        key = tuple((s.start, s.stop, s.step) for s in index)
        if self.last is not None and self.last[0] == key:
            return self.last[1]
        col_start, col_stop, col_step = columns.indices(self.get_shape()[1])
        assert col_step == 1 and rows.step in (None, 1), "read by contiguous rows and columns"
        groups = slice(col_start // VALUES_PER_GROUP, -(-col_stop // VALUES_PER_GROUP))
        first = groups.start * VALUES_PER_GROUP
        part = (experts, rows, groups)
        values = dequantize_mxfp4(self.blocks[part].to(self.device), self.scales[part].to(self.device), self.dtype)
        result = values[..., col_start - first : col_stop - first].transpose(-1, -2)  # [E, columns, rows]
        self.last = (key, result)
        return result
