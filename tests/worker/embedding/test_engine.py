"""The embedding engine against sentence-transformers' `encode` on the same checkpoint (CPU, fp32), its batching
by length, and what it refuses."""

from __future__ import annotations

import dataclasses
import json
import random
import shutil

import pytest
import torch

from tests.fixtures.checkpoints import corpus
from tests.fixtures.embedding_checkpoints import EMBEDDING_FAMILIES
from worker.embedding.checkpoint import EmbeddingCheckpointError, read_embedding_spec
from worker.embedding.engine import BUCKET_RATIO, EmbeddingEngine, EmbeddingRequest, EmbeddingResult
from worker.engine.api import EngineProtocol, ErrorCode, FinishReason, TokenizerProtocol

COSINE_MIN = 0.99999


def _texts(num: int, seed: int = 0) -> list[str]:
    rng = random.Random(seed)
    lines = corpus(200, seed=seed)
    # lengths from one word to a few sentences, so that the batches span several buckets
    return [" ".join(rng.sample(lines, rng.randint(1, 6)))[: rng.randint(1, 400)].strip() or "x" for _ in range(num)]


def _run(engine: EmbeddingEngine, requests: list[EmbeddingRequest], timeout: float = 60) -> dict[str, EmbeddingResult]:
    engine.start()
    try:
        for request in requests:
            engine.add_request(request)
        results: dict[str, EmbeddingResult] = {}
        while len(results) < len(requests):
            got = engine.get_results(timeout=timeout)
            assert got, "the engine returned nothing in time"
            for result in got:
                assert isinstance(result, EmbeddingResult)
                results[result.request_id] = result
        return results
    finally:
        engine.shutdown()


@pytest.fixture(scope="module")
def sentence_transformer():
    from sentence_transformers import SentenceTransformer

    return lambda path: SentenceTransformer(str(path), device="cpu")


@pytest.mark.parametrize("family", list(EMBEDDING_FAMILIES))
def test_equals_sentence_transformers_encode(family, embedding_checkpoints, sentence_transformer):
    path = embedding_checkpoints[family]
    texts = _texts(40)
    reference = sentence_transformer(path).encode(texts, convert_to_tensor=True, batch_size=16).float()
    # small batches, so that requests of several lengths and buckets run in several steps
    engine = EmbeddingEngine.from_model(str(path), device="cpu", max_num_batched_tokens=1024, max_num_seqs=8)
    requests = [
        EmbeddingRequest(f"r{i}", engine.tokenizer.encode(engine.spec.prompt + text)) for i, text in enumerate(texts)
    ]
    results = _run(engine, requests)
    got = torch.tensor([results[f"r{i}"].embedding for i in range(len(texts))])
    cosine = torch.nn.functional.cosine_similarity(got, reference, dim=-1)
    assert cosine.min().item() >= COSINE_MIN, cosine
    if engine.spec.normalize:
        assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)
    else:
        assert torch.allclose(got, reference, rtol=1e-4, atol=1e-5)
    assert engine.stats().steps > 1
    for request in requests:
        usage = results[request.request_id].usage
        assert usage.prompt_tokens == len(request.prompt_ids) and usage.completion_tokens == 0
        assert usage.gpu_seconds > 0


def test_matryoshka_dimensions_truncate_then_normalize(embedding_checkpoints, sentence_transformer):
    path = embedding_checkpoints["qwen3"]
    texts = _texts(6, seed=1)
    reference = sentence_transformer(path).encode(texts, convert_to_tensor=True, truncate_dim=16).float()
    engine = EmbeddingEngine.from_model(str(path), device="cpu")
    requests = [
        EmbeddingRequest(f"r{i}", engine.tokenizer.encode(engine.spec.prompt + t), dimensions=16)
        for i, t in enumerate(texts)
    ]
    results = _run(engine, requests)
    got = torch.tensor([results[f"r{i}"].embedding for i in range(len(texts))])
    assert got.shape == (len(texts), 16)
    assert torch.nn.functional.cosine_similarity(got, reference, dim=-1).min() >= COSINE_MIN
    assert torch.allclose(got.norm(dim=-1), torch.ones(len(texts)), atol=1e-5)


def test_refuses_what_the_model_cannot_run(embedding_checkpoints):
    engine = EmbeddingEngine.from_model(str(embedding_checkpoints["bert"]), device="cpu")
    vocab = engine.model.get_input_embeddings().num_embeddings
    requests = [
        EmbeddingRequest("long", [5] * (engine.spec.max_seq_length + 1)),
        EmbeddingRequest("vocab", [5, vocab]),
        EmbeddingRequest("matryoshka", [5, 6], dimensions=8),  # the BERT fixture declares no Matryoshka support
        EmbeddingRequest("too-wide", [5, 6], dimensions=engine.spec.dimension + 1),
        EmbeddingRequest("own-dimension", [5, 6], dimensions=engine.spec.dimension),
    ]
    results = _run(engine, requests)
    codes = {rid: (r.finish_reason, r.error_code) for rid, r in results.items()}
    assert codes["long"] == (FinishReason.ERROR, ErrorCode.CONTEXT_LENGTH_EXCEEDED)
    assert codes["vocab"] == (FinishReason.ERROR, ErrorCode.INVALID_PROMPT)
    assert codes["matryoshka"] == (FinishReason.ERROR, ErrorCode.INVALID_VALUE)
    assert "Matryoshka" in (results["matryoshka"].error or "")
    assert codes["too-wide"] == (FinishReason.ERROR, ErrorCode.INVALID_VALUE)
    assert codes["own-dimension"] == (FinishReason.STOP, None)
    assert len(results["own-dimension"].embedding) == engine.spec.dimension


