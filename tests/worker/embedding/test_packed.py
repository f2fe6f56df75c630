"""The packed forwards of embedding models (worker/embedding/packed.py, packed_encoder.py) on the CPU: which models take it, the
same vectors as transformers' padded forward in every pooling mode, packed pooling against padded pooling, and
batches bounded by their real tokens."""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from tests.worker.embedding.test_engine import _run, _texts
from tests.worker.engine.test_fused_kernels import _interpret, needs_triton
from worker.embedding.checkpoint import EmbeddingCheckpointError
from worker.embedding.engine import PACKED, TRANSFORMERS, EmbeddingEngine, EmbeddingRequest
from worker.embedding.pooling import pool, pool_packed

COSINE_MIN = 0.99999
MODES = ["cls", "mean", "max", "mean_sqrt_len_tokens", "lasttoken"]


@pytest.mark.parametrize(
    "family, decoder, forward",
    [
        ("qwen3", "auto", PACKED),
        ("mistral", "owned", PACKED),
        ("qwen3", "hf", TRANSFORMERS),
        ("bert", "auto", PACKED),
        ("xlm_roberta", "owned", PACKED),
        ("bert", "hf", TRANSFORMERS),
        ("modernbert", "auto", TRANSFORMERS),
    ],
)
def test_decoder_families_take_the_packed_forward(family, decoder, forward, embedding_checkpoints):
    engine = EmbeddingEngine.from_model(str(embedding_checkpoints[family]), device="cpu", decoder=decoder)
    assert engine.forward == forward
    assert f"{forward} forward" in engine.describe("m", "m")


def test_decoder_owned_refuses_an_encoder_it_does_not_pack(embedding_checkpoints):
    with pytest.raises(EmbeddingCheckpointError, match="modernbert is not an encoder cbq packs"):
        EmbeddingEngine.from_model(str(embedding_checkpoints["modernbert"]), device="cpu", decoder="owned")


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("family", ["qwen3", "mistral", "bert", "xlm_roberta"])
def test_packed_equals_the_transformers_forward(family, mode, embedding_checkpoints):
    hf = EmbeddingEngine.from_model(str(embedding_checkpoints[family]), device="cpu", decoder="hf")
    spec = dataclasses.replace(hf.spec, pooling=mode)
    hf.spec = spec
    packed = EmbeddingEngine(hf.model, hf.tokenizer, spec, hf.pad_token_id, hf.device, max_batch_tokens=1024)
    assert packed.forward == PACKED
    batch = [hf.tokenizer.encode(spec.prompt + text) for text in _texts(24, seed=5)]
    assert max(map(len, batch)) > 32  # past the mistral fixture's sliding window
    want = torch.tensor(hf.embed(batch))
    got = torch.tensor(packed.embed(batch))
    assert torch.equal(torch.tensor(hf.embed(batch)), want), "the padded forward keeps its own attention after"
    cosine = torch.nn.functional.cosine_similarity(got, want, dim=-1)
    assert cosine.min().item() >= COSINE_MIN, cosine
    assert torch.allclose(got, want, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mode", MODES)
def test_packed_pooling_equals_padded_pooling(mode):
    torch.manual_seed(0)
    lengths = torch.tensor([3, 1, 7, 4])
    padded = torch.randn(len(lengths), int(lengths.max()), 8)
    mask = (torch.arange(padded.shape[1])[None, :] < lengths[:, None]).long()
    packed = torch.cat([padded[i, :n] for i, n in enumerate(lengths.tolist())])
    cu = torch.zeros(len(lengths) + 1, dtype=torch.int64)
    cu[1:] = lengths.cumsum(0)
    torch.testing.assert_close(pool_packed(packed, cu, lengths, mode), pool(padded, mask, lengths, mode))


def test_packed_batches_are_bounded_by_their_real_tokens(embedding_checkpoints):
    engine = EmbeddingEngine.from_model(str(embedding_checkpoints["qwen3"]), device="cpu", max_num_batched_tokens=1024)
    seen: list[list[int]] = []
    launch = engine.launch

    def recording(batch_ids):
        seen.append([len(ids) for ids in batch_ids])
        return launch(batch_ids)

    engine.launch = recording  # type: ignore[method-assign]
    rng = random.Random(1)
    requests = [EmbeddingRequest(f"r{i}", [7] * rng.randint(100, 200)) for i in range(60)]
    results = _run(engine, requests)
    assert all(r.finish_reason.value == "stop" for r in results.values())
    assert sum(map(len, seen)) == len(requests)
    assert all(sum(lengths) <= 1024 for lengths in seen), seen
    # packed: a batch fills its budget with real tokens, past what padding to the longest would have allowed
    assert any(max(lengths) * len(lengths) > 1024 for lengths in seen), seen


# The packed forward's GPU path (the owned decoder's Triton kernels, the varlen paged prefill over the scratch cache)
# against its torch path, run by Triton's interpreter on the CPU in a subprocess (TRITON_INTERPRET must be set before
# triton is imported). Qwen3 (q/k norms) and Mistral with a sliding window shorter than the longest input.
INTERPRETED_CHECK = """
import torch
from transformers import AutoConfig, AutoModel
from tests.worker.engine.test_attention_triton import _patch_triton_interpreter
from worker.embedding.packed import PackedDecoderForward

_patch_triton_interpreter()  # the interpreter's loop bounds loaded from memory (test_attention_triton.py says why)

def base_model(model_type, **extra):
    config = AutoConfig.for_model(model_type, vocab_size=256, hidden_size=64, intermediate_size=128,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=256,
        **extra)
    torch.manual_seed(0)
    return AutoModel.from_config(config, dtype=torch.float32).eval()

lengths = [5, 1, 40, 17, 33]
batch = [[(7 * i + 3 * j) % 250 + 1 for j in range(n)] for i, n in enumerate(lengths)]
for model_type, extra in (("qwen3", {}), ("mistral", {"sliding_window": 16})):
    for pooling in ("lasttoken", "mean"):
        want = PackedDecoderForward(base_model(model_type, **extra), torch.device("cpu"), 256, use_triton=False)
        got = PackedDecoderForward(base_model(model_type, **extra), torch.device("cpu"), 256, use_triton=True)
        assert got.decoder.use_triton and type(got.backend).__name__ == "TritonAttentionBackend"
        a = want.launch(batch, pooling, True)
        b = got.launch(batch, pooling, True)
        assert a.shape == (len(lengths), 64), a.shape
        torch.testing.assert_close(b, a, rtol=1e-4, atol=1e-5)
print("packed forward matches")
"""


@needs_triton
def test_packed_forward_triton_path_matches_torch_path_in_the_interpreter():
    _interpret(INTERPRETED_CHECK, "packed forward matches")
