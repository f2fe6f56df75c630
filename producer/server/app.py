"""The HTTP layer of `cbq serve`: OpenAI's Files and Batches endpoints, `/v1/models` and `/health` (Starlette).

Owns requests and responses only: parameter checks, API keys, and errors in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`. Batches live in `service.py`, files in `files.py`.
Handlers are plain functions, which Starlette runs on its thread pool, since Redis and disk calls block;
only the upload is async, to read the multipart body as it streams in.
"""

from __future__ import annotations

import contextlib
import hmac
import threading
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Route

from producer.client import Client
from producer.server.files import FileNotFound, FileStore, FileTooLarge
from producer.server.records import BatchRecordNotFound
from producer.server.service import SUPPORTED_ENDPOINTS, BatchService, parse_completion_window

CLEANUP_INTERVAL_SECONDS = 60
MULTIPART_OVERHEAD_BYTES = 64 * 1024  # slack over the file limit for the form's other parts and boundaries


class ApiError(Exception):
    def __init__(
        self, status_code: int, message: str, type: str = "invalid_request_error", param=None, code=None
    ):
        super().__init__(message)
        self.status_code, self.message, self.type, self.param, self.code = (
            status_code,
            message,
            type,
            param,
            code,
        )


def error_response(status_code: int, message: str, type: str, param=None, code=None) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status_code)


class _CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict | None = None


