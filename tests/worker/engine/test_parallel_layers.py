"""Tensor-parallel layers at TP=2 over gloo on the CPU equal the unsharded math (fp32).

One TP=2 group serves the whole module: the helper rank runs `serve_forever` with a runner that
executes named checks, and each test sends one check as a step, so every check runs the same code on
both ranks. Weights are written once to a safetensors file that each rank reads by slice.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn

from worker.engine.checkpoint import SafetensorsCheckpoint
from worker.engine.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from worker.engine.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from worker.engine.parallel.group import ParallelState, all_gather, launch_ranks
from worker.engine.parallel.memory import head_shard, shard_for, vocab_shard
from worker.engine.parallel.messages import StepDriver, serve_forever
from worker.engine.quant.protocol import LinearMethod, ParamSplit, add_parameter

HIDDEN, INTER, HEAD_DIM, NUM_HEADS, VOCAB = 16, 24, 4, 4, 33  # vocab not divisible by 2: padded
NUM_TOKENS = 7


def full_weights(num_kv_heads: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(num_kv_heads)

    def rand(*shape):
        return torch.randn(*shape, generator=g)

    kv = num_kv_heads * HEAD_DIM
    return {
        "lin.weight": rand(12, HIDDEN), "lin.bias": rand(12),
        "row.weight": rand(12, HIDDEN), "row.bias": rand(12),
        "embed.weight": rand(VOCAB, HIDDEN), "lm_head.weight": rand(VOCAB, HIDDEN),
        "q_proj.weight": rand(NUM_HEADS * HEAD_DIM, HIDDEN), "q_proj.bias": rand(NUM_HEADS * HEAD_DIM),
        "k_proj.weight": rand(kv, HIDDEN), "k_proj.bias": rand(kv),
        "v_proj.weight": rand(kv, HIDDEN), "v_proj.bias": rand(kv),
        "o_proj.weight": rand(HIDDEN, NUM_HEADS * HEAD_DIM) / 4,
        "gate_proj.weight": rand(INTER, HIDDEN) / 4, "up_proj.weight": rand(INTER, HIDDEN) / 4,
        "down_proj.weight": rand(HIDDEN, INTER) / 4,
        "q8.weight": torch.randint(-127, 128, (12, HIDDEN), generator=g, dtype=torch.int8),
        "q8.weight_scale": rand(12).abs() / 64,
    }  # fmt: skip


def inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(123)
    ids = torch.cat([torch.arange(VOCAB), torch.randint(0, VOCAB, (NUM_TOKENS,), generator=g)])
    return torch.randn(NUM_TOKENS, HIDDEN, generator=g), ids


class TinyBlock(nn.Module):
    """A Llama-shaped block (embedding, attention projections, MLP, LM head) from the parallel
    layers: the same code at every world size."""

    def __init__(self, state: ParallelState, num_kv_heads: int):
        super().__init__()
        self.embed = VocabParallelEmbedding(VOCAB, HIDDEN, state)
        self.qkv = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, num_kv_heads, state, bias=True)
        self.o = RowParallelLinear(NUM_HEADS * HEAD_DIM, HIDDEN, state)
        self.gate_up = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], state)
        self.down = RowParallelLinear(INTER, HIDDEN, state)
        self.lm_head = ParallelLMHead(VOCAB, HIDDEN, state)

    def load(self, ckpt: SafetensorsCheckpoint) -> None:
        self.embed.load_from(ckpt, "embed")
        self.qkv.load_qkv(ckpt, "q_proj", "k_proj", "v_proj")
        self.o.load_from(ckpt, "o_proj")
        self.gate_up.load_merged(ckpt, ["gate_proj", "up_proj"])
        self.down.load_from(ckpt, "down_proj")
        self.lm_head.load_from(ckpt, "lm_head")

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor | None:
        hidden = self.embed(input_ids)
        num_tokens = input_ids.shape[0]
        q, k, v = self.qkv.split(self.qkv(hidden))
        heads = self.qkv.heads
        q = q.view(num_tokens, heads.num_q_heads, HEAD_DIM).transpose(0, 1)
        k, v = (t.view(num_tokens, heads.num_kv_heads, HEAD_DIM).transpose(0, 1) for t in (k, v))
        group_size = heads.num_q_heads // heads.num_kv_heads
        k, v = k.repeat_interleave(group_size, 0), v.repeat_interleave(group_size, 0)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        hidden = hidden + self.o(out.transpose(0, 1).reshape(num_tokens, -1))
        gate, up = self.gate_up(hidden).chunk(2, dim=-1)
        hidden = hidden + self.down(F.silu(gate) * up)
        return self.lm_head(hidden)


# --- the checks, run on every rank; rank 0 returns what the test compares -----------------------------


def check_column(state, ckpt):
    layer = ColumnParallelLinear(HIDDEN, 12, state, bias=True, gather_output=True)
    layer.load_from(ckpt, "lin")
    return layer(inputs()[0])


def check_row(state, ckpt):
    layer = RowParallelLinear(HIDDEN, 12, state, bias=True, input_is_parallel=False)
    layer.load_from(ckpt, "row")
    return layer(inputs()[0])


class Int8PerChannelMethod(LinearMethod):
    """A stand-in quantized format: int8 weights and one scale per output channel, loaded by the
    same layer loaders (so a column layer splits the scales with their rows; a row layer keeps them)."""

    def create_weights(self, layer, sizes, dtype, device) -> None:
        weight = torch.empty(sizes.output_size, sizes.input_size, dtype=torch.int8, device=device)
        add_parameter(layer, "weight", weight, ParamSplit())
        add_parameter(layer, "weight_scale", torch.empty(sizes.output_size, dtype=dtype), ParamSplit(0, None))

    def apply(self, layer, x, bias):
        return F.linear(x, layer.weight.to(x.dtype) * layer.weight_scale[:, None], bias)


def check_quantized(state, ckpt):
    column = ColumnParallelLinear(HIDDEN, 12, state, gather_output=True, method=Int8PerChannelMethod())
    row = RowParallelLinear(HIDDEN, 12, state, input_is_parallel=False, method=Int8PerChannelMethod())
    for layer in (column, row):
        layer.load_from(ckpt, "q8")
    x = inputs()[0]
    return column(x), row(x)


def check_merged(state, ckpt):
    layer = MergedColumnParallelLinear(HIDDEN, [INTER, INTER], state)
    layer.load_merged(ckpt, ["gate_proj", "up_proj"])
    return all_gather(state, layer(inputs()[0]))  # every rank's [gate part; up part], rank order


def check_qkv(state, ckpt):
    layer = QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, ckpt.get_slice("k_proj.weight").get_shape()[0] // HEAD_DIM, state, bias=True)  # fmt: skip
    layer.load_qkv(ckpt, "q_proj", "k_proj", "v_proj")
    return all_gather(state, layer(inputs()[0]))


def check_embedding(state, ckpt):
    layer = VocabParallelEmbedding(VOCAB, HIDDEN, state)
    layer.load_from(ckpt, "embed")
    return layer(inputs()[1])


def check_lm_head(state, ckpt):
    layer = ParallelLMHead(VOCAB, HIDDEN, state)
    layer.load_from(ckpt, "lm_head")
    logits = layer(inputs()[0])
    assert (logits is None) == (not state.is_first_rank), f"rank {state.rank} got logits {logits}"
    return logits


def check_block(state, ckpt):
    num_kv_heads = ckpt.get_slice("k_proj.weight").get_shape()[0] // HEAD_DIM
    blocks = {"tp": TinyBlock(state, num_kv_heads)}
    if state.is_first_rank:
        blocks["single"] = TinyBlock(ParallelState.single(), num_kv_heads)
    for block in blocks.values():
        block.load(ckpt)
    ids = inputs()[1]
    return {name: block(ids) for name, block in blocks.items()}


CHECKS = {fn.__name__: fn for fn in (check_column, check_row, check_quantized, check_merged, check_qkv, check_embedding, check_lm_head, check_block)}  # fmt: skip


@dataclass(frozen=True)
class LayerCheck:
    """The test's stand-in for a step description: which check, on which weights."""

    name: str
    checkpoint_path: str


