"""FP8 at --tensor-parallel-size 2 over gloo on the CPU (issue 27): each rank's FP8 linears hold their slice with
the scales of that slice (their layers' FP8 methods, quant/methods.py), so greedy output equals the one-process engine's on the same
checkpoint token for token (fp32): block-wise FP8 and static per-tensor FP8 kept in FP8 (`keep_fp8`: the owned
decoder fuses the rank's FP8 rows and runs the emulated FP8 GEMM), and block-wise, per-channel and
`--quantization fp8` dequantized (the CPU's default). The per-channel scales themselves are checked against one
process's: a column-parallel rank's rows, every row's for row-parallel o/down, and for `--quantization fp8` the
whole row's absmax on both ranks (the ranks' largest). A shard boundary inside a [128, 128] block is refused.

The FP8 shape has 128-dim heads and an intermediate size of 512, so that 2 ranks' slices keep whole blocks.

INT4 checkpoints (GPTQ, AWQ gemm, compressed-tensors pack-quantized; issue 46) take the same path: each rank reads
its packed words and its groups' scales and zero points by slice (the INT4 methods' splits) and dequantizes them,
so greedy output equals one process's; at an intermediate size of 512, each rank's half of down_proj's columns is
two whole groups of 128. A slice that cuts a group (384: 192 columns a rank), or an act-order linear split by
columns, is refused in one line.
"""

from __future__ import annotations

import pytest
import torch

from tests.fixtures.checkpoints import build_checkpoint
from tests.fixtures.fp8_checkpoints import FP8_SHAPE, build_fp8_checkpoint, build_fp8_moe_checkpoint
from tests.fixtures.int4_checkpoints import FORMATS as INT4_FORMATS
from tests.fixtures.int4_checkpoints import build_int4_checkpoint, build_int4_moe_checkpoint
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import ModelLoadError, load_model
from worker.engine.quant.linear import Fp8LinearModule
from worker.engine.ranks import build_sharded_engine

from .test_parallel_engine import make_requests

CPU = torch.device("cpu")
CONFIG = dict(max_num_batched_tokens=32, num_kv_blocks=24, max_num_seqs=8)
TP_SHAPE = dict(head_dim=128, intermediate_size=512)


def _checkpoint(tmp_path_factory, fmt: str) -> str:
    path = tmp_path_factory.mktemp(fmt)
    if fmt == "online":  # a bf16 checkpoint, quantized at load
        build_checkpoint(path, "llama3", dtype=torch.bfloat16, shape={**FP8_SHAPE, **TP_SHAPE})
    elif fmt in INT4_FORMATS:  # each rank's down_proj columns: two whole groups of 128
        build_int4_checkpoint(path, fmt, shape=dict(intermediate_size=512))
    else:
        build_fp8_checkpoint(path, fmt, "llama3" if fmt == "ct-tensor-static" else "qwen3", shape=TP_SHAPE)
    return str(path)


def _one_process(path: str, keep_fp8: bool, quantization: str | None) -> tuple[Engine, list]:
    model, tokenizer = load_model(path, CPU, torch.float32, quantization=quantization, keep_fp8=keep_fp8)
    engine = Engine(model, tokenizer, EngineConfig(decoder="owned", quantization=quantization, **CONFIG))
    requests = make_requests(None, num=6)
    return engine, requests


CASES = [
    ("fp8-block", True),
    ("fp8-block", False),
    ("ct-block", True),
    ("ct-tensor-static", True),
    ("ct-channel-dynamic", False),
    ("fbgemm", False),
    ("online", False),
    ("gptq", False),
    ("awq", False),
    ("ct-asym", False),
]


@pytest.mark.parametrize(("fmt", "keep_fp8"), CASES)
def test_greedy_at_tp2_equals_one_process(tmp_path_factory, fmt, keep_fp8):
    path = _checkpoint(tmp_path_factory, fmt)
    quantization = "fp8" if fmt == "online" else None
    one, requests = _one_process(path, keep_fp8, quantization)
    reference = {r.request_id: r.token_ids for r in one.generate(requests)}
    one.close()
    config = EngineConfig(quantization=quantization, **CONFIG)
    sharded = build_sharded_engine(path, config, world_size=2, keep_fp8=keep_fp8)
    try:
        assert sharded.runner.replica is not None
        kept = [m for m in sharded.model.modules() if isinstance(m, Fp8LinearModule)]
        assert len(kept) == (7 * sharded.model.config.num_hidden_layers if keep_fp8 else 0)
        results = sharded.generate(requests)
    finally:
        sharded.close()
    assert {r.request_id: r.token_ids for r in results} == reference
    assert len({t for ids in reference.values() for t in ids}) > 5, "diverse greedy text"


def _scales(model) -> dict[str, torch.Tensor]:
    return {name: m.weight_scale for name, m in model.named_modules() if isinstance(m, Fp8LinearModule)}


