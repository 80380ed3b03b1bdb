"""What refuses a request before it reaches the engine, and the one shape every refusal takes.

Every error leaves as `{"error": {"code", "message", "type", "param"}}` (OpenAI's `type` from `TYPES`,
`param` the request field at fault or null) with a status from `STATUS`; a bug leaves as a 500
`internal_error` whose trace is logged server-side only.
"""

from __future__ import annotations

import hmac
import logging
import math
import time
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from limits import parse
from limits.storage import MemoryStorage
from limits.strategies import MovingWindowRateLimiter
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from inferlab.errors import InferlabError, PayloadTooLargeError, RateLimitedError, ShuttingDownError, UnauthorizedError
from inferlab.server.settings import ServerSettings
from inferlab.server.validation import describe, param

log = logging.getLogger("inferlab.server")

STATUS = {  # InferlabError.code -> HTTP status
    "invalid_request": 422,
    "unauthorized": 401,
    "payload_too_large": 413,
    "not_found": 404,
    "rate_limited": 429,
    "overloaded": 503,  # the KV pool and the wait queue are full
    "capacity_exceeded": 503,  # the slot pool is full (single-request engine)
    "shutting_down": 503,
    "timeout": 504,
    "engine_failed": 503,  # the engine loop stopped: /health says why, the process exits
    "generation_failed": 500,  # this request's own work failed in the engine; the others continue
}


TYPES = {  # InferlabError.code -> OpenAI's error type; any other code is a server_error
    "invalid_request": "invalid_request_error",
    "payload_too_large": "invalid_request_error",
    "not_found": "invalid_request_error",
    "method_not_allowed": "invalid_request_error",
    "unauthorized": "authentication_error",
    "rate_limited": "rate_limit_error",
}


def envelope(code: str, message: str, param: str | None = None) -> dict[str, Any]:
    return {"error": {"code": code, "message": message, "type": TYPES.get(code, "server_error"), "param": param}}


def error_response(error: InferlabError) -> JSONResponse:
    headers = None
    if isinstance(error, RateLimitedError):
        headers = {"Retry-After": str(error.retry_after_s)}
    elif isinstance(error, UnauthorizedError):
        headers = {"WWW-Authenticate": "Bearer"}
    return JSONResponse(
        envelope(error.code, _one_line(error), error.param), STATUS.get(error.code, 500), headers=headers
    )


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(InferlabError)
    async def inferlab_error(request: Request, error: InferlabError) -> JSONResponse:
        return error_response(error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, error: RequestValidationError) -> JSONResponse:
        errors = error.errors()
        return JSONResponse(envelope("invalid_request", describe(errors), param(errors)), 422)

    @app.exception_handler(HTTPException)
    async def http_error(request: Request, error: HTTPException) -> JSONResponse:
        phrase = HTTPStatus(error.status_code).phrase
        return JSONResponse(
            envelope(phrase.lower().replace(" ", "_"), str(error.detail or phrase)),
            error.status_code,
            headers=error.headers,
        )

    @app.exception_handler(Exception)
    async def bug(request: Request, error: Exception) -> JSONResponse:
        request_id = getattr(request.state, "record", None) and request.state.record.id
        log.error("request %s failed", request_id, exc_info=error)
        return JSONResponse(envelope("internal_error", f"internal error (request {request_id})"), 500)


OPEN_PATHS = frozenset({"/", "/health", "/metrics", "/openapi.json", "/docs", "/docs/oauth2-redirect", "/redoc"})


class Guards:
    """Who may call: draining, API key, per-client rate limit, decided from the method, path and headers
    alone. Every path but OPEN_PATHS needs the key when keys are configured; every POST (the work)
    is refused while draining and counts against the client's limit."""

    def __init__(self, settings: ServerSettings) -> None:
        self.keys = [k.encode() for k in settings.api_keys]
        self.limit = parse(settings.rate_limit)
        self.limiter = MovingWindowRateLimiter(MemoryStorage())
        self.draining = False  # set when shutdown starts: refuse new work, let running streams finish

    def check(self, method: str, path: str, authorization: str | None, address: str) -> None:
        if path in OPEN_PATHS:
            return
        if method == "POST" and self.draining:
            raise ShuttingDownError("the server is shutting down")
        key = self.authorize(authorization)
        if method == "POST":
            # no keys configured: the bucket is the address, so a made-up token cannot buy a fresh one
            client = f"key:{key}" if key else f"addr:{address}"
            if not self.limiter.hit(self.limit, client):
                reset = self.limiter.get_window_stats(self.limit, client).reset_time
                raise RateLimitedError(f"rate limit {self.limit} exceeded", max(1, math.ceil(reset - time.time())))

    def authorize(self, authorization: str | None) -> str | None:
        """The caller's key (None when no keys are configured); 401 when it is missing or wrong."""
        if not self.keys:
            return None
        scheme, _, token = (authorization or "").partition(" ")
        given = token.strip().encode() if scheme.lower() == "bearer" else b""
        if not any(hmac.compare_digest(given, key) for key in self.keys):
            raise UnauthorizedError("missing or wrong API key: send `Authorization: Bearer <key>`")
        return given.decode()


class Gate:
    """ASGI middleware: `Guards.check` before anything reads, parses or validates the body, so a client
    without a key learns only that (401), however malformed what it sent."""

    def __init__(self, app: ASGIApp, guards: Guards) -> None:
        self.app, self.guards = app, guards

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            client = scope.get("client")
            try:
                self.guards.check(
                    scope["method"],
                    scope["path"],
                    Headers(scope=scope).get("authorization"),
                    client[0] if client else "unknown",
                )
            except InferlabError as error:
                return await error_response(error)(scope, receive, send)
        await self.app(scope, receive, send)


class BodySizeLimit:
    """ASGI middleware: 413 for a body over `max_bytes`, declared or streamed, before anything parses it."""

    def __init__(self, app: ASGIApp, max_bytes: int) -> None:
        self.app, self.max_bytes = app, max_bytes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = dict(scope["headers"]).get(b"content-length", b"0")
        if not declared.isdigit() or int(declared) > self.max_bytes:
            return await self._refuse(scope, receive, send)
        buffered: list[Message] = []
        size, more = 0, True
        while more:
            message = await receive()
            buffered.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            more = message.get("more_body", False)
            if size > self.max_bytes:
                return await self._refuse(scope, receive, send)

        async def replay() -> Message:
            return buffered.pop(0) if buffered else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send) -> None:
        error = PayloadTooLargeError(f"request body over {self.max_bytes} bytes")
        await error_response(error)(scope, receive, send)


def _one_line(error: Exception) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__
