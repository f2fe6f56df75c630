"""FP8 (float8_e4m3fn) arithmetic in plain torch: the CPU path and the reference the kernels are checked
against. Owns `Fp8Linear`, one quantized linear's tensors, and nothing else.

Every quantization here is symmetric, `x ≈ x_fp8 * scale` with an fp32 scale, and rounds the same way the
Triton kernels do (kernels.py): the scale is `max(absmax, MIN_ABSMAX) * (1 / FP8_MAX)`, the value `x / scale` is
clamped to ±FP8_MAX and rounded to nearest even by the cast. The scale multiplies by the reciprocal because torch
on CUDA divides a tensor by a Python number that way (one bit from the division), on the CPU by dividing: a
product is the same bits on the CPU, on CUDA and in Triton, so every path's scales agree.

`fp8_linear_emulated` is the emulation the GPU path is compared with: the input quantized as the scheme says
(dynamic per token or per token group, or static), both operands dequantized to fp32, one fp32 GEMM.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from .config import ActivationScale, Fp8Scheme, WeightScale

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)  # 448
# A row (or group) of zeros still gets a finite, nonzero scale; vLLM's per-token-group kernels use the same.
MIN_ABSMAX = 1e-10


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def to_fp8(scaled: torch.Tensor) -> torch.Tensor:
    """Saturating cast: float8_e4m3fn has no infinity, so anything past ±FP8_MAX must be clamped first."""
    return scaled.clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)


def scale_from_absmax(absmax: torch.Tensor) -> torch.Tensor:
    return absmax.float().clamp(min=MIN_ABSMAX) * (1.0 / FP8_MAX)


# -- activations ------------------------------------------------------------------------------------------


def quantize_per_token(x: torch.Tensor, scale_ub: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale fp32 [M]). `scale_ub` caps a row's absmax (fbgemm's
    activation_scale_ub): an outlier row saturates instead of crushing its other values to zero."""
    absmax = x.abs().amax(dim=-1).float()
    if scale_ub is not None:
        absmax = absmax.clamp(max=scale_ub)
    scale = scale_from_absmax(absmax)
    return to_fp8(x.float() / scale[:, None]), scale


def quantize_per_token_group(x: torch.Tensor, group_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (x_fp8 [M, K], scale fp32 [M, ceil(K / group_size)]): one scale per row and per group of
    `group_size` columns (the last group may be shorter)."""
    m, k = x.shape
    num_groups = _cdiv(k, group_size)
    padded = torch.nn.functional.pad(x.float(), (0, num_groups * group_size - k))  # zeros leave absmax alone
    groups = padded.view(m, num_groups, group_size)
    scale = scale_from_absmax(groups.abs().amax(dim=-1))
    x_fp8 = to_fp8(groups / scale[:, :, None]).view(m, -1)[:, :k]
    return x_fp8.contiguous(), scale


def quantize_static(x: torch.Tensor, input_scale: torch.Tensor) -> torch.Tensor:
    """x [M, K] with the checkpoint's calibrated per-tensor scale (fp32 [])."""
    return to_fp8(x.float() / input_scale)


def dequantize_groups(x_fp8: torch.Tensor, scale: torch.Tensor, group_size: int) -> torch.Tensor:
    """Inverse of `quantize_per_token_group`, in fp32."""
    expanded = scale.repeat_interleave(group_size, dim=-1)[:, : x_fp8.shape[1]]
    return x_fp8.float() * expanded


# -- weights ----------------------------------------------------------------------------------------------


def quantize_weight_per_channel(
    weight: torch.Tensor, absmax: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_fp8 [N, K], scale fp32 [N]): `--quantization fp8` at load, as vLLM does it per channel.
    `absmax` [N]: each row's absmax when `weight` is only part of the row (a row-parallel rank's columns: the
    largest over every rank's, so that the scale is the whole row's, as in one process)."""
    scale = scale_from_absmax(weight.abs().amax(dim=-1) if absmax is None else absmax)
    return to_fp8(weight.float() / scale[:, None]), scale


def quantize_weight_per_tensor(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    scale = scale_from_absmax(weight.abs().amax())
    return to_fp8(weight.float() / scale), scale


def quantize_weight_blocks(weight: torch.Tensor, block_shape: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (w_fp8 [N, K], scale fp32 [ceil(N / bn), ceil(K / bk)]): the block-wise releases' layout."""
    (n, k), (bn, bk) = weight.shape, block_shape
    nb, kb = _cdiv(n, bn), _cdiv(k, bk)
    padded = torch.nn.functional.pad(weight.float(), (0, kb * bk - k, 0, nb * bn - n))
    blocks = padded.view(nb, bn, kb, bk)
    scale = scale_from_absmax(blocks.abs().amax(dim=(1, 3)))
    w_fp8 = to_fp8(blocks / scale[:, None, :, None]).view(nb * bn, kb * bk)[:n, :k]
    return w_fp8.contiguous(), scale


