"""The FastAPI app: OpenAI-compatible endpoints in front of an ``AsyncLLM``.

``build_app`` loads the tokenizer and config (fast, fails early on a bad model folder); the
engine process starts in the app's lifespan and the app answers ``/health`` (200) and ``/ready``
(503) while the model loads and warms up.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from tandem.engine.client import RequestGroup
from tandem.engine.config import EngineArgs
from tandem.server.errors import (
    APIError,
    bad_request,
    error_body,
    install_error_handlers,
    payload_too_large,
    too_many_headers,
)
from tandem.server.protocol import (
    ChatCompletionRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
)
from tandem.server.serving import (
    ClientDisconnected,
    SSEResponse,
    engine_error_to_api,
    unless_disconnected,
)
from tandem.server.serving_chat import ChatHandler, render_chat_prompt
from tandem.server.serving_completion import CompletionHandler
from tandem.server.state import ServerSettings, ServerState
from tandem.version import __version__

logger = logging.getLogger(__name__)

OPEN_PATHS = ("/health", "/ready", "/metrics", "/version")
CLIENT_CLOSED_REQUEST = 499  # nginx's status for "the client went away"; nobody reads it


class APIKeyMiddleware:
    """Requires ``Authorization: Bearer <key>`` everywhere except the open paths.

    A plain ASGI middleware (not ``BaseHTTPMiddleware``) so that streaming and disconnect
    detection are untouched; it runs before the body is read, so a bad key is always a 401."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.key = api_key.encode()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS:
            token = b""
            for name, value in scope["headers"]:
                if name == b"authorization":
                    scheme, _, token = value.partition(b" ")
                    token = token.strip() if scheme.lower() == b"bearer" else b""
                    break
            if not hmac.compare_digest(token, self.key):
                body = error_body(
                    "Incorrect or missing API key. Send 'Authorization: Bearer <key>'.",
                    "invalid_request_error",
                    None,
                    "invalid_api_key",
                )
                response = JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


class HeaderLimitMiddleware:
    """Answers 431 for requests with more than ``count`` header fields or more than ``size``
    bytes of them (names and values). uvicorn bounds what it buffers of a header block that has
    not arrived whole by the same size (a 400, the connection closed); one that arrived whole is
    measured here."""

    def __init__(self, app: ASGIApp, count: int, size: int) -> None:
        self.app = app
        self.count = count
        self.size = size

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            headers = scope["headers"]
            size = sum(len(name) + len(value) for name, value in headers)
            if len(headers) > self.count or size > self.size:
                await too_many_headers(self.count, self.size).response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


class BodyLimitMiddleware:
    """Answers 413 for request bodies over ``limit`` bytes, declared (Content-Length) or
    streamed (chunked), before the app parses them. The body is read here and replayed to the
    app; later ``receive`` calls reach the client (disconnect detection still works)."""

    def __init__(self, app: ASGIApp, limit: int) -> None:
        self.app = app
        self.limit = limit

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope["headers"]:
            if name == b"content-length" and value.isdigit() and int(value) > self.limit:
                await payload_too_large(self.limit).response()(scope, receive, send)
                return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > self.limit:
                await payload_too_large(self.limit).response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: bytes | None = b"".join(chunks)

        async def replay() -> Message:
            nonlocal body
            if body is None:
                return await receive()
            message: Message = {"type": "http.request", "body": body, "more_body": False}
            body = None
            return message

        await self.app(scope, replay, send)


def _state(request: Request) -> ServerState:
    return request.app.state.tandem


async def _run(
    request: Request, group: RequestGroup, handler: CompletionHandler | ChatHandler
) -> Response:
    """Finish a non-streaming request, aborting it if the client disconnects."""
    try:
        outs = await unless_disconnected(request, group.final_outputs())
    except ClientDisconnected:
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except APIError:
        raise
    except Exception as e:
        raise engine_error_to_api(e) from e
    finally:
        group.abort()
    return JSONResponse(handler.response(outs))


