"""Images made in memory, and a local HTTP server on a free loopback port whose routes a test sets."""

from __future__ import annotations

import base64
import http.server
import io
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import pytest
from PIL import Image


def image_bytes(fmt: str = "PNG", size: tuple[int, int] = (8, 6), color=(200, 30, 40), **save) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", size, color).save(buffer, format=fmt, **save)
    return buffer.getvalue()


def gif_two_frames() -> bytes:
    first, second = Image.new("RGB", (4, 4), (255, 0, 0)), Image.new("RGB", (4, 4), (0, 0, 255))
    buffer = io.BytesIO()
    first.save(buffer, format="GIF", save_all=True, append_images=[second])
    return buffer.getvalue()


def data_url(data: bytes, mime: str = "image/png") -> str:
    return f"data:{mime};base64,{base64.b64encode(data).decode()}"


Route = Callable[[http.server.BaseHTTPRequestHandler], None]


@dataclass
class LocalServer:
    port: int
    routes: dict[str, Route] = field(default_factory=dict)
    hits: list[str] = field(default_factory=list)

    def url(self, path: str, host: str = "localhost") -> str:
        return f"http://{host}:{self.port}{path}"

    def serve_bytes(self, path: str, body: bytes, content_type: str = "image/png") -> None:
        def route(handler):
            handler.send_response(200)
            handler.send_header("Content-Type", content_type)
            handler.send_header("Content-Length", str(len(body)))
            handler.end_headers()
            handler.wfile.write(body)

        self.routes[path] = route

    def redirect(self, path: str, location: str, status: int = 302) -> None:
        def route(handler):
            handler.send_response(status)
            handler.send_header("Location", location)
            handler.send_header("Content-Length", "0")
            handler.end_headers()

        self.routes[path] = route

    def stall(self, path: str, seconds: float) -> None:
        def route(handler):
            handler.send_response(200)
            handler.send_header("Content-Length", "1000")
            handler.end_headers()
            for _ in range(int(seconds / 0.05)):  # a byte at a time: each read is quick, the whole is not
                handler.wfile.write(b"x")
                handler.wfile.flush()
                time.sleep(0.05)

        self.routes[path] = route


@pytest.fixture
def local_server() -> Iterator[LocalServer]:
    server_state: dict[str, LocalServer] = {}

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):  # noqa: N802 (http.server's name)
            state = server_state["s"]
            state.hits.append(self.path)
            route = state.routes.get(self.path)
            if route is None:
                self.send_error(404)
                return
            try:
                route(self)
            except (BrokenPipeError, ConnectionResetError):
                pass

        def log_message(self, *args):
            pass

    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    httpd.daemon_threads = True
    server_state["s"] = LocalServer(port=httpd.server_address[1])
    thread = threading.Thread(target=httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server_state["s"]
    finally:
        httpd.shutdown()
        httpd.server_close()
