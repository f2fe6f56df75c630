"""What one client may cost `cbq serve`: body sizes, time per connection, number of connections. Owns the limits
and their enforcement; the routes never see a body past its limit.

- `BodyLimitMiddleware` (ASGI): a request body is counted as it streams in, so a chunked upload without a
  Content-Length is stopped at its route's limit (413) instead of being spooled to disk first; a declared
  Content-Length over the limit is refused before anything is read; a body must arrive whole by a deadline,
  `body_timeout_s` after its headers plus one second per MIN_BODY_BYTES_PER_S bytes it delivered (a 200 MB
  upload over a slow link passes; a byte now and then does not), or it gets 408. Both close the connection, so
  the rest of the body is never read, and a client dropped so costs one log line.
- `guarded_h11_protocol` (uvicorn's h11 protocol): a connection must deliver a request's headers within
  `header_timeout_s` of opening or of its previous response (idle and half-sent connections are closed); past
  `max_connections` open connections, or past `max_connections_per_client` from one client address, a new one
  gets 503 and is closed at once, so one client cannot hold the whole cap; a request h11 cannot parse (headers
  over h11's 16 KiB included) gets a 400 in OpenAI's shape. uvicorn itself closes an idle keep-alive
  connection after `--keep-alive-timeout`.

NOTE: the protocol subclass relies on uvicorn's H11Protocol members (`cycle`, `connections`, `transport`, `loop`,
`on_response_complete`, `send_400_response`); tests/producer/server/test_limits.py fails if an upgrade moves them.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

from producer.server.service import DEFAULT_MAX_LINES_PER_FILE

MAX_JSON_BODY_BYTES = 1 << 20  # POST /v1/batches and every other route but the upload
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # slack over the file limit for the form's other parts and boundaries
CONNECTIONS_RETRY_AFTER_SECONDS = 1
MIN_BODY_BYTES_PER_S = 64 * 1024  # a body's deadline grows one second per this many bytes it delivered


@dataclass(frozen=True)
class ServerLimits:
    max_file_bytes: int
    header_timeout_s: float = 10.0
    body_timeout_s: float = 30.0
    keep_alive_timeout_s: int = 5
    max_connections: int = 256
    max_connections_per_client: int | None = None  # None: half of max_connections
    max_lines_per_file: int = DEFAULT_MAX_LINES_PER_FILE  # of an input file (`service.py`)

    @property
    def client_connection_share(self) -> int:
        if self.max_connections_per_client is not None:
            return self.max_connections_per_client
        return max(1, self.max_connections // 2)

    def body_limit(self, method: str, path: str) -> tuple[int, BodyTooLarge]:
        """The most bytes a request's body may have, and the error past them."""
        if method == "POST" and path == "/v1/files":
            error = BodyTooLarge(
                f"the file is larger than the server's limit of {self.max_file_bytes} bytes", "file"
            )
            return self.max_file_bytes + MULTIPART_OVERHEAD_BYTES, error
        message = f"the request body is larger than this endpoint's limit of {MAX_JSON_BODY_BYTES} bytes"
        return MAX_JSON_BODY_BYTES, BodyTooLarge(message, None)


class BodyTooLarge(Exception):
    def __init__(self, message: str, param: str | None):
        super().__init__(message)
        self.param = param


class BodyTimeout(Exception):
    def __init__(self, deadline_s: float, num_received: int):
        super().__init__(
            f"the request body did not arrive within {deadline_s:.1f} seconds ({num_received} bytes came; "
            f"a body has the server's --body-timeout plus one second per {MIN_BODY_BYTES_PER_S} bytes)"
        )


