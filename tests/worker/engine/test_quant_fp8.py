"""FP8 arithmetic and the per-format methods (worker/engine/quant/fp8.py, methods.py) on the CPU: quantization
rounds as float8_e4m3fn does, dequantization matches transformers' own and the dense weights within FP8's
precision, scale layouts are read as the releases ship them, and fused linears dequantize to the stacked parts."""

from __future__ import annotations

import pytest
import torch

from worker.engine.quant import (
    ActivationScale,
    Fp8CheckpointError,
    Fp8Linear,
    Fp8Scheme,
    WeightScale,
    linear_method,
)
from worker.engine.quant.config import BlockFp8Config, OnlineFp8Config, checkpoint_quantization
from worker.engine.quant.fp8 import (
    FP8_DTYPE,
    FP8_MAX,
    dequantize_groups,
    dequantize_weight,
    fp8_linear_emulated,
    quantize_per_token,
    quantize_per_token_group,
    quantize_weight_blocks,
    quantize_weight_per_channel,
    quantize_weight_per_tensor,
)

BLOCK = Fp8Scheme(WeightScale.BLOCK, ActivationScale.TOKEN_GROUP, block_shape=(128, 128))
CHANNEL = Fp8Scheme(WeightScale.CHANNEL, ActivationScale.TOKEN)
TENSOR_STATIC = Fp8Scheme(WeightScale.TENSOR, ActivationScale.STATIC)
# e4m3 keeps 3 mantissa bits: a value rounds to within 2^-4 of itself, relative (normal range)
FP8_REL = 2.0**-4


def test_the_fp8_format():
    assert FP8_MAX == 448.0 and FP8_DTYPE == torch.float8_e4m3fn


def test_per_token_scales_rows_to_the_fp8_range_and_caps_outliers():
    torch.manual_seed(0)
    x = torch.randn(5, 300) * torch.tensor([1e-3, 1.0, 30.0, 1e4, 0.0])[:, None]
    x_fp8, scale = quantize_per_token(x)
    assert x_fp8.dtype == FP8_DTYPE and scale.shape == (5,) and scale.dtype == torch.float32
    assert torch.equal(x_fp8[:4].float().abs().amax(dim=1), torch.full((4,), FP8_MAX))  # each row's max maps to 448
    assert torch.equal(x_fp8[4].float(), torch.zeros(300)) and scale[4] > 0  # a zero row keeps a finite scale
    back = x_fp8.float() * scale[:, None]
    assert ((back - x).abs() <= FP8_REL * x.abs() + scale[:, None] * 2**-9).all()  # 2^-9: e4m3's subnormal step
    capped, capped_scale = quantize_per_token(x, scale_ub=100.0)
    # the cap times fp32(1 / 448): scales multiply by the reciprocal, as torch's CUDA division by a number does
    assert capped_scale[3] == torch.tensor(100.0) * (1.0 / FP8_MAX) and capped_scale[2] == scale[2]
    assert capped[3].float().abs().max() == FP8_MAX  # saturated, not inf/nan


def test_per_token_group_quantization_has_a_scale_per_group_and_a_short_last_group():
    torch.manual_seed(0)
    x = torch.randn(3, 300)
    x[:, 128:256] *= 50  # the middle group alone is large: its scale must not spoil the others
    x_fp8, scale = quantize_per_token_group(x, 128)
    assert scale.shape == (3, 3)
    assert torch.allclose(scale[:, 1] / scale[:, 0], x[:, 128:256].abs().amax(1) / x[:, :128].abs().amax(1))
    back = dequantize_groups(x_fp8, scale, 128)
    assert ((back - x).abs() <= FP8_REL * x.abs() + 1e-6 * scale.amax()).all()


@pytest.mark.parametrize("quantize", ["blocks", "channel", "tensor"])
def test_weights_dequantize_to_within_fp8_precision(quantize):
    torch.manual_seed(0)
    w = torch.randn(300, 200) * torch.linspace(0.1, 10, 300)[:, None]  # rows of different sizes
    if quantize == "blocks":
        w_fp8, scale = quantize_weight_blocks(w, (128, 128))
        assert scale.shape == (3, 2)  # ceil(300 / 128), ceil(200 / 128): the releases' layout
        layer = Fp8Linear(w_fp8, scale, BLOCK)
    elif quantize == "channel":
        w_fp8, scale = quantize_weight_per_channel(w)
        layer = Fp8Linear(w_fp8, scale, CHANNEL)
    else:
        w_fp8, scale = quantize_weight_per_tensor(w)
        layer = Fp8Linear(w_fp8, scale, TENSOR_STATIC, input_scale=torch.tensor(0.01))
    back = dequantize_weight(layer, torch.float32)
    subnormal_step = 2**-9 * scale.max()
    assert ((back - w).abs() <= FP8_REL * w.abs() + subnormal_step).all()
    assert dequantize_weight(layer, torch.bfloat16).dtype == torch.bfloat16