class CheckRunner:
    def __init__(self, state: ParallelState):
        self.state = state

    def execute_step(self, step: LayerCheck):
        return CHECKS[step.name](self.state, SafetensorsCheckpoint([step.checkpoint_path]))


def serve_checks(state: ParallelState) -> None:
    serve_forever(state, CheckRunner(state))


@pytest.fixture(scope="module")
def tp2():
    group = launch_ranks(2, serve_checks, timeout_s=20)
    driver = StepDriver(group, CheckRunner(group.state))
    yield driver
    driver.shutdown()


@pytest.fixture(scope="module", params=[2, 1], ids=["kv2", "kv1-replicated"])
def weights(request, tmp_path_factory):
    path = tmp_path_factory.mktemp("tp") / f"kv{request.param}.safetensors"
    save_file(full_weights(request.param), str(path))
    return str(path), load_file(str(path)), request.param


def run(tp2, name: str, weights):
    return tp2.run(LayerCheck(name, weights[0]))


def close(actual, expected, atol=1e-5):
    torch.testing.assert_close(actual, expected, rtol=1e-5, atol=atol)


def test_column_parallel_equals_linear(tp2, weights):
    w = weights[1]
    close(run(tp2, "check_column", weights), F.linear(inputs()[0], w["lin.weight"], w["lin.bias"]))


