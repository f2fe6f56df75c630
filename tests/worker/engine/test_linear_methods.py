"""The one linear-method protocol (quant/protocol.py): a format says how each of its parameters follows the
weight's rows and columns, and the parallel layers read every rank's slice with the same code. Checked here
without a process group (loading needs none): each rank of a world of two holds exactly its rows or columns of
what one process holds, for a packed INT4-shaped format (qweight packed along K, scales and zeros per group,
the form of quant/int4/packed.py) and for block-wise FP8; a split that cuts a pack, a group or a block is
refused in one line. And `LinearMethods.method_for` hands each linear its method by name."""

from __future__ import annotations

import pytest
import torch

from worker.engine.layers.linear import ColumnParallelLinear, MergedColumnParallelLinear, RowParallelLinear
from worker.engine.parallel.group import ParallelState
from worker.engine.quant.config import BlockFp8Config, OnlineFp8Config
from worker.engine.quant.fp8 import dequantize_weight, quantize_weight_blocks
from worker.engine.quant.methods import (
    BlockFp8LinearMethod,
    DequantizedLinearMethod,
    LinearMethods,
    OnlineFp8LinearMethod,
    fp8_linear_of,
)
from worker.engine.quant.protocol import (
    UNQUANTIZED,
    LinearLoadError,
    LinearMethod,
    ParamSplit,
    WholeTensor,
    add_parameter,
)

PACK, GROUP = 8, 16


