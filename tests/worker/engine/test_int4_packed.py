"""cbq's in-memory INT4 form (quant/int4/packed.py): packing round-trips, dequantization, act-order columns."""

import pytest
import torch

from worker.engine.quant.int4 import Int4Linear, dequantize, pack_int4, quantize_rtn, unpack_int4


def test_pack_round_trips_every_nibble_including_the_sign_bit():
    values = torch.arange(16, dtype=torch.uint8).repeat(3, 2)  # [3, 32]: 15 in slot 7 sets bit 31
    packed = pack_int4(values)
    assert packed.dtype == torch.int32 and packed.shape == (3, 4)
    assert torch.equal(unpack_int4(packed), values)
    assert int(packed[0, 0]) == 0x76543210  # value k at bits 4k
    assert int(packed[0, 1]) == (0xFEDCBA98 - (1 << 32))


@pytest.mark.parametrize("symmetric", [True, False])
def test_rtn_dequantizes_within_half_a_step(symmetric):
    torch.manual_seed(0)
    weight = torch.randn(32, 256)
    layer = quantize_rtn(weight, group_size=128, symmetric=symmetric)
    step = layer.scales.float().repeat_interleave(128, dim=1)
    assert ((dequantize(layer, torch.float32) - weight).abs() <= step / 2 + 1e-6).all()
    assert (layer.zeros is None) == symmetric


def test_act_order_columns_restore_the_input_order():
    torch.manual_seed(1)
    weight, perm = torch.randn(16, 256), torch.randperm(256)
    stored = quantize_rtn(weight[:, perm], group_size=64)
    layer = Int4Linear(stored.qweight, stored.scales, stored.zeros, 64, perm)
    x = torch.randn(4, 256)
    torch.testing.assert_close(x @ dequantize(layer, torch.float32).T, x[:, perm] @ dequantize(stored, torch.float32).T)


def test_concat_stacks_rows_and_refuses_mismatched_groups():
    a, b = quantize_rtn(torch.randn(8, 128), 64), quantize_rtn(torch.randn(24, 128), 64)
    fused = Int4Linear.concat([a, b])
    assert fused.out_features == 32
    torch.testing.assert_close(dequantize(fused, torch.float32)[8:], dequantize(b, torch.float32))
    with pytest.raises(ValueError, match="group size"):
        Int4Linear.concat([a, quantize_rtn(torch.randn(8, 128), 128)])