def test_row_parallel_equals_linear_with_bias_added_once(tp2, weights):
    w = weights[1]
    close(run(tp2, "check_row", weights), F.linear(inputs()[0], w["row.weight"], w["row.bias"]))


def test_quantized_method_shards_its_scales_with_the_weights(tp2, weights):
    w = weights[1]
    expected = F.linear(inputs()[0], w["q8.weight"].float() * w["q8.weight_scale"][:, None])
    column, row = run(tp2, "check_quantized", weights)
    close(column, expected)
    close(row, expected)


def test_merged_gate_up_ranks_hold_matching_slices(tp2, weights):
    w = weights[1]
    gate, up = (F.linear(inputs()[0], w[f"{n}_proj.weight"]) for n in ("gate", "up"))
    expected = torch.cat([torch.cat([gate[:, shard_for(INTER, r, 2)], up[:, shard_for(INTER, r, 2)]], -1) for r in (0, 1)], -1)  # fmt: skip
    close(run(tp2, "check_merged", weights), expected)


def test_qkv_split_by_head_with_biases(tp2, weights):
    """Rank r holds [its q heads; its KV heads of k; of v]; with one KV head both ranks hold it."""
    w, num_kv_heads = weights[1], weights[2]
    x = inputs()[0]
    q, k, v = (F.linear(x, w[f"{n}_proj.weight"], w[f"{n}_proj.bias"]) for n in "qkv")
    parts = []
    for rank in (0, 1):
        heads = head_shard(NUM_HEADS, num_kv_heads, rank, 2)
        rows = [slice(h.start * HEAD_DIM, h.stop * HEAD_DIM) for h in (heads.q_heads, heads.kv_heads)]
        parts += [q[:, rows[0]], k[:, rows[1]], v[:, rows[1]]]
    if num_kv_heads == 1:
        assert head_shard(NUM_HEADS, 1, 1, 2).kv_heads == slice(0, 1), "rank 1 reads the only KV head"
    close(run(tp2, "check_qkv", weights), torch.cat(parts, -1))


def test_vocab_parallel_embedding_with_padding(tp2, weights):
    close(run(tp2, "check_embedding", weights), F.embedding(inputs()[1], weights[1]["embed.weight"]))


def test_lm_head_gathers_trimmed_logits_on_rank0_only(tp2, weights):
    logits = run(tp2, "check_lm_head", weights)
    assert logits.shape == (NUM_TOKENS, VOCAB)
    close(logits, F.linear(inputs()[0], weights[1]["lm_head.weight"]))


def test_llama_shaped_block_tp2_equals_tp1(tp2, weights):
    out = run(tp2, "check_block", weights)
    assert out["single"].shape == (VOCAB + NUM_TOKENS, VOCAB)
    close(out["tp"], out["single"], atol=1e-4)  # logits reach ~100: fp32 sums in another order