def expand_block_scale(scale: torch.Tensor, block_shape: tuple[int, int], n: int, k: int) -> torch.Tensor:
    """[ceil(N / bn), ceil(K / bk)] block scales -> one scale per weight element [N, K]."""
    bn, bk = block_shape
    return scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]


@dataclass(frozen=True)
class Fp8Linear:
    """One quantized linear: what a method's `load` returns and its `apply` runs.

    weight        float8_e4m3fn [N, K] (out, in), as the checkpoints store it
    weight_scale  fp32: [] (TENSOR), [N] (CHANNEL) or [ceil(N / bn), ceil(K / bk)] (BLOCK); w ≈ weight * scale
    input_scale   fp32 [] for STATIC activations, else None
    """

    weight: torch.Tensor
    weight_scale: torch.Tensor
    scheme: Fp8Scheme
    input_scale: torch.Tensor | None = None

    def __post_init__(self) -> None:
        n, k = self.weight.shape
        assert self.weight.dtype == FP8_DTYPE, f"FP8 weight expected, got {self.weight.dtype}"
        assert self.weight_scale.dtype == torch.float32, "scales are kept in fp32"
        assert tuple(self.weight_scale.shape) == weight_scale_shape(self.scheme, n, k), (
            f"weight scale {tuple(self.weight_scale.shape)} for a {self.scheme.weight.value}-scaled [{n}, {k}] weight"
        )
        is_static = self.scheme.activation is ActivationScale.STATIC
        assert is_static == (self.input_scale is not None), "an input scale goes with static activations"
        assert self.input_scale is None or self.input_scale.shape == (), "the input scale is per tensor"

    @property
    def out_features(self) -> int:
        return self.weight.shape[0]

    @property
    def in_features(self) -> int:
        return self.weight.shape[1]

    def to(self, device: torch.device | str) -> Fp8Linear:
        move = (lambda t: None if t is None else t.to(device))  # noqa: E731
        return replace(
            self, weight=self.weight.to(device), weight_scale=self.weight_scale.to(device),
            input_scale=move(self.input_scale),
        )

    @staticmethod
    def concat(parts: list[Fp8Linear]) -> Fp8Linear:
        """Linears that read the same input (q/k/v, gate/up) stacked along N, for one GEMM.

        Per-tensor weight scales that differ become per-channel ones (exact). Static input scales are the
        calibrated scale of the same input, so the releases ship them equal; if they are not, the largest is
        used, as vLLM does (no value saturates; the others lose a little precision)."""
        scheme = parts[0].scheme
        assert all(p.scheme == scheme for p in parts), "fused linears share one scheme"
        assert len({p.in_features for p in parts}) == 1, "fused linears read the same input"
        weight = torch.cat([p.weight for p in parts], dim=0)
        input_scale = None
        if scheme.activation is ActivationScale.STATIC:
            input_scale = torch.stack([p.input_scale for p in parts if p.input_scale is not None]).amax()
        if scheme.weight is WeightScale.BLOCK:
            assert scheme.block_shape is not None
            bn = scheme.block_shape[0]
            assert all(p.out_features % bn == 0 for p in parts[:-1]), "block rows must not straddle two linears"
            return Fp8Linear(weight, torch.cat([p.weight_scale for p in parts]), scheme, input_scale)
        if scheme.weight is WeightScale.TENSOR:
            scales = torch.stack([p.weight_scale for p in parts])
            if bool((scales == scales[0]).all()):
                return Fp8Linear(weight, scales[0].clone(), scheme, input_scale)
            scheme = replace(scheme, weight=WeightScale.CHANNEL)
        per_row = [p.weight_scale.expand(p.out_features) for p in parts]
        return Fp8Linear(weight, torch.cat(per_row).contiguous(), scheme, input_scale)


