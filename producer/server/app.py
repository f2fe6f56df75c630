"""The HTTP layer of `cbq serve`: OpenAI's Files and Batches endpoints, `/v1/models` and `/health` (Starlette).

Owns requests and responses only: parameter checks, which project sees which file, and errors in OpenAI's shape
`{"error": {"message", "type", "param", "code"}}`, for every status the server sends (404 and 405 from the router,
413 and 408 from `limits.py`, 400 for bodies too deep to parse, 503 with Retry-After while Redis is unreachable,
500 for anything unforeseen). Batches live in `service.py`, files in `files.py`, keys in `auth.py`.
Handlers are plain functions, which Starlette runs on its thread pool, since Redis and disk calls block;
only the upload is async, to read the multipart body as it streams in.
"""

from __future__ import annotations

import contextlib
import json
import logging
import threading
from collections.abc import Callable, Mapping
from typing import Any

import redis
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from starlette.applications import Starlette
from starlette.concurrency import run_in_threadpool
from starlette.datastructures import UploadFile
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import FileResponse, JSONResponse
from starlette.routing import Route

from producer.client import Client
from producer.server.auth import ApiKeyMiddleware, Principal, principal_of
from producer.server.files import FileNotFound, FileRecord, FileStore, FileTooLarge
from producer.server.limits import BodyLimitMiddleware, BodyTimeout, BodyTooLarge, ServerLimits
from producer.server.service import SUPPORTED_ENDPOINTS, BatchService, parse_completion_window
from producer.store.api_batches import BatchRecordNotFound

log = logging.getLogger("cbq.server")

CLEANUP_INTERVAL_SECONDS = 60
REDIS_RETRY_AFTER_SECONDS = 5


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


def error_response(
    status_code: int, message: str, type: str, param=None, code=None, headers: Mapping[str, str] | None = None
) -> JSONResponse:
    body = {"error": {"message": message, "type": type, "param": param, "code": code}}
    return JSONResponse(body, status_code=status_code, headers=headers)


_CLOSE = {"connection": "close"}  # on answers sent before the body was read: the rest of it never is


def body_too_large(exc: BodyTooLarge) -> JSONResponse:
    code = "file_too_large" if exc.param == "file" else "request_too_large"  # as files.save's own check says
    return error_response(413, str(exc), "invalid_request_error", exc.param, code, _CLOSE)


