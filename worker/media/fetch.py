"""An image's bytes from its URL: a `data:` URL, a file under the allowed root, or an http(s) URL of an
allowed host. Owns what the worker may read and reach for a request: nothing a URL says can make it read
outside the root (real paths, so no symlink leads out) or connect to a host not listed (redirects included).
"""

from __future__ import annotations

import base64
import binascii
import http.client
import os
import stat
import time
import urllib.parse

from schemas.media import DATA_URL
from worker.media.policy import MAX_REDIRECTS, MediaError, MediaPolicy, is_ip_literal

_READ_CHUNK_BYTES = 64 * 1024
_REDIRECTS = (301, 302, 303, 307, 308)


def read_image_bytes(param: str, url: str, policy: MediaPolicy) -> bytes:
    """The bytes `url` names, at most `policy.max_image_bytes`; MediaError(param, why) otherwise."""
    scheme = url[: url.find(":")].lower() if ":" in url else ""
    if scheme == "data":
        return _data_url_bytes(param, url, policy)
    if scheme == "file":
        return _local_file_bytes(param, url, policy)
    if scheme in ("http", "https"):
        return _http_bytes(param, url, policy)
    raise MediaError(param, "an image url is a data:, file: or http(s) URL")


def _too_large(param: str, policy: MediaPolicy) -> MediaError:
    return MediaError(param, f"the image is larger than this worker's {policy.max_image_bytes} bytes")


def _data_url_bytes(param: str, url: str, policy: MediaPolicy) -> bytes:
    match = DATA_URL.match(url)
    if match is None:
        raise MediaError(param, "an image data URL is data:image/<type>;base64,<payload>")
    payload = url[match.end() :]
    if len(payload) // 4 * 3 > policy.max_image_bytes + 2:  # before decoding anything
        raise _too_large(param, policy)
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        raise MediaError(param, "the data URL's payload is not valid base64") from None
    if len(data) > policy.max_image_bytes:
        raise _too_large(param, policy)
    return data


def _local_file_bytes(param: str, url: str, policy: MediaPolicy) -> bytes:
    root = policy.allowed_local_media_path
    if root is None:
        raise MediaError(param, "local image files are not allowed: the worker runs without --allowed-local-media-path")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost") or parts.query or parts.fragment:
        raise MediaError(param, "a file URL is file:///absolute/path")
    path = urllib.parse.unquote(parts.path)
    if not os.path.isabs(path) or "\x00" in path:
        raise MediaError(param, "a file URL is file:///absolute/path")
    real = os.path.realpath(path)  # every symlink resolved: what is checked is what is opened
    if os.path.commonpath([root, real]) != root:
        raise MediaError(param, f"{path} is outside the allowed local media path")
    try:
        # O_NOFOLLOW: a symlink swapped in at the last component after the check is refused, not followed.
        fd = os.open(real, os.O_RDONLY | os.O_NOFOLLOW | getattr(os, "O_NONBLOCK", 0))
    except OSError as exc:
        raise MediaError(param, f"{path} cannot be read: {exc.strerror}") from None
    try:
        info = os.fstat(fd)  # of what was opened: a FIFO or device never blocks or streams here
        if not stat.S_ISREG(info.st_mode):
            raise MediaError(param, f"{path} is not a regular file")
        if info.st_size > policy.max_image_bytes:
            raise _too_large(param, policy)
        with os.fdopen(os.dup(fd), "rb") as file:
            data = file.read(policy.max_image_bytes + 1)
    finally:
        os.close(fd)
    if len(data) > policy.max_image_bytes:
        raise _too_large(param, policy)
    return data


def _allowed_host(param: str, parts: urllib.parse.SplitResult, policy: MediaPolicy) -> str:
    host = (parts.hostname or "").rstrip(".")
    if not host:
        raise MediaError(param, "the image URL has no host")
    if is_ip_literal(host):
        raise MediaError(param, f"{host} is an address: images are fetched from allowed host names only")
    if host not in policy.allowed_media_domains:
        listed = ", ".join(sorted(policy.allowed_media_domains))
        allowed = f"allowed: {listed}" if listed else "this worker fetches from none: --allowed-media-domains"
        raise MediaError(param, f"{host} is not an allowed media domain ({allowed})")
    return host


def _http_bytes(param: str, url: str, policy: MediaPolicy) -> bytes:
    """GET `url`, following redirects only to allowed hosts, within one deadline for the whole fetch."""
    deadline = time.monotonic() + policy.fetch_timeout_seconds
    try:
        for _ in range(MAX_REDIRECTS + 1):
            parts = urllib.parse.urlsplit(url)
            if parts.scheme.lower() not in ("http", "https"):
                raise MediaError(param, f"a redirect to {parts.scheme or 'a relative'}: URL is not followed")
            host = _allowed_host(param, parts, policy)
            status, location, data = _get_once(param, parts, host, policy, deadline)
            if status not in _REDIRECTS:
                return data
            if location is None:
                raise MediaError(param, f"{host} answered HTTP {status} without a Location")
            url = urllib.parse.urljoin(url, location)
    except TimeoutError:
        raise MediaError(param, f"fetching the image took longer than {policy.fetch_timeout_seconds:g} s") from None
    except (OSError, http.client.HTTPException) as exc:
        raise MediaError(param, f"the image could not be fetched: {type(exc).__name__}: {exc}") from None
    raise MediaError(param, f"more than {MAX_REDIRECTS} redirects")


def _remaining(deadline: float) -> float:
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError
    return left


def _get_once(
    param: str, parts: urllib.parse.SplitResult, host: str, policy: MediaPolicy, deadline: float
) -> tuple[int, str | None, bytes]:
    try:
        port = parts.port
    except ValueError:
        raise MediaError(param, "the image URL's port is not a number") from None
    kind = http.client.HTTPSConnection if parts.scheme.lower() == "https" else http.client.HTTPConnection
    conn = kind(host, port, timeout=_remaining(deadline))
    try:
        target = urllib.parse.urlunsplit(("", "", parts.path or "/", parts.query, ""))
        conn.request("GET", target, headers={"Accept": "image/*", "User-Agent": "cbq-worker"})
        response = conn.getresponse()
        if response.status in _REDIRECTS:
            return response.status, response.getheader("Location"), b""
        if response.status != 200:
            raise MediaError(param, f"{host} answered HTTP {response.status} {response.reason}")
        length = response.getheader("Content-Length")
        if length is not None and length.isdigit() and int(length) > policy.max_image_bytes:
            raise _too_large(param, policy)
        chunks, size = [], 0
        while True:
            if conn.sock is not None:
                conn.sock.settimeout(_remaining(deadline))
            chunk = response.read1(_READ_CHUNK_BYTES)
            if not chunk:
                break
            size += len(chunk)
            if size > policy.max_image_bytes:
                raise _too_large(param, policy)
            chunks.append(chunk)
            _remaining(deadline)
        return response.status, None, b"".join(chunks)
    finally:
        conn.close()