@pytest.mark.parametrize("block", [(128, 128), (64, 32)])
def test_block_dequantization_matches_transformers(block):
    """transformers' own dequantization of `weight_scale_inv` (its FP8 integration's backward path) is an
    independent reading of the block layout, partial blocks included."""
    from transformers.integrations.finegrained_fp8 import _dequantize_fp8_weight

    torch.manual_seed(0)
    w_fp8, scale = quantize_weight_blocks(torch.randn(300, 200) * torch.rand(300, 1) * 10, block)
    scheme = Fp8Scheme(WeightScale.BLOCK, ActivationScale.TOKEN_GROUP, block_shape=block)
    ours = dequantize_weight(Fp8Linear(w_fp8, scale, scheme), torch.float32)
    assert torch.equal(ours, _dequantize_fp8_weight(w_fp8, scale, list(block), torch.float32))


def test_the_emulation_is_dequantized_operands_and_one_fp32_gemm():
    torch.manual_seed(0)
    w_fp8, scale = quantize_weight_per_channel(torch.randn(64, 96))
    layer = Fp8Linear(w_fp8, scale, CHANNEL)
    x = torch.randn(2, 3, 96, dtype=torch.bfloat16)
    bias = torch.randn(64)
    out = fp8_linear_emulated(x, layer, bias)
    assert out.shape == (2, 3, 64) and out.dtype == torch.bfloat16
    x_fp8, x_scale = quantize_per_token(x.reshape(6, 96))
    by_hand = (x_fp8.float() * x_scale[:, None]) @ (w_fp8.float() * scale[:, None]).t() + bias
    assert torch.equal(out.reshape(6, 64), by_hand.to(torch.bfloat16))
    # close to the dense product: FP8 on both sides
    dense = x.float().reshape(6, 96) @ dequantize_weight(layer, torch.float32).t() + bias
    assert (out.reshape(6, 64).float() - dense).abs().max() < 0.1 * dense.abs().max()


def test_static_activations_use_the_checkpoint_scale():
    w_fp8, scale = quantize_weight_per_tensor(torch.randn(32, 48))
    layer = Fp8Linear(w_fp8, scale, TENSOR_STATIC, input_scale=torch.tensor(0.5 / FP8_MAX))
    x = torch.tensor([[0.25] * 47 + [3.0]])
    out = fp8_linear_emulated(x, layer)
    # 3.0 is past the calibrated range (0.5): it saturates to 0.5
    expected = (torch.tensor([[0.25] * 47 + [0.5]]) @ dequantize_weight(layer, torch.float32).t())
    assert torch.allclose(out, expected, rtol=1e-6, atol=1e-6)  # the emulation sums in fp64 on the CPU


def test_fused_linears_dequantize_to_their_stacked_parts():
    torch.manual_seed(0)
    parts = [torch.randn(n, 256) * s for n, s in ((256, 1.0), (128, 5.0), (128, 0.2))]  # q, k, v
    for make in (
        lambda w: Fp8Linear(*quantize_weight_blocks(w, (128, 128)), BLOCK),
        lambda w: Fp8Linear(*quantize_weight_per_channel(w), CHANNEL),
        lambda w: Fp8Linear(*quantize_weight_per_tensor(w), TENSOR_STATIC, input_scale=torch.tensor(0.01)),
    ):
        linears = [make(w) for w in parts]
        fused = Fp8Linear.concat(linears)
        assert fused.out_features == 512
        expected = torch.cat([dequantize_weight(lin, torch.float32) for lin in linears])
        assert torch.equal(dequantize_weight(fused, torch.float32), expected)
    assert fused.scheme.weight is WeightScale.CHANNEL  # per-tensor scales that differ: one per row instead


def _tensors(prefix: str, **named) -> dict[str, torch.Tensor]:
    return {f"{prefix}.{name}": t for name, t in named.items()}


