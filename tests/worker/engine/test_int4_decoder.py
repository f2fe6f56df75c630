"""Packed INT4 weights in the owned decoder (quant/int4/linear.py's `Int4LinearModule` and `Int4Weight`).

CPU: a model whose linears are kept packed (`quantize_linears`) runs the owned decoder with q/k/v and gate/up fused
by `Int4Linear.concat`, multiplied through the twin (dequantize + F.linear); its greedy tokens equal `generate` on
the same model with each linear's weight replaced by its dequantization (fp32), and transformers' forward over the
packed modules gives the same tokens too.

An INT4 checkpoint (GPTQ with act-order, asymmetric compressed-tensors) loaded with `keep_int4` holds its linears packed
(models/quant_loader.py) and decodes as the same checkpoint loaded dequantized.

GPU (`gpu`): the W4A16 kernels in the owned decoder in bf16, CUDA graphs on, against the same engine run eagerly
(the same kernels, so the same tokens) and against the dequantized model's logits.
"""

from __future__ import annotations

import copy

import pytest
import torch

from tests.fixtures.int4_checkpoints import build_int4_checkpoint
from tests.worker.engine.test_quant_decoder import _greedy, _requests
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.kernels import w4a16
from worker.engine.models import load_model
from worker.engine.quant.int4 import dequantize
from worker.engine.quant.int4.linear import PACKED_ENV, Int4LinearModule, Int4Weight, quantize_linears

CPU = torch.device("cpu")


def _int4_and_dequantized(device: torch.device, dtype: torch.dtype, group: int, symmetric: bool):
    """(tiny-llama with its decoder linears packed INT4, a copy whose linears hold those weights dequantized)."""
    model, tokenizer = load_model("tiny-llama", device, dtype)
    dense = copy.deepcopy(model)
    replaced = quantize_linears(model, group_size=group, symmetric=symmetric)
    assert replaced == 7 * model.config.num_hidden_layers, "every decoder linear, not the output head"
    assert not isinstance(model.lm_head, Int4LinearModule)
    for name, module in model.named_modules():
        if isinstance(module, Int4LinearModule):
            with torch.no_grad():
                dense.get_submodule(name).weight.copy_(dequantize(module.layer, dtype))
    return model, dense, tokenizer


