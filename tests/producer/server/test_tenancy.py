"""Each key of `cbq serve` sees only its project's files and batches, as OpenAI's projects do; an admin key sees all.
Driven with the `openai` SDK against a server and a redis-server of the test's own (no worker: batches stay
`in_progress`, which is all tenancy needs)."""

from __future__ import annotations

import json
import time

import pytest

from tests.producer.server.serving import ServeProcess

openai = pytest.importorskip("openai")
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")

from producer.server.auth import Principal, parse_api_keys  # noqa: E402

pytestmark = pytest.mark.redis_server

KEYS = "alpha-1:alpha,alpha-2:alpha,beta-1:beta,solo-key,root-key:*"


@pytest.fixture(scope="module")
def server(tmp_path_factory, private_redis_url):
    proc = ServeProcess(private_redis_url, tmp_path_factory.mktemp("tenancy"), api_keys=KEYS)
    yield proc
    proc.stop()


def _client(server, key: str):
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=10)


def _upload_and_create(client, tag: str):
    line = {
        "custom_id": tag,
        "method": "POST",
        "url": "/v1/completions",
        "body": {"model": "tiny", "prompt": tag, "max_tokens": 2},
    }
    uploaded = client.files.create(file=(f"{tag}.jsonl", json.dumps(line).encode() + b"\n"), purpose="batch")
    batch = client.batches.create(
        input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
    )
    deadline = time.monotonic() + 10
    while client.batches.retrieve(batch.id).status == "validating":
        assert time.monotonic() < deadline
        time.sleep(0.05)
    return uploaded, batch


@pytest.fixture(scope="module")
def made(server):
    """A file and a batch of project alpha, of project beta and of the key without a project."""
    return {
        key: _upload_and_create(_client(server, key), key.split("-")[0])
        for key in ("alpha-1", "beta-1", "solo-key")
    }


def _assert_hidden(client, uploaded, batch):
    for call in (
        lambda: client.files.retrieve(uploaded.id),
        lambda: client.files.content(uploaded.id),
        lambda: client.files.delete(uploaded.id),
        lambda: client.batches.retrieve(batch.id),
        lambda: client.batches.cancel(batch.id),
        lambda: client.batches.create(
            input_file_id=uploaded.id, endpoint="/v1/completions", completion_window="24h"
        ),
    ):
        with pytest.raises(openai.NotFoundError) as info:
            call()
        assert info.value.body["code"] == "not_found"
    assert uploaded.id not in {f.id for f in client.files.list()}
    assert batch.id not in {b.id for b in client.batches.list(limit=100)}


@pytest.mark.parametrize("key", ["beta-1", "solo-key"])
def test_another_project_sees_nothing_of_alpha(server, made, key):
    _assert_hidden(_client(server, key), *made["alpha-1"])


def test_a_key_alone_is_a_project_of_its_own(server, made):
    for key in ("alpha-1", "alpha-2", "beta-1"):
        _assert_hidden(_client(server, key), *made["solo-key"])


def test_keys_of_one_project_share_its_files_and_batches(server, made):
    uploaded, batch = made["alpha-1"]
    other = _client(server, "alpha-2")
    assert other.files.retrieve(uploaded.id).id == uploaded.id
    assert other.files.content(uploaded.id).text.startswith("{")
    assert {b.id for b in other.batches.list(limit=100)} == {batch.id}
    assert {f.id for f in other.files.list()} == {uploaded.id}
    assert other.batches.cancel(batch.id).status in ("cancelling", "cancelled")


def test_an_admin_key_sees_every_project(server, made):
    root = _client(server, "root-key")
    listed = {b.id for b in root.batches.list(limit=100)}
    assert {batch.id for _, batch in made.values()} <= listed
    assert {uploaded.id for uploaded, _ in made.values()} <= {f.id for f in root.files.list()}
    uploaded, batch = made["beta-1"]
    assert root.batches.retrieve(batch.id).id == batch.id
    assert root.files.delete(uploaded.id).deleted
    with pytest.raises(openai.NotFoundError):
        _client(server, "beta-1").files.retrieve(uploaded.id)


def test_paging_stays_inside_the_project(server, made):
    alpha = _client(server, "alpha-1")
    beta_batch = made["beta-1"][1]
    assert alpha.batches.list(after=beta_batch.id).data == []  # another project's id is no cursor


def test_the_key_table():
    table = parse_api_keys(" k1 , k2:team-a, k3:team-a, k4:* ,, ")
    assert table["k2"] == table["k3"] == Principal("team-a")
    assert table["k4"].is_admin and not table["k2"].is_admin
    assert table["k1"].project.startswith("key-") and "k1" not in table["k1"].project
    assert table["k1"] != parse_api_keys("k5")["k5"]
    assert table["k1"].can_see(table["k1"].project) and not table["k1"].can_see("team-a")
    assert not table["k1"].can_see(None) and table["k4"].can_see(None)  # records older than projects
    for bad in ("k1:no/slash", "k1:" + "x" * 65, ":team", "k1:a,k1:b"):
        with pytest.raises(ValueError, match="entry"):
            parse_api_keys(bad)