class _CreateBatch(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str
    metadata: dict[str, str] | None = Field(None, max_length=16)
    output_expires_after: dict | None = None


def create_app(
    client: Client,
    files: FileStore,
    *,
    api_keys: dict[str, Principal],
    ttl_seconds: int,
    chunk_size: int,
    limits: ServerLimits | None = None,
):
    """The ASGI app. `api_keys` empty: no authentication (the CLI then binds loopback only)."""
    limits = limits or ServerLimits(max_file_bytes=files.max_bytes)
    service = BatchService(
        client,
        files,
        ttl_seconds=ttl_seconds,
        chunk_size=chunk_size,
        max_lines_per_file=limits.max_lines_per_file,
    )
    stop_cleanup = threading.Event()

    # --- files ------------------------------------------------------------------------------------------------

    def visible_file(request: Request) -> FileRecord:
        record = files.get(request.path_params["file_id"])
        if not principal_of(request.scope).can_see(record.project):
            raise FileNotFound(record.id)
        return record

    async def create_file(request: Request):
        # Starlette spools each uploaded part to a temporary file past 1 MiB, and BodyLimitMiddleware stops the
        # body at the limit: memory and disk stay bounded.
        async with request.form(max_files=1, max_fields=8) as form:
            purpose, upload = form.get("purpose"), form.get("file")
            if purpose != "batch":
                raise ApiError(400, f"purpose must be 'batch', got {purpose!r}", param="purpose")
            if not isinstance(upload, UploadFile):
                raise ApiError(400, "a multipart field 'file' with the JSONL file is required", param="file")
            try:
                record = await run_in_threadpool(
                    files.save,
                    upload.file,
                    upload.filename or "input.jsonl",
                    purpose,
                    principal_of(request.scope).project,
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
        records = files.list(params.get("purpose"), principal_of(request.scope).listing_project)
        if order == "asc":
            records.reverse()
        ids = [r.id for r in records]
        after = params.get("after")
        start = ids.index(after) + 1 if after in ids else (0 if after is None else len(ids))
        page = records[start : start + limit]
        return _list_response([r.to_openai() for r in page], has_more=start + limit < len(records))

    def retrieve_file(request: Request):
        return JSONResponse(visible_file(request).to_openai())

    def file_content(request: Request):
        return FileResponse(files.data_path(visible_file(request).id), media_type="application/jsonl")

    def delete_file(request: Request):
        file_id = visible_file(request).id
        files.delete(file_id)
        return JSONResponse({"id": file_id, "object": "file", "deleted": True})

    # --- batches ----------------------------------------------------------------------------------------------

    async def create_batch(request: Request):
        raw = await request.body()
        try:
            body = _CreateBatch.model_validate(json.loads(raw))
        except RecursionError:
            raise ApiError(400, "the request body is nested too deeply") from None
        except ValueError as exc:
            raise _body_error(exc) from None
        return JSONResponse(await run_in_threadpool(_create_batch, principal_of(request.scope), body))

    def _create_batch(principal: Principal, body: _CreateBatch) -> dict:
        if body.endpoint not in SUPPORTED_ENDPOINTS:
            supported = ", ".join(SUPPORTED_ENDPOINTS)
            raise ApiError(
                400, f"endpoint {body.endpoint!r} is not supported (supported: {supported})", param="endpoint"
            )
        window_seconds = parse_completion_window(body.completion_window)
        if window_seconds is None:
            raise ApiError(400, "completion_window must look like '24h'", param="completion_window")
        if window_seconds > ttl_seconds:
            raise ApiError(
                400,
                f"completion_window is longer than the server keeps results ({ttl_seconds} s, --ttl)",
                param="completion_window",
            )
        try:
            input_file = files.get(body.input_file_id)
            if not principal.can_see(input_file.project):
                raise FileNotFound(input_file.id)
        except FileNotFound as exc:
            raise ApiError(404, str(exc), param="input_file_id", code="not_found") from None
        if input_file.purpose != "batch":
            raise ApiError(400, "the input file must have purpose 'batch'", param="input_file_id")
        for key, value in (body.metadata or {}).items():
            if len(key) > 64 or len(value) > 512:
                raise ApiError(400, "metadata keys have at most 64 characters, values 512", param="metadata")
        return service.create(
            principal,
            input_file_id=body.input_file_id,
            endpoint=body.endpoint,
            completion_window_seconds=window_seconds,
            completion_window=body.completion_window,
            metadata=body.metadata,
            output_expires_seconds=_output_expiry(body.output_expires_after),
        )

    def retrieve_batch(request: Request):
        return JSONResponse(service.view(principal_of(request.scope), request.path_params["batch_id"]))

    def cancel_batch(request: Request):
        return JSONResponse(service.cancel(principal_of(request.scope), request.path_params["batch_id"]))

    def list_batches(request: Request):
        limit = _int_param(request.query_params, "limit", 20, 1, 100)
        data, has_more = service.list(principal_of(request.scope), request.query_params.get("after"), limit)
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
            retry_after = {"retry-after": str(REDIS_RETRY_AFTER_SECONDS)}
            body = {"status": "error", "redis": False, "detail": str(exc)}
            return JSONResponse(body, status_code=503, headers=retry_after)
        return JSONResponse({"status": "ok", "redis": True})

    # --- errors, auth, lifespan -------------------------------------------------------------------------------

    async def api_error(request: Request, exc: ApiError):
        return error_response(exc.status_code, exc.message, exc.type, exc.param, exc.code)

    async def not_found(request: Request, exc: LookupError):
        return error_response(404, str(exc), "invalid_request_error", None, "not_found")

    async def http_error(request: Request, exc: HTTPException):
        kind = "server_error" if exc.status_code >= 500 else "invalid_request_error"
        return error_response(exc.status_code, str(exc.detail), kind, None, None, exc.headers)

    async def too_large(request: Request, exc: BodyTooLarge):
        return body_too_large(exc)

    async def body_timeout(request: Request, exc: BodyTimeout):
        log.warning("%s %s: 408, %s", request.method, request.url.path, exc)
        return error_response(408, str(exc), "invalid_request_error", None, "request_timeout", _CLOSE)

    async def client_gone(request: Request, exc: ClientDisconnect):
        # The client closed its connection before its body was whole: one line, and an answer no one reads.
        log.warning("%s %s: the client went away before its body arrived", request.method, request.url.path)
        return error_response(400, "the client disconnected", "invalid_request_error", None, None, _CLOSE)

    async def redis_down(request: Request, exc: Exception):
        log.warning("%s %s: Redis is unreachable: %s", request.method, request.url.path, exc)
        message = "The server's Redis is unreachable; retry later."
        headers = {"retry-after": str(REDIS_RETRY_AFTER_SECONDS)}
        return error_response(503, message, "server_error", None, "service_unavailable", headers)

    async def server_error(request: Request, exc: Exception):
        # Starlette's outermost handler: it logs the traceback; the client gets no detail of it.
        return error_response(500, "The server had an error processing the request.", "server_error")

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
        BodyTooLarge: too_large,
        BodyTimeout: body_timeout,
        ClientDisconnect: client_gone,
        redis.ConnectionError: redis_down,  # BusyLoadingError too
        redis.TimeoutError: redis_down,
        Exception: server_error,
    }
    app = Starlette(routes=routes, exception_handlers=handlers, lifespan=lifespan)
    unauthorized = error_response(
        401, "Incorrect API key provided.", "invalid_request_error", None, "invalid_api_key"
    )
    return BodyLimitMiddleware(ApiKeyMiddleware(app, api_keys, unauthorized), limits, body_too_large)


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
