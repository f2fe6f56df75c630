"""Fixtures for the queue tests: a real Redis server (db 15, flushed) and an in-process fakeredis.

`conn` runs a test once against each: fakeredis always, the real server when one answers on 127.0.0.1:6379
(CI starts one). Set CBQ_TEST_REDIS_URL to use another server or db.
"""

from __future__ import annotations

import os

import fakeredis
import pytest
import redis

TEST_REDIS_URL = os.environ.get("CBQ_TEST_REDIS_URL", "redis://127.0.0.1:6379/15")


def _server_answers() -> bool:
    try:
        return bool(redis.Redis.from_url(TEST_REDIS_URL, socket_connect_timeout=0.5).ping())
    except (redis.ConnectionError, redis.TimeoutError):
        return False


@pytest.fixture
def real_redis():
    if not _server_answers():
        pytest.skip(f"no Redis server answers at {TEST_REDIS_URL}")
    conn = redis.Redis.from_url(TEST_REDIS_URL)
    conn.flushdb()
    yield conn
    conn.flushdb()


@pytest.fixture
def fake_redis():
    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


@pytest.fixture(params=["fakeredis", pytest.param("redis_server", marks=pytest.mark.redis_server)])
def conn(request):
    return request.getfixturevalue("fake_redis" if request.param == "fakeredis" else "real_redis")
