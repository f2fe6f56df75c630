"""AWQ INT4 checkpoints in the GEMM layout (AutoAWQ's releases, e.g. Qwen/*-AWQ, TheBloke/*-AWQ, version "gemm"):
the config's parsing and the method that reads a linear into `Int4Linear`.

The layout read is AutoAWQ's WQLinear_GEMM's, as transformers' and vLLM's AWQ loaders read it:

  <m>.qweight  int32 [K, N / 8]   packed along the OUTPUT dim, interleaved: the i-th 4-bit value of word
                                  [k, w] (bits 4i..4i+3) is column 8w + INTERLEAVE[i], INTERLEAVE = 0 2 4 6 1 3 5 7
  <m>.qzeros   int32 [G, N / 8]   the zero points (0..15, stored as they are), packed and interleaved alike
  <m>.scales   [G, N]             fp16 in the releases

G = K / g groups. w[n, k] = (q[k, n] - zero[k // g, n]) * scale[k // g, n]. Config fields read: bits 4, group_size,
zero_point (true: AutoAWQ's GEMM releases all carry zero points), version "gemm" (gemv, gemv_fast, exllama, ipex
and marlin lay the words out otherwise and are refused), `modules_to_not_convert`; the head stays dense.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from ..base import FIELD, FormatRefused, module_list, stays_dense
from .method import (
    SCALES,
    WORDS,
    Int4Config,
    Int4LinearMethod,
    Int4Scheme,
    PackedTensor,
    check_bits,
    group_size_of,
    int4_form,
    unpack_words,
)
from .packed import PACK, Int4Linear

INTERLEAVE = (0, 2, 4, 6, 1, 3, 5, 7)  # the column each 4-bit position of a word holds, within its eight
VERSION = "gemm"


@dataclass(frozen=True)
class AwqConfig(Int4Config):
    scheme: Int4Scheme
    modules_to_not_convert: tuple[str, ...] = ()

    quant_method = "awq"

    def scheme_for(self, module_name: str) -> Int4Scheme | None:
        return None if stays_dense(module_name, self.modules_to_not_convert) else self.scheme


def parse(qc: Mapping[str, Any]) -> AwqConfig:
    check_bits(qc, default=4)  # transformers' AwqConfig's default
    given = qc.get("version", VERSION)
    version = str(getattr(given, "value", given)).lower()  # transformers' AwqConfig holds an enum
    if version != VERSION:
        raise FormatRefused(f"{FIELD}.version {qc.get('version')!r} (AWQ checkpoints in the {VERSION} layout)")
    if qc.get("zero_point", True) is not True:
        raise FormatRefused(f"{FIELD}.zero_point {qc.get('zero_point')!r} (AWQ GEMM without zero points)")
    size = group_size_of(qc.get("group_size", 128), f"{FIELD}.group_size")
    return AwqConfig(Int4Scheme(size, symmetric=False),
                     module_list(qc.get("modules_to_not_convert"), f"{FIELD}.modules_to_not_convert"))


def _deinterleave(words: torch.Tensor) -> torch.Tensor:
    """int32 [R, N / 8] -> uint8 [R, N] in column order."""
    values = unpack_words(words, dim=1)  # position order: 8w + i
    columns = torch.arange(values.shape[1]).reshape(-1, PACK)[:, list(INTERLEAVE)].reshape(-1)
    out = torch.empty_like(values)
    out[:, columns] = values  # position 8w + i holds column 8w + INTERLEAVE[i]
    return out


class AwqInt4Method(Int4LinearMethod):
    format_name = "awq gemm"

    def tensors(self) -> tuple[PackedTensor, ...]:
        return (
            PackedTensor("qweight", WORDS, output_dim=1, input_dim=0, output_block="word"),
            PackedTensor("qzeros", WORDS, output_dim=1, input_dim=0, output_block="word", input_block="group"),
            PackedTensor("scales", SCALES, output_dim=1, input_dim=0, input_block="group"),
        )

    def to_int4(self, t, n, k, group, perm, prefix) -> Int4Linear:
        q = _deinterleave(t["qweight"])[:, :n].t()  # [N, K]
        zeros = _deinterleave(t["qzeros"])[:, :n].t()
        return int4_form(q, t["scales"].t(), zeros, group, perm, False, prefix)