def test_methods_read_the_scale_layouts_the_releases_ship():
    torch.manual_seed(0)
    w = torch.randn(256, 384)
    prefix = "model.layers.0.mlp.up_proj"
    # Qwen3-FP8: weight_scale_inv in bf16, [2, 3]
    w_fp8, scale = quantize_weight_blocks(w, (128, 128))
    method = linear_method(BlockFp8Config((128, 128)), prefix)
    layer = method.load(_tensors(prefix, weight=w_fp8, weight_scale_inv=scale.bfloat16()), prefix)
    assert layer.weight_scale.dtype == torch.float32 and layer.weight_scale.shape == (2, 3)
    assert method.tensor_names(prefix) == [f"{prefix}.weight", f"{prefix}.weight_scale_inv"]
    # compressed-tensors channel: [N, 1]; static per-tensor: weight_scale and input_scale [1]
    from tests.fixtures.fp8_checkpoints import quantization_config

    w_fp8, scale = quantize_weight_per_channel(w)
    channel = checkpoint_quantization(quantization_config("ct-channel-dynamic", 2))
    layer = linear_method(channel, prefix).load(_tensors(prefix, weight=w_fp8, weight_scale=scale[:, None]), prefix)
    assert layer.weight_scale.shape == (256,)
    w_fp8, scale = quantize_weight_per_tensor(w)
    static = linear_method(checkpoint_quantization(quantization_config("ct-tensor-static", 2)), prefix)
    tensors = _tensors(prefix, weight=w_fp8, weight_scale=scale.reshape(1), input_scale=torch.tensor([0.02]))
    layer = static.load(tensors, prefix)
    assert layer.weight_scale.shape == () and layer.input_scale == torch.tensor(0.02)
    assert static.tensor_names(prefix)[-1] == f"{prefix}.input_scale"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"weight_scale_inv": torch.ones(2, 2)}, "weight_scale_inv has shape [2, 2]; block-scaled FP8 of a [256, 384] weight needs [2, 3]"),
        ({"weight_scale_inv": None}, "the checkpoint has no model.layers.0.mlp.up_proj.weight_scale_inv"),
        ({"weight": torch.zeros(256, 384, dtype=torch.bfloat16)}, "weight is torch.bfloat16 [256, 384]"),
        ({"weight_scale_inv": torch.zeros(2, 3)}, "holds a scale that is not a positive finite number"),
        ({"weight_scale_inv": torch.ones(2, 3, dtype=torch.int32)}, "weight_scale_inv is torch.int32"),
    ],
)
def test_a_tensor_that_does_not_fit_its_format_is_named(change, message):
    prefix = "model.layers.0.mlp.up_proj"
    w_fp8, scale = quantize_weight_blocks(torch.randn(256, 384), (128, 128))
    tensors = {"weight": w_fp8, "weight_scale_inv": scale, **change}
    method = linear_method(BlockFp8Config((128, 128)), prefix)
    with pytest.raises(Fp8CheckpointError, match=message.replace("[", r"\[").replace("]", r"\]")):
        method.load(_tensors(prefix, **{k: v for k, v in tensors.items() if v is not None}), prefix)


def test_online_quantization_reads_a_dense_weight():
    prefix = "model.layers.0.self_attn.o_proj"
    w = torch.randn(64, 64, dtype=torch.bfloat16)
    method = linear_method(OnlineFp8Config(), prefix)
    layer = method.load({f"{prefix}.weight": w}, prefix)
    assert layer.scheme == CHANNEL and layer.weight.dtype == FP8_DTYPE
    assert ((dequantize_weight(layer, torch.float32) - w.float()).abs() <= FP8_REL * w.float().abs() + 1e-3).all()
    with pytest.raises(Fp8CheckpointError, match="quantizes a 2-D bf16, fp16 or fp32 weight"):
        method.load({f"{prefix}.weight": layer.weight}, prefix)


def test_the_state_dict_skips_kv_scales_and_names_what_the_config_does_not_account_for():
    from worker.engine.models.quant_loader import dequantize_state_dict
    from worker.engine.quant.config import CompressedTensorsFp8Config

    channel = CompressedTensorsFp8Config(((("Linear",), CHANNEL),), ignore=("lm_head",))
    w_fp8, scale = quantize_weight_per_channel(torch.randn(32, 16))
    tensors = {
        "model.layers.0.mlp.up_proj.weight": w_fp8,
        "model.layers.0.mlp.up_proj.weight_scale": scale[:, None].bfloat16(),
        "model.layers.0.self_attn.k_scale": torch.tensor(0.1),  # a kv_cache_scheme's: skipped
        "model.norm.weight": torch.ones(16, dtype=torch.bfloat16),
        "lm_head.weight": torch.randn(8, 16, dtype=torch.bfloat16),
    }
    linears = ["model.layers.0.mlp.up_proj", "lm_head"]
    state = dequantize_state_dict(tensors, channel, torch.float32, linears)
    assert sorted(state) == ["lm_head.weight", "model.layers.0.mlp.up_proj.weight", "model.norm.weight"]
    assert all(t.dtype == torch.float32 for t in state.values())
    assert torch.equal(state["model.layers.0.mlp.up_proj.weight"], w_fp8.float() * scale[:, None].bfloat16().float())
    tensors["lm_head.weight"] = torch.zeros(8, 16, dtype=FP8_DTYPE)  # FP8, but the config ignores lm_head
    with pytest.raises(Fp8CheckpointError, match="has lm_head.weight .*leaves lm_head unquantized"):
        dequantize_state_dict(tensors, channel, torch.float32, linears)
