"""What the INT4 weight-only formats share: the scheme a linear runs (`Int4Scheme`), the base of their configs
(`Int4Config`) and of their linear methods (`Int4LinearMethod`, a method of the one protocol, quant/protocol.py),
and the unpacking and act-order arithmetic each release layout is read with. Owns nothing.

Each format module (compressed_tensors.py, gptq.py, awq.py) says only how its release lays the tensors out: a table
of its tensors (`PackedTensor`: which dims follow the weight's rows and columns, and how many of them one entry
covers: 8 for a packed word, the group for a scale or a zero point), so a tensor-parallel rank reads its slice of
each straight from the checkpoint (a split that cuts a word or a group refused in one line), and `to_int4`, which
turns one logical output's tensors into the one in-memory form, `packed.Int4Linear`. Everything after that is
common: `process_after_loading` dequantizes it to the model dtype (the default: the CPU, and CUDA until the W4A16
GEMMs are tuned), or with `keep_packed` keeps it packed (`keeps_int4`: CBQ_INT4_PACKED=1 on CUDA), and `apply` runs
`int4/linear.py`'s `int4_linear` (the W4A16 GEMM on CUDA, dequantize + F.linear elsewhere) or F.linear.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..base import FIELD, FormatRefused, QuantCheckpointError, QuantConfig
from ..protocol import (
    LinearLoadError,
    LinearMethod,
    LinearSizes,
    ParamSplit,
    add_parameter,
    load_whole_linear,
    split_of,
)
from .linear import int4_linear as int4_gemm
from .packed import PACK, Int4Linear, dequantize, pack_int4

_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)  # bit offset of the i-th 4-bit value of a word
WORDS, SCALES, INDEX = "int32 words", "scales", "integers"  # what a packed tensor holds (its dtype's check)


class Int4CheckpointError(LinearLoadError, QuantCheckpointError):
    """A checkpoint's INT4 tensors do not match its quantization_config; the message names the tensor."""


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


@dataclass(frozen=True)
class PackedTensor:
    """One tensor of a release's linear: its name under the linear's prefix, what it holds, and how it follows the
    weight [N, K] (`ParamSplit`; block "word": 8 values a word, "group": the scheme's group). `shape`: a fixed shape
    that follows neither (compressed-tensors' weight_shape)."""

    name: str
    holds: str  # WORDS, SCALES or INDEX
    output_dim: int | None
    input_dim: int | None
    output_block: str = ""  # "", "word" or "group"
    input_block: str = ""
    per_shard: bool = False  # one per logical output of a merged layer (g_idx, weight_shape)
    optional: bool = False
    shape: tuple[int, ...] | None = None

    def split(self, group: int) -> ParamSplit:
        blocks = {"": 1, "word": PACK, "group": group}
        what = "groups" if "group" in (self.output_block, self.input_block) else "packed words"
        return ParamSplit(self.output_dim, self.input_dim, blocks[self.output_block], blocks[self.input_block],
                          self.per_shard, what=f"INT4 {what}", optional=self.optional)  # fmt: skip

    def shape_for(self, split: ParamSplit, n: int, k: int) -> tuple[int, ...]:
        """Its shape for a weight of [n, k] (one logical output's)."""
        if self.shape is not None:
            return self.shape
        dims = [d for d in (split.output_dim, split.input_dim) if d is not None]
        shape = [0] * (max(dims) + 1)
        if split.output_dim is not None:
            shape[split.output_dim] = split.entries(n, split.output_block)
        if split.input_dim is not None:
            shape[split.input_dim] = split.entries(k, split.input_block)
        return tuple(shape)


