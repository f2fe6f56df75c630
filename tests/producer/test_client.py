"""The Python client over fakeredis and the real server, with the instant FakeEngine behind a burst worker."""

import json
import signal

import pytest

from producer.client import BatchNotFinished, BatchNotFound, Client, InvalidInput, NothingToSubmit


@pytest.fixture
def client(conn):
    return Client(connection=conn, queue="client-test")


def drain(client):
    from worker.fake_engine import FakeEngine
    from worker.queue_worker import CbqWorker

    handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        CbqWorker([client.queue], FakeEngine(), connection=client.connection).work(
            burst=True, logging_level="WARNING"
        )
    finally:
        for sig, handler in handlers.items():
            signal.signal(sig, handler)


def test_submit_dicts_with_defaults_wait_and_read_results_in_order(client):
    lines = [{"custom_id": f"c{i}", "prompt": f"p{i}"} for i in range(5)] + [
        {"prompt": "own", "max_new_tokens": 2}
    ]
    batch = client.submit(lines, max_new_tokens=3, chunk_size=2)
    assert batch.submission.num_requests == 6 and batch.submission.num_chunks == 3
    with pytest.raises(BatchNotFinished):
        batch.results()  # raised at the call, not at the first next()
    assert [r.custom_id for r in batch.results(partial=True)] == []

    drain(client)
    seen = []
    final = batch.wait(progress=seen.append, interval=0.05, timeout=5)
    assert final.is_done and final.num_completed == 6 and seen[-1] == final
    results = list(batch.results())
    assert [r.custom_id for r in results] == [f"c{i}" for i in range(5)] + [None]
    assert [r.usage.completion_tokens for r in results] == [3] * 5 + [2]
    openai_lines = list(client.batch(batch.id).results(format="openai"))
    assert [line.custom_id for line in openai_lines][:2] == ["c0", "c1"]
    assert client.batches(limit=1)[0].batch_id == batch.id


def test_submit_a_path_and_json_strings(client, tmp_path):
    path = tmp_path / "in.jsonl"
    path.write_text(json.dumps({"prompt": "a"}) + "\n\n" + json.dumps({"prompt": "b"}) + "\n")
    assert client.submit(path).status().num_total == 2
    assert client.submit(str(path)).status().num_total == 2
    assert client.submit([json.dumps({"prompt": "c"})]).status().num_total == 1


def test_invalid_input_and_nothing_to_submit(client):
    mixed = [{"prompt": "ok"}, {"prompt": "x", "temperature": -1}]
    with pytest.raises(InvalidInput) as info:
        client.submit(mixed, strict=True)
    assert [e.line_no for e in info.value.errors] == [2]
    with pytest.raises(InvalidInput) as info:  # a format error refuses the input whatever `strict` says
        client.submit([{"prompt": "ok"}, "not json"])
    assert [e.line_no for e in info.value.errors] == [2]
    batch = client.submit(mixed)  # the invalid request fails alone, counted failed from the start
    assert batch.submission.num_requests == 2 and [e.line_no for e in batch.submission.invalid] == [2]
    assert (batch.status().num_failed, batch.status().num_total) == (1, 2)
    with pytest.raises(TypeError, match="skip_invalid was removed"):
        client.submit(mixed, skip_invalid=True)
    with pytest.raises(NothingToSubmit):
        client.submit([])
    client.submit([{"custom_id": "a", "prompt": "x"}], name="nightly")
    with pytest.raises(NothingToSubmit) as again:
        client.submit([{"custom_id": "a", "prompt": "x"}], name="nightly")
    assert again.value.skipped_custom_ids == ["a"]
    with pytest.raises(ValueError, match="top_p"):
        client.submit([{"prompt": "x"}], top_p=2.0)


def test_cancel_timeout_and_unknown_batches(client):
    batch = client.submit([{"prompt": "x"}] * 3, chunk_size=1)
    with pytest.raises(TimeoutError):
        batch.wait(interval=0.01, timeout=0.05)
    assert batch.cancel().num_requests_cancelled == 3
    assert batch.wait(timeout=1).num_cancelled == 3
    with pytest.raises(BatchNotFound):
        client.batch("nope").status()