@dataclass(frozen=True)
class Fp8Rows:
    """Activations already quantized per token: e4m3 rows [M, K] and their fp32 scales [M], for a GEMM whose
    output is in `dtype` (the model's). The kernel before the GEMM makes them (a norm: small_step.fp8_add_rmsnorm;
    act·mul: kernels.act_mul_per_token_quant), so the GEMM needs no quantization launch; every FP8 GEMM of a
    layer that `takes_rows` reads them as they are (the same bits as quantizing the unquantized rows itself)."""

    x: torch.Tensor
    scale: torch.Tensor
    dtype: torch.dtype

    @property
    def shape(self) -> torch.Size:
        return self.x.shape

    @property
    def device(self) -> torch.device:
        return self.x.device

    def stride(self, dim: int) -> int:
        return self.x.stride(dim)


def takes_rows(layer: Fp8Linear) -> bool:
    """Whether the layer's FP8 GEMMs can read `Fp8Rows`: activations quantized per token at run time, weights per
    channel or per tensor (block-wise weights quantize per token group; static activations have one scale)."""
    return layer.scheme.activation is ActivationScale.TOKEN and layer.scheme.weight is not WeightScale.BLOCK


def weight_scale_shape(scheme: Fp8Scheme, n: int, k: int) -> tuple[int, ...]:
    if scheme.weight is WeightScale.TENSOR:
        return ()
    if scheme.weight is WeightScale.CHANNEL:
        return (n,)
    assert scheme.block_shape is not None
    return (_cdiv(n, scheme.block_shape[0]), _cdiv(k, scheme.block_shape[1]))


def dequantize_weight(layer: Fp8Linear, dtype: torch.dtype) -> torch.Tensor:
    """The weight in `dtype`: products taken in fp32, rounded once."""
    w, scale = layer.weight.float(), layer.weight_scale
    if layer.scheme.weight is WeightScale.TENSOR:
        w = w * scale
    elif layer.scheme.weight is WeightScale.CHANNEL:
        w = w * scale[:, None]
    else:
        assert layer.scheme.block_shape is not None
        w = w * expand_block_scale(scale, layer.scheme.block_shape, *w.shape)
    return w.to(dtype)


def quantize_input(x: torch.Tensor, layer: Fp8Linear) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] quantized as the layer's scheme says: (x_fp8, scale) with scale [M] (TOKEN),
    [M, groups] (TOKEN_GROUP) or [] (STATIC)."""
    scheme = layer.scheme
    if scheme.activation is ActivationScale.TOKEN:
        return quantize_per_token(x, scheme.activation_scale_ub)
    if scheme.activation is ActivationScale.TOKEN_GROUP:
        return quantize_per_token_group(x, scheme.group_size)
    assert layer.input_scale is not None
    return quantize_static(x, layer.input_scale), layer.input_scale


def dequantize_input(x_fp8: torch.Tensor, scale: torch.Tensor, scheme: Fp8Scheme) -> torch.Tensor:
    if scheme.activation is ActivationScale.TOKEN_GROUP:
        return dequantize_groups(x_fp8, scale, scheme.group_size)
    if scheme.activation is ActivationScale.TOKEN:
        return x_fp8.float() * scale[:, None]
    return x_fp8.float() * scale


def fp8_linear_emulated(
    x: torch.Tensor | Fp8Rows,
    layer: Fp8Linear,
    bias: torch.Tensor | None = None,
    out_dtype: torch.dtype | None = None,
) -> torch.Tensor:
    """The reference for the FP8 GEMMs: x quantized per the scheme, both operands dequantized, then the GEMM.

    On the CPU the GEMM runs in fp64 and is rounded to fp32 once: the sum no longer depends on how the BLAS
    blocks it, so a fused q/k/v GEMM (the owned decoder) and three separate ones (transformers' modules) give
    the same bits on every machine. In fp32 they differed in the last bit on some CPUs, and the next layer's
    e4m3 re-quantization turned that into different greedy tokens. On a GPU (the path of pre-sm89 devices and
    the kernels' reference) it stays fp32. `Fp8Rows` are read as they are (`takes_rows` layers)."""
    if isinstance(x, Fp8Rows):
        assert takes_rows(layer), "per-token rows reach only layers that quantize per token"
        x_fp8, x_scale, dtype = x.x, x.scale, x.dtype
        lead: tuple[int, ...] = (x.shape[0],)
    else:
        x_fp8, x_scale = quantize_input(x.reshape(-1, layer.in_features), layer)
        dtype, lead = x.dtype, tuple(x.shape[:-1])
    acc = torch.float64 if x.device.type == "cpu" else torch.float32
    x_deq = dequantize_input(x_fp8, x_scale, layer.scheme).to(acc)
    out = (x_deq @ dequantize_weight(layer, torch.float32).to(acc).t()).float()
    if bias is not None:
        out = out + bias.float()
    return out.to(out_dtype or dtype).reshape(*lead, layer.out_features)
