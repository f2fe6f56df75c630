"""Fixtures for the queue tests: a redis-server of the test session's own and an in-process fakeredis.

`conn` runs a test once against each: fakeredis always, and a real redis-server that this session starts on a
free port (skipped where `redis-server` is not installed). No test ever touches a server it did not start:
CBQ_TEST_REDIS_URL points the tests at another server only when a person sets it, and its db is flushed.
"""

from __future__ import annotations

import os
import shutil

import fakeredis
import pytest
import redis

from tests.reliability.harness import RedisServer


@pytest.fixture(scope="session")
def private_redis_url(tmp_path_factory):
    """The URL of a memory-only redis-server started for this test session (stopped at its end)."""
    if url := os.environ.get("CBQ_TEST_REDIS_URL"):
        yield url
        return
    if shutil.which("redis-server") is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path_factory.mktemp("redis"), durable=False)
    server.start()
    try:
        yield server.url
    finally:
        server.kill()


@pytest.fixture
def real_redis(private_redis_url):
    conn = redis.Redis.from_url(private_redis_url)
    conn.flushdb()
    yield conn
    conn.flushdb()


@pytest.fixture
def fake_redis():
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


@pytest.fixture(params=["fakeredis", pytest.param("redis_server", marks=pytest.mark.redis_server)])
def conn(request):
    return request.getfixturevalue("fake_redis" if request.param == "fakeredis" else "real_redis")
