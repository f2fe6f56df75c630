"""`cbq serve`: run the OpenAI-compatible server. Imported only when the command runs (Starlette, uvicorn)."""

from __future__ import annotations

import ipaddress
import os

import click
import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from producer import settings
from producer.client import Client
from producer.options import chunk_size_option, queue_option, redis_url_option, ttl_option
from producer.server.service import DEFAULT_MAX_LINES_PER_FILE

API_KEYS_ENV = "CBQ_API_KEYS"
FILES_DIR_ENV = "CBQ_FILES_DIR"
DEFAULT_FILES_DIR = os.path.join("~", ".cache", "cbq", "files")
DEFAULT_MAX_FILE_BYTES = 200 * 1000 * 1000  # OpenAI's limit for a batch input file
# A request waits at most this long on an unreachable or stalled Redis before it gets a 503.
REDIS_SOCKET_TIMEOUT_S = 5.0
REDIS_CONNECT_TIMEOUT_S = 2.0


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def connect_redis(url: str) -> redis.Redis:
    """The server's Redis client: bounded socket timeouts and one retry, so that a request fails fast (503) while
    Redis is down or stalled instead of holding a thread; checked once here. A `redis+sentinel://` URL follows
    its primary through a failover (`settings.connect`)."""
    try:
        conn = settings.connect(
            url,
            socket_timeout=REDIS_SOCKET_TIMEOUT_S,
            socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S,
            # One quick retry of a dropped connection; a timeout is not retried (a stalled Redis would cost each
            # retry a reconnect handshake of socket timeouts more).
            retry=Retry(ExponentialBackoff(cap=0.2, base=0.02), 1, supported_errors=(redis.ConnectionError,)),
        )
    except ValueError as exc:  # a malformed URL
        raise click.BadParameter(str(exc), param_hint="--redis-url") from None
    try:
        conn.ping()
    except (redis.ConnectionError, redis.TimeoutError, redis.AuthenticationError, redis.ResponseError) as exc:
        raise click.ClickException(f"cannot reach Redis at {settings.redact_url(url)}: {exc}") from None
    return conn


@click.command()
@click.option("--host", default="127.0.0.1", show_default=True, help="Address to bind.")
@click.option("--port", type=click.IntRange(0, 65535), default=8000, show_default=True, help="Port to bind.")
@redis_url_option
@queue_option
@click.option(
    "--files-dir",
    envvar=FILES_DIR_ENV,
    default=DEFAULT_FILES_DIR,
    show_default=True,
    help=f"Where uploaded and output files live. Env: {FILES_DIR_ENV}.",
)
@ttl_option
@click.option(
    "--max-file-bytes",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_FILE_BYTES,
    show_default=True,
    help="Largest accepted upload (enforced while it streams in).",
)
@click.option(
    "--max-lines-per-file",
    type=click.IntRange(min=1),
    default=DEFAULT_MAX_LINES_PER_FILE,
    show_default=True,
    help="Lines an input file may have (more fail its batch): the server holds about 220 bytes per request while "
    "it validates and submits a file.",
)
@chunk_size_option
@click.option(
    "--max-connections",
    type=click.IntRange(min=1),
    default=256,
    show_default=True,
    help="Open connections past this get 503 and are closed.",
)
@click.option(
    "--max-connections-per-client",
    type=click.IntRange(min=1),
    default=None,
    help="Open connections from one client address past this get 503 and are closed (default: half of "
    "--max-connections; behind a reverse proxy every client has its address, so set it to --max-connections).",
)
@click.option(
    "--header-timeout",
    "header_timeout_s",
    type=click.FloatRange(min=0.1),
    default=10.0,
    show_default=True,
    help="Seconds a connection has to send a request's headers (after opening or after its last response).",
)
@click.option(
    "--body-timeout",
    "body_timeout_s",
    type=click.FloatRange(min=0.1),
    default=30.0,
    show_default=True,
    # NOTE: 64 KiB is limits.MIN_BODY_BYTES_PER_S (limits.py needs uvicorn, imported only when serve runs).
    help="Seconds a request body has to arrive whole, plus one per 64 KiB it delivered (then 408): a slow "
    "link's large upload passes, a trickle of bytes does not.",
)
@click.option(
    "--keep-alive-timeout",
    "keep_alive_timeout_s",
    type=click.IntRange(min=1),
    default=5,
    show_default=True,
    help="Seconds an idle keep-alive connection stays open.",
)
@click.option("--log-level", default="info", show_default=True, help="uvicorn's log level.")
def serve(
    host,
    port,
    redis_url,
    queue,
    files_dir,
    ttl_seconds,
    max_file_bytes,
    max_lines_per_file,
    chunk_size,
    max_connections,
    max_connections_per_client,
    header_timeout_s,
    body_timeout_s,
    keep_alive_timeout_s,
    log_level,
):
    """Serve OpenAI's Files and Batches API over cbq: point the `openai` SDK's base_url at http://HOST:PORT/v1.

    API keys come from the CBQ_API_KEYS environment variable, comma-separated `key`, `key:project` or `key:*`
    (clients send `Authorization: Bearer KEY`). A key sees only its project's files and batches; a key alone is
    a project of its own; `key:*` is an admin key that sees all. Without keys there is no authentication, so the
    server binds only a loopback address. Files live in --files-dir and expire --ttl seconds after they were
    created, like batch results.
    """
    try:
        import uvicorn

        from producer.server.app import create_app
        from producer.server.auth import parse_api_keys
        from producer.server.files import FileStore
        from producer.server.limits import ServerLimits, guarded_h11_protocol
    except ImportError as exc:
        raise click.ClickException(
            f"{exc.name} is missing: install the server extra, `pip install -e '.[server]'`"
        ) from None
    try:
        api_keys = parse_api_keys(os.environ.get(API_KEYS_ENV, ""))
    except ValueError as exc:
        raise click.ClickException(f"{API_KEYS_ENV}: {exc}") from None
    if not api_keys and not is_loopback(host):
        raise click.ClickException(
            f"refusing to serve {host} without authentication: set {API_KEYS_ENV}, or bind 127.0.0.1"
        )
    client = Client(connection=connect_redis(redis_url), queue=queue)
    files = FileStore(os.path.expanduser(files_dir), ttl_seconds=ttl_seconds, max_bytes=max_file_bytes)
    limits = ServerLimits(
        max_file_bytes=max_file_bytes,
        header_timeout_s=header_timeout_s,
        body_timeout_s=body_timeout_s,
        keep_alive_timeout_s=keep_alive_timeout_s,
        max_connections=max_connections,
        max_connections_per_client=max_connections_per_client,
        max_lines_per_file=max_lines_per_file,
    )
    app = create_app(
        client, files, api_keys=api_keys, ttl_seconds=ttl_seconds, chunk_size=chunk_size, limits=limits
    )
    click.echo(
        f"cbq serve: files in {files.root}, {'API keys required' if api_keys else 'no API keys'}", err=True
    )
    uvicorn.run(
        app,
        host=host,
        port=port,
        log_level=log_level.lower(),
        http=guarded_h11_protocol(header_timeout_s, max_connections, limits.client_connection_share),
        timeout_keep_alive=keep_alive_timeout_s,
    )
