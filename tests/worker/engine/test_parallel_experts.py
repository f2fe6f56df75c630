"""Each rank's slice of a sparse layer's experts (layers/experts.py), from every checkpoint layout: the
ranks' slices put back together are the whole layer, whichever layout they were read from (stacked, per-expert,
gpt-oss's interleaved one, its MXFP4 release with slices that start and end inside a 32-value group)."""

from __future__ import annotations

import pytest
import torch

from worker.engine.checkpoint import ModelSource
from worker.engine.families.gpt_oss import FAMILY as GPT_OSS
from worker.engine.families.mixtral import FAMILY as MIXTRAL
from worker.engine.layers.experts import load_expert_shard
from worker.engine.moe.mxfp4 import dequantize_mxfp4
from worker.engine.moe.spec import MoeSpec
from worker.engine.parallel.group import ParallelState

E, H, INTER = 3, 64, 96  # at TP=4 each rank holds 24 of the 96 features: three 32-value groups, cut mid-group
LAYER = "model.layers.0"


def rank(r: int, world_size: int) -> ParallelState:
    return ParallelState(rank=r, world_size=world_size, device=torch.device("cpu"), group=object())


def shards(source, family, spec, world_size):
    assert family.moe is not None
    return [
        load_expert_shard(source, LAYER, family.moe, spec, rank(r, world_size)) for r in range(world_size)
    ]


