"""Hostile input against a real server: schemathesis fuzzing from Tandem's own OpenAPI schema
plus hand-written cases (malformed JSON, wrong types, out-of-range numbers, invalid UTF-8, ids
outside the vocabulary, empty and enormous prompts, context overflow, oversized and deeply nested
bodies). Nothing may answer 5xx or hang, and the server must answer correctly afterwards. Also:
overload (bounded queue, 503 + Retry-After, recovery) and the security rules (API key, ids,
templates, logs)."""

from __future__ import annotations

import ast
import asyncio
import json
import time
from collections import Counter
from pathlib import Path

import httpx
import pytest

from server_utils import (
    REPO,
    RemoteServer,
    is_openai_error,
    metric,
    scrape_metrics,
    tiny_model,
    wait_until,
)

API_KEY = "sk-tandem-fuzz-7f3a9c0e5b1d"
MAX_MODEL_LEN = 64
BODY_LIMIT = 64 << 10  # --max-request-body-size
FUZZ_EXAMPLES = 80  # per operation and generation mode (positive, negative)
FUZZ_BUDGET_S = 75.0  # stop sending (examples still drawn) once this much time has passed
PROMPT = "Hello world!"
LABEL = {"model_name": "tiny"}

pytestmark = pytest.mark.timeout(300)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    args = [
        "--max-model-len", str(MAX_MODEL_LEN), "--max-num-seqs", "2",
        "--max-waiting-requests", "2", "--served-model-name", "tiny",
        "--max-request-body-size", str(BODY_LIMIT), "--log-level", "debug",
    ]  # fmt: skip
    with RemoteServer(model, args, api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(http) -> str:
    """A greedy completion from the fresh server: the same request must give the same text
    after everything the fuzzers throw at it."""
    return greedy_text(http)


def greedy_text(http: httpx.Client) -> str:
    r = http.post("/v1/completions", json={
        "model": "tiny", "prompt": PROMPT, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
    })  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"]


def assert_client_error(r: httpx.Response, status: int | None = None) -> dict:
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:500])
    if status is not None:
        assert r.status_code == status, r.text[:500]
    assert is_openai_error(r), r.text[:500]
    return r.json()["error"]


def idle(server: RemoteServer) -> bool:
    m = scrape_metrics(server)
    return all(
        metric(m, f"tandem:{name}", **LABEL) == 0
        for name in (
            "num_requests_running", "num_requests_waiting", "kv_cache_used_blocks",
            "num_requests_in_flight",
        )
    )  # fmt: skip


# ------------------------------------------------------------------ schemathesis


def test_schemathesis_fuzz_finds_no_5xx(server, reference):
    import schemathesis
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis.errors import Unsatisfiable
    from schemathesis import GenerationMode

    raw = httpx.get(server.url("/openapi.json"), headers=server.headers, timeout=30).json()
    schema = schemathesis.openapi.from_dict(raw)
    statuses: Counter[int] = Counter()
    bad: list[str] = []
    start = time.monotonic()
    ops = [result.ok() for result in schema.get_all_operations()]
    assert {"/v1/completions", "/v1/chat/completions", "/tokenize"} <= {op.path for op in ops}

    for op in ops:
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):

            @settings(
                max_examples=FUZZ_EXAMPLES, deadline=None, database=None, derandomize=True,
                phases=[Phase.explicit, Phase.generate],
                suppress_health_check=list(HealthCheck),
            )  # fmt: skip
            @given(case=op.as_strategy(generation_mode=mode))
            def run(case) -> None:
                if time.monotonic() - start > FUZZ_BUDGET_S:
                    return
                try:
                    r = case.call(base_url=server.base_url, headers=server.headers, timeout=60)
                except Exception as e:  # a dropped connection or a hang counts as a failure
                    bad.append(f"{case.method} {case.path}: {type(e).__name__}: {e}")
                    return
                statuses[r.status_code] += 1
                if r.status_code >= 500 or (r.status_code >= 400 and not _openai_shape(r)):
                    bad.append(f"{case.method} {case.path} -> {r.status_code} {r.text[:300]}")

            try:
                run()
            except Unsatisfiable:  # nothing to make invalid (an operation without inputs)
                assert mode == GenerationMode.NEGATIVE

    total = sum(statuses.values())
    print(f"\nschemathesis: {total} requests in {time.monotonic() - start:.1f} s, "
          f"statuses {dict(sorted(statuses.items()))}")  # fmt: skip
    assert not bad, "\n".join(bad[:20])
    assert total >= 100
    assert statuses[200] > 0 and statuses[400] > 0  # both sides of validation were reached
    # Still healthy, still correct, nothing left behind.
    wait_until(lambda: idle(server), timeout_s=60, interval_s=0.5)
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        assert c.get("/health").status_code == 200
        assert greedy_text(c) == reference


