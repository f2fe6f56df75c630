"""Issue 29 item 8: a batch goes to the queue of the model its lines name, a worker serves a name
(`--served-model-name`, default the checkpoint folder's), `cbq status` says when no live worker serves a
batch's model, `cbq stats` lists the models of live workers, and outputs carry the served name."""

import json

import pytest
from click.testing import CliRunner

from producer import settings
from producer.cli import main
from schemas import keys
from tests.worker.conftest import run_burst_worker
from worker.cli import served_model_name


@pytest.fixture
def cbq(fake_redis, monkeypatch):
    monkeypatch.setattr(settings, "connect", lambda url, **options: fake_redis)
    return lambda *args: CliRunner().invoke(main, [str(a) for a in args], catch_exceptions=False)


def line(custom_id: str, model: str) -> dict:
    body = {"model": model, "prompt": f"prompt {custom_id}", "max_tokens": 3}
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions", "body": body}


def test_a_batch_waits_on_its_models_queue_until_a_worker_serves_that_model(cbq, fake_redis, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(o) + "\n" for o in [line("a", "m1"), line("b", "m2"), line("c", "m1")]))
    submitted = json.loads(cbq("submit", path, "--json").stdout.splitlines()[-1])
    assert [e["issues"][0]["message"] for e in submitted["errors"]] == [
        "the model 'm2' is not this batch's 'm1' (a batch names one model)"
    ]
    batch_id = submitted["batch_id"]
    status = json.loads(cbq("status", batch_id, "--json").stdout)
    assert (status["queue"], status["model"], status["num_model_workers"]) == ("cbq:m1", "m1", 0)
    assert "no live worker serves model 'm1': start one with --served-model-name m1" in cbq("status", batch_id).stdout

    run_burst_worker(fake_redis, queue="cbq", model_name="m2")  # serves another model: leaves the batch alone
    assert json.loads(cbq("status", batch_id, "--json").stdout)["num_queued"] == 2
    stats = json.loads(cbq("stats", "--json").stdout)
    assert stats["models"] == [{"id": "m2", "num_workers": 1}]

    run_burst_worker(fake_redis, queue=keys.model_queue("cbq", "m1"), model_name="m1")
    status = json.loads(cbq("status", batch_id, "--json").stdout)
    assert (status["num_completed"], status["num_failed"], status["num_model_workers"]) == (2, 1, None)
    out = [json.loads(x) for x in cbq("results", batch_id, "--format", "openai").stdout.splitlines()]
    assert [o["response"]["body"].get("model") for o in out] == ["m1", None, "m1"]
    assert out[1]["response"]["body"]["error"]["code"] == "model_not_found"
    assert "models: m1 (1 worker), m2 (1 worker)" in cbq("stats").stdout


def test_the_served_name_defaults_to_the_checkpoint_folders(tmp_path):
    (tmp_path / "Qwen2.5-0.5B-Instruct").mkdir()
    assert served_model_name(str(tmp_path / "Qwen2.5-0.5B-Instruct") + "/") == "Qwen2.5-0.5B-Instruct"
    assert served_model_name("tiny-llama") == "tiny-llama"
    assert served_model_name("org/hub-model") == "org/hub-model"
    assert served_model_name("tiny-llama", "gpt-4o-mini") == "gpt-4o-mini"
