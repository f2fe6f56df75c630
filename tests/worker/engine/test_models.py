"""Model loading: presets with the byte tokenizer, a checkpoint saved to disk and loaded back by path,
unsupported model types, and the byte tokenizer itself."""

from __future__ import annotations

import pytest
import torch

from worker.engine.api import EngineRequest, SamplingParams
from worker.engine.config import EngineConfig
from worker.engine.engine import Engine
from worker.engine.models import PRESETS, SUPPORTED_MODEL_TYPES, load_model, preset_config
from worker.engine.quant import linear_method
from worker.engine.tokenizer import ByteTokenizer

CPU = torch.device("cpu")
TINY_PRESETS = [name for name in PRESETS if name.startswith("tiny-")]


@pytest.mark.parametrize("name", list(PRESETS))
def test_preset_configs_carry_the_byte_tokenizer_ids(name):
    tok = ByteTokenizer()
    config = preset_config(name)
    assert config.model_type == PRESETS[name][0] and config.model_type in SUPPORTED_MODEL_TYPES
    assert (config.bos_token_id, config.eos_token_id, config.pad_token_id) == (256, 257, 258)
    assert config.vocab_size >= tok.vocab_size


@pytest.mark.parametrize("name", TINY_PRESETS)
def test_tiny_presets_build_with_the_byte_tokenizer(name):
    model, tok = load_model(
        name, CPU, torch.float32
    )  # not the shared instance: an Engine may have patched it
    assert isinstance(tok, ByteTokenizer)
    assert model.config.model_type == PRESETS[name][0]
    assert model.dtype == torch.float32 and not model.training
    assert not any(p.requires_grad for p in model.parameters())
    with torch.no_grad():
        logits = model(torch.tensor([tok.encode("hi")])).logits
    assert logits.shape == (1, 3, model.config.vocab_size) and torch.isfinite(logits).all()


def test_presets_are_deterministic_in_the_seed():
    a, _ = load_model("tiny-qwen3", CPU, torch.float32, seed=0)
    b, _ = load_model("tiny-qwen3", CPU, torch.float32, seed=0)
    c, _ = load_model("tiny-qwen3", CPU, torch.float32, seed=1)
    wa, wb, wc = (m.model.embed_tokens.weight for m in (a, b, c))
    assert torch.equal(wa, wb) and not torch.equal(wa, wc)


def greedy(engine: Engine, tok) -> list[list[int]]:
    reqs = [
        EngineRequest(f"r{i}", tok.encode(text), SamplingParams(12))
        for i, text in enumerate(["abc", "hello x"])
    ]
    return [r.token_ids for r in engine.generate(reqs)]


def test_saved_checkpoint_loads_back_by_path(tmp_path):
    model, tok = load_model("tiny-llama", CPU, torch.float32)
    model.save_pretrained(tmp_path)  # weights and config only: no tokenizer files
    loaded, loaded_tok = load_model(str(tmp_path), CPU, torch.float32)
    assert isinstance(loaded_tok, ByteTokenizer), (
        "a checkpoint without tokenizer files uses the byte tokenizer"
    )
    assert loaded.config.model_type == "llama" and not loaded.training
    original = dict(model.state_dict())
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, original[key]), key

    config = EngineConfig(mode="sync", num_kv_blocks=32)
    expected = greedy(Engine(model, tok, config), tok)
    assert any(len(ids) > 3 for ids in expected)
    assert greedy(Engine(loaded, loaded_tok, config), loaded_tok) == expected
    by_path = Engine.from_model(str(tmp_path), device="cpu", mode="sync", num_kv_blocks=32)
    assert by_path.device == CPU and by_path.model.dtype == torch.float32
    assert greedy(by_path, by_path.tokenizer) == expected
    by_name = Engine.from_model("tiny-llama", device="cpu", mode="sync", num_kv_blocks=32)
    assert greedy(by_name, by_name.tokenizer) == expected