class Int4LinearMethod(LinearMethod):
    """One INT4 format's linears through the protocol. A format names its tensors (`tensors`) and turns one logical
    output's into an `Int4Linear` (`to_int4`); `keep_packed`: the layer keeps them packed (the W4A16 GEMMs) rather
    than dequantized to the model dtype after loading."""

    format_name = ""
    g_idx = ""  # the name of the tensor giving each input column's group, where the format has one

    def __init__(self, scheme: Int4Scheme, keep_packed: bool = False):
        self.scheme = scheme
        self.keep_packed = keep_packed

    @classmethod
    def for_config(cls, config: QuantConfig, scheme: Int4Scheme) -> Int4LinearMethod:
        """The method of one linear of `config` (a format whose layout has config-wide switches reads them here)."""
        return cls(scheme)

    def kept(self, keep_packed: bool) -> Int4LinearMethod:
        """This method, its layers kept packed or dequantized after loading."""
        method = copy.copy(self)
        method.keep_packed = keep_packed
        return method

    # -- what a format says
    def tensors(self) -> tuple[PackedTensor, ...]:
        """The release's tensors of one linear, its packed weight first."""
        raise NotImplementedError

    def to_int4(
        self, t: Mapping[str, torch.Tensor], n: int, k: int, group: int, perm: torch.Tensor | None, prefix: str
    ) -> Int4Linear:
        """One logical output's tensors (by the names of `tensors`, shapes already checked) of a weight [n, k]
        (`perm`: its act-order column order, from `g_idx`) as the one form."""
        raise NotImplementedError

    # -- the protocol
    def create_weights(self, layer, sizes, dtype, device) -> None:
        # a whole row's group when the scheme has one group a row (`input_size`: a parallel layer's whole columns)
        group = getattr(layer, "input_size", sizes.input_size) if self.scheme.group_size == -1 else self.scheme.group_size
        layer.int4_group, layer.int4_sizes, layer.compute_dtype = group, sizes, dtype
        layer.int4_prefixes = []  # each logical output's linear, as loaded (for the messages)
        for spec in self.tensors():
            split = spec.split(group)
            shape = spec.shape_for(split, sizes.output_size, sizes.input_size)
            if spec.per_shard:
                shape = (len(sizes.output_sizes), *shape)
            held = torch.float32 if spec.holds == SCALES else torch.int32 if spec.holds == WORDS else torch.int64
            # -1: an optional index the checkpoint left out (`to_int4` sees it absent)
            add_parameter(layer, spec.name, torch.full(shape, -1, dtype=held, device=device), split)

    def load_tensor(self, layer, name, tensor, what, part):
        prefix = what.rpartition(".")[0]
        if not layer.int4_prefixes or layer.int4_prefixes[-1] != prefix:
            layer.int4_prefixes.append(prefix)
        spec = next(s for s in self.tensors() if s.name == name)
        split = split_of(layer.get_parameter(name))
        shape = spec.shape_for(split, *part)
        if spec.holds == WORDS:
            return expect(tensor, what, shape, torch.int32)
        expect(tensor, what, shape)
        if spec.holds == SCALES and not tensor.is_floating_point():
            raise Int4CheckpointError(f"{what} is {tensor.dtype}; INT4 scales are bf16, fp16 or fp32")
        if spec.holds == INDEX and (tensor.is_floating_point() or tensor.is_complex()):
            raise Int4CheckpointError(f"{what} is {tensor.dtype}; an integer tensor expected")
        return tensor  # scales are held in fp32: the releases' fp16 and bf16 exactly

    def process_after_loading(self, layer) -> None:
        """Each logical output's tensors as an `Int4Linear`; then kept packed (scales in the model dtype, as the
        W4A16 GEMMs read them), or the weight dequantized to the model dtype."""
        sizes: LinearSizes = layer.int4_sizes
        names = layer.int4_prefixes
        names = names if len(names) == len(sizes.output_sizes) else names[:1] * len(sizes.output_sizes)  # fused
        split_columns = getattr(layer, "input_size", sizes.input_size) != sizes.input_size  # a row-parallel rank's
        if sizes.input_size % layer.int4_group:
            raise Int4CheckpointError(f"{names[0]}: K={sizes.input_size} is not a multiple of the group size {layer.int4_group}")
        parts: list[Int4Linear] = []
        for t, n, prefix in zip(_per_output(layer, self, sizes), sizes.output_sizes, names, strict=True):
            g_idx = t.get(self.g_idx) if self.g_idx else None
            perm = self._perm(g_idx, layer.int4_group, split_columns, f"{prefix}.{self.g_idx}")
            parts.append(self.to_int4(t, n, sizes.input_size, layer.int4_group, perm, prefix))
        for spec in self.tensors():
            layer.register_parameter(spec.name, None)
        if self.keep_packed:
            dtype = layer.compute_dtype
            layer.int4_parts = [Int4Linear(p.qweight, p.scales.to(dtype), p.zeros, p.group_size, p.perm) for p in parts]
        else:
            weight = torch.cat([dequantize(p, layer.compute_dtype) for p in parts])
            layer.weight = nn.Parameter(weight, requires_grad=False)

    def apply(self, layer, x, bias):
        if not self.keep_packed:
            return F.linear(x, layer.weight, bias)
        shape, parts = x.shape, layer.int4_parts
        x = x.reshape(-1, shape[-1])
        if len(parts) == 1:
            y = int4_gemm(x, parts[0], bias)
        else:  # one GEMM an output (their act-order permutations may differ); the model's modules fuse what they can
            y = torch.cat([int4_gemm(x, p) for p in parts], dim=-1)
            y = y if bias is None else y + bias
        return y.reshape(*shape[:-1], y.shape[-1])

    # -- one whole linear (a world of one), through the protocol
    def load(self, tensors: Mapping[str, torch.Tensor], prefix: str) -> Int4Linear:
        """Linear `prefix` whole, as the one form (scales in fp32), its [N, K] read off its packed weight."""
        packed = self.tensors()[0]
        split, what = packed.split(1), f"{prefix}.{packed.name}"  # a packed weight's blocks are words, not groups
        words = get(tensors, what)
        if words.dim() != 2 or split.output_dim is None or split.input_dim is None:
            raise Int4CheckpointError(f"{what} is {list(words.shape)}; packed INT4 words are 2-D")
        n = words.shape[split.output_dim] * split.output_block
        k = words.shape[split.input_dim] * split.input_block
        layer = load_whole_linear(
            self.kept(True), tensors, prefix, (n, k), torch.float32, missing=Int4CheckpointError, device=words.device
        )
        parts: list[Int4Linear] = layer.int4_parts  # type: ignore[assignment]
        return parts[0]

    def dequantize(self, layer: Int4Linear, dtype: torch.dtype) -> torch.Tensor:
        return dequantize(layer, dtype)

    def _perm(self, g_idx: torch.Tensor | None, group: int, split_columns: bool, name: str) -> torch.Tensor | None:
        """`Int4Linear.perm` from one output's `g_idx` (the input columns' groups; all -1: the checkpoint has none),
        None where the groups are in order. An act-order one of a layer holding a rank's slice of the columns
        (row-parallel) is refused: its groups are spread over every rank's columns."""
        if g_idx is None or bool((g_idx < 0).all()):
            if self.scheme.act_order:
                raise Int4CheckpointError(f"the checkpoint has no {name}, which act-order needs")
            return None
        first = int(g_idx[0]) if g_idx.numel() else 0  # a rank's slice starts on a group: its first group
        if torch.equal(g_idx.long() - first, torch.arange(g_idx.numel(), device=g_idx.device) // group):
            return None
        if split_columns:
            raise LinearLoadError(
                f"tensor parallelism: {name} (act-order) spreads each group over every rank's input columns: an "
                f"act-order checkpoint runs with --tensor-parallel-size 1"
            )
        return act_order_perm(g_idx, group, name)


def _per_output(layer: nn.Module, method: Int4LinearMethod, sizes: LinearSizes) -> list[dict[str, torch.Tensor]]:
    """Each logical output's part of each parameter (its rows' entries; a per-output one's own)."""
    parts: list[dict[str, torch.Tensor]] = [{} for _ in sizes.output_sizes]
    for spec in method.tensors():
        param = layer.get_parameter(spec.name)
        split = split_of(param)
        start = 0
        for i, size in enumerate(sizes.output_sizes):
            if split.output_dim is not None:
                count = split.entries(size, split.output_block)
                parts[i][spec.name] = param.data.narrow(split.output_dim, start, count)
                start += count
            else:
                parts[i][spec.name] = param.data[i] if split.per_shard else param.data
    return parts


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
        raise Int4CheckpointError(f"the checkpoint has no {name}, which its quantization_config needs")
    return tensors[name]


def expect(tensor: torch.Tensor, name: str, shape: tuple[int, ...], dtype: torch.dtype | None = None) -> torch.Tensor:
    """`tensor` as the layout says it ships, or an error naming it."""
    if tuple(tensor.shape) != shape or (dtype is not None and tensor.dtype != dtype):
        want = f"{'' if dtype is None else str(dtype).removeprefix('torch.') + ' '}{list(shape)}"
        have = f"{str(tensor.dtype).removeprefix('torch.')} {list(tensor.shape)}"
        raise Int4CheckpointError(f"{name} is {have}; this layout needs {want}")
    return tensor


def unpack_words(words: torch.Tensor, dim: int) -> torch.Tensor:
    """int32 words holding eight 4-bit values each, value i at bits 4i..4i+3, unpacked along `dim` (which grows
    eight-fold): uint8 values 0..15, value i of word w at index 8w + i."""
    if words.dtype != torch.int32:
        raise Int4CheckpointError(f"packed INT4 words are int32, got {words.dtype}")
    moved = words.movedim(dim, -1)
    values = (moved.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 0xF
    return values.reshape(*moved.shape[:-1], moved.shape[-1] * PACK).movedim(-1, dim).to(torch.uint8)


def act_order_perm(g_idx: torch.Tensor, group_size: int, name: str) -> torch.Tensor | None:
    """`g_idx` [K] (input column k's group) as `Int4Linear.perm`: the columns sorted by group, so that each group is
    one contiguous run; None where the groups already are (k // group_size). Each group must hold group_size columns,
    as GPTQ's act-order and compressed-tensors' actorder "group" write them."""
    k = g_idx.numel()
    g_idx = g_idx.to(torch.int64).reshape(-1)
    in_order = torch.arange(k, device=g_idx.device) // group_size
    if torch.equal(g_idx, in_order):
        return None
    perm = torch.argsort(g_idx, stable=True)
    if not torch.equal(g_idx[perm], in_order):
        raise Int4CheckpointError(f"{name} does not put {group_size} input columns in each group")
    return perm


def int4_form(
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
            raise Int4CheckpointError(f"{name}: the config says symmetric, but its zero points are not all 8")
        zeros = None
    return Int4Linear(pack_int4(q), scales.contiguous(), None if zeros is None else zeros.contiguous(), group_size, perm)
