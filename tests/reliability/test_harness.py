"""The fault-injection harness itself: a RedisServer whose free port another process took first (test processes
run in parallel) starts on another port, and never mistakes the other process's server for its own."""

from __future__ import annotations

import shutil

import pytest

from tests.reliability.harness import RedisServer

pytestmark = pytest.mark.skipif(shutil.which("redis-server") is None, reason="redis-server is not installed")


def test_a_server_whose_port_was_taken_starts_on_another_and_answers_as_itself(tmp_path):
    squatter = RedisServer(tmp_path / "squatter", durable=False)
    (tmp_path / "squatter").mkdir()
    squatter.start()
    (tmp_path / "ours").mkdir()
    ours = RedisServer(tmp_path / "ours", durable=False)
    ours.port, ours.url = squatter.port, squatter.url  # as if free_port() had handed out the same port twice
    try:
        ours.start()
        assert ours.proc is not None and ours.proc.poll() is None, "our redis-server is running"
        assert ours.port != squatter.port and ours.url == f"redis://127.0.0.1:{ours.port}/0"
        assert ours.connect().info("server")["process_id"] == ours.proc.pid
        ours.kill()
        ours.start()  # a restart keeps the port the tests hold
        assert ours.url == f"redis://127.0.0.1:{ours.port}/0" and ours.answers()
    finally:
        ours.kill()
        squatter.kill()


def test_a_restart_whose_port_was_taken_fails_rather_than_use_another_server(tmp_path):
    ours = RedisServer(tmp_path, durable=False)
    ours.start()
    ours.kill()
    squatter = RedisServer(tmp_path, durable=False)
    squatter.port, squatter.url = ours.port, ours.url
    squatter.start()
    try:
        with pytest.raises(AssertionError, match="on restart"):
            ours.start()
    finally:
        ours.kill()
        squatter.kill()


def test_a_restarted_server_counts_as_started_only_once_it_has_loaded_its_data(tmp_path):
    """A restarted server answers INFO while it replays its append-only file and refuses data commands with
    LOADING until it is done: start() must wait past that, or the test reading first fails on
    BusyLoadingError (as one did in CI). An append-only file of ~300k keys takes long enough to replay that a
    start() which returned at the first answer would land inside the replay."""
    server = RedisServer(tmp_path)
    server.start()
    try:
        conn = server.connect()
        for chunk in range(30):
            pipe = conn.pipeline(transaction=False)
            for i in range(10_000):
                pipe.set(f"k{chunk}:{i}", "v" * 32)
            pipe.execute()
        server.kill()
        server.start()
        assert server.connect().dbsize() == 300_000  # raises BusyLoadingError if start() returned mid-replay
    finally:
        server.kill()
