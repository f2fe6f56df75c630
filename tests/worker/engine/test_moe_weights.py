"""Stacked expert weights from every checkpoint naming (worker/engine/moe/weights.py) and the MXFP4
dequantizer (mxfp4.py): known FP4 codes and scales, agreement with transformers' own MXFP4 reader, the
per-expert and stacked names loading to the same tensors, and gpt-oss's MXFP4 release read by the loaders' reader
(layers/experts.py, here at a world of one) to transformers' dequantized parameters."""

from __future__ import annotations

import pytest
import torch
from transformers.integrations.mxfp4 import convert_moe_packed_tensors

from worker.engine.checkpoint import ModelSource
from worker.engine.families.gpt_oss import FAMILY as GPT_OSS
from worker.engine.layers.experts import load_expert_shard
from worker.engine.moe import load_moe_layer, spec_from_config
from worker.engine.moe.mxfp4 import E2M1_TABLE, dequantize_mxfp4
from worker.engine.parallel.group import ParallelState

from .test_moe_reference import layer_from_block, random_block


def test_e2m1_table():
    assert E2M1_TABLE[:8] == (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
    assert E2M1_TABLE[8:] == tuple(-v for v in E2M1_TABLE[:8])


def test_dequantize_known_values():
    blocks = torch.zeros(1, 2, 16, dtype=torch.uint8)
    blocks[0, 0, 0] = 0x21  # low nibble 1 (0.5) comes first, then high nibble 2 (1.0)
    blocks[0, 0, 1] = 0xF7  # 7 (6.0), then 15 (-6.0)
    blocks[0, 1, 15] = 0x9B  # 11 (-1.5), then 9 (-0.5): the last two values of the second group
    scales = torch.tensor([[127, 130]], dtype=torch.uint8)  # 2**0 and 2**3
    out = dequantize_mxfp4(blocks, scales, torch.bfloat16)
    assert out.shape == (1, 64) and out.dtype == torch.bfloat16
    want = torch.zeros(64)
    want[:4] = torch.tensor([0.5, 1.0, 6.0, -6.0])
    want[62:] = torch.tensor([-1.5 * 8, -0.5 * 8])
    assert torch.equal(out[0].float(), want)
    tiny = dequantize_mxfp4(blocks[:, :1], torch.tensor([[1]], dtype=torch.uint8), torch.float32)
    assert tiny[0, 0].item() == 0.5 * 2.0**-126  # scales reach down to bf16's smallest normals, exactly


def test_dequantize_equals_transformers_reader():
    gen = torch.Generator().manual_seed(0)
    blocks = torch.randint(0, 256, (3, 8, 4, 16), dtype=torch.uint8, generator=gen)  # [E, rows, groups, 16]
    scales = torch.randint(110, 140, (3, 8, 4), dtype=torch.uint8, generator=gen)
    theirs = convert_moe_packed_tensors(blocks, scales, dtype=torch.bfloat16)  # [E, groups * 32, rows]
    assert torch.equal(dequantize_mxfp4(blocks, scales), theirs.transpose(1, 2))
    with pytest.raises(ValueError, match="do not match"):
        dequantize_mxfp4(blocks, scales[..., :3])


def _same(a, b):
    assert a.dtype == b.dtype and torch.equal(a, b)


def test_released_per_expert_names_load_like_stacked():
    for model_type, prefix, (gate, up, down) in (
        ("qwen3_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
        ("qwen2_moe", "mlp", ("gate_proj", "up_proj", "down_proj")),
        ("mixtral", "block_sparse_moe", ("w1", "w3", "w2")),
    ):
        config, block = random_block(model_type)
        spec = spec_from_config(config)
        stacked = layer_from_block(block, spec)
        inter = spec.expert_intermediate_size
        released = {
            f"model.layers.0.{prefix}.{k}": v for k, v in block.state_dict().items() if "experts." not in k
        }
        for e in range(spec.num_experts):
            experts = f"model.layers.0.{prefix}.experts.{e}"
            released[f"{experts}.{gate}.weight"] = block.experts.gate_up_proj[e, :inter].detach().clone()
            released[f"{experts}.{up}.weight"] = block.experts.gate_up_proj[e, inter:].detach().clone()
            released[f"{experts}.{down}.weight"] = block.experts.down_proj[e].detach().clone()
        loaded = load_moe_layer(released, "model.layers.0", spec, torch.float32, "cpu")
        _same(loaded.experts.gate_up, stacked.experts.gate_up)
        _same(loaded.experts.down, stacked.experts.down)
        _same(loaded.router_weight, stacked.router_weight)
        if spec.has_shared_expert:
            _same(loaded.shared.gate_up, stacked.shared.gate_up)
            _same(loaded.shared.gate, stacked.shared.gate)


def test_gpt_oss_mxfp4_checkpoint_loads_like_its_dequantized_weights():
    """The released layout ([E, 2I, H / 32, 16] blocks, interleaved gate/up rows) read as the one-process loader
    reads it (layers/experts.py at a world of one) against transformers' dequantized [E, H, 2I] parameters (which
    test_moe_reference checks against GptOssMLP), and stacked by load_moe_layer as the owned decoder stacks them."""
    config, block = random_block("gpt_oss")
    spec = spec_from_config(config)
    num_experts, hidden, inter = spec.num_experts, spec.hidden_size, spec.expert_intermediate_size
    gen = torch.Generator().manual_seed(1)
    gate_up_blocks = torch.randint(
        0, 256, (num_experts, 2 * inter, hidden // 32, 16), dtype=torch.uint8, generator=gen
    )
    gate_up_scales = torch.randint(
        122, 130, (num_experts, 2 * inter, hidden // 32), dtype=torch.uint8, generator=gen
    )
    down_blocks = torch.randint(
        0, 256, (num_experts, hidden, inter // 32, 16), dtype=torch.uint8, generator=gen
    )
    down_scales = torch.randint(
        122, 130, (num_experts, hidden, inter // 32), dtype=torch.uint8, generator=gen
    )
    with torch.no_grad():
        block.experts.gate_up_proj.copy_(
            convert_moe_packed_tensors(gate_up_blocks, gate_up_scales, dtype=torch.float32)
        )
        block.experts.down_proj.copy_(
            convert_moe_packed_tensors(down_blocks, down_scales, dtype=torch.float32)
        )
    state = {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}
    released = {
        k: v for k, v in state.items() if not k.endswith(("experts.gate_up_proj", "experts.down_proj"))
    }
    experts = "model.layers.0.mlp.experts"
    released |= {
        f"{experts}.gate_up_proj_blocks": gate_up_blocks,
        f"{experts}.gate_up_proj_scales": gate_up_scales,
        f"{experts}.down_proj_blocks": down_blocks,
        f"{experts}.down_proj_scales": down_scales,
    }
    one_rank = ParallelState(rank=0, world_size=1, device=torch.device("cpu"))
    assert GPT_OSS.moe is not None
    for dtype in (torch.float32, torch.bfloat16):
        from_mxfp4 = load_expert_shard(ModelSource(released), "model.layers.0", GPT_OSS.moe, spec, one_rank, dtype=dtype)
        assert from_mxfp4.keys() == state.keys()
        for name, tensor in from_mxfp4.items():
            _same(tensor, state[name].to(dtype))  # bf16: exact too, every MXFP4 value is a bf16 number
        _same(
            load_moe_layer(from_mxfp4, "model.layers.0", spec, dtype, "cpu").experts.gate_up,
            load_moe_layer(state, "model.layers.0", spec, dtype, "cpu").experts.gate_up,
        )


def test_gpt_oss_gate_up_is_deinterleaved():
    config, block = random_block("gpt_oss")
    spec = spec_from_config(config)
    layer = layer_from_block(block, spec)
    inter = spec.expert_intermediate_size
    _same(layer.experts.gate_up[2, :inter], block.experts.gate_up_proj[2, :, 0::2].T.contiguous())
    _same(layer.experts.gate_up[2, inter:], block.experts.gate_up_proj[2, :, 1::2].T.contiguous())
    _same(layer.experts.gate_up_bias[2, :inter], block.experts.gate_up_proj_bias[2, 0::2])


def test_load_errors_name_the_tensor():
    config, block = random_block("qwen3_moe")
    spec = spec_from_config(config)
    state = {f"model.layers.0.mlp.{k}": v for k, v in block.state_dict().items()}
    with pytest.raises(ValueError, match="no MoE router at 'model.layers.1'"):
        load_moe_layer(state, "model.layers.1", spec, torch.float32, "cpu")
    bad = dict(state)
    bad["model.layers.0.mlp.experts.down_proj"] = bad["model.layers.0.mlp.experts.down_proj"][:, :, :-1]
    with pytest.raises(
        ValueError, match=r"model.layers.0.mlp.experts.down_proj: checkpoint shape \[64, 47\], expected 48 along dim 1"
    ):
        load_moe_layer(bad, "model.layers.0", spec, torch.float32, "cpu")
    no_experts = {k: v for k, v in state.items() if "experts" not in k}
    with pytest.raises(ValueError, match="no expert weights under 'model.layers.0.mlp.experts'"):
        load_moe_layer(no_experts, "model.layers.0", spec, torch.float32, "cpu")


def test_per_expert_modules_are_stacked_once_and_rebound_to_views_of_the_stack():
    """A model whose experts are per-expert linears (older transformers, Mixtral's w1/w3/w2): the owned decoder's
    weights are one stack, each expert's linears become views of it, and the layer computes what they did."""
    from torch import nn

    from worker.engine.families.spec import MoeMlpSpec
    from worker.engine.models.moe_from_model import moe_layer_weights
    from worker.engine.moe.reference import moe_forward_ref
    from worker.engine.moe.spec import MoeSpec

    num_experts, hidden, inter = 4, 8, 6
    spec = MoeSpec(model_type="mixtral", num_experts=num_experts, top_k=2, hidden_size=hidden,
                   expert_intermediate_size=inter, norm_topk_prob=True)  # fmt: skip

    def expert() -> nn.Module:
        m = nn.Module()
        m.w1, m.w3 = nn.Linear(hidden, inter, bias=False), nn.Linear(hidden, inter, bias=False)
        m.w2 = nn.Linear(inter, hidden, bias=False)
        return m

    torch.manual_seed(0)
    layer = nn.Module()
    layer.mlp = nn.Module()
    layer.mlp.gate = nn.Linear(hidden, num_experts, bias=False)
    layer.mlp.experts = nn.ModuleList(expert() for _ in range(num_experts))
    x = torch.randn(5, hidden)
    topk_weights, topk_ids = torch.topk(torch.softmax(layer.mlp.gate(x), -1), 2)
    topk_weights = topk_weights / topk_weights.sum(-1, keepdim=True)
    want = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for weight, e in zip(topk_weights[t], topk_ids[t].tolist(), strict=True):
            m = layer.mlp.experts[e]
            want[t] += weight * m.w2(torch.nn.functional.silu(m.w1(x[t])) * m.w3(x[t]))

    weights = moe_layer_weights(layer, MoeMlpSpec(router="mlp.gate", experts="mlp.experts"), spec)
    stack = weights.experts.gate_up
    start, end = stack.data_ptr(), stack.data_ptr() + stack.numel() * stack.element_size()
    for e, module in enumerate(layer.mlp.experts):
        assert start <= module.w1.weight.data_ptr() < end and start <= module.w3.weight.data_ptr() < end
        assert module.w2.weight.data_ptr() == weights.experts.down[e].data_ptr()
    assert torch.equal(weights.experts.gate_up[1, inter:], layer.mlp.experts[1].w3.weight)
    torch.testing.assert_close(moe_forward_ref(x, weights, spec), want)


def test_gpt_oss_experts_move_into_the_kernels_layout_once_and_generate_is_unchanged():
    """gpt-oss's experts ([E, H, 2I], interleaved in transformers) are held once after the owned decoder's build: its
    module in the kernels' layout takes transformers' place, the old tensors are gone (the model's parameter bytes do
    not grow), transformers' forward gives the same bits as before, and a second build takes views of the same
    tensors."""
    from worker.engine.config import EngineConfig
    from worker.engine.engine import Engine
    from worker.engine.families.gpt_oss import ExpertsInKernelLayout
    from worker.engine.models import load_model

    model, tok = load_model("tiny-gpt-oss", torch.device("cpu"), torch.float32)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3, 11, 4]])
    with torch.no_grad():
        before = model(ids).logits

    def bytes_held() -> int:
        storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
        return sum(storages.values())

    held = bytes_held()
    shapes = {k: v.shape for k, v in model.state_dict().items()}
    engine = Engine(model, tok, EngineConfig(device="cpu", decoder="owned"))
    layers = model.model.layers
    assert all(isinstance(layer.mlp.experts, ExpertsInKernelLayout) for layer in layers)
    assert not any(name.endswith("gate_up_proj") for name, _ in model.named_parameters())
    assert bytes_held() == held
    with torch.no_grad():
        after = model(ids).logits
    assert torch.equal(before, after)
    assert {k: v.shape for k, v in model.state_dict().items()} == shapes  # saves as transformers' checkpoint
    first = engine.runner.decoder.moe_layers[0].experts.gate_up
    del engine
    again = Engine(model, tok, EngineConfig(device="cpu", decoder="owned"))
    assert again.runner.decoder.moe_layers[0].experts.gate_up.data_ptr() == first.data_ptr()


def test_a_part_of_biased_experts_in_the_kernels_layout():
    """The one expert loader (moe/loader.py) on a part of the intermediate features: gate's and up's rows and bias
    entries of that part, down's columns, and the down bias on the first rank alone (the ranks' outputs are summed)."""
    from worker.engine.checkpoint import ModelSource
    from worker.engine.moe.loader import read_layer_experts
    from worker.engine.moe.spec import MoeSpec

    spec = MoeSpec("qwen3_moe", num_experts=2, top_k=1, hidden_size=8, expert_intermediate_size=4, has_expert_bias=True)
    g = torch.Generator().manual_seed(5)
    gate_up, down = torch.randn(2, 8, 8, generator=g), torch.randn(2, 8, 4, generator=g)
    bias, down_bias = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
    tensors = {"mlp.experts.gate_up_proj": gate_up, "mlp.experts.down_proj": down,
               "mlp.experts.gate_up_proj_bias": bias, "mlp.experts.down_proj_bias": down_bias}  # fmt: skip
    for first_rank in (True, False):
        w = read_layer_experts(ModelSource(tensors), "mlp.experts", spec, part=slice(2, 4), first_rank=first_rank)
        assert torch.equal(w.gate_up, torch.cat((gate_up[:, 2:4], gate_up[:, 6:8]), dim=1))
        assert torch.equal(w.down, down[:, :, 2:4])
        assert w.gate_up_bias is not None and torch.equal(w.gate_up_bias, torch.cat((bias[:, 2:4], bias[:, 6:8]), dim=1))
        assert w.down_bias is not None and torch.equal(w.down_bias, down_bias if first_rank else torch.zeros(2, 8))