@dataclass(frozen=True)
class ForwardStep:
    """A stand-in for the engine's step description: the token ids of one forward."""

    input_ids: tuple[int, ...]


class BlockRunner:
    """The wiring the engine will use: each rank builds its shards once, then runs every step."""

    def __init__(self, state: ParallelState, checkpoint_path: str, num_kv_heads: int):
        self.block = TinyBlock(state, num_kv_heads)
        self.block.load(SafetensorsCheckpoint([checkpoint_path]))

    def execute_step(self, step: ForwardStep):
        return self.block(torch.tensor(step.input_ids))


def serve_block(state: ParallelState, checkpoint_path: str, num_kv_heads: int) -> None:
    serve_forever(state, BlockRunner(state, checkpoint_path, num_kv_heads))


def test_model_built_once_per_rank_serves_steps(weights):
    path, _, num_kv_heads = weights
    group = launch_ranks(2, serve_block, (path, num_kv_heads), timeout_s=20)
    driver = StepDriver(group, BlockRunner(group.state, path, num_kv_heads))
    single = BlockRunner(ParallelState.single(), path, num_kv_heads)
    for num_tokens in (1, 5, 9):
        step = ForwardStep(tuple(range(num_tokens)))
        close(driver.run(step), single.execute_step(step), atol=1e-4)
    driver.shutdown()


# --- in-process: the split arithmetic and what a loader reads --------------------------------------


def test_shard_arithmetic():
    assert [shard_for(8, r, 4) for r in range(4)] == [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]
    with pytest.raises(
        ValueError, match="intermediate_size 10 is not divisible by the tensor-parallel size 3"
    ):
        shard_for(10, 0, 3, "intermediate_size")
    # 8 q heads, 2 KV heads, 4 ranks: ranks 0-1 read KV head 0, ranks 2-3 KV head 1
    assert [head_shard(8, 2, r, 4).kv_heads for r in range(4)] == [slice(0, 1)] * 2 + [slice(1, 2)] * 2
    assert head_shard(8, 8, 3, 4) == head_shard(8, 8, 3, 4) and head_shard(8, 8, 3, 4).kv_heads == slice(6, 8)
    with pytest.raises(ValueError, match="not a multiple of num_key_value_heads 2"):
        head_shard(6, 2, 0, 3)
    assert vocab_shard(33, 0, 2) == vocab_shard(33, 0, 2) and vocab_shard(33, 1, 2).start == 17
    assert vocab_shard(33, 1, 2).stop == 33 and vocab_shard(33, 1, 2).num_rows == 17


class RecordingSource:
    """A checkpoint that records how many elements each read returned."""

    def __init__(self, ckpt: SafetensorsCheckpoint):
        self.ckpt = ckpt
        self.numel_read: dict[str, int] = {}

    def get_slice(self, name: str):
        inner, record = self.ckpt.get_slice(name), self.numel_read

        class Recorded:
            def get_shape(self):
                return inner.get_shape()

            def __getitem__(self, index):
                tensor = inner[index]
                record[name] = record.get(name, 0) + tensor.numel()
                return tensor

        return Recorded()


def test_rank_reads_only_its_slices(tmp_path):
    """Rank 1 of 2 loads a block: each split tensor is read as half (embedding: its 16 of 33 rows),
    and only the replicated KV head is read whole."""
    path = tmp_path / "w.safetensors"
    full = full_weights(1)
    save_file(full, str(path))
    source = RecordingSource(SafetensorsCheckpoint([path]))
    rank1 = ParallelState(
        rank=1, world_size=2, device=torch.device("cpu"), group=object()
    )  # loading needs no group
    TinyBlock(rank1, num_kv_heads=1).load(source)
    whole = {name: t.numel() for name, t in full.items()}
    assert source.numel_read["q_proj.weight"] == whole["q_proj.weight"] // 2
    assert source.numel_read["q_proj.bias"] == whole["q_proj.bias"] // 2
    assert source.numel_read["k_proj.weight"] == whole["k_proj.weight"], "one KV head, replicated"
    for name in ("o_proj.weight", "gate_proj.weight", "up_proj.weight", "down_proj.weight"):
        assert source.numel_read[name] == whole[name] // 2, name
    assert source.numel_read["embed.weight"] == (VOCAB - 17) * HIDDEN


