"""`cbq serve`: run the OpenAI-compatible server. Imported only when the command runs (Starlette, uvicorn)."""

from __future__ import annotations

import ipaddress
import os

import click

from producer.client import Client
from producer.options import chunk_size_option, open_redis, queue_option, redis_url_option, ttl_option

API_KEYS_ENV = "CBQ_API_KEYS"
FILES_DIR_ENV = "CBQ_FILES_DIR"
DEFAULT_FILES_DIR = os.path.join("~", ".cache", "cbq", "files")
DEFAULT_MAX_FILE_BYTES = 200 * 1000 * 1000  # OpenAI's limit for a batch input file


def api_keys_from_env() -> list[str]:
    return [key.strip() for key in os.environ.get(API_KEYS_ENV, "").split(",") if key.strip()]


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


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
    help="Largest accepted upload.",
)
@chunk_size_option
@click.option("--log-level", default="info", show_default=True, help="uvicorn's log level.")
def serve(host, port, redis_url, queue, files_dir, ttl_seconds, max_file_bytes, chunk_size, log_level):
    """Serve OpenAI's Files and Batches API over cbq: point the `openai` SDK's base_url at http://HOST:PORT/v1.

    API keys come from the CBQ_API_KEYS environment variable (comma-separated; clients send
    `Authorization: Bearer KEY`). Without keys there is no authentication, so the server binds only a loopback
    address. Files live in --files-dir and expire --ttl seconds after they were created, like batch results.
    """
    try:
        import uvicorn

        from producer.server.app import create_app
        from producer.server.files import FileStore
    except ImportError as exc:
        raise click.ClickException(
            f"{exc.name} is missing: install the server extra, `pip install -e '.[server]'`"
        ) from None
    api_keys = api_keys_from_env()
    if not api_keys and not is_loopback(host):
        raise click.ClickException(
            f"refusing to serve {host} without authentication: set {API_KEYS_ENV}, or bind 127.0.0.1"
        )
    client = Client(connection=open_redis(redis_url), queue=queue)
    files = FileStore(os.path.expanduser(files_dir), ttl_seconds=ttl_seconds, max_bytes=max_file_bytes)
    app = create_app(client, files, api_keys=api_keys, ttl_seconds=ttl_seconds, chunk_size=chunk_size)
    click.echo(
        f"cbq serve: files in {files.root}, {'API keys required' if api_keys else 'no API keys'}", err=True
    )
    uvicorn.run(app, host=host, port=port, log_level=log_level.lower())