def test_mixtral_per_expert_release_splits_like_the_stacked_layout():
    spec = MoeSpec("mixtral", num_experts=E, top_k=2, hidden_size=H, expert_intermediate_size=INTER)
    g = torch.Generator().manual_seed(0)
    gate_up, down, router = (
        torch.randn(E, 2 * INTER, H, generator=g),
        torch.randn(E, H, INTER, generator=g),
        torch.randn(E, H),
    )
    stacked = {f"{LAYER}.mlp.experts.gate_up_proj": gate_up, f"{LAYER}.mlp.experts.down_proj": down,
               f"{LAYER}.mlp.gate.weight": router}  # fmt: skip
    released = {f"{LAYER}.block_sparse_moe.gate.weight": router}
    for e in range(E):
        experts = f"{LAYER}.block_sparse_moe.experts.{e}"
        released |= {f"{experts}.w1.weight": gate_up[e, :INTER], f"{experts}.w3.weight": gate_up[e, INTER:],
                     f"{experts}.w2.weight": down[e]}  # fmt: skip
    for world_size in (2, 4):
        from_stacked = shards(ModelSource(stacked), MIXTRAL, spec, world_size)
        from_released = shards(ModelSource(released), MIXTRAL, spec, world_size)
        for a, b in zip(from_stacked, from_released, strict=True):
            assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
            assert torch.equal(a[f"{LAYER}.mlp.gate.weight"], router), (
                "the router is replicated, named as the model"
            )
        gate = torch.cat(
            [s[f"{LAYER}.mlp.experts.gate_up_proj"][:, : INTER // world_size] for s in from_stacked], dim=1
        )
        assert torch.equal(gate, gate_up[:, :INTER])
        assert torch.equal(
            torch.cat([s[f"{LAYER}.mlp.experts.down_proj"] for s in from_stacked], dim=2), down
        )


@pytest.mark.parametrize("world_size", [2, 4])
def test_gpt_oss_mxfp4_release_splits_like_its_dequantized_weights(world_size):
    spec = MoeSpec("gpt_oss", num_experts=E, top_k=2, hidden_size=H, expert_intermediate_size=INTER,
                   has_router_bias=True, has_expert_bias=True)  # fmt: skip
    g = torch.Generator().manual_seed(1)
    experts = f"{LAYER}.mlp.experts"
    gate_up_blocks = torch.randint(0, 256, (E, 2 * INTER, H // 32, 16), dtype=torch.uint8, generator=g)
    gate_up_scales = torch.randint(120, 130, (E, 2 * INTER, H // 32), dtype=torch.uint8, generator=g)
    down_blocks = torch.randint(0, 256, (E, H, INTER // 32, 16), dtype=torch.uint8, generator=g)
    down_scales = torch.randint(120, 130, (E, H, INTER // 32), dtype=torch.uint8, generator=g)
    common = {f"{experts}.gate_up_proj_bias": torch.randn(E, 2 * INTER, generator=g),
              f"{experts}.down_proj_bias": torch.randn(E, H, generator=g),
              f"{LAYER}.mlp.router.weight": torch.randn(E, H), f"{LAYER}.mlp.router.bias": torch.randn(E)}  # fmt: skip
    gate_up = dequantize_mxfp4(gate_up_blocks, gate_up_scales, torch.float32).transpose(1, 2)  # [E, H, 2I]
    down = dequantize_mxfp4(down_blocks, down_scales, torch.float32).transpose(1, 2)  # [E, INTER, H]
    stacked = common | {f"{experts}.gate_up_proj": gate_up, f"{experts}.down_proj": down}
    released = common | {f"{experts}.gate_up_proj_blocks": gate_up_blocks, f"{experts}.gate_up_proj_scales": gate_up_scales,
                         f"{experts}.down_proj_blocks": down_blocks, f"{experts}.down_proj_scales": down_scales}  # fmt: skip
    from_stacked = shards(ModelSource(stacked), GPT_OSS, spec, world_size)
    from_released = shards(ModelSource(released), GPT_OSS, spec, world_size)
    for a, b in zip(from_stacked, from_released, strict=True):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), world_size
    assert torch.equal(torch.cat([s[f"{experts}.gate_up_proj"] for s in from_stacked], dim=2), gate_up)
    assert torch.equal(torch.cat([s[f"{experts}.down_proj"] for s in from_stacked], dim=1), down)
    biases = [s[f"{experts}.down_proj_bias"] for s in from_stacked]
    assert torch.equal(biases[0], common[f"{experts}.down_proj_bias"]), "rank 0 adds the down bias"
    assert all(not b.any() for b in biases[1:]), "the others hold zeros: the all-reduce adds it once"


def _block_fp8_release(block: tuple[int, int], inter: int) -> dict[str, torch.Tensor]:
    """A Mixtral layer whose experts ship as block-wise FP8 linears (`weight` + `weight_scale_inv`)."""
    from worker.engine.quant.fp8 import quantize_weight_blocks

    g = torch.Generator().manual_seed(3)
    tensors = {f"{LAYER}.block_sparse_moe.gate.weight": torch.randn(E, H, generator=g)}
    for e in range(E):
        for name, shape in (("w1", (inter, H)), ("w3", (inter, H)), ("w2", (H, inter))):
            w_fp8, scale = quantize_weight_blocks(torch.randn(*shape, generator=g), block)
            tensors[f"{LAYER}.block_sparse_moe.experts.{e}.{name}.weight"] = w_fp8
            tensors[f"{LAYER}.block_sparse_moe.experts.{e}.{name}.weight_scale_inv"] = scale
    return tensors


def test_fp8_experts_kept_fp8_split_by_their_blocks():
    """Block-wise FP8 experts kept FP8 (moe/fp8.py `Fp8ExpertMethod`) follow their linears' ParamSplit: at TP=2 each
    rank's e4m3 rows of gate and up, columns of down, and block scales are the whole layer's slice; a split that cuts
    a block is refused in one line naming the linear."""
    from worker.engine.layers.experts import load_experts
    from worker.engine.quant.config import BlockFp8Config
    from worker.engine.quant.methods import LinearMethods

    inter, block = 128, (32, 32)
    source = ModelSource(_block_fp8_release(block, inter))
    spec = MoeSpec("mixtral", num_experts=E, top_k=2, hidden_size=H, expert_intermediate_size=inter)
    methods = LinearMethods(BlockFp8Config(block_shape=block), keep_fp8_experts=True)
    assert MIXTRAL.moe is not None

    def load(world_size: int, r: int):
        state = ParallelState.single() if world_size == 1 else rank(r, world_size)
        return load_experts(source, LAYER, MIXTRAL.moe, spec, state, methods)  # type: ignore[arg-type]

    whole = load(1, 0)
    assert whole.fp8 is not None and whole.gate_up.dtype == torch.float8_e4m3fn
    half, blocks = inter // 2, inter // 2 // block[0]
    for r in range(2):
        part = load(2, r)
        assert part.fp8 is not None
        rows = torch.cat(
            [torch.arange(r * half, (r + 1) * half), inter + torch.arange(r * half, (r + 1) * half)]
        )
        assert torch.equal(part.gate_up.view(torch.uint8), whole.gate_up[:, rows].view(torch.uint8))
        assert torch.equal(
            part.down.view(torch.uint8), whole.down[:, :, r * half : (r + 1) * half].view(torch.uint8)
        )
        up_blocks = inter // block[0]  # gate's block rows, then up's
        scale_rows = torch.cat(
            [
                torch.arange(r * blocks, (r + 1) * blocks),
                up_blocks + torch.arange(r * blocks, (r + 1) * blocks),
            ]
        )
        assert torch.equal(part.fp8.gate_up, whole.fp8.gate_up[:, scale_rows])
        assert torch.equal(part.fp8.down, whole.fp8.down[:, :, r * blocks : (r + 1) * blocks])
    with pytest.raises(
        ValueError, match=r"experts.0.w1's rows \[16, 32\) of 128 cut its block-wise FP8 blocks of 32"
    ):
        load(8, 1)  # 16 rows a rank: half a block