@pytest.mark.parametrize("quantization", [None, "fp8"])
def test_a_checkpoint_is_read_by_slice_through_the_parallel_layers(tmp_path, monkeypatch, quantization):
    """The one loader: a bf16/fp32 checkpoint (and `--quantization fp8` on it) is read by slice at a world of one, as
    the tensor-parallel ranks read it (no transformers from_pretrained): every value equal to the checkpoint's (or
    its per-channel FP8 rounding), q/k/v and gate/up views of one parallel layer's weight each."""
    from transformers import AutoModelForCausalLM

    from worker.engine.quant import OnlineFp8Config
    from worker.engine.quant.fp8 import dequantize_weight

    model, _ = load_model("tiny-qwen3", CPU, torch.float32)
    model.save_pretrained(tmp_path)

    def refuse(*args, **kwargs):
        raise AssertionError("from_pretrained ran on the owned path")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)
    loaded, _ = load_model(str(tmp_path), CPU, torch.float32, quantization=quantization)
    assert "quantization_config" not in loaded.config.to_dict()
    scheme = OnlineFp8Config().scheme_for("model.layers.0.mlp.up_proj")
    original = dict(model.state_dict())
    for key, value in loaded.state_dict().items():
        expected = original[key]
        if quantization and key.endswith("proj.weight"):  # rounded per output channel, then dequantized (CPU)
            method = linear_method(OnlineFp8Config(), key.removesuffix(".weight"))
            expected = dequantize_weight(method.load({key: expected}, key.removesuffix(".weight")), torch.float32)
            assert method.scheme == scheme
        assert torch.equal(value, expected), key
    attn, mlp = loaded.model.layers[0].self_attn, loaded.model.layers[0].mlp
    for first, second in ((attn.q_proj, attn.k_proj), (mlp.gate_proj, mlp.up_proj)):
        assert first.weight.untyped_storage().data_ptr() == second.weight.untyped_storage().data_ptr()


def test_a_checkpoint_with_only_pickled_weights_still_loads(tmp_path):
    """pytorch_model.bin without safetensors (older releases): the slice reader reads safetensors only, so such a
    folder takes transformers' from_pretrained."""
    import os

    model, _ = load_model("tiny-llama", CPU, torch.float32)
    model.save_pretrained(tmp_path)
    os.remove(tmp_path / "model.safetensors")
    torch.save(model.state_dict(), tmp_path / "pytorch_model.bin")
    loaded, _ = load_model(str(tmp_path), CPU, torch.float32)
    original = dict(model.state_dict())
    for key, value in loaded.state_dict().items():
        assert torch.equal(value, original[key]), key


def tiny_gpt2_config():
    from transformers import GPT2Config

    return GPT2Config(
        n_layer=1, n_embd=16, n_head=2, vocab_size=64, n_positions=32, bos_token_id=0, eos_token_id=0
    )


def test_unsupported_model_type_is_a_clear_error(tmp_path):
    from transformers import GPT2LMHeadModel

    config_only = tmp_path / "config_only"
    tiny_gpt2_config().save_pretrained(config_only)  # rejected from its config, before any weights are read
    with_weights = tmp_path / "with_weights"
    GPT2LMHeadModel(tiny_gpt2_config()).save_pretrained(with_weights)
    for path in (config_only, with_weights):
        with pytest.raises(ValueError, match="model type 'gpt2' is not supported; cbq runs llama, mistral"):
            load_model(str(path), CPU, torch.float32)
    with pytest.raises(ValueError, match="'gpt2' is not supported"):
        Engine.from_model(str(with_weights), device="cpu")


def test_byte_tokenizer_round_trips_utf8():
    tok = ByteTokenizer()
    text = "Hello, wörld — 日本語 🙂\n\ttab"
    ids = tok.encode(text)
    assert ids[0] == tok.bos_token_id and all(0 <= i < 256 for i in ids[1:])
    assert len(ids) == 1 + len(text.encode("utf-8"))
    assert tok.decode(ids) == text  # BOS decodes to nothing
    assert tok.encode("") == [tok.bos_token_id] and tok.decode([]) == ""
    # Special and unused ids decode to nothing; a cut multi-byte character decodes to a replacement.
    assert tok.decode([tok.bos_token_id, 104, tok.eos_token_id, 105, tok.pad_token_id, 300]) == "hi"
    assert tok.decode(list("é".encode())[:1]) == "\ufffd"
    assert (tok.vocab_size, tok.eos_token_ids) == (259, frozenset({257}))


def test_byte_tokenizer_chat_template():
    tok = ByteTokenizer()
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Héllo?"},
        {"role": "assistant", "content": "Hi."},
        {"role": "user", "content": "Bye"},
    ]
    ids = tok.encode_chat(messages)
    assert ids[0] == tok.bos_token_id and ids.count(tok.bos_token_id) == 1
    assert tok.decode(ids) == (
        "<|system|>\nBe brief.\n<|user|>\nHéllo?\n<|assistant|>\nHi.\n<|user|>\nBye\n<|assistant|>\n"
    )
    assert tok.encode_chat([]) == tok.encode("<|assistant|>\n")
    # a tool-use transcript (as ChatMessage.for_template gives it): calls as JSON where there is no content
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": {"x": 1}}}
    transcript = [{"role": "assistant", "tool_calls": [call]}, {"role": "tool", "tool_call_id": "c1", "content": "2"}]
    assert tok.decode(tok.encode_chat(transcript)) == (
        '<|assistant|>\n[{"name": "f", "arguments": {"x": 1}}]\n<|tool|>\n2\n<|assistant|>\n'
    )
