"""The owned decoder's construction: fused weights are views the HF model shares, a second build
allocates nothing, the rotary tables equal transformers', and the decoder choice is honoured.
Token-for-token exactness against `model.generate` is in test_engine_exact.py."""

from __future__ import annotations

import pytest
import torch

from worker.engine.decoder import OwnedDecoder, build_decoder, rotary_tables, unsupported_reason
from worker.engine.models import load_model


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "tiny-qwen3"])
def test_fused_weights_are_shared_views_and_the_hf_model_is_unchanged(name):
    model, _ = load_model(name, torch.device("cpu"), torch.float32)
    ids = torch.tensor([[1, 7, 42, 9, 100]])
    with torch.inference_mode():
        before = model(ids).logits
    layer = model.model.layers[0]
    q_weight = layer.self_attn.q_proj.weight.detach().clone()
    decoder = OwnedDecoder(model, 64, use_triton=False)
    w = decoder.layers[0]
    attn = layer.self_attn
    assert w.qkv_weight.shape[0] == attn.q_proj.out_features + 2 * attn.k_proj.out_features
    assert attn.q_proj.weight.data_ptr() == w.qkv_weight.data_ptr()  # a view, not a copy
    assert attn.v_proj.weight.data_ptr() == w.qkv_weight[-attn.v_proj.out_features :].data_ptr()
    assert (
        layer.mlp.up_proj.weight.data_ptr() == w.gate_up_weight[layer.mlp.gate_proj.out_features :].data_ptr()
    )
    assert torch.equal(attn.q_proj.weight, q_weight)
    assert (w.qkv_bias is not None) == (name == "tiny-qwen2")  # Qwen2's q/k/v biases are fused too
    assert (w.q_norm is not None) == (name == "tiny-qwen3")
    with torch.inference_mode():
        assert torch.equal(model(ids).logits, before)
    again = OwnedDecoder(model, 64, use_triton=False)  # a second engine on the same model
    assert again.layers[0].qkv_weight.data_ptr() == w.qkv_weight.data_ptr()
    assert again.layers[1].gate_up_weight.data_ptr() == decoder.layers[1].gate_up_weight.data_ptr()


def test_rotary_tables_equal_transformers_rotary_forward():
    model, _ = load_model("tiny-llama", torch.device("cpu"), torch.float32)
    rotary = model.model.rotary_emb
    positions = torch.tensor([[0, 1, 5, 63, 200]])
    cos, sin = rotary(torch.zeros(1, dtype=torch.float32), positions)
    cos_table, sin_table = rotary_tables(rotary, 256, model.model.embed_tokens.weight)
    assert torch.equal(cos_table[positions[0]], cos[0]) and torch.equal(sin_table[positions[0]], sin[0])


def test_decoder_choice(tiny_models):
    model, _ = tiny_models("tiny-mistral")
    cpu = torch.device("cpu")
    assert build_decoder(model, "hf", cpu, 64, False) is None
    assert build_decoder(model, "auto", cpu, 64, False) is None  # CPU keeps transformers' forward
    assert isinstance(build_decoder(model, "owned", cpu, 64, False), OwnedDecoder)
    assert unsupported_reason(model) is None
    # the small-step path (Triton GEMMs chained by PDL) needs CUDA sm90+: "auto" falls back, "triton" says why
    assert build_decoder(model, "owned", cpu, 64, True, gemm="auto").small_step_ops is None
    with pytest.raises(ValueError, match="decode_gemm 'triton' needs CUDA sm90"):
        build_decoder(model, "owned", cpu, 64, True, gemm="triton")


def test_unsupported_models_are_refused_by_owned_and_skipped_by_auto():
    model, _ = load_model("tiny-llama", torch.device("cpu"), torch.float32)
    model.model.rotary_emb.rope_type = "dynamic"
    assert "dynamic" in unsupported_reason(model)
    with pytest.raises(ValueError, match="does not support"):
        build_decoder(model, "owned", torch.device("cpu"), 64, False)
    assert build_decoder(model, "auto", torch.device("cuda"), 64, False) is None
