"""compressed-tensors `pack-quantized` INT4 weight-only checkpoints (llm-compressor's W4A16 releases, e.g.
RedHatAI/*-quantized.w4a16): the config's parsing and the method that reads a linear into `Int4Linear`.

The layout read is compressed-tensors' packed compressor's, as vLLM's WNA16 scheme loads it:

  <m>.weight_packed      int32 [N, K / 8]   eight 4-bit values a word along the input dim, value k at bits
                                            4 (k % 8); each the signed value (-8..7) plus 8
  <m>.weight_scale       [N, K / g]         one scale per row and group (strategy "channel": [N, 1])
  <m>.weight_zero_point  int32 [N / 8, K / g]  asymmetric only: packed along the OUTPUT dim (eight rows a word),
                                            each the signed zero point plus 8
  <m>.weight_shape       int [2]            (N, K)
  <m>.weight_g_idx       int32 [K]          actorder "group" only: input column k's group

w = (q - zero_point) * scale in signed values is the same as in the stored, +8 ones, which is `Int4Linear`'s
form: `weight_packed` is its qweight as it is. The config (compressed-tensors' QuantizationConfig):
`config_groups.<g>.weights` {num_bits 4, type "int", strategy "group" or "channel", group_size, symmetric,
actorder, dynamic false}, `input_activations` null (16-bit activations), `targets` and `ignore` naming the linears
(`base.ct_matches`; the output head stays dense as the releases ship it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ..base import FIELD, FormatRefused, ct_matches, module_list, stays_dense
from .method import (
    INDEX,
    SCALES,
    WORDS,
    Int4Config,
    Int4LinearMethod,
    Int4Scheme,
    PackedTensor,
    group_size_of,
    int4_form,
    unpack_words,
)
from .packed import Int4Linear, unpack_int4

FORMAT = "pack-quantized"


@dataclass(frozen=True)
class CompressedTensorsInt4Config(Int4Config):
    groups: tuple[tuple[tuple[str, ...], Int4Scheme], ...]  # (targets, scheme), in config_groups order
    ignore: tuple[str, ...] = ()

    quant_method = "compressed-tensors"

    def scheme_for(self, module_name: str) -> Int4Scheme | None:
        if stays_dense(module_name, ()) or any(ct_matches(module_name, t) for t in self.ignore):
            return None
        for targets, scheme in self.groups:
            if any(ct_matches(module_name, target) for target in targets):
                return scheme
        return None


def is_pack_quantized(qc: Mapping[str, Any]) -> bool:
    """Whether any config group (or the whole config) is in the packed INT format: this module reads it."""
    groups = qc.get("config_groups")
    formats = {qc.get("format")} | {g.get("format") for g in groups.values() if isinstance(g, Mapping)} if isinstance(
        groups, Mapping
    ) else {qc.get("format")}
    return FORMAT in formats


def parse(qc: Mapping[str, Any]) -> CompressedTensorsInt4Config:
    groups_in = qc.get("config_groups")
    if not isinstance(groups_in, Mapping) or not groups_in:
        raise FormatRefused(f"{FIELD}: compressed-tensors without config_groups")
    groups = []
    for name, group in groups_in.items():
        where = f"{FIELD}.config_groups.{name}"
        fmt = group.get("format") or qc.get("format")
        if fmt != FORMAT:
            raise FormatRefused(f"{where}: compressed-tensors format {fmt!r} beside {FORMAT!r}")
        targets = group.get("targets")
        if not isinstance(targets, list) or not targets or not all(isinstance(t, str) for t in targets):
            raise FormatRefused(f"{where}.targets {targets!r} (a list of module names expected)")
        groups.append((tuple(targets), _scheme(group, where)))
    return CompressedTensorsInt4Config(tuple(groups), module_list(qc.get("ignore"), f"{FIELD}.ignore"))


def _scheme(group: Mapping[str, Any], where: str) -> Int4Scheme:
    weights = group.get("weights")
    if not isinstance(weights, Mapping):
        raise FormatRefused(f"{where}.weights {weights!r}")
    if weights.get("type") != "int" or weights.get("num_bits") != 4:
        raise FormatRefused(f"{where}.weights: {weights.get('type')} {weights.get('num_bits')}-bit {FORMAT}")
    if group.get("input_activations") is not None:
        raise FormatRefused(f"{where}.input_activations (INT4 weights with quantized activations)")
    if group.get("output_activations") is not None:
        raise FormatRefused(f"{where}.output_activations")
    if weights.get("dynamic"):
        raise FormatRefused(f"{where}.weights.dynamic {weights.get('dynamic')!r}")
    strategy = weights.get("strategy")
    if strategy == "group":
        size = group_size_of(weights.get("group_size"), f"{where}.weights.group_size")
    elif strategy == "channel":
        size = -1
    else:
        raise FormatRefused(f"{where}.weights.strategy {strategy!r} with INT4 weights")
    actorder = weights.get("actorder")
    if actorder not in (None, "static", "weight", "group"):  # "weight"/"static": the order is the quantizer's alone
        raise FormatRefused(f"{where}.weights.actorder {actorder!r}")
    return Int4Scheme(size, bool(weights.get("symmetric", True)), act_order=actorder == "group")


class CompressedTensorsInt4Method(Int4LinearMethod):
    format_name = f"compressed-tensors {FORMAT}"
    g_idx = "weight_g_idx"

    def tensors(self) -> tuple[PackedTensor, ...]:
        # A symmetric scheme's zero point is 0 by definition: one stored beside it anyway is read, not used.
        sym = self.scheme.symmetric
        return (
            PackedTensor("weight_packed", WORDS, output_dim=0, input_dim=1, input_block="word"),
            PackedTensor("weight_scale", SCALES, output_dim=0, input_dim=1, input_block="group"),
            PackedTensor("weight_shape", INDEX, None, None, per_shard=True, shape=(2,)),
            PackedTensor("weight_zero_point", WORDS, 0, 1, output_block="word", input_block="group", optional=sym),
            *([PackedTensor("weight_g_idx", INDEX, None, 0, per_shard=True)] if self.scheme.act_order else []),
        )

    def to_int4(self, t, n, k, group, perm, prefix) -> Int4Linear:
        # weight_shape is the whole weight's (a rank holds a slice): the packed tensors' shapes were checked instead
        zeros = None if self.scheme.symmetric else unpack_words(t["weight_zero_point"], dim=0)[:n]  # eight rows a word
        return int4_form(unpack_int4(t["weight_packed"]), t["weight_scale"], zeros, group, perm, self.scheme.symmetric,
                         prefix)  # fmt: skip
