"""What the INT4 weight-only formats share: the scheme a linear runs (`Int4Scheme`), the base of their configs
(`Int4Config`) and of their method objects (`Int4LinearMethod`, FP8's methods' shape: tensor_names, load,
dequantize, apply), and the unpacking and act-order arithmetic each release layout is read with. Owns nothing.

Each format module (compressed_tensors.py, gptq.py, awq.py) says only how its release lays the tensors out; its
`load` returns the one in-memory form, `packed.Int4Linear`, and everything after that is common: the CPU
dequantizes it at load (models/quant_loader.py), and `apply` is the reference GEMM over the dequantized weight
until the W4A16 kernel takes the packed form on CUDA.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

import torch

from ..base import FIELD, FormatRefused, QuantCheckpointError, QuantConfig
from .packed import PACK, Int4Linear, dequantize, pack_int4

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit offset of the i-th 4-bit value of a word


@dataclass(frozen=True)
class Int4Scheme:
    """How one linear's weight is quantized: 4-bit integers with one scale (and, asymmetric, one zero point) per
    output row and group of `group_size` input columns (-1: one group over the whole row)."""

    group_size: int
    symmetric: bool
    act_order: bool = False  # the groups follow a permutation of the input columns (GPTQ's desc_act, g_idx)


class Int4Config(QuantConfig):
    """Base of the INT4 formats' descriptions; `scheme_for` gives an `Int4Scheme` or None."""

    def scheme_for(self, module_name: str) -> Int4Scheme | None:
        raise NotImplementedError


class Int4LinearMethod:
    """One INT4 format's linears: `load` reads the release's tensors of linear `prefix` into an `Int4Linear`."""

    format_name = ""

    def __init__(self, scheme: Int4Scheme):
        self.scheme = scheme

    @classmethod
    def for_config(cls, config: QuantConfig, scheme: Int4Scheme) -> Int4LinearMethod:
        """The method of one linear of `config` (a format whose layout has config-wide switches reads them here)."""
        return cls(scheme)

    def tensor_names(self, prefix: str) -> list[str]:
        """What `load` reads (the first: the packed weight, whose presence says the linear is stored quantized)."""
        raise NotImplementedError

    def load(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> Int4Linear:
        raise NotImplementedError

    def dequantize(self, layer: Int4Linear, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(layer, dtype)

    def apply(self, layer: Int4Linear, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """The reference W4A16 GEMM: the weight dequantized to x's dtype, then one GEMM."""
        return torch.nn.functional.linear(x, dequantize(layer, x.dtype), bias)


def check_bits(qc: Mapping[str, object], default: int | None = None) -> None:
    """4 bits, or the refusal naming the config's (`default`: what the format's loaders assume when it is absent)."""
    field = "bits"
    bits = qc.get(field, default)
    if bits != 4:
        raise FormatRefused(f"{FIELD}.{field} {bits!r} ({qc.get('quant_method')} at {bits} bits)")


def group_size_of(value: object, where: str) -> int:
    """A config's group size: a positive multiple of 8 (whole packed words per group), or -1 (one group a row)."""
    if value == -1:
        return -1
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0 or value % PACK:
        raise FormatRefused(f"{where} {value!r} (a positive multiple of {PACK}, or -1, expected)")
    return value


def get(tensors: Mapping[str, torch.Tensor], name: str) -> torch.Tensor:
    if name not in tensors:
        raise QuantCheckpointError(f"the checkpoint has no {name}, which its quantization_config needs")
    return tensors[name]


def expect(tensor: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` as the layout says it ships, or an error naming it."""
    if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
        want = f"{'' if dtype is None else str(dtype).removeprefix('torch.') + ' '}{list(shape)}"
        have = f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
        raise QuantCheckpointError(f"{name} is {have}; this layout needs {want}")
    return tensor


def scales_of(tensor: torch.Tensor, name: str) -> torch.Tensor:
    if not tensor.is_floating_point():
        raise QuantCheckpointError(f"{name} is {tensor.dtype}; INT4 scales are bf16, fp16 or fp32")
    return tensor


def unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding eight 4-bit values each, value i at bits 4i..4i+3, unpacked along `dim` (which grows
    eight-fold): uint8 values 0..15, value i of word w at index 8w + i."""
    if words.dtype != torch.int32:
        raise QuantCheckpointError(f"packed INT4 words are int32, got {words.dtype}")
    moved = words.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0xF
    return values.reshape(*moved.shape[:-1], moved.shape[-1] * PACK).movedim(-1, dim).to(torch.uint8)


def act_order_perm(g_idx: torch.Tensor, group_size: int, name: str) -> torch.Tensor | None:
    """`g_idx` [K] (input column k's group) as `Int4Linear.perm`: the columns sorted by group, so that each group is
    one contiguous run; None where the groups already are (k // group_size). Each group must hold group_size columns,
    as GPTQ's act-order and compressed-tensors' actorder "group" write them."""
    k = g_idx.numel()
    g_idx = g_idx.to(torch.int64).reshape(-1)
    in_order = torch.arange(k) // group_size
    if torch.equal(g_idx, in_order):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], in_order):
        raise QuantCheckpointError(f"{name} does not put {group_size} input columns in each group")
    return perm


def int4_linear(
    q: torch.Tensor, scales: torch.Tensor, zeros: torch.Tensor | None, group_size: int, perm: torch.Tensor | None,
    symmetric: bool, name: str,
) -> Int4Linear:
    """The one form from unpacked values `q` [N, K] (0..15, the input's own column order), `scales` [N, K / g] and
    `zeros` [N, K / g] (0..15; None: every zero 8). `perm`: act-order, the columns stored sorted by group. A
    symmetric scheme's zeros must all be 8 (the form then keeps none)."""
    if perm is not None:
        q = q[:, perm]
    if zeros is not None and symmetric:
        if not bool((zeros == 8).all()):
            raise QuantCheckpointError(f"{name}: the config says symmetric, but its zero points are not all 8")
        zeros = None
    return Int4Linear(pack_int4(q), scales.contiguous(), None if zeros is None else zeros.contiguous(), group_size, perm)
