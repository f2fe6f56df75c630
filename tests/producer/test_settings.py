"""`redis+sentinel://` URLs: parsed into the Sentinels, the service and the db, refused with a message when
malformed, and redacted in messages (the failover itself: tests/reliability/test_sentinel_failover.py)."""

from __future__ import annotations

import pytest
from click.testing import CliRunner
from redis.sentinel import SentinelConnectionPool

from producer import settings
from producer.cli import main
from producer.settings import SentinelUrl, parse_sentinel_url


def test_a_sentinel_url_names_its_sentinels_service_db_and_passwords():
    assert parse_sentinel_url("redis+sentinel://:pw@h1:26380,h2,[::1]:5/mymaster/3") == SentinelUrl(
        [("h1", 26380), ("h2", 26379), ("::1", 5)], "mymaster", db=3, password="pw"
    )
    parsed = parse_sentinel_url("redis+sentinel://user:p%40ss@h1:1/svc?sentinel_password=s")
    assert (parsed.username, parsed.password, parsed.sentinel_password, parsed.db) == ("user", "p@ss", "s", 0)


@pytest.mark.parametrize(
    "url",
    ["redis+sentinel://h1:1", "redis+sentinel://h1:1/svc/x", "redis+sentinel://h1:port/svc", "redis+sentinel://h:1/s?db=2"],
)
def test_a_malformed_sentinel_url_is_a_clear_error(url):
    with pytest.raises(ValueError):
        parse_sentinel_url(url)
    result = CliRunner().invoke(main, ["status", "b", "--redis-url", url])
    assert result.exit_code == 2 and "--redis-url" in result.stderr and "Traceback" not in result.stderr


def test_connect_follows_the_primary_through_the_sentinels():
    conn = settings.connect("redis+sentinel://:pw@127.0.0.1:1/svc/2", socket_timeout=1)
    assert isinstance(conn.connection_pool, SentinelConnectionPool)
    assert conn.connection_pool.service_name == "svc"
    kwargs = conn.connection_pool.connection_kwargs
    assert (kwargs["db"], kwargs["password"], kwargs["socket_timeout"]) == (2, "pw", 1)


def test_passwords_are_redacted():
    url = "redis+sentinel://u:secret@h1:1,h2:2/svc?sentinel_password=secret2"
    assert settings.redact_url(url) == "redis+sentinel://u:***@h1:1,h2:2/svc?sentinel_password=***"
    assert settings.redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert settings.redact_url("redis://h:1/0") == "redis://h:1/0"