@pytest.mark.parametrize("fmt", ["ct-channel-dynamic", "online"])
def test_per_channel_scales_are_one_process_rows(tmp_path_factory, fmt):
    """Rank 0's q/k/v and gate/up scales are its rows' of one process's; o and down hold every row's scale, and
    with --quantization fp8 that is the whole row's (the largest absmax over the ranks' columns), not the absmax
    of rank 0's half of each row."""
    path = _checkpoint(tmp_path_factory, fmt)
    quantization = "fp8" if fmt == "online" else None
    whole = _scales(load_model(path, CPU, torch.float32, quantization=quantization, keep_fp8=True)[0])
    config = EngineConfig(quantization=quantization, **CONFIG)
    sharded = build_sharded_engine(path, config, world_size=2, keep_fp8=True)
    try:
        ranks = _scales(sharded.model)
    finally:
        sharded.close()
    assert ranks.keys() == whole.keys() and ranks
    for name, scale in ranks.items():
        full = whole[name]
        if name.endswith(("o_proj", "down_proj")):
            torch.testing.assert_close(scale, full, rtol=0, atol=0)
        else:  # the first half of the rows (q/k/v: rank 0's heads; gate/up: its features)
            torch.testing.assert_close(scale, full[: full.shape[0] // 2], rtol=0, atol=0)


def test_a_shard_boundary_inside_an_fp8_block_is_refused(tmp_path_factory):
    """64-dim KV heads, 2 of them: each rank's 64 k rows are half a [128, 128] block."""
    path = str(build_fp8_checkpoint(tmp_path_factory.mktemp("fp8-block-64"), "fp8-block", "qwen3").path)
    with pytest.raises(
        ModelLoadError, match=r"k_proj's rows \[0, 64\) of 128 cut its block-wise FP8 blocks of 128"
    ):
        build_sharded_engine(path, EngineConfig(**CONFIG), world_size=2)


@pytest.mark.parametrize(
    ("fmt", "shape", "message"),
    [
        ("gptq", {}, r"mlp.down_proj's columns \[0, 192\) of 384 cut its INT4 groups of 128"),
        ("gptq-act-order", {"intermediate_size": 512}, r"self_attn.o_proj.g_idx \(act-order\) spreads each group over every rank"),
    ],
)
def test_an_int4_split_that_cuts_a_group_is_refused(tmp_path_factory, fmt, shape, message):
    path = str(build_int4_checkpoint(tmp_path_factory.mktemp(fmt), fmt, shape=shape).path)
    with pytest.raises(ModelLoadError, match=f"tensor parallelism: model.layers.0.{message}"):
        build_sharded_engine(path, EngineConfig(**CONFIG), world_size=2)


@pytest.mark.parametrize(
    ("fmt", "keep_fp8"), [("fp8-block", True), ("fp8-block", False), ("ct-channel-dynamic", False), ("gptq", False)]
)
def test_an_fp8_mixture_of_experts_at_tp2_equals_one_process(tmp_path_factory, fmt, keep_fp8):
    """Qwen3-MoE's block-wise FP8 release and GLM-4.5's per-channel one (a shared expert, a dense first layer): the
    attention (and GLM's dense MLP) FP8 slices, kept FP8 or dequantized, and every expert dequantized whole from
    the checkpoint and then split by intermediate columns, as one process dequantizes them. Greedy output equals one
    process's token for token (fp32; block-wise activations are quantized per 128-column group inside a rank's
    aligned columns, so even the kept FP8 GEMMs are one process's bits. GLM's per-channel linears kept FP8 would
    quantize o/down's per-token activations over each rank's half, not one process's bits: dequantized here, as in
    test_greedy_at_tp2_equals_one_process). A GPTQ Qwen3-MoE likewise: INT4 attention slices, experts dequantized
    whole."""
    folder = tmp_path_factory.mktemp(fmt)
    if fmt in INT4_FORMATS:
        path = str(build_int4_moe_checkpoint(folder, fmt).path)
    else:
        path = str(build_fp8_moe_checkpoint(folder, fmt, shape=dict(head_dim=128)).path)
    one, requests = _one_process(path, keep_fp8, None)
    reference = {r.request_id: r.token_ids for r in one.generate(requests)}
    one.close()
    sharded = build_sharded_engine(path, EngineConfig(**CONFIG), world_size=2, keep_fp8=keep_fp8)
    try:
        modules = dict(sharded.model.named_modules())
        kept = {name for name, m in modules.items() if isinstance(m, Fp8LinearModule)}
        assert any(n.endswith("self_attn.o_proj") for n in kept) == keep_fp8, "the attention stays FP8 with keep_fp8"
        assert not any(".mlp.experts" in n or ".mlp.shared_experts" in n or n.endswith(".mlp.gate") for n in kept)
        results = sharded.generate(requests)
    finally:
        sharded.close()
    assert {r.request_id: r.token_ids for r in results} == reference
    assert len({t for ids in reference.values() for t in ids}) > 5, "diverse greedy text"


def test_an_fp8_mixture_of_experts_keeps_its_experts_fp8_at_tp2(tmp_path_factory):
    """`keep_fp8_experts` under TP (sm89+ CUDA's default, forced on the CPU, the grouped GEMMs emulated): each rank
    keeps its slice of every expert's intermediate columns as the release's e4m3 bytes with their [128, 128] block
    scales (an `Fp8Experts` in the shard), a quarter of the bytes the dequantized experts take, so an FP8 release
    too big for its ranks in bf16 (DeepSeek-V3/R1 at TP=8) fits. Greedy output equals one process's with its experts
    kept FP8 (block-wise activations are quantized per 128-column group, inside each rank's aligned columns)."""
    from worker.engine.moe.fp8_experts import Fp8Experts

    folder = tmp_path_factory.mktemp("fp8-experts")  # 256 intermediate columns: a rank's 128 are one block
    path = str(build_fp8_moe_checkpoint(folder, "fp8-block", shape=dict(head_dim=128, moe_intermediate_size=256)).path)
    model, tokenizer = load_model(path, CPU, torch.float32, keep_fp8=True, keep_fp8_experts=True)
    assert any(isinstance(m, Fp8Experts) for m in model.modules())
    requests = make_requests(None, num=6)
    reference = {r.request_id: r.token_ids for r in Engine(model, tokenizer, EngineConfig(**CONFIG)).generate(requests)}
    del model
    sharded = build_sharded_engine(path, EngineConfig(**CONFIG), world_size=2, keep_fp8=True, keep_fp8_experts=True)
    try:
        kept = [m for m in sharded.model.modules() if isinstance(m, Fp8Experts)]
        assert kept and all(m.gate_up_proj.dtype == torch.float8_e4m3fn for m in kept)
        assert kept[0].down_proj.shape[-1] == 128, "each rank holds half of every expert's 256 columns"
        results = sharded.generate(requests)
    finally:
        sharded.close()
    assert {r.request_id: r.token_ids for r in results} == reference
    assert len({t for ids in reference.values() for t in ids}) > 5, "diverse greedy text"


def test_quantization_fp8_on_a_mixture_of_experts_at_tp2_equals_one_process():
    """`--quantization fp8` on Qwen2-MoE at TP=2: the attention quantized per output channel with one process's
    scales (o's the whole row's), the sparse MLPs (experts, shared expert, router, the shared expert's gate) left
    in the model dtype, as one process leaves them. Greedy output equals one process's (fp32, dequantized)."""
    one, requests = _one_process("tiny-qwen2-moe", False, "fp8")
    reference = {r.request_id: r.token_ids for r in one.generate(requests)}
    one.close()
    sharded = build_sharded_engine("tiny-qwen2-moe", EngineConfig(quantization="fp8", **CONFIG), world_size=2)
    try:
        results = sharded.generate(requests)
    finally:
        sharded.close()
    assert {r.request_id: r.token_ids for r in results} == reference


def test_quantization_fp8_on_a_shard_leaves_the_sparse_mlps_dense():
    """A shard after `--quantization fp8` with kept FP8: the attention and the dense layer's MLP are
    Fp8LinearModules, nothing under a sparse MLP is."""
    from worker.engine.models import family_for
    from worker.engine.models.loader import sparse_layers
    from worker.engine.models.shard_model import load_shard
    from worker.engine.parallel.group import ParallelState

    state = ParallelState(rank=0, world_size=1, device=CPU)
    model, _, _ = load_shard("tiny-qwen2-moe", state, EngineConfig(quantization="fp8"), keep_fp8=True)
    kept = {name for name, m in model.named_modules() if isinstance(m, Fp8LinearModule)}
    sparse = sparse_layers(model.config, family_for(model.config)[0])
    assert sparse is not None and sparse.layer_prefixes
    assert any(name.endswith("self_attn.o_proj") for name in kept)
    assert not any(sparse.holds(name) for name in kept), sorted(kept)
    assert any(name.endswith("mlp.down_proj") for name in kept), "the dense layer's MLP is quantized"


def test_an_fp8_weight_without_its_scale_is_refused(tmp_path):
    """A rank never casts bare FP8 values into a weight: a quantized linear without its scale names the missing
    tensor, and an FP8 weight of a linear its config leaves unquantized is named too."""
    from safetensors.torch import save_file

    from worker.engine.checkpoint import SafetensorsCheckpoint
    from worker.engine.layers.linear import ColumnParallelLinear
    from worker.engine.models.quant_loader import AccountedCheckpoint
    from worker.engine.parallel.group import ParallelState
    from worker.engine.quant import BlockFp8Config, LinearMethods
    from worker.engine.quant.protocol import LinearLoadError

    prefix = "model.layers.0.mlp.up_proj"
    save_file({f"{prefix}.weight": torch.zeros(128, 128).to(torch.float8_e4m3fn)}, tmp_path / "m.safetensors")
    source = AccountedCheckpoint(SafetensorsCheckpoint.from_dir(tmp_path))
    method = LinearMethods(BlockFp8Config(block_shape=(128, 128))).method_for(prefix)
    layer = ColumnParallelLinear(128, 128, ParallelState.single(), method=method)
    with pytest.raises(LinearLoadError, match=f"the checkpoint has no {prefix}.weight_scale_inv"):
        layer.load_from(source, prefix)
    with pytest.raises(LinearLoadError, match=f"{prefix}.weight is FP8 .*leaves it unquantized"):
        ColumnParallelLinear(128, 128, ParallelState.single()).load_from(source, prefix)