def _openai_shape(r: object) -> bool:
    try:
        body = r.json()  # type: ignore[attr-defined]
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return isinstance(err, dict) and set(err) == {"message", "type", "param", "code"}


# ------------------------------------------------------------------ hand-written hostile cases

DEEP = 30_000  # JSON nesting far past Python's recursion limit, still under BODY_LIMIT

RAW_BODIES = {
    "truncated": b'{"model": "tiny", "prompt": "x",',
    "trailing": b'{"model": "tiny", "prompt": "x"}}',
    "binary": b"\x00\x01\x02\xff",
    "invalid_utf8": b'{"model": "tiny", "prompt": "\xff\xfe caf\xc3"}',
    "overlong_utf8": b'{"model": "tiny", "prompt": "\xc0\xaf"}',
    "lone_surrogate": b'{"model": "tiny", "prompt": "a\\ud800b"}',
    "surrogate_key": b'{"model": "tiny", "prompt": "x", "\\udfff": 1}',
    "surrogate_model": b'{"model": "\\ud800", "prompt": "x"}',
    "infinity": b'{"model": "tiny", "prompt": "x", "temperature": 1e999}',
    "nan": b'{"model": "tiny", "prompt": "x", "top_p": NaN}',
    "deep_array": b'{"model": "tiny", "prompt": ' + b"[" * DEEP + b"]" * DEEP + b"}",
    "deep_object": b'{"model": "tiny", "prompt": "x", "metadata": '
    + b'{"a":' * (DEEP // 4)
    + b"1"
    + b"}" * (DEEP // 4)
    + b"}",
    "null": b"null",
    "number": b"12345678901234567890",
}


@pytest.mark.parametrize("name", sorted(RAW_BODIES))
@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions", "/tokenize"])
def test_raw_hostile_bodies(http, name, path):
    r = http.post(path, content=RAW_BODIES[name], headers={"content-type": "application/json"})
    assert_client_error(r, 400)


BIG = 2**64
JSON_CASES = {
    # wrong types
    "prompt_number": {"prompt": 5},
    "prompt_mixed": {"prompt": [1, "a", None]},
    "prompt_nested_ids": {"prompt": [[1, 2], [3, [4]]]},
    "max_tokens_string": {"prompt": "x", "max_tokens": "5"},
    "n_float": {"prompt": "x", "n": 1.0},
    "stream_int": {"prompt": "x", "stream": 1},
    "stop_dict": {"prompt": "x", "stop": {"a": 1}},
    "model_list": {"prompt": "x", "model": ["tiny"]},
    # out of range
    "max_tokens_huge": {"prompt": "x", "max_tokens": BIG},
    "max_tokens_neg": {"prompt": "x", "max_tokens": -(2**63)},
    "temperature_huge": {"prompt": "x", "temperature": 1e308},
    "top_k_huge_neg": {"prompt": "x", "top_k": -(10**30)},
    "seed_huge": {"prompt": "x", "seed": BIG},
    "logprobs_huge": {"prompt": "x", "logprobs": 10**100},
    "n_huge": {"prompt": "x", "n": 128},
    "min_tokens_huge": {"prompt": "x", "min_tokens": BIG},
    "stop_token_huge": {"prompt": "x", "stop_token_ids": [2**40]},
    # token ids outside the vocabulary (320)
    "id_vocab": {"prompt": [1, 2, 320]},
    "id_int32": {"prompt": [2**31]},
    "id_huge": {"prompt": [BIG]},
    "id_negative": {"prompt": [-1]},
    "ids_batch_bad": {"prompt": [[1, 2], [999_999]]},
    # empty
    "empty_text": {"prompt": ""},
    "empty_ids": {"prompt": []},
    "empty_batch": {"prompt": [[]]},
    "empty_batch_text": {"prompt": ["x", ""]},
    "no_prompt": {"model": "tiny"},
    # beyond the context (max_model_len 64)
    "enormous_text": {"prompt": "word " * 10_000},
    "enormous_ids": {"prompt": list(range(1, 300)) * 30},
    "prompt_plus_max_tokens": {"prompt": "Hello world! " * 4, "max_tokens": MAX_MODEL_LEN},
    "max_tokens_past_context": {"prompt": "x", "max_tokens": MAX_MODEL_LEN},
}


@pytest.mark.parametrize("name", sorted(JSON_CASES))
def test_hostile_completion_requests(http, name):
    r = http.post("/v1/completions", json={"model": "tiny", **JSON_CASES[name]})
    err = assert_client_error(r, 400)
    if name in ("enormous_text", "enormous_ids", "prompt_plus_max_tokens"):
        assert err["code"] == "context_length_exceeded", err
    if name == "max_tokens_past_context":
        assert err["code"] == "context_length_exceeded", err


def _nested_content(depth: int) -> object:
    value: object = "x"
    for _ in range(depth):
        value = [{"type": "text", "text": value}]
    return value


CHAT_CASES = {
    "messages_empty": {"messages": []},
    "messages_object": {"messages": {"role": "user", "content": "hi"}},
    "content_nested": {"messages": [{"role": "user", "content": _nested_content(200)}]},
    "tool_choice_nested": {
        "messages": [{"role": "user", "content": "hi"}],
        "tool_choice": _nested_content(200),
    },
    "content_surrogate": {"messages": [{"role": "user", "content": "\ud800"}]},
    "name_surrogate": {"messages": [{"role": "user", "content": "hi", "name": "\udc00"}]},
    "enormous_content": {"messages": [{"role": "user", "content": "word " * 10_000}]},
    "many_messages": {"messages": [{"role": "user", "content": "hi"}] * 1000},
    "max_completion_past_context": {
        "messages": [{"role": "user", "content": "hi"}],
        "max_completion_tokens": MAX_MODEL_LEN,
    },
    "request_chat_template": {  # refused: the operator did not allow request templates
        "messages": [{"role": "user", "content": "hi"}],
        "chat_template": "{{ messages[0]['content'] }}",
    },
}


@pytest.mark.parametrize("name", sorted(CHAT_CASES))
def test_hostile_chat_requests(http, name):
    body = {"model": "tiny", **CHAT_CASES[name]}
    # json.dumps keeps lone surrogates as \\u escapes, which is what a hostile client sends.
    r = http.post(
        "/v1/chat/completions",
        content=json.dumps(body).encode(),
        headers={"content-type": "application/json"},
    )
    err = assert_client_error(r, 400)
    if name in ("enormous_content", "many_messages", "max_completion_past_context"):
        assert err["code"] == "context_length_exceeded", err
    if name == "request_chat_template":
        assert err["param"] == "chat_template" and "--trust-request-chat-template" in err["message"]


def test_tokenizer_endpoints_with_hostile_input(http):
    for tokens in ([-1], [BIG], [320], [1, 2**31]):
        assert_client_error(http.post("/detokenize", json={"tokens": tokens}), 400)
    assert_client_error(http.post("/tokenize", json={"prompt": "x", "messages": []}), 400)
    assert_client_error(
        http.post("/tokenize", content=b'{"prompt": "\\ud800"}',
                  headers={"content-type": "application/json"}), 400,
    )  # fmt: skip
    assert_client_error(http.post("/detokenize", content=b"[]"), 400)


def test_oversized_bodies_get_413(http, server):
    big = {"model": "tiny", "prompt": "x" * (BODY_LIMIT + 10)}
    err = assert_client_error(http.post("/v1/completions", json=big), 413)
    assert err["code"] == "request_too_large"

    def chunks():  # no Content-Length: the limit must hold for a streamed body too
        yield b'{"model": "tiny", "prompt": "'
        for _ in range(BODY_LIMIT // 4096 + 2):
            yield b"y" * 4096
        yield b'"}'

    r = http.post("/v1/chat/completions", content=chunks(),
                  headers={"content-type": "application/json"})  # fmt: skip
    assert_client_error(r, 413)
    # Just under the limit is parsed (and refused for its length, not its size).
    near = {"model": "tiny", "prompt": "word " * ((BODY_LIMIT - 200) // 5)}
    assert assert_client_error(http.post("/v1/completions", json=near), 400)["code"] == (
        "context_length_exceeded"
    )


def test_methods_paths_and_content_types(http):
    assert_client_error(http.get("/v1/completions"), 405)
    assert_client_error(http.post("/v1/../../etc/passwd", json={}), 404)
    assert_client_error(http.delete("/v1/models"), 405)
    r = http.post("/v1/completions", content=b'{"prompt": "x"}',
                  headers={"content-type": "text/plain"})  # fmt: skip
    assert_client_error(r, 400)


def test_server_answers_correctly_after_hostile_input(server, http, reference):
    assert http.get("/health").status_code == 200
    assert http.get("/ready").json() == {"status": "ready"}
    assert greedy_text(http) == reference
    wait_until(lambda: idle(server), timeout_s=60, interval_s=0.5)


# ------------------------------------------------------------------ overload


def test_overload_gets_503_with_retry_after_then_recovers(server, reference):
    # max_num_seqs 2 + max_waiting_requests 2: four sequences in flight at most.
    body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 48, "ignore_eos": True}

    async def flood() -> list[httpx.Response]:
        async with httpx.AsyncClient(
            base_url=server.base_url, headers=server.headers, timeout=120
        ) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(12)])

    responses = asyncio.run(flood())
    codes = Counter(r.status_code for r in responses)
    print(f"\noverload: 12 concurrent requests -> {dict(codes)}")
    assert set(codes) <= {200, 503} and codes[200] >= 4 and codes[503] >= 1
    for r in responses:
        if r.status_code == 503:
            assert assert_server_error(r)["code"] == "queue_full"
            assert int(r.headers["retry-after"]) >= 1
        else:
            assert r.json()["usage"]["completion_tokens"] == 48
    # Load gone: everything is admitted again and answers correctly.
    wait_until(lambda: idle(server), timeout_s=60, interval_s=0.5)
    with httpx.Client(base_url=server.base_url, headers=server.headers, timeout=60) as c:
        for _ in range(3):
            assert c.post("/v1/completions", json={**body, "max_tokens": 4}).status_code == 200
        assert greedy_text(c) == reference


def assert_server_error(r: httpx.Response) -> dict:
    assert r.status_code >= 500 and is_openai_error(r), r.text[:500]
    return r.json()["error"]


# ------------------------------------------------------------------ security


def test_api_key_is_required_everywhere_but_the_open_paths(server):
    wrong = [
        {},
        {"Authorization": "Bearer"},
        {"Authorization": f"Bearer {API_KEY[:-1]}"},
        {"Authorization": f"Bearer {API_KEY}x"},
        {"Authorization": f"Basic {API_KEY}"},
        {"Authorization": API_KEY},
        {"Authorization": b"Bearer \xe9\xe8"},
    ]
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        for headers in wrong:
            for method, path in (("POST", "/v1/completions"), ("GET", "/v1/models"),
                                 ("POST", "/tokenize"), ("GET", "/openapi.json")):  # fmt: skip
                r = c.request(method, path, headers=headers, json={"prompt": "x"})
                assert r.status_code == 401, (headers, path, r.text)
                assert is_openai_error(r) and r.json()["error"]["code"] == "invalid_api_key"
        for path in ("/health", "/ready", "/metrics", "/version"):
            assert c.get(path).status_code == 200
        ok = c.get("/v1/models", headers={"Authorization": f"Bearer {API_KEY}"})
        assert ok.status_code == 200


def test_api_key_comparison_is_constant_time(monkeypatch):
    import hmac

    from starlette.applications import Starlette
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    from tandem.server.app import APIKeyMiddleware

    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    inner = Starlette(routes=[Route("/v1/x", lambda request: PlainTextResponse("ok"))])
    app = APIKeyMiddleware(inner, "secret")

    async def go(headers: dict[str, str]) -> int:
        transport = httpx.ASGITransport(app=app)
        async with httpx.AsyncClient(transport=transport, base_url="http://t") as c:
            return (await c.get("/v1/x", headers=headers)).status_code

    assert asyncio.run(go({"Authorization": "Bearer secret"})) == 200
    assert asyncio.run(go({"Authorization": "Bearer secreT"})) == 401
    assert calls == [(b"secret", b"secret"), (b"secreT", b"secret")]


def test_default_host_is_loopback():
    from tandem.cli import build_parser

    ns = build_parser().parse_args(["serve", "/some/model"])
    assert ns.host == "127.0.0.1"
    assert ns.trust_request_chat_template is False


def test_server_generated_request_ids_never_collide(http):
    from tandem.server.serving import new_request_id

    ids = [new_request_id("cmpl") for _ in range(200_000)]
    assert len(set(ids)) == len(ids)
    seen = set()
    for _ in range(5):
        r = http.post("/v1/completions", json={"model": "tiny", "prompt": "x", "max_tokens": 1})
        seen.add(r.json()["id"])
        r = http.post("/v1/chat/completions", json={
            "model": "tiny", "messages": [{"role": "user", "content": "x"}], "max_tokens": 1,
        })  # fmt: skip
        seen.add(r.json()["id"])
    assert len(seen) == 10


def test_request_templates_render_in_the_sandbox_when_allowed(tmp_path_factory):
    from types import SimpleNamespace

    from transformers import AutoTokenizer

    from tandem.server.errors import APIError
    from tandem.server.protocol import ChatMessage
    from tandem.server.serving_chat import render_chat_prompt
    from tandem.server.state import ServerSettings

    tok = AutoTokenizer.from_pretrained(str(tiny_model(tmp_path_factory)))
    messages = [ChatMessage(role="user", content="hi")]
    state = SimpleNamespace(settings=ServerSettings(), tokenizer=tok, renderer=None)
    with pytest.raises(APIError) as refused:
        render_chat_prompt(state, messages, True, "{{ messages[0]['content'] }}")
    assert refused.value.status == 400 and refused.value.param == "chat_template"

    state.settings = ServerSettings(allow_request_chat_template=True)
    ids = render_chat_prompt(state, messages, True, "<{{ messages[0]['content'] }}>")
    assert tok.decode(ids) == "<hi>"
    for escape in (
        "{{ ''.__class__.__mro__[1].__subclasses__() }}",
        "{{ cycler.__init__.__globals__.os.system('true') }}",
        "{% for x in range(10) %}",  # does not compile
    ):
        with pytest.raises(APIError) as bad:
            render_chat_prompt(state, messages, True, escape)
        assert bad.value.status == 400


def test_no_pickle_eval_or_exec_in_the_http_layer():
    """Nothing in server/ may unpickle, eval or exec; templates only through the sandbox."""
    forbidden_calls = {"eval", "exec", "compile", "__import__"}
    forbidden_modules = {"pickle", "cPickle", "marshal", "shelve", "dill"}
    for path in sorted((REPO / "server").glob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
                assert node.func.id not in forbidden_calls, f"{path.name}: {node.func.id}()"
            if isinstance(node, ast.Import | ast.ImportFrom):
                names = [a.name for a in node.names] + [getattr(node, "module", None) or ""]
                assert not forbidden_modules & {n.split(".")[0] for n in names}, path.name
            # Jinja only through the sandbox: no plain Environment or Template.
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name):
                plain = node.value.id == "jinja2" and node.attr in ("Environment", "Template")
                assert not plain, path.name
            if isinstance(node, ast.ImportFrom) and node.module == "jinja2":
                assert not {a.name for a in node.names} & {"Environment", "Template"}, path.name
    chat = (REPO / "server" / "chat.py").read_text()
    assert "ImmutableSandboxedEnvironment" in chat


def test_logs_never_contain_the_api_key_nor_tracebacks(server):
    """Runs last in this module: everything above was logged at debug level."""
    log = Path(server.log.name).read_text(errors="replace")
    assert "GET /v1/models" in log or "POST /v1/completions" in log  # the log is the real one
    assert API_KEY not in log
    assert API_KEY[:-1] not in log  # nor the near misses clients sent
    assert "Traceback" not in log  # and no hostile request reached an unhandled exception
