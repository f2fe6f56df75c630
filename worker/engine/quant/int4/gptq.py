"""GPTQ INT4 checkpoints (AutoGPTQ's and GPTQModel's releases, e.g. Qwen/*-GPTQ-Int4, TheBloke/*-GPTQ): the config's
parsing and the method that reads a linear into `Int4Linear`.

The layout read is AutoGPTQ's QuantLinear's, as transformers' and vLLM's GPTQ loaders read it:

  <m>.qweight  int32 [K / 8, N]   packed along the INPUT dim: input row k of column n at bits 4 (k % 8) of word
                                  [k // 8, n] (unsigned 0..15)
  <m>.qzeros   int32 [G, N / 8]   packed along the OUTPUT dim: column n's zero at bits 4 (n % 8) of word [group, n // 8]
  <m>.scales   [G, N]             fp16 in the releases
  <m>.g_idx    int32 [K]          input row k's group: k // g, or with `desc_act` (act-order) a permutation's

G = K / g groups (`group_size` -1: one). w[n, k] = (q[k, n] - zero[g_idx[k], n]) * scale[g_idx[k], n]. The zeros of
`checkpoint_format` "gptq" (AutoGPTQ's, the default) are stored minus one (a symmetric zero of 8 is stored 7),
which "gptq_v2" (GPTQModel's) undoes; other checkpoint formats (marlin, bitblas, ...) are refused. With act-order
the columns are stored sorted by group (`Int4Linear.perm`), so each group is contiguous for the W4A16 GEMM.
Config fields read: bits 4, group_size, desc_act, sym, checkpoint_format (or GPTQModel's `format`),
`modules_to_not_convert`; `lm_head` true (a quantized head) and `dynamic` per-module overrides are refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..base import FIELD, FormatRefused, QuantConfig, module_list, stays_dense
from .method import (
    INDEX,
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
from .packed import Int4Linear

CHECKPOINT_FORMATS = ("gptq", "gptq_v2")


@dataclass(frozen=True)
class GptqConfig(Int4Config):
    scheme: Int4Scheme
    zeros_minus_one: bool  # checkpoint_format "gptq": each stored zero is the zero point minus one
    modules_to_not_convert: tuple[str, ...] = ()

    quant_method = "gptq"

    def scheme_for(self, module_name: str) -> Int4Scheme | None:
        """Every linear but the head and `modules_to_not_convert`; a linear the release left dense (a mixture of
        experts' router) has no `qweight`, and the loader reads its `weight` as stored."""
        return None if stays_dense(module_name, self.modules_to_not_convert) else self.scheme


def parse(qc: Mapping[str, Any]) -> GptqConfig:
    check_bits(qc)
    fmt = qc.get("checkpoint_format") or qc.get("format") or "gptq"
    if fmt not in CHECKPOINT_FORMATS:
        raise FormatRefused(f"{FIELD}.checkpoint_format {fmt!r} (GPTQ checkpoints in {' or '.join(CHECKPOINT_FORMATS)})")
    if qc.get("lm_head"):
        raise FormatRefused(f"{FIELD}.lm_head true (a GPTQ-quantized output head)")
    if qc.get("dynamic"):
        raise FormatRefused(f"{FIELD}.dynamic {qc['dynamic']!r} (per-module GPTQ overrides)")
    if qc.get("modules_in_block_to_quantize"):
        raise FormatRefused(f"{FIELD}.modules_in_block_to_quantize (a GPTQ checkpoint quantizing part of each block)")
    size = group_size_of(qc.get("group_size", 128), f"{FIELD}.group_size")
    sym = qc.get("sym", True)
    scheme = Int4Scheme(size, bool(sym), act_order=bool(qc.get("desc_act", False)))
    return GptqConfig(scheme, fmt == "gptq", module_list(qc.get("modules_to_not_convert"), f"{FIELD}.modules_to_not_convert"))


class GptqInt4Method(Int4LinearMethod):
    format_name = "gptq"
    g_idx = "g_idx"

    def __init__(self, scheme: Int4Scheme, zeros_minus_one: bool, keep_packed: bool = False):
        super().__init__(scheme, keep_packed)
        self.zeros_minus_one = zeros_minus_one

    @classmethod
    def for_config(cls, config: QuantConfig, scheme: Int4Scheme) -> GptqInt4Method:
        assert isinstance(config, GptqConfig)
        return cls(scheme, config.zeros_minus_one)

    def tensors(self) -> tuple[PackedTensor, ...]:
        return (
            PackedTensor("qweight", WORDS, output_dim=1, input_dim=0, input_block="word"),
            PackedTensor("qzeros", WORDS, output_dim=1, input_dim=0, output_block="word", input_block="group"),
            PackedTensor("scales", SCALES, output_dim=1, input_dim=0, input_block="group"),
            # the releases carry it with and without desc_act
            PackedTensor("g_idx", INDEX, None, 0, per_shard=True, optional=not self.scheme.act_order),
        )

    def to_int4(self, t, n, k, group, perm, prefix) -> Int4Linear:
        zeros = unpack_words(t["qzeros"], dim=1)[:, :n]  # [groups, N]
        if self.zeros_minus_one:  # AutoGPTQ's: stored minus one (a zero of 0 wrapped to 15 comes back as 0)
            zeros = (zeros + 1) & 0xF
        q = unpack_words(t["qweight"], dim=0).t()  # [N, K]: input rows packed eight a word
        return int4_form(q, t["scales"].t(), zeros.t(), group, perm, self.scheme.symmetric, prefix)
