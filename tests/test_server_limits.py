"""The limits that protect the server (issue #49 item 5), each a ``tandem serve`` flag: header
size and count, idle kept-alive connections, chat messages, tools, schema bytes and ``n`` (the
body size, the queue's 503 with Retry-After: tests/test_server_errors.py); and a client that
never reads its stream holds nothing of the engine's once its request is done."""

from __future__ import annotations

import json
import socket
import time

import httpx
import pytest

from checkpoints import build_llama
from server_utils import RemoteServer, metric, scrape_metrics, wait_until
from tandem.cli import build_parser
from tandem.server.cli import server_settings_from

LIMITS = {
    "--h11-max-incomplete-event-size": "4KiB",
    "--h11-max-header-count": "12",
    "--timeout-keep-alive": "1",
    "--max-chat-messages": "3",
    "--max-tools": "2",
    "--max-schema-size": "300",
    "--max-n": "4",
}
ASK = [{"role": "user", "content": "Hi"}]


def _tool(name: str, properties: int = 1) -> dict:
    props = {f"p{i}": {"type": "string"} for i in range(properties)}
    return {"type": "function", "function": {"name": name, "parameters": {
        "type": "object", "properties": props}}}  # fmt: skip


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    # 2,048 positions: the tiny tokenizer spells a chat prompt with two tools in some 600.
    model = build_llama(tmp_path_factory.mktemp("limits"), max_position_embeddings=2048)
    args = [a for kv in LIMITS.items() for a in kv] + ["--served-model-name", "m"]
    with RemoteServer(model, args, max_model_len=2048) as s:
        yield s


def _post(server, path: str, body: dict, **kw) -> httpx.Response:
    return httpx.post(server.url(path), json={"model": "m", **body}, timeout=60, **kw)


@pytest.mark.parametrize(
    ("path", "body", "param", "flag"),
    [
        ("/v1/chat/completions", {"messages": ASK * 4}, "messages", "--max-chat-messages"),
        ("/v1/chat/completions", {"messages": ASK, "tools": [_tool("a"), _tool("b"), _tool("c")]},
         "tools", "--max-tools"),
        ("/v1/chat/completions", {"messages": ASK, "tools": [_tool("a"), _tool("b", 20)]},
         "tools[1].function.parameters", "--max-schema-size"),
        ("/v1/chat/completions", {"messages": ASK, "response_format": {
            "type": "json_schema", "json_schema": {"name": "x", "schema": _tool("x", 20)}}},
         "response_format", "--max-schema-size"),
        ("/v1/completions", {"prompt": "a", "structured_outputs": {"regex": "a" * 400}},
         "structured_outputs", "--max-schema-size"),
        ("/v1/completions", {"prompt": "a", "n": 5}, "n", "--max-n"),
        ("/v1/chat/completions", {"messages": ASK, "n": 5}, "n", "--max-n"),
    ],
    ids=["messages", "tools", "tool-schema", "response-format", "structured-outputs",
         "n-completions", "n-chat"],
)  # fmt: skip
def test_requests_over_a_limit_are_400s_naming_the_field_and_the_flag(
    server, path: str, body: dict, param: str, flag: str
) -> None:
    r = _post(server, path, {**body, "max_tokens": 2})
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param, error
    assert flag in error["message"], error


def test_requests_at_the_limits_are_served(server) -> None:
    tools = [_tool("a"), _tool("b", 3)]
    chat = {"messages": ASK * 3, "tools": tools, "n": 4, "max_tokens": 2}
    assert _post(server, "/v1/chat/completions", chat).status_code == 200
    r = _post(server, "/v1/completions", {"prompt": "a", "n": 4, "max_tokens": 2})
    assert r.status_code == 200 and len(r.json()["choices"]) == 4


def test_too_many_header_fields_get_a_431_and_too_large_headers_a_400(server) -> None:
    many = {f"x-extra-{i}": "1" for i in range(12)}
    r = httpx.get(server.url("/v1/models"), headers=many, timeout=10)
    assert r.status_code == 431, r.text
    assert r.json()["error"]["code"] == "request_header_fields_too_large"
    assert httpx.get(server.url("/v1/models"), headers={"x-a": "1"}, timeout=10).status_code == 200
    r = httpx.get(server.url("/v1/models"), headers={"x-big": "a" * 5000}, timeout=10)
    assert r.status_code == 431, r.text
    # Over 4 KiB of a header block that has not arrived whole: uvicorn stops buffering it.
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\nx-big: " + b"a" * 5000)
        assert conn.recv(4096).startswith(b"HTTP/1.1 400")
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


def test_an_idle_kept_alive_connection_is_closed_after_the_timeout(server) -> None:
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: keep-alive\r\n\r\n")
        answer = b""
        while not answer.endswith(b'{"status":"ok"}'):
            answer += conn.recv(4096)
        assert answer.startswith(b"HTTP/1.1 200")
        started = time.monotonic()
        assert conn.recv(4096) == b""  # the server closed it
        assert 0.5 < time.monotonic() - started < 5


def test_a_client_that_never_reads_its_stream_holds_no_engine_state(server) -> None:
    """A streaming client that stops reading: its request still finishes (its output waits in
    the socket and the API process's buffer, bounded by max_tokens), the engine frees its KV
    blocks, and other clients are served meanwhile."""
    body = {"model": "m", "prompt": "a", "max_tokens": 400, "ignore_eos": True, "stream": True}
    payload = json.dumps(body).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        b"Content-Length: " + str(len(payload)).encode() + b"\r\n\r\n" + payload
    )
    with socket.create_connection(("127.0.0.1", server.port), timeout=10) as conn:
        conn.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        conn.sendall(request)  # and never read
        r = _post(server, "/v1/completions", {"prompt": "b", "max_tokens": 3})
        assert r.status_code == 200

        def idle() -> bool:
            m = scrape_metrics(server)
            return (
                metric(m, "tandem:num_requests_running", model_name="m") == 0
                and metric(m, "tandem:kv_cache_usage_perc", model_name="m") == 0
                and metric(m, "tandem:generation_tokens_total", model_name="m") >= 400
            )

        assert wait_until(idle, 60), scrape_metrics(server)
    assert httpx.get(server.url("/health"), timeout=10).status_code == 200


@pytest.mark.parametrize(
    ("flag", "value"),
    [("--h11-max-header-count", "0"), ("--max-chat-messages", "0"), ("--max-tools", "-1"),
     ("--max-schema-size", "0"), ("--max-n", "0"), ("--max-n", "129"),
     ("--timeout-keep-alive", "0"), ("--h11-max-incomplete-event-size", "100")],
)  # fmt: skip
def test_limits_out_of_range_are_refused_naming_the_flag(flag: str, value: str) -> None:
    ns = build_parser().parse_args(["serve", "m", flag, value])
    with pytest.raises(ValueError, match=flag):
        server_settings_from(ns)
