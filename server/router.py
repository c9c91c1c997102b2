"""``tandem router``: one OpenAI-compatible address in front of prefill and decode instances
(``tandem serve --role prefill|decode``).

Each completion or chat request goes to a prefill instance with ``kv_transfer_params:
{"do_remote_decode": true}``, not streamed: it runs the prompt, samples the first token and its
drafts, and answers where its KV waits (its ``kv_transfer_params``). The same request then goes
to a decode instance with those ``kv_transfer_params``, streamed or not as the client asked; the
decode instance pulls the KV and answers the client through the router, first token included.

Choice: the prefill instance that last took a prompt starting the same way (its prefix cache),
unless it has ``PREFIX_SLACK`` more requests in flight than the least loaded one; the decode
instance with the fewest requests in flight; instances last seen dead only when no other is
left. A request that fails on an instance before anything reached the client (a refused
connection, a 5xx, a failed pull) is tried once more on another pair; an instance whose
connection failed is reported dead on ``/health`` until it answers again. ``/metrics``: requests by outcome, hand-over latency (the prefill
instance's answer) and the KV bytes handed over.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import time
from collections import OrderedDict
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any

import httpx
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

logger = logging.getLogger(__name__)

PREFIX_SLACK = 8  # requests in flight past the least loaded before the prefix is ignored
PREFIX_CHARS = 512  # how much of a prompt picks its prefill instance
MAX_PREFIXES = 4096
ROUTED = ("/v1/completions", "/v1/chat/completions")


@dataclass
class Instance:
    url: str
    role: str
    in_flight: int = 0
    dead: str | None = None  # why it was last seen dead (None: alive)


@dataclass
class RouterState:
    prefill: list[Instance]
    decode: list[Instance]
    timeout_s: float
    client: httpx.AsyncClient | None = None
    prefixes: OrderedDict[str, int] = field(default_factory=OrderedDict)
    registry: CollectorRegistry = field(default_factory=CollectorRegistry)

    def __post_init__(self) -> None:
        r = self.registry
        self.requests = Counter(
            "tandem_router_requests", "Requests by outcome.", ["outcome"], registry=r
        )
        self.handover_s = Histogram(
            "tandem_router_handover_seconds",
            "From sending a request to its prefill instance to its hand-over answer.",
            registry=r,
        )
        self.handover_bytes = Counter(
            "tandem_router_handover_bytes",
            "KV bytes the prefill instances handed over.",
            registry=r,
        )
        self.retries = Counter(
            "tandem_router_retries", "Requests tried again on another pair.", registry=r
        )

    def pick_prefill(self, body: dict[str, Any], avoid: set[str]) -> Instance:
        alive = _usable(self.prefill, avoid)
        least = min(alive, key=lambda i: i.in_flight)
        key = _prefix_key(body)
        index = self.prefixes.get(key)
        chosen = least
        if index is not None:
            same = self.prefill[index]
            if same in alive and same.in_flight <= least.in_flight + PREFIX_SLACK:
                chosen = same
        self.prefixes[key] = self.prefill.index(chosen)
        self.prefixes.move_to_end(key)
        while len(self.prefixes) > MAX_PREFIXES:
            self.prefixes.popitem(last=False)
        return chosen

    def pick_decode(self, avoid: set[str]) -> Instance:
        return min(_usable(self.decode, avoid), key=lambda i: i.in_flight)


def _usable(instances: list[Instance], avoid: set[str]) -> list[Instance]:
    """Those not tried for this request and not seen dead; failing that, those not tried;
    failing that, all (the request then fails on one of them, naming it)."""
    return (
        [i for i in instances if i.url not in avoid and i.dead is None]
        or [i for i in instances if i.url not in avoid]
        or instances
    )


def _prefix_key(body: dict[str, Any]) -> str:
    head = body.get("messages", body.get("prompt"))
    text = json.dumps(head, sort_keys=True, default=str)[:PREFIX_CHARS]
    return hashlib.sha256(text.encode()).hexdigest()


class _Retry(Exception):
    """The pair failed before anything reached the client: try another."""

    def __init__(self, instance: Instance, message: str) -> None:
        super().__init__(message)
        self.instance = instance


def _forward_headers(request: Request) -> dict[str, str]:
    auth = request.headers.get("authorization")
    return {"authorization": auth} if auth else {}


def _error(status: int, message: str, kind: str = "server_error") -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": kind, "param": None, "code": None}},
        status_code=status,
    )


async def _post(state: RouterState, inst: Instance, path: str, body: dict[str, Any],
                headers: dict[str, str]) -> httpx.Response:  # fmt: skip
    assert state.client is not None
    inst.in_flight += 1
    try:
        response = await state.client.post(inst.url + path, json=body, headers=headers)
        inst.dead = None
        return response
    except httpx.TransportError as e:
        inst.dead = f"{type(e).__name__}: {e}"
        raise _Retry(inst, f"{inst.role} instance {inst.url}: {e}") from e
    finally:
        inst.in_flight -= 1


async def _route(state: RouterState, request: Request, path: str) -> Response:
    try:
        body = await request.json()
    except ValueError:
        return _error(400, "the body is not valid JSON", "invalid_request_error")
    if not isinstance(body, dict):
        return _error(400, "the body must be a JSON object", "invalid_request_error")
    headers = _forward_headers(request)
    avoid: set[str] = set()
    last = "no instance answered"
    for attempt in range(2):
        if attempt:
            state.retries.inc()
        prefill, decode = state.pick_prefill(body, avoid), state.pick_decode(avoid)
        try:
            return await _through_pair(state, prefill, decode, path, body, headers)
        except _Retry as e:
            avoid.add(e.instance.url)
            last = str(e)
            logger.warning("router: %s (attempt %d)", e, attempt + 1)
    state.requests.labels("failed").inc()
    return _error(503, f"no prefill/decode pair could serve the request: {last}")


async def _through_pair(state: RouterState, prefill: Instance, decode: Instance, path: str,
                        body: dict[str, Any], headers: dict[str, str]) -> Response:  # fmt: skip
    first = {k: v for k, v in body.items() if k != "stream_options"}
    first.update(stream=False, kv_transfer_params={"do_remote_decode": True})
    started = time.monotonic()
    answer = await _post(state, prefill, path, first, headers)
    if answer.status_code >= 500:
        raise _Retry(prefill, f"prefill instance {prefill.url}: {answer.status_code}")
    if answer.status_code != 200:  # the client's request is at fault: as the instance said
        state.requests.labels("refused").inc()
        return Response(answer.content, answer.status_code, media_type="application/json")
    kv = answer.json().get("kv_transfer_params")
    if kv is None:
        raise _Retry(prefill, f"prefill instance {prefill.url} did not hand the request over")
    state.handover_s.observe(time.monotonic() - started)
    state.handover_bytes.inc(int(kv.get("num_bytes", 0)))
    second = {**body, "kv_transfer_params": kv}
    if body.get("stream"):
        return await _stream(state, decode, path, second, headers)
    reply = await _post(state, decode, path, second, headers)
    if reply.status_code >= 500:
        raise _Retry(decode, f"decode instance {decode.url}: {reply.status_code} {reply.text}")
    state.requests.labels("ok" if reply.status_code == 200 else "refused").inc()
    return Response(reply.content, reply.status_code, media_type="application/json")


async def _stream(state: RouterState, decode: Instance, path: str, body: dict[str, Any],
                  headers: dict[str, str]) -> Response:  # fmt: skip
    """The decode instance's stream, passed through once it answered 200 (before that, a
    failure is retried)."""
    assert state.client is not None
    req = state.client.build_request("POST", decode.url + path, json=body, headers=headers)
    decode.in_flight += 1
    try:
        resp = await state.client.send(req, stream=True)
    except httpx.TransportError as e:
        decode.in_flight -= 1
        decode.dead = f"{type(e).__name__}: {e}"
        raise _Retry(decode, f"decode instance {decode.url}: {e}") from e
    if resp.status_code != 200:
        content = await resp.aread()
        await resp.aclose()
        decode.in_flight -= 1
        if resp.status_code >= 500:
            raise _Retry(decode, f"decode instance {decode.url}: {resp.status_code}")
        state.requests.labels("refused").inc()
        return Response(content, resp.status_code, media_type="application/json")

    async def relay() -> AsyncIterator[bytes]:
        outcome = "failed"
        try:
            async for chunk in resp.aiter_raw():
                yield chunk
            outcome = "ok"
        except httpx.TransportError as e:  # mid-stream: the client sees an error event
            decode.dead = f"{type(e).__name__}: {e}"
            message = f"the decode instance {decode.url} failed mid-stream: {e}"
            event = {"error": {"message": message, "type": "server_error", "code": 503}}
            yield f"data: {json.dumps(event)}\n\ndata: [DONE]\n\n".encode()
        finally:
            decode.in_flight -= 1
            state.requests.labels(outcome).inc()
            await resp.aclose()

    return StreamingResponse(relay(), media_type="text/event-stream")


async def _health(state: RouterState) -> Response:
    """200 when every instance answers its /health, else 503 naming the dead ones."""
    assert state.client is not None

    async def check(inst: Instance) -> None:
        try:
            r = await state.client.get(inst.url + "/health", timeout=5)  # type: ignore[union-attr]
            inst.dead = None if r.status_code == 200 else f"/health answered {r.status_code}"
        except httpx.HTTPError as e:
            inst.dead = f"{type(e).__name__}: {e}"

    instances = state.prefill + state.decode
    await asyncio.gather(*(check(i) for i in instances))
    dead = {i.url: i.dead for i in instances if i.dead is not None}
    if dead:
        return JSONResponse({"status": "degraded", "dead": dead}, status_code=503)
    return JSONResponse({"status": "ok"})


def build_router(prefill: list[str], decode: list[str], timeout_s: float = 600.0) -> FastAPI:
    if not prefill or not decode:
        raise ValueError("tandem router needs at least one --prefill and one --decode URL")
    state = RouterState(
        [Instance(u.rstrip("/"), "prefill") for u in prefill],
        [Instance(u.rstrip("/"), "decode") for u in decode],
        timeout_s,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.client = httpx.AsyncClient(timeout=httpx.Timeout(timeout_s, connect=10.0))
        try:
            yield
        finally:
            await state.client.aclose()

    app = FastAPI(title="tandem router", lifespan=lifespan)
    app.state.router = state

    for path in ROUTED:

        async def handler(request: Request, path: str = path) -> Response:
            return await _route(state, request, path)

        app.post(path)(handler)

    @app.get("/health")
    async def health() -> Response:
        return await _health(state)

    @app.get("/v1/models")
    async def models(request: Request) -> Response:
        assert state.client is not None
        inst = state.pick_decode(set())
        try:
            r = await state.client.get(inst.url + "/v1/models", headers=_forward_headers(request))
        except httpx.HTTPError as e:
            return _error(503, f"decode instance {inst.url}: {e}")
        return Response(r.content, r.status_code, media_type="application/json")

    @app.get("/metrics")
    async def metrics() -> Response:
        return Response(generate_latest(state.registry), media_type="text/plain; version=0.0.4")

    return app


def run_router(ns: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=ns.log_level.upper(), format="%(asctime)s %(levelname)s %(message)s")
    app = build_router(ns.prefill, ns.decode, ns.timeout)
    logger.info("router on http://%s:%d: prefill %s, decode %s", ns.host, ns.port,
                ", ".join(ns.prefill), ", ".join(ns.decode))  # fmt: skip
    # In-flight requests get 5 s at shutdown, then are cut (their instances end them).
    uvicorn.run(
        app, host=ns.host, port=ns.port, log_level=ns.log_level, timeout_graceful_shutdown=5
    )
    return 0