def test_loader_names_a_shape_mismatch(tmp_path):
    path = tmp_path / "w.safetensors"
    save_file({"lin.weight": torch.zeros(10, HIDDEN)}, str(path))
    layer = ColumnParallelLinear(HIDDEN, 12, ParallelState.single())
    with pytest.raises(ValueError, match=r"lin.weight: checkpoint shape \[10, 16\], expected 12 along dim 0"):
        layer.load_from(SafetensorsCheckpoint([path]), "lin")


def test_checkpoint_reads_a_sharded_index(tmp_path):
    save_file({"a.weight": torch.arange(6.0).view(3, 2)}, str(tmp_path / "model-00001-of-00002.safetensors"))
    save_file({"b.weight": torch.ones(2)}, str(tmp_path / "model-00002-of-00002.safetensors"))
    weight_map = {
        "a.weight": "model-00001-of-00002.safetensors",
        "b.weight": "model-00002-of-00002.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    ckpt = SafetensorsCheckpoint.from_dir(tmp_path)
    assert sorted(ckpt.names()) == ["a.weight", "b.weight"] and "b.weight" in ckpt
    assert ckpt.get_slice("a.weight")[1:3].tolist() == [[2.0, 3.0], [4.0, 5.0]]
    with pytest.raises(KeyError, match="tensor 'c.weight' is not in the checkpoint"):
        ckpt.get_slice("c.weight")


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_fused_checkpoint_tensors_load_like_separate_ones(tmp_path, num_kv_heads):
    """Phi-3's qkv_proj and gate_up_proj ([q; k; v] and [gate; up] rows in one tensor): each rank's shard equals
    the one it loads from the separate tensors, and it reads only its rows of the fused tensor."""
    full = full_weights(num_kv_heads)
    fused = {
        "qkv_proj.weight": torch.cat([full[f"{p}_proj.weight"] for p in "qkv"]),
        "qkv_proj.bias": torch.cat([full[f"{p}_proj.bias"] for p in "qkv"]),
        "gate_up_proj.weight": torch.cat([full["gate_proj.weight"], full["up_proj.weight"]]),
    }
    save_file(full, str(tmp_path / "separate.safetensors"))
    save_file(fused, str(tmp_path / "fused.safetensors"))
    separate = SafetensorsCheckpoint([tmp_path / "separate.safetensors"])
    for rank in range(2):
        state = ParallelState(rank=rank, world_size=2, device=torch.device("cpu"), group=object())
        source = RecordingSource(SafetensorsCheckpoint([tmp_path / "fused.safetensors"]))
        qkv_fused, qkv = (QKVParallelLinear(HIDDEN, HEAD_DIM, NUM_HEADS, num_kv_heads, state, bias=True) for _ in "ab")
        qkv_fused.load_fused_qkv(source, "qkv_proj")
        qkv.load_qkv(separate, "q_proj", "k_proj", "v_proj")
        assert torch.equal(qkv_fused.weight, qkv.weight) and torch.equal(qkv_fused.bias, qkv.bias)
        gate_up_fused, gate_up = (MergedColumnParallelLinear(HIDDEN, [INTER, INTER], state) for _ in "ab")
        gate_up_fused.load_fused(source, "gate_up_proj")
        gate_up.load_merged(separate, ["gate_proj", "up_proj"])
        assert torch.equal(gate_up_fused.weight, gate_up.weight)
        assert source.numel_read["qkv_proj.weight"] == qkv.weight.numel() < fused["qkv_proj.weight"].numel()
        assert source.numel_read["gate_up_proj.weight"] == fused["gate_up_proj.weight"].numel() // 2
    rows = (NUM_HEADS + 2 * num_kv_heads) * HEAD_DIM
    with pytest.raises(ValueError, match=rf"q_proj.weight: checkpoint shape \[16, 16\], expected {rows} along dim 0"):
        qkv.load_fused_qkv(separate, "q_proj")  # a tensor of q rows only is not a fused q/k/v
