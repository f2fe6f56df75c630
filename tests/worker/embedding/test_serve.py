"""`cbq serve` with a worker of an embedding model: a batch with endpoint `/v1/embeddings` through the `openai` SDK,
its output parsed by the SDK's `CreateEmbeddingResponse` and equal to sentence-transformers' `encode`."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import uuid

import pytest
import redis
import torch

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from tests.producer.test_openai_server import ROOT, _free_port, _get, _wait_for, wait_for_batch  # noqa: E402

pytestmark = pytest.mark.redis_server
API_KEY = "embed-key"
TEXTS = ["the cat sat on the mat", "water is wet", "first answer to the question of the day " * 3]


@pytest.fixture
def embedding_stack(tmp_path, private_redis_url, embedding_checkpoints):
    conn = redis.Redis.from_url(private_redis_url, socket_connect_timeout=0.5)
    conn.flushdb()
    port = _free_port()
    env = {**os.environ, "CBQ_API_KEYS": API_KEY, "CBQ_REDIS_URL": private_redis_url,
           "CBQ_QUEUE": f"cbq-embed-{uuid.uuid4().hex[:8]}"}
    cli = [sys.executable, "-m", "producer.cli"]
    log = open(tmp_path / "stack.log", "w")  # noqa: SIM115
    model = str(embedding_checkpoints["qwen3"])
    procs = [
        subprocess.Popen([*cli, "serve", "--port", str(port), "--files-dir", str(tmp_path / "files"),
                          "--log-level", "warning"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
        subprocess.Popen([*cli, "worker", "--model", model, "--served-model-name", "emb", "--device", "cpu",
                          "--log-level", "WARNING"], cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT),
    ]
    try:
        _wait_for("the server", lambda: _get(f"http://127.0.0.1:{port}/health"), procs[:1])
        yield openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key=API_KEY, max_retries=0, timeout=20), procs
    finally:
        for proc in procs:
            proc.send_signal(signal.SIGINT)
        for proc in procs:
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
        log.close()
        print((tmp_path / "stack.log").read_text()[-3000:])
        conn.flushdb()


def test_an_embeddings_batch_through_the_openai_sdk(embedding_stack, embedding_checkpoints, tmp_path):
    from sentence_transformers import SentenceTransformer

    client, _ = embedding_stack
    lines = [
        {"custom_id": "all", "method": "POST", "url": "/v1/embeddings", "body": {"model": "emb", "input": TEXTS}},
        {"custom_id": "one", "method": "POST", "url": "/v1/embeddings",
         "body": {"model": "emb", "input": TEXTS[1], "encoding_format": "float"}},
    ]
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    uploaded = client.files.create(file=path.open("rb"), purpose="batch")
    created = client.batches.create(input_file_id=uploaded.id, endpoint="/v1/embeddings", completion_window="24h")
    assert created.endpoint == "/v1/embeddings"
    batch, _ = wait_for_batch(client, created.id, timeout=90)
    assert batch.status == "completed", batch
    assert batch.request_counts.total == batch.request_counts.completed == 4  # one request per input
    served = {json.loads(x)["custom_id"]: json.loads(x) for x in client.files.content(batch.output_file_id).text.splitlines()}
    reference = SentenceTransformer(str(embedding_checkpoints["qwen3"]), device="cpu").encode(
        TEXTS, convert_to_tensor=True
    ).float()
    body = openai.types.CreateEmbeddingResponse.model_validate(served["all"]["response"]["body"])
    assert body.model == "emb" and [d.index for d in body.data] == [0, 1, 2]
    got = torch.tensor([d.embedding for d in body.data])
    assert torch.nn.functional.cosine_similarity(got, reference, dim=-1).min() >= 0.99999
    one = openai.types.CreateEmbeddingResponse.model_validate(served["one"]["response"]["body"])
    assert one.usage.prompt_tokens == one.usage.total_tokens > 0
    assert batch.usage.input_tokens == body.usage.prompt_tokens + one.usage.prompt_tokens
    assert batch.usage.output_tokens == 0