def create_app(client: Client, files: FileStore, *, api_keys: list[str], ttl_seconds: int, chunk_size: int):
    """The Starlette app. `api_keys` empty: no authentication (the CLI then binds loopback only)."""
    service = BatchService(client, files, ttl_seconds=ttl_seconds, chunk_size=chunk_size)
    stop_cleanup = threading.Event()

    # --- files ------------------------------------------------------------------------------------------------

    async def create_file(request: Request):
        declared = int(request.headers.get("content-length") or 0)
        if declared > files.max_bytes + MULTIPART_OVERHEAD_BYTES:
            raise ApiError(413, str(FileTooLarge(files.max_bytes)), param="file", code="file_too_large")
        # Starlette spools each uploaded part to a temporary file past 1 MiB: memory stays bounded.
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise ApiError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "a multipart field 'file' with the JSONL file is required", param="file")
            try:
                record = await run_in_threadpool(
                    files.save, upload.file, upload.filename or "input.jsonl", purpose
                )
            except FileTooLarge as exc:
                raise ApiError(413, str(exc), param="file", code="file_too_large") from None
        return JSONResponse(record.to_openai())

    def list_files(request: Request):
        params = request.query_params
        limit = _int_param(params, "limit", 10_000, 1, 10_000)
        order = params.get("order", "desc")
        if order not in ("asc", "desc"):
            raise ApiError(400, "order must be 'asc' or 'desc'", param="order")
        records = files.list(params.get("purpose"))
        if order == "asc":
            records.reverse()
        ids = [r.id for r in records]
        after = params.get("after")
        start = ids.index(after) + 1 if after in ids else (0 if after is None else len(ids))
        page = records[start : start + limit]
        return _list_response([r.to_openai() for r in page], has_more=start + limit < len(records))

    def retrieve_file(request: Request):
        return JSONResponse(files.get(request.path_params["file_id"]).to_openai())

    def file_content(request: Request):
        file_id = request.path_params["file_id"]
        return FileResponse(files.data_path(file_id), media_type="application/jsonl")

    def delete_file(request: Request):
        file_id = request.path_params["file_id"]
        files.delete(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # --- batches ----------------------------------------------------------------------------------------------

    async def create_batch(request: Request):
        try:
            body = _CreateBatch.model_validate(await request.json())
        except ValueError as exc:
            raise _body_error(exc) from None
        return JSONResponse(await run_in_threadpool(_create_batch, body))

    def _create_batch(body: _CreateBatch) -> dict:
        if body.endpoint not in SUPPORTED_ENDPOINTS:
            supported = ", ".join(SUPPORTED_ENDPOINTS)
            raise ApiError(
                400, f"endpoint {body.endpoint!r} is not supported (supported: {supported})", param="endpoint"
            )
        window_seconds = parse_completion_window(body.completion_window)
        if window_seconds is None:
            raise ApiError(400, "completion_window must look like '24h'", param="completion_window")
        try:
            input_file = files.get(body.input_file_id)
        except FileNotFound as exc:
            raise ApiError(404, str(exc), param="input_file_id", code="not_found") from None
        if input_file.purpose != "batch":
            raise ApiError(400, "the input file must have purpose 'batch'", param="input_file_id")
        for key, value in (body.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ApiError(400, "metadata keys have at most 64 characters, values 512", param="metadata")
        return service.create(
            input_file_id=body.input_file_id,
            endpoint=body.endpoint,
            completion_window_seconds=window_seconds,
            completion_window=body.completion_window,
            metadata=body.metadata,
            output_expires_seconds=_output_expiry(body.output_expires_after),
        )

    def retrieve_batch(request: Request):
        return JSONResponse(service.view(request.path_params["batch_id"]))

    def cancel_batch(request: Request):
        return JSONResponse(service.cancel(request.path_params["batch_id"]))

    def list_batches(request: Request):
        limit = _int_param(request.query_params, "limit", 20, 1, 100)
        data, has_more = service.list(request.query_params.get("after"), limit)
        return _list_response(data, has_more)

    # --- models, health ---------------------------------------------------------------------------------------

    def list_models(request: Request):
        seen: dict[str, int] = {}
        for worker in client.workers():
            seen.setdefault(worker.model, int(worker.started_at))
        data = [
            {"id": m, "object": "model", "created": t, "owned_by": "cbq"} for m, t in sorted(seen.items())
        ]
        return JSONResponse({"object": "list", "data": data})

    def health(request: Request):
        try:
            client.connection.ping()
        except Exception as exc:
            return JSONResponse({"status": "error", "redis": False, "detail": str(exc)}, status_code=503)
        return JSONResponse({"status": "ok", "redis": True})

    # --- errors, auth, lifespan -------------------------------------------------------------------------------

    async def api_error(request: Request, exc: ApiError):
        return error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code)

    async def not_found(request: Request, exc: LookupError):
        return error_response(404, str(exc), "invalid_request_error", None, "not_found")

    async def http_error(request: Request, exc: HTTPException):
        return error_response(exc.status_code, str(exc.detail), "invalid_request_error", None, None)

    def cleanup_loop():
        while not stop_cleanup.wait(CLEANUP_INTERVAL_SECONDS):
            with contextlib.suppress(Exception):
                files.remove_expired()

    @contextlib.asynccontextmanager
    async def lifespan(app):
        files.remove_expired()
        thread = threading.Thread(target=cleanup_loop, name="cbq-file-cleanup", daemon=True)
        thread.start()
        try:
            yield
        finally:
            stop_cleanup.set()
            service.shutdown()

    routes = [
        Route("/health", health),
        Route("/v1/models", list_models),
        Route("/v1/files", create_file, methods=["POST"]),
        Route("/v1/files", list_files, methods=["GET"]),
        Route("/v1/files/{file_id}", retrieve_file, methods=["GET"]),
        Route("/v1/files/{file_id}", delete_file, methods=["DELETE"]),
        Route("/v1/files/{file_id}/content", file_content, methods=["GET"]),
        Route("/v1/batches", create_batch, methods=["POST"]),
        Route("/v1/batches", list_batches, methods=["GET"]),
        Route("/v1/batches/{batch_id}", retrieve_batch, methods=["GET"]),
        Route("/v1/batches/{batch_id}/cancel", cancel_batch, methods=["POST"]),
    ]
    handlers: dict[Any, Callable] = {
        ApiError: api_error,
        FileNotFound: not_found,
        BatchRecordNotFound: not_found,
        HTTPException: http_error,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    return ApiKeyMiddleware(app, api_keys) if api_keys else app


class ApiKeyMiddleware:
    """`Authorization: Bearer KEY` on every /v1/ path; a missing or wrong key gets OpenAI's 401."""

    def __init__(self, app, api_keys: list[str]):
        self.app = app
        self._keys = [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"].startswith("/v1/") and not self._authorized(scope):
            response = error_response(
                401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key"
            )
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        header = dict(scope["headers"]).get(b"authorization", b"")
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer":
            return False
        token = token.strip()
        # compare_digest against every key: the time taken says nothing about which key came close.
        return any([hmac.compare_digest(token, key) for key in self._keys])


def _list_response(data: list[dict], has_more: bool) -> JSONResponse:
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": has_more,
        }
    )


def _int_param(params, name: str, default: int, low: int, high: int) -> int:
    raw = params.get(name)
    if raw is None:
        return default
    try:
        value = int(raw)
    except ValueError:
        value = low - 1
    if not low <= value <= high:
        raise ApiError(400, f"{name} must be an integer from {low} to {high}", param=name)
    return value


def _output_expiry(policy: dict | None) -> int | None:
    if policy is None:
        return None
    seconds = policy.get("seconds")
    if (
        policy.get("anchor") != "created_at"
        or not isinstance(seconds, int)
        or not 3600 <= seconds <= 2_592_000
    ):
        raise ApiError(
            400,
            "output_expires_after needs anchor 'created_at' and seconds from 3600 to 2592000",
            param="output_expires_after",
        )
    return seconds


def _body_error(exc: ValueError) -> ApiError:
    if isinstance(exc, ValidationError):
        error = exc.errors(include_url=False)[0]
        param = ".".join(str(p) for p in error["loc"]) or None
        return ApiError(400, f"{param}: {error['msg']}" if param else error["msg"], param=param)
    return ApiError(400, "the request body must be a JSON object")
