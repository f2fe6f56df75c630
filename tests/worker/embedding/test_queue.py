"""Embedding lines through the queue: `cbq submit` + a worker of an embedding model + `cbq results`, `cbq run`,
the kind check of a worker given lines of the other kind, and the stats and metrics that tell the kinds apart."""

from __future__ import annotations

import json

import openai
import pytest
import torch
from click.testing import CliRunner

from producer.cli import main
from schemas import keys
from schemas.embeddings import decode_embedding
from worker.embedding.engine import EmbeddingEngine
from worker.fake_engine import FakeEngine
from worker.metrics import WorkerCollector

TEXTS = ["the cat sat on the mat", "water is wet", "a", "first answer to the question of the day " * 4]


def _embedding_line(custom_id: str, input, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/embeddings", "body": {"model": "emb", "input": input, **body}}


@pytest.fixture(scope="module")
def reference(embedding_checkpoints):
    """sentence-transformers' embeddings of TEXTS on the Qwen3-Embedding-shaped fixture (its default prompt)."""
    from sentence_transformers import SentenceTransformer

    model = SentenceTransformer(str(embedding_checkpoints["qwen3"]), device="cpu")
    return model.encode(TEXTS, convert_to_tensor=True).float()


def _cosine(a, b) -> float:
    return torch.nn.functional.cosine_similarity(torch.tensor(a).float(), b, dim=-1).item()


def _lines(stdout: str) -> list[dict]:
    return [json.loads(line) for line in stdout.splitlines()]


def test_openai_embedding_lines_through_submit_worker_results(
    cbq, burst_worker, write_jsonl, embedding_checkpoints, reference
):
    path = embedding_checkpoints["qwen3"]
    engine = EmbeddingEngine.from_model(str(path), device="cpu")
    token_ids = engine.tokenizer.encode(engine.spec.prompt + TEXTS[2])
    objs = [
        _embedding_line("one", TEXTS[0]),
        _embedding_line("many", TEXTS, encoding_format="base64"),
        _embedding_line("ids", token_ids),
        _embedding_line("short", [TEXTS[1], TEXTS[3]], dimensions=16, user="u1"),
        _embedding_line("wide", TEXTS[0], dimensions=65),
        {"custom_id": "chat", "method": "POST", "url": "/v1/chat/completions",
         "body": {"model": "emb", "messages": [{"role": "user", "content": "hi"}]}},
    ]
    submitted = cbq("submit", write_jsonl(objs), "--json", "--chunk-size", "3")
    batch_id = json.loads(submitted.stdout.splitlines()[-1])["batch_id"]
    worker = burst_worker(engine, queue=keys.model_queue("cbq", "emb"), model_name="emb")
    out = {line["custom_id"]: line for line in _lines(cbq("results", batch_id, "--format", "openai").stdout)}
    assert list(out) == ["one", "many", "ids", "short", "wide", "chat"]

    def body(custom_id: str) -> openai.types.CreateEmbeddingResponse:
        response = out[custom_id]["response"]
        assert response["status_code"] == 200, response
        raw = response["body"]
        if any(isinstance(item["embedding"], str) for item in raw["data"]):  # base64: decoded as the SDK does
            raw = {**raw, "data": [{**d, "embedding": decode_embedding(d["embedding"])} for d in raw["data"]]}
        return openai.types.CreateEmbeddingResponse.model_validate(raw)

    one = body("one")
    assert one.object == "list" and one.model == "emb" and len(one.data) == 1
    assert _cosine(one.data[0].embedding, reference[0]) >= 0.99999
    assert one.usage.prompt_tokens == one.usage.total_tokens == len(engine.tokenizer.encode(engine.spec.prompt + TEXTS[0]))

    assert all(isinstance(d["embedding"], str) for d in out["many"]["response"]["body"]["data"])
    many = body("many")
    assert [d.index for d in many.data] == [0, 1, 2, 3]
    floats = [d.embedding for d in many.data]  # from base64 of little-endian float32
    for i, vector in enumerate(floats):
        assert _cosine(vector, reference[i]) >= 0.99999
    assert floats[0] == pytest.approx(one.data[0].embedding, abs=1e-6)  # the float form's values
    assert many.usage.prompt_tokens == sum(len(engine.tokenizer.encode(engine.spec.prompt + t)) for t in TEXTS)

    assert _cosine(body("ids").data[0].embedding, reference[2]) >= 0.99999
    short = body("short")
    assert [len(d.embedding) for d in short.data] == [16, 16]
    assert torch.tensor(short.data[0].embedding).norm().item() == pytest.approx(1.0, abs=1e-5)

    wide = out["wide"]["response"]
    assert wide["status_code"] == 400 and wide["body"]["error"]["param"] == "dimensions"
    chat = out["chat"]["response"]
    assert chat["status_code"] == 400 and "embedding model" in chat["body"]["error"]["message"]

    status = json.loads(cbq("status", batch_id, "--json").stdout)
    assert status["num_completed"] == 1 + 4 + 1 + 2 and status["num_failed"] == 2
    # cbq's own result lines carry each input's vector (in the request's encoding) and its prompt tokens
    cbq_lines = _lines(cbq("results", batch_id).stdout)
    assert isinstance(cbq_lines[1]["embedding"], str) and isinstance(cbq_lines[0]["embedding"], list)
    assert all(line["usage"]["completion_tokens"] == 0 for line in cbq_lines)
    assert all(line["usage"]["gpu_seconds"] > 0 for line in cbq_lines if line["finish_reason"] == "stop")

    stats = json.loads(cbq("stats", "--json").stdout)
    [published] = [w for w in stats["workers"] if w["worker_name"] == worker.name]
    assert published["model_kind"] == "embed" and published["prompt_tokens"] > 0
    assert published["prompt_tokens_per_second"] > 0 and published["output_tokens"] == 0
    assert " embed " in cbq("stats").stdout
    metrics = {m.name: m for m in WorkerCollector(worker).collect()}
    kinds = {s.labels["model_kind"]: s.value for s in metrics["cbq_worker_model_kind"].samples}
    assert kinds == {"generate": 0.0, "embed": 1.0}


def test_a_generation_model_fails_embedding_lines_alone(cbq, burst_worker, write_jsonl):
    objs = [{"custom_id": "gen", "prompt": "hello", "max_new_tokens": 2}, {"custom_id": "emb", "input": "hello"}]
    batch_id = json.loads(cbq("submit", write_jsonl(objs), "--json").stdout.splitlines()[-1])["batch_id"]
    burst_worker(FakeEngine())
    lines = {line["custom_id"]: line for line in _lines(cbq("results", batch_id).stdout)}
    assert lines["gen"]["finish_reason"] == "length"
    assert lines["emb"]["finish_reason"] == "error" and lines["emb"]["error_code"] == "invalid_value"
    assert "generation model" in lines["emb"]["error"]


def test_cbq_run_embeds_native_and_openai_lines(tmp_path, embedding_checkpoints, reference):
    path = embedding_checkpoints["qwen3"]
    source = tmp_path / "in.jsonl"
    objs = [{"custom_id": "a", "input": TEXTS[0]}, {"custom_id": "b", "input": TEXTS[1:3], "encoding_format": "base64"}]
    source.write_text("".join(json.dumps(o) + "\n" for o in objs))
    out = tmp_path / "out.jsonl"
    result = CliRunner().invoke(main, ["run", str(source), "-o", str(out), "--model", str(path), "--device", "cpu"])
    assert result.exit_code == 0, result.output
    lines = _lines(out.read_text())
    assert [(line["custom_id"], line["finish_reason"]) for line in lines] == [("a", "stop"), ("b", "stop"), ("b", "stop")]
    for line, want in zip(lines, reference[:3], strict=True):
        assert _cosine(decode_embedding(line["embedding"]), want) >= 0.99999

    openai_source = tmp_path / "openai.jsonl"
    openai_source.write_text(json.dumps(_embedding_line("x", TEXTS[:2])) + "\n")
    openai_out = tmp_path / "openai_out.jsonl"
    args = ["run", str(openai_source), "-o", str(openai_out), "--model", str(path), "--device", "cpu",
            "--format", "openai", "--served-model-name", "emb"]
    result = CliRunner().invoke(main, args)
    assert result.exit_code == 0, result.output
    [line] = _lines(openai_out.read_text())
    parsed = openai.types.CreateEmbeddingResponse.model_validate(line["response"]["body"])
    assert [_cosine(d.embedding, reference[i]) >= 0.99999 for i, d in enumerate(parsed.data)] == [True, True]