@pytest.mark.parametrize("symmetric", [True, False])
def test_owned_decoder_with_packed_int4_weights_decodes_as_the_dequantized_model(symmetric):
    model, dense, tokenizer = _int4_and_dequantized(CPU, torch.float32, group=32, symmetric=symmetric)
    engine = Engine(model, tokenizer, EngineConfig(decoder="owned", max_num_batched_tokens=64))
    decoder = engine.runner.decoder
    assert decoder is not None and decoder.is_quantized
    attn = model.model.layers[-1].self_attn
    fused = decoder.layers[-1].qkv_weight
    assert isinstance(fused, Int4Weight) and isinstance(decoder.layers[-1].down_weight, Int4Weight)
    assert fused.layer.out_features == sum(m.out_features for m in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert attn.q_proj.qweight.data_ptr() == fused.layer.qweight.data_ptr(), "q_proj views the fused rows"
    second = Engine(model, tokenizer, EngineConfig(decoder="owned", num_kv_blocks=8)).runner.decoder.layers[0]
    first = decoder.layers[0]
    assert isinstance(second.gate_up_weight, Int4Weight) and isinstance(first.gate_up_weight, Int4Weight)
    assert second.gate_up_weight.layer.qweight.data_ptr() == first.gate_up_weight.layer.qweight.data_ptr()

    reqs = _requests(tokenizer, 6)
    reference = {r.request_id: _greedy(dense, tokenizer, r) for r in reqs}
    assert len({t for ids in reference.values() for t in ids}) > 10, "diverse greedy text"
    results = engine.generate(reqs)
    assert {r.request_id: r.token_ids for r in results} == reference
    assert {r.request_id: _greedy(model, tokenizer, r) for r in reqs} == reference, "transformers' forward too"


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and w4a16.HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_owned_decoder_runs_w4a16_in_cuda_graphs():
    device = torch.device("cuda")
    model, dense, tokenizer = _int4_and_dequantized(device, torch.bfloat16, group=32, symmetric=True)
    reqs = _requests(tokenizer, 8)
    graphed = Engine(model, tokenizer, EngineConfig(decoder="owned", max_num_batched_tokens=256))
    assert graphed.runner.decoder is not None and graphed.runner.decoder.small_step_ops is not None
    eager = Engine(model, tokenizer, EngineConfig(decoder="owned", max_num_batched_tokens=256, use_cuda_graphs=False))
    tokens = {r.request_id: r.token_ids for r in graphed.generate(reqs)}
    assert tokens == {r.request_id: r.token_ids for r in eager.generate(reqs)}
    ids = torch.tensor([reqs[0].prompt_ids], device=device)
    with torch.no_grad():
        packed_logits, dense_logits = model(ids).logits.float(), dense(ids).logits.float()
    rel = float((packed_logits - dense_logits).norm() / dense_logits.norm())
    assert rel < 2e-2, f"transformers' forward over the packed modules vs the dequantized model: {rel}"


def test_deterministic_mode_refuses_packed_int4_weights_in_one_line():
    model, _, tokenizer = _int4_and_dequantized(CPU, torch.float32, group=32, symmetric=True)
    with pytest.raises(ValueError, match="deterministic mode runs unquantized weights only"):
        Engine(model, tokenizer, EngineConfig(decoder="owned", deterministic=True, num_kv_blocks=8))


@pytest.mark.parametrize("fmt", ["gptq-act-order", "ct-asym"])
def test_an_int4_checkpoint_kept_packed_decodes_as_the_dequantized_load(tmp_path, fmt):
    release = build_int4_checkpoint(tmp_path / fmt, fmt)
    packed, tokenizer = load_model(str(release.path), CPU, torch.float32, keep_int4=True)
    dense, _ = load_model(str(release.path), CPU, torch.float32, keep_int4=False)
    q_proj = packed.model.layers[0].self_attn.q_proj
    assert isinstance(q_proj, Int4LinearModule) and (q_proj.perm is not None) == (fmt == "gptq-act-order")
    assert not any(isinstance(m, Int4LinearModule) for m in dense.modules())
    engine = Engine(packed, tokenizer, EngineConfig(decoder="owned", max_num_batched_tokens=64))
    layer = engine.runner.decoder.layers[0]
    assert isinstance(layer.down_weight, Int4Weight) and isinstance(layer.o_weight, Int4Weight)
    # the fixture draws each act-order linear's own column order: fused ones that differ run dequantized
    assert isinstance(layer.gate_up_weight, torch.Tensor if fmt == "gptq-act-order" else Int4Weight)
    reqs = _requests(tokenizer, 4)
    reference = {r.request_id: _greedy(dense, tokenizer, r) for r in reqs}
    assert {r.request_id: r.token_ids for r in engine.generate(reqs)} == reference


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and w4a16.HAVE_TRITON), reason="needs CUDA, triton")
def test_gpu_an_int4_checkpoint_stays_packed_on_cuda_where_asked(tmp_path, monkeypatch):
    release = build_int4_checkpoint(tmp_path / "gptq", "gptq-act-order")
    model, _ = load_model(str(release.path), torch.device("cuda"), torch.bfloat16)
    assert not isinstance(model.model.layers[0].mlp.down_proj, Int4LinearModule), "dequantized by default"
    monkeypatch.setenv(PACKED_ENV, "1")
    model, tokenizer = load_model(str(release.path), torch.device("cuda"), torch.bfloat16)
    assert isinstance(model.model.layers[0].mlp.down_proj, Int4LinearModule), f"{PACKED_ENV}=1 keeps it packed"
    dense, _ = load_model(str(release.path), torch.device("cuda"), torch.bfloat16, keep_int4=False)
    reqs = _requests(tokenizer, 4)
    engine = Engine(model, tokenizer, EngineConfig(decoder="owned", max_num_batched_tokens=256))
    firsts = [res.token_ids[:1] == _greedy(dense, tokenizer, r)[:1] for r, res in zip(reqs, engine.generate(reqs), strict=True)]
    assert sum(firsts) >= 3, firsts

