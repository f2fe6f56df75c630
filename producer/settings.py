"""Defaults shared by producer and worker, their environment variables, and the Redis connection factory."""

from __future__ import annotations

import os
from dataclasses import dataclass
from urllib.parse import parse_qs, unquote, urlsplit, urlunsplit

import redis
from redis.sentinel import Sentinel

REDIS_URL_ENV = "CBQ_REDIS_URL"
RESULT_TTL_ENV = "CBQ_RESULT_TTL"
QUEUE_ENV = "CBQ_QUEUE"

DEFAULT_REDIS_URL = "redis://127.0.0.1:6379/0"
SENTINEL_SCHEME = "redis+sentinel"
DEFAULT_SENTINEL_PORT = 26379
DEFAULT_QUEUE = "cbq"
DEFAULT_RESULT_TTL_SECONDS = 7 * 24 * 3600
DEFAULT_CHUNK_SIZE = 64
# A chunk whose worker died is re-enqueued this many times (finished requests are skipped).
DEFAULT_RETRIES = 2
# Seconds one Redis outage may last before a worker or `cbq wait` gives up.
DEFAULT_REDIS_OUTAGE_LIMIT_SECONDS = 300
# Durable result writes (`cbq worker --redis-wait-replicas`): replicas a write waits for (0: none, Redis's own
# asynchronous replication) and how long at most.
REDIS_WAIT_REPLICAS_ENV = "CBQ_REDIS_WAIT_REPLICAS"
REDIS_WAIT_TIMEOUT_ENV = "CBQ_REDIS_WAIT_TIMEOUT"
DEFAULT_REDIS_WAIT_TIMEOUT_SECONDS = 1.0
NO_JOB_TIMEOUT = -1  # the default: a chunk's time depends on the load of the engine, so no limit


def default_redis_url() -> str:
    return os.environ.get(REDIS_URL_ENV, DEFAULT_REDIS_URL)


def connect(url: str, **options) -> redis.Redis:
    """A client for `url`: redis://, rediss:// with TLS, unix:// (passwords in the URL are fine), or
    `redis+sentinel://[[user]:password@]host:port[,host:port...]/service_name[/db][?sentinel_password=...]`,
    the primary that those Sentinels name for service_name, looked up again whenever a connection to it fails,
    so that a client reconnects to the promoted replica after a failover (the password is the data nodes',
    `sentinel_password` the Sentinels' own, if they have one). `options`: redis.Redis keyword arguments
    (socket timeouts, retry).

    Responses stay bytes: rq needs that, and cbq decodes what it reads itself.
    """
    options.setdefault("health_check_interval", 30)
    if urlsplit(url).scheme == SENTINEL_SCHEME:
        return _connect_sentinel(parse_sentinel_url(url), options)
    return redis.Redis.from_url(url, **options)


@dataclass(frozen=True)
class SentinelUrl:
    sentinels: list[tuple[str, int]]
    service_name: str
    db: int = 0
    username: str | None = None
    password: str | None = None
    sentinel_password: str | None = None


def parse_sentinel_url(url: str) -> SentinelUrl:
    """The parts of a `redis+sentinel://` URL (see `connect`); ValueError names what is wrong."""
    parts = urlsplit(url)
    userinfo, _, hostlist = parts.netloc.rpartition("@")
    username, _, password = userinfo.partition(":")
    sentinels = []
    for item in hostlist.split(","):
        host, _, port = item.rpartition(":") if not item.endswith("]") else (item, "", "")
        if not host:  # no port given
            host, port = item, ""
        host = host.strip("[]")
        if not host or (port and not port.isdigit()):
            raise ValueError(f"{redact_url(url)}: {item!r} is not host:port")
        sentinels.append((host, int(port) if port else DEFAULT_SENTINEL_PORT))
    path = [segment for segment in parts.path.split("/") if segment]
    if not path or len(path) > 2 or (len(path) == 2 and not path[1].isdigit()):
        raise ValueError(f"{redact_url(url)}: the path must be /service_name or /service_name/db")
    query = parse_qs(parts.query)
    unknown = set(query) - {"sentinel_password"}
    if unknown:
        raise ValueError(f"{redact_url(url)}: unknown parameter(s) {', '.join(sorted(unknown))}")
    return SentinelUrl(
        sentinels=sentinels,
        service_name=unquote(path[0]),
        db=int(path[1]) if len(path) == 2 else 0,
        username=unquote(username) or None,
        password=unquote(password) or None,
        sentinel_password=query["sentinel_password"][-1] if "sentinel_password" in query else None,
    )


def _connect_sentinel(url: SentinelUrl, options: dict) -> redis.Redis:
    # The Sentinels are asked with the same socket timeouts as the primary, so a dead one costs no more than that.
    sentinel_kwargs = {k: v for k, v in options.items() if k.startswith("socket_")}
    if url.sentinel_password is not None:
        sentinel_kwargs["password"] = url.sentinel_password
    sentinel = Sentinel(url.sentinels, sentinel_kwargs=sentinel_kwargs)
    return sentinel.master_for(
        url.service_name, db=url.db, username=url.username, password=url.password, **options
    )


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
