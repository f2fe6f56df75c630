"""Defaults shared by producer and worker, their environment variables, and the Redis connection factory."""

from __future__ import annotations

import os
from urllib.parse import urlsplit, urlunsplit

import redis

REDIS_URL_ENV = "CBQ_REDIS_URL"
RESULT_TTL_ENV = "CBQ_RESULT_TTL"
QUEUE_ENV = "CBQ_QUEUE"

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
DEFAULT_QUEUE = "cbq"
DEFAULT_RESULT_TTL_SECONDS = 7 * 24 * 3600
DEFAULT_CHUNK_SIZE = 64
# A chunk whose worker died is re-enqueued this many times (finished requests are skipped).
DEFAULT_RETRIES = 2
# Seconds one Redis outage may last before a worker or `cbq wait` gives up.
DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS = 300
NO_JOB_TIMEOUT = -1  # the default: a chunk's time depends on the load of the engine, so no limit


def default_redis_url() -> str:
    return os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)


def connect(url: str, **options) -> redis.Redis:
    """A client for `url` (redis://, rediss:// with TLS, unix://; passwords in the URL are fine). `options`:
    redis.Redis keyword arguments (socket timeouts, retry).

    Responses stay bytes: rq needs that, and cbq decodes what it reads itself.
    """
    options.setdefault("health_check_interval", 30)
    return redis.Redis.from_url(url, **options)


def in_process_redis() -> redis.Redis:
    """A private in-process Redis (fakeredis), for `cbq run` and benchmarks that need no server."""
    import fakeredis

    return fakeredis.FakeRedis(server=fakeredis.FakeServer())


def redact_url(url: str) -> str:
    """The URL with any password replaced (a Sentinel URL's sentinel_password too), for messages."""
    parts = urlsplit(url)
    userinfo, at, hostlist = parts.netloc.rpartition("@")
    if ":" in userinfo:
        parts = parts._replace(netloc=f"{userinfo.partition(':')[0]}:***{at}{hostlist}")
    if "sentinel_password=" in parts.query:
        query = "&".join(
            "sentinel_password=***" if item.startswith("sentinel_password=") else item
            for item in parts.query.split("&")
        )
        parts = parts._replace(query=query)
    return urlunsplit(parts)