def build_app(engine_args: EngineArgs, settings: ServerSettings | None = None) -> FastAPI:
    settings = settings or ServerSettings()
    state = ServerState(engine_args, settings)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.llm.launch()
        starting = asyncio.create_task(state.start())
        try:
            yield
        finally:
            if not starting.done():
                starting.cancel()
            await asyncio.to_thread(state.llm.shutdown)

    app = FastAPI(title="Tandem", version=__version__, lifespan=lifespan)
    app.state.tandem = state
    install_error_handlers(app)
    # The last one added runs first: the header count, then the key, before any body is read.
    app.add_middleware(BodyLimitMiddleware, limit=settings.max_request_body_bytes)
    if settings.api_key:
        app.add_middleware(APIKeyMiddleware, api_key=settings.api_key)
    app.add_middleware(
        HeaderLimitMiddleware, count=settings.max_header_count, size=settings.max_header_bytes
    )

    # ---------------------------------------------------------------- operations

    @app.get("/health")
    async def health() -> Response:
        if state.start_error is None and state.llm.is_healthy:
            return JSONResponse({"status": "ok"})
        reason = state.start_error or state.llm.dead_reason or "the engine is not responding"
        return JSONResponse(error_body(reason, "server_error", None, "engine_dead"), 503)

    @app.get("/ready")
    async def ready() -> Response:
        """Readiness: 503 while loading, shutting down or when the engine is gone."""
        try:
            state.require_ready()
        except APIError as e:
            return e.response()
        if not state.llm.is_healthy:
            return JSONResponse(
                error_body("the engine is not responding", "server_error", None, "engine_dead"),
                503,
            )
        return JSONResponse({"status": "ready"})

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(state.metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version() -> dict[str, str]:
        return {"version": __version__}

    # ---------------------------------------------------------------- OpenAI API

    @app.get("/v1/models")
    async def list_models() -> dict[str, Any]:
        card = {
            "object": "model",
            "created": state.created,
            "owned_by": "tandem",
            "root": engine_args.model,
            "max_model_len": state.max_model_len,
        }
        return {"object": "list", "data": [{"id": n, **card} for n in state.listed_model_names]}

    @app.post("/v1/completions")
    async def create_completion(body: CompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        body.check_supported()
        state.require_ready()
        handler = CompletionHandler(state, body)
        group = await handler.submit()
        if body.stream:
            return SSEResponse(handler.stream(group), on_close=group.abort)
        return await _run(request, group, handler)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
        state.check_model(body.model)
        body.check_supported()
        state.require_ready()
        handler = ChatHandler(state, body)
        group = await handler.submit()
        if body.stream:
            return SSEResponse(handler.stream(group), on_close=group.abort)
        return await _run(request, group, handler)

    # ---------------------------------------------------------------- tokenizer

    @app.post("/tokenize")
    async def tokenize(body: TokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        if (body.prompt is None) == (body.messages is None):
            raise bad_request("send exactly one of 'prompt' or 'messages'", "prompt")
        body.check_template_kwargs()
        if body.messages is not None:
            if not body.messages:
                raise bad_request("messages must not be empty", "messages")
            kwargs = {**state.settings.default_chat_template_kwargs}
            kwargs.update(body.chat_template_kwargs or {})
            ids = render_chat_prompt(
                state, body.messages, body.add_generation_prompt, template_kwargs=kwargs
            )
        elif isinstance(body.prompt, str):
            ids = state.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
        else:
            ids = list(body.prompt or [])
        return {"tokens": ids, "count": len(ids), "max_model_len": state.max_model_len}

    @app.post("/detokenize")
    async def detokenize(body: DetokenizeRequest) -> dict[str, Any]:
        state.check_model(body.model)
        vocab = state.vocab_size
        bad = [t for t in body.tokens if not 0 <= t < vocab]
        if bad:
            raise bad_request(f"token ids out of range [0, {vocab}): {bad[:5]}", "tokens")
        return {"prompt": state.tokenizer.decode(body.tokens)}

    return app