class BodyLimitMiddleware:
    """Counts each request's body as it is received. Raises `BodyTooLarge` or `BodyTimeout` from `receive`, inside
    the app, whose handlers turn them into 413 and 408; a Content-Length over the limit gets `too_large` at once.
    """

    def __init__(self, app, limits: ServerLimits, too_large: Callable[[BodyTooLarge], Any]):
        self.app = app
        self.limits = limits
        self._too_large = too_large  # exception -> ASGI response

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        limit_bytes, too_large = self.limits.body_limit(scope["method"], scope["path"])
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > limit_bytes:
            await self._too_large(too_large)(scope, receive, send)
            return
        num_received = 0
        is_body_complete = False
        timeout_s = self.limits.body_timeout_s
        loop = asyncio.get_running_loop()
        started = loop.time()

        async def counted_receive():
            nonlocal num_received, is_body_complete
            if is_body_complete:  # what follows is the wait for a disconnect, as long as a response streams
                return await receive()
            # One deadline for the whole body, not per piece: a trickle of bytes must not hold a connection.
            deadline_s = timeout_s + num_received / MIN_BODY_BYTES_PER_S
            remaining = started + deadline_s - loop.time()
            try:
                if remaining <= 0:
                    raise TimeoutError
                message = await asyncio.wait_for(receive(), remaining)
            except TimeoutError:
                raise BodyTimeout(deadline_s, num_received) from None
            if message["type"] == "http.request":
                num_received += len(message.get("body", b""))
                if num_received > limit_bytes:
                    raise too_large
                is_body_complete = not message.get("more_body", False)
            return message

        await self.app(scope, counted_receive, send)


def guarded_h11_protocol(
    header_timeout_s: float, max_connections: int, max_connections_per_client: int | None = None
) -> type[H11Protocol]:
    """uvicorn's h11 protocol with a header timeout, a connection cap and a share of it per client address
    (`max_connections_per_client`, None: no share; pass it as uvicorn's `http`)."""
    retry_after = {"retry-after": str(CONNECTIONS_RETRY_AFTER_SECONDS)}
    rejection = _raw_error(
        503,
        "Service Unavailable",
        "The server has too many open connections; retry shortly.",
        "server_error",
        "too_many_connections",
        retry_after,
    )
    client_rejection = _raw_error(
        503,
        "Service Unavailable",
        "This client has too many open connections to the server; close some or retry shortly.",
        "server_error",
        "too_many_connections",
        retry_after,
    )
    num_open_by_client: dict[str, int] = {}  # one event loop: no lock

    class GuardedH11Protocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None
        _client_key: str | None = None

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            peer = transport.get_extra_info("peername")
            self._client_key = str(peer[0]) if isinstance(peer, tuple) and peer else "unknown"
            num_open_by_client[self._client_key] = num_open_by_client.get(self._client_key, 0) + 1
            if len(self.connections) > max_connections:
                transport.write(rejection)
                transport.close()
                return
            share = max_connections_per_client
            if share is not None and num_open_by_client[self._client_key] > share:
                self.logger.info("refusing a connection: %s has %d open already", self._client_key, share)
                transport.write(client_rejection)
                transport.close()
                return
            self._arm_header_timer()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm_header_timer()

        def connection_lost(self, exc) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
            if self._client_key is not None:
                left = num_open_by_client.pop(self._client_key) - 1
                if left:
                    num_open_by_client[self._client_key] = left
                self._client_key = None
            super().connection_lost(exc)

        def send_400_response(self, msg: str) -> None:
            # uvicorn's own answer is plain text; the h11 state machine is in error by now, so write it raw.
            self.transport.write(
                _raw_error(400, "Bad Request", msg, "invalid_request_error", "invalid_http_request", {})
            )
            self.transport.close()

        def _arm_header_timer(self) -> None:
            # The request cycle when armed: a new one by the deadline means the headers came in time.
            if self._header_timer is not None:
                self._header_timer.cancel()
            self._header_timer = self.loop.call_later(header_timeout_s, self._headers_late, self.cycle)

        def _headers_late(self, cycle_when_armed) -> None:
            self._header_timer = None
            is_idle = self.cycle is None or self.cycle.response_complete  # not in the middle of a request
            if self.cycle is cycle_when_armed and is_idle and not self.transport.is_closing():
                self.logger.info(
                    "closing a connection that sent no complete request in %gs", header_timeout_s
                )
                self.transport.close()

    return GuardedH11Protocol


def _raw_error(
    status: int, reason: str, message: str, type: str, code: str, headers: dict[str, str]
) -> bytes:
    """A whole HTTP/1.1 error response in OpenAI's shape, for the protocol to write before or outside any request."""
    error = {"message": message, "type": type, "param": None, "code": code}
    body = json.dumps({"error": error}).encode()
    lines = [f"HTTP/1.1 {status} {reason}", "content-type: application/json", f"content-length: {len(body)}"]
    lines += [f"{name}: {value}" for name, value in headers.items()]
    lines.append("connection: close")
    return ("\r\n".join(lines) + "\r\n\r\n").encode() + body