@pytest.mark.parametrize("decoder", ["auto", "hf"])
def test_batches_keep_padding_within_a_bucket(embedding_checkpoints, decoder):
    """A batch holds one length bucket, within the token bound: real tokens packed ("auto" on BERT), padded ones in
    transformers' padded forward ("hf")."""
    engine = EmbeddingEngine.from_model(
        str(embedding_checkpoints["bert"]), device="cpu", max_num_batched_tokens=2048, decoder=decoder
    )
    assert engine.forward == ("packed" if decoder == "auto" else "transformers")
    seen: list[list[int]] = []
    launch = engine.launch

    def recording(batch_ids):
        seen.append([len(ids) for ids in batch_ids])
        return launch(batch_ids)

    engine.launch = recording  # type: ignore[method-assign]
    rng = random.Random(0)
    requests = [EmbeddingRequest(f"r{i}", [7] * rng.randint(1, 200)) for i in range(120)]
    results = _run(engine, requests)
    assert all(r.finish_reason == FinishReason.STOP for r in results.values())
    assert sum(map(len, seen)) == len(requests)
    for lengths in seen:
        assert max(lengths) <= BUCKET_RATIO * min(lengths) + 1, lengths
        assert (sum(lengths) if decoder == "auto" else max(lengths) * len(lengths)) <= 2048


def test_abort_of_a_waiting_request_cancels_it(embedding_checkpoints):
    engine = EmbeddingEngine.from_model(str(embedding_checkpoints["bert"]), device="cpu")
    assert isinstance(engine, EngineProtocol) and isinstance(engine.tokenizer, TokenizerProtocol)
    engine.add_request(EmbeddingRequest("a", [5, 6, 7]))  # not started: it waits
    engine.abort("a")
    [result] = engine.get_results()
    assert result.finish_reason == FinishReason.CANCELLED


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda p: _append_module(p, "sentence_transformers.models.Dense", "2_Dense"), "Transformer -> Pooling -> Dense"),
        (lambda p: _set_pooling(p, pooling_mode_lasttoken=False, pooling_mode_weightedmean_tokens=True), "weightedmean"),
        (lambda p: _set_pooling(p, pooling_mode_cls_token=True), "exactly one"),
    ],
)
def test_checkpoints_cbq_cannot_run_as_released_are_refused(change, message, embedding_checkpoints, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(embedding_checkpoints["qwen3"], path)
    change(path)
    with pytest.raises(EmbeddingCheckpointError, match=message):
        read_embedding_spec(str(path))


def test_matryoshka_dimensions_from_config(embedding_checkpoints, tmp_path):
    path = tmp_path / "model"
    shutil.copytree(embedding_checkpoints["qwen3"], path)
    config = json.loads((path / "config.json").read_text())
    config.pop("is_matryoshka")
    config["matryoshka_dimensions"] = [16, 32]
    (path / "config.json").write_text(json.dumps(config))
    spec = read_embedding_spec(str(path))
    assert spec.check_dimensions(16) is None and spec.check_dimensions(64) is None
    assert "not one of" in (spec.check_dimensions(24) or "")


def _append_module(path, type_name: str, folder: str) -> None:
    modules = json.loads((path / "modules.json").read_text())
    modules.insert(2, {"idx": 2, "name": "2", "path": folder, "type": type_name})
    (path / "modules.json").write_text(json.dumps(modules))


def _set_pooling(path, **flags) -> None:
    config_path = path / "1_Pooling" / "config.json"
    config = json.loads(config_path.read_text()) | flags
    config_path.write_text(json.dumps(config))


def test_the_default_batch_holds_the_longest_input(embedding_checkpoints):
    loaded = EmbeddingEngine.from_model(str(embedding_checkpoints["bert"]), device="cpu")
    long_spec = dataclasses.replace(loaded.spec, max_seq_length=8192)  # bge-m3's, over the CPU default of 4,096

    def build(**kwargs):
        return EmbeddingEngine(loaded.model, loaded.tokenizer, long_spec, 0, loaded.device, **kwargs)

    assert build().max_batch_tokens == 8192
    assert build(max_batch_tokens=16384).max_batch_tokens == 16384
    with pytest.raises(ValueError, match="below the model's max_seq_length"):
        build(max_batch_tokens=4096)