class PackedInt4Method(LinearMethod):
    """The parameters of an INT4 weight-only format, as quant/int4/packed.py holds them: qweight int32
    [N, K / 8] (eight values a word along K), scales [N, K / group] and zeros [N, K / group]."""

    def create_weights(self, layer, sizes, dtype, device) -> None:
        n, k = sizes.output_size, sizes.input_size
        add_parameter(layer, "qweight", torch.empty(n, k // PACK, dtype=torch.int32), ParamSplit(0, 1, 1, PACK, what="packed words"))
        group = ParamSplit(0, 1, 1, GROUP, what="quantization groups")
        add_parameter(layer, "scales", torch.empty(n, k // GROUP, dtype=dtype), group)
        add_parameter(layer, "zeros", torch.empty(n, k // GROUP, dtype=torch.uint8), group)

    def apply(self, layer, x, bias):
        raise NotImplementedError("loading only")


class Source:
    def __init__(self, tensors):
        self.tensors = tensors

    def __contains__(self, name):
        return name in self.tensors

    def get_slice(self, name):
        return WholeTensor(self.tensors[name])


def state(rank: int, world_size: int) -> ParallelState:
    # loading runs no collective: a stand-in group satisfies ParallelState
    return ParallelState(rank, world_size, torch.device("cpu"), group=None if world_size == 1 else object())


def int4_tensors(prefix: str, n: int, k: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        f"{prefix}.qweight": torch.randint(-(2**31), 2**31 - 1, (n, k // PACK), dtype=torch.int32, generator=g),
        f"{prefix}.scales": torch.rand(n, k // GROUP, generator=g),
        f"{prefix}.zeros": torch.randint(0, 16, (n, k // GROUP), dtype=torch.uint8, generator=g),
    }


def test_a_packed_format_splits_by_words_and_groups_at_every_world_size():
    n, k = 32, 64
    source = Source(int4_tensors("down", n, k))
    whole = RowParallelLinear(k, n, state(0, 1), method=PackedInt4Method())
    whole.load_from(source, "down")
    for rank in range(2):
        row = RowParallelLinear(k, n, state(rank, 2), method=PackedInt4Method())
        row.load_from(source, "down")
        cols = slice(rank * k // 2, (rank + 1) * k // 2)
        assert torch.equal(row.qweight, whole.qweight[:, cols.start // PACK : cols.stop // PACK])
        assert torch.equal(row.scales, whole.scales[:, cols.start // GROUP : cols.stop // GROUP])
        assert torch.equal(row.zeros, whole.zeros[:, cols.start // GROUP : cols.stop // GROUP])
    gate_up = Source(int4_tensors("gate", n, k) | int4_tensors("up", n, k))
    merged = MergedColumnParallelLinear(k, [n, n], state(1, 2), method=PackedInt4Method())
    merged.load_merged(gate_up, ["gate", "up"])
    half = slice(n // 2, n)
    assert torch.equal(merged.qweight, torch.cat([gate_up.tensors["gate.qweight"][half], gate_up.tensors["up.qweight"][half]]))


def test_a_split_that_cuts_a_group_is_refused():
    k = 3 * GROUP  # two ranks: 24 columns each, a group of 16 cut
    with pytest.raises(LinearLoadError, match=r"down's columns \[0, 24\) of 48 cut its quantization groups of 16"):
        RowParallelLinear(k, 8, state(0, 2), method=PackedInt4Method()).load_from(Source(int4_tensors("down", 8, k)), "down")


def test_block_fp8_ranks_hold_their_blocks_and_dequantize_to_one_process_rows():
    torch.manual_seed(0)
    w_fp8, scale = quantize_weight_blocks(torch.randn(256, 384), (128, 128))
    source = Source({"lin.weight": w_fp8, "lin.weight_scale_inv": scale.bfloat16()})
    method = BlockFp8LinearMethod(BlockFp8Config((128, 128)).scheme_for("lin"))
    whole = ColumnParallelLinear(384, 256, state(0, 1), method=method)
    whole.load_from(source, "lin")
    dense = dequantize_weight(fp8_linear_of(whole), torch.float32)
    for rank in range(2):
        kept = ColumnParallelLinear(384, 256, state(rank, 2), method=method)
        kept.load_from(source, "lin")
        assert torch.equal(kept.weight_scale, whole.weight_scale[rank : rank + 1])
        dequantized = ColumnParallelLinear(384, 256, state(rank, 2), method=DequantizedLinearMethod(method))
        dequantized.load_from(source, "lin")
        assert torch.equal(dequantized.weight, dense[rank * 128 : (rank + 1) * 128])
        assert dequantized.weight_scale is None, "dequantized at load: the scales are gone"


def test_online_fp8_quantizes_after_loading_with_one_process_scales():
    w = torch.randn(16, 32)
    layer = ColumnParallelLinear(32, 16, state(0, 1), method=OnlineFp8LinearMethod(OnlineFp8Config().scheme_for("lin")))
    layer.load_from(Source({"lin.weight": w}), "lin")
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == (16,)
    assert torch.allclose(dequantize_weight(fp8_linear_of(layer), torch.float32), w, rtol=0.07, atol=1e-3)


def test_the_config_object_hands_each_linear_its_method():
    block = BlockFp8Config((128, 128))
    kept = LinearMethods(block, keep_fp8=True, stays_dense=lambda name: ".mlp.shared_expert." in name)
    assert isinstance(kept.method_for("model.layers.0.self_attn.q_proj"), BlockFp8LinearMethod)
    assert kept.method_for("lm_head") is UNQUANTIZED
    assert isinstance(kept.method_for("model.layers.1.mlp.shared_expert.up_proj"), DequantizedLinearMethod)
    assert isinstance(LinearMethods(block).method_for("model.layers.0.mlp.up_proj"), DequantizedLinearMethod)
    online = LinearMethods(OnlineFp8Config(), keep_fp8=True, stays_dense=lambda name: ".experts." in name)
    assert online.method_for("model.layers.0.mlp.experts.0.up_proj") is UNQUANTIZED
    assert LinearMethods().method_for("model.layers.0.self_attn.q_proj") is UNQUANTIZED


def test_per_tensor_scales_of_a_merged_layer_are_one_per_output_and_fused_per_row_where_they_differ():
    """q/k/v with their own per-tensor scales: the layer multiplies with one scale per row (exact, as
    `Fp8Linear.concat`), and each output's part keeps the scale it shipped (what the transformers model holds)."""
    from worker.engine.layers.linear import QKVParallelLinear
    from worker.engine.quant.config import ActivationScale, Fp8Scheme, WeightScale
    from worker.engine.quant.fp8 import Fp8Linear, quantize_weight_per_tensor
    from worker.engine.quant.methods import CompressedTensorsFp8LinearMethod, fp8_parts

    scheme = Fp8Scheme(WeightScale.TENSOR, ActivationScale.STATIC)
    torch.manual_seed(0)
    tensors, pieces = {}, []
    for name, rows, gain in (("q", 32, 1.0), ("k", 16, 3.0), ("v", 16, 0.5)):
        w_fp8, scale = quantize_weight_per_tensor(torch.randn(rows, 32) * gain)
        tensors |= {f"{name}.weight": w_fp8, f"{name}.weight_scale": scale.reshape(1), f"{name}.input_scale": torch.tensor([0.02])}
        pieces.append(Fp8Linear(w_fp8, scale, scheme, torch.tensor(0.02)))
    layer = QKVParallelLinear(32, 8, 4, 2, state(0, 1), method=CompressedTensorsFp8LinearMethod(scheme))
    layer.load_qkv(Source(tensors), "q", "k", "v")
    expected = Fp8Linear.concat(pieces)
    assert torch.equal(layer.weight_scale, expected.weight_scale) and torch.equal(layer.weight, expected.weight)
    x = torch.randn(3, 32)
    assert torch.equal(layer(x), CompressedTensorsFp8LinearMethod(scheme).apply(expected, x, None))
    for part, piece in zip(fp8_parts(layer, [32, 16, 16]), pieces, strict=True):
        assert part.scheme == scheme and torch.equal(part.weight_scale, piece.weight_scale)
        # its own allocation, not a view 4 or 8 bytes into the layer's: cuBLASLt refuses misaligned scales
        assert part.weight_scale.storage_offset() == 0 and part.weight_scale.data_ptr() % 16 == 0
