"""Bad input gets a 4xx in OpenAI's error shape and the server keeps serving; a full queue gets
503; a dead engine turns /health to 503 and the server exits non-zero.

Raw HTTP (httpx), so that we can send what no SDK would."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import socket

import httpx
import pytest

from server_utils import MAX_MODEL_LEN, RemoteServer, tiny_model, wait_until

PROMPT = "Hello world!"
MESSAGES = [{"role": "user", "content": "hi"}]


CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    template = tmp_path_factory.mktemp("template") / "chat.jinja"
    template.write_text(CHAT_TEMPLATE)
    args = ["--max-num-seqs", "2", "--max-waiting-requests", "2", "--served-model-name", "tiny"]
    with RemoteServer(model, [*args, "--chat-template", str(template)]) as s:
        yield s


def test_ready_only_after_warm_up_while_health_is_ok(server):
    # While the engine loaded, /ready said 503 and /health (liveness) said 200.
    assert server.polls[-1] == (200, 200)
    assert (503, 200) in server.polls
    assert all(health == 200 for _, health in server.polls)


def test_chat_template_file_is_used(http):
    ids = http.post("/tokenize", json={"messages": MESSAGES}).json()["tokens"]
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == "user: hi\nassistant:"


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


def assert_openai_error(r: httpx.Response, status: int, param: str | None = None) -> dict:
    assert r.status_code == status, r.text
    body = r.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert isinstance(err["type"], str)
    if param is not None:
        assert err["param"] == param, err
    return err


def completion(http, **body):
    return http.post("/v1/completions", json={"model": "tiny", "prompt": PROMPT, **body})


def chat(http, **body):
    body.setdefault("messages", MESSAGES)
    return http.post("/v1/chat/completions", json={"model": "tiny", **body})


# ------------------------------------------------------------------ malformed requests


@pytest.mark.parametrize(
    "raw",
    [b"{not json", b"[1, 2]", b"", b'"a string"', b'{"model": "tiny", "prompt": "x", "n": NaN}'],
)
def test_malformed_bodies(http, raw):
    r = http.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
    assert_openai_error(r, 400)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", "hot"),
        ("temperature", "0.5"),
        ("n", True),
        ("max_tokens", 1.5),
        ("stop", 3),
        ("prompt", [1, "a"]),
        ("prompt", {"text": "x"}),
        ("logprobs", True),
        ("seed", "1"),
        ("stream", "yes"),
    ],
)
def test_wrong_types(http, field, value):
    err = assert_openai_error(completion(http, **{field: value}), 400)
    assert err["param"] is not None and err["param"].startswith(field)


@pytest.mark.parametrize(
    "field,value",
    [
        ("temperature", 2.5),
        ("temperature", -1),
        ("top_p", 0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("top_k", 10**12),
        ("min_p", 1.0),
        ("n", 0),
        ("n", 1000),
        ("logprobs", 21),
        ("presence_penalty", 3),
        ("frequency_penalty", -3),
        ("repetition_penalty", 0),
        ("max_tokens", 0),
        ("max_tokens", -5),
        ("seed", 2**70),
        ("stop", ""),
        ("stop", ["a"] * 40),
        ("stop_token_ids", [-1]),
        ("min_tokens", -1),
    ],
)
def test_out_of_range_values(http, field, value):
    assert_openai_error(completion(http, **{field: value}), 400, field)


def test_min_tokens_past_the_max_tokens_a_request_gets(http):
    """With max_tokens left out a request gets the context left after its prompt: min_tokens
    past that is the same 400 as past an explicit max_tokens (it returned 200 and stopped at
    the context length)."""
    for value in (10**30, MAX_MODEL_LEN):
        err = assert_openai_error(completion(http, min_tokens=value), 400, "min_tokens")
        assert "must be in [0, max_tokens]" in err["message"], err
        err = assert_openai_error(chat(http, min_tokens=value), 400, "min_tokens")
        assert "max_tokens left out is" in err["message"], err
    assert_openai_error(completion(http, min_tokens=5, max_tokens=4), 400, "min_tokens")
    ok = completion(http, min_tokens=3, max_tokens=3, ignore_eos=False)
    assert ok.status_code == 200 and ok.json()["usage"]["completion_tokens"] == 3


def test_context_length(http):
    err = assert_openai_error(completion(http, max_tokens=10**12), 400)
    assert err["code"] == "context_length_exceeded"
    err = assert_openai_error(completion(http, prompt="hello " * 400, max_tokens=1), 400)
    assert err["code"] == "context_length_exceeded"
    err = assert_openai_error(chat(http, max_completion_tokens=10**9), 400, "messages")
    assert err["code"] == "context_length_exceeded"


def test_prompt_token_ids_out_of_range(http):
    assert_openai_error(completion(http, prompt=[1, 2, 10**6]), 400, "prompt")
    assert_openai_error(completion(http, prompt=[1, -2]), 400, "prompt")
    assert_openai_error(completion(http, prompt=[]), 400, "prompt")
    assert_openai_error(completion(http, prompt=""), 400, "prompt")


@pytest.mark.parametrize(
    "messages,param",
    [
        ([], "messages"),
        ("hello", "messages"),
        ([{"role": "wizard", "content": "hi"}], "messages[0].role"),
        ([{"role": "tool", "content": "hi"}], "messages[0].tool_call_id"),
        ([{"content": "hi"}], "messages[0].role"),
        ([{"role": "user"}], "messages[0].content"),
        ([{"role": "user", "content": 5}], "messages[0].content"),
        (
            [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
            "messages[0].content[0]",
        ),
        (
            [
                {
                    "role": "user",
                    "content": "hi",
                    "tool_calls": [
                        {
                            "id": "a",
                            "type": "function",
                            "function": {"name": "f", "arguments": "{}"},
                        }
                    ],
                }
            ],
            "messages[0].tool_calls",
        ),  # fmt: skip
    ],
)
def test_bad_messages(http, messages, param):
    err = assert_openai_error(chat(http, messages=messages), 400)
    assert err["param"].startswith(param), err


def test_text_parts_are_accepted(http):
    parts = [{"type": "text", "text": "hi"}, {"type": "text", "text": "there"}]
    r = chat(http, messages=[{"role": "developer", "content": "be brief"},
                             {"role": "user", "content": parts}], max_tokens=2)  # fmt: skip
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "endpoint,field,value",
    [
        ("chat", "tool_choice", "required"),
        ("chat", "functions", [{"name": "f"}]),
        ("chat", "logit_bias", {"5": 101}),  # outside [-100, 100]
        ("chat", "audio", {"voice": "alloy", "format": "wav"}),
        ("chat", "modalities", ["text", "audio"]),
        ("chat", "reasoning_effort", "extreme"),  # low, medium or high
        ("chat", "store", True),
        ("chat", "service_tier", "priority"),
        ("completion", "best_of", 3),
        ("completion", "suffix", "end"),
        ("completion", "logit_bias", {"5": 10, "-3": 1}),  # not a token id
        ("completion", "logit_bias", {"5": 10, "100000000": 1}),  # past the vocabulary
        ("completion", "echo", True),  # with logprobs: prompt logprobs are not served
    ],
)
def test_unsupported_fields_are_named(http, endpoint, field, value):
    extra = {"logprobs": 1} if field == "echo" else {}
    send = chat if endpoint == "chat" else completion
    err = assert_openai_error(send(http, **{field: value}, **extra), 400, field)
    assert field in err["message"]


@pytest.mark.parametrize("field", ["frobnicate", "guided_json", "echo_prompt"])
def test_unknown_fields_are_named(http, field):
    err = assert_openai_error(chat(http, **{field: 1}), 400, field)
    assert field in err["message"]


def test_neutral_values_of_unsupported_fields_pass(http):
    r = chat(
        http, max_tokens=2, tools=[], tool_choice="none", response_format={"type": "text"},
        logit_bias={}, store=False, service_tier="auto", user="u", metadata={"k": "v"},
        parallel_tool_calls=True, modalities=["text"],
    )  # fmt: skip
    assert r.status_code == 200, r.text
    r = completion(http, max_tokens=2, best_of=1, suffix=None, logit_bias={})
    assert r.status_code == 200, r.text


def test_option_combinations(http):
    assert_openai_error(
        chat(http, stream=True, stream_options={"include_obfuscation": True}),
        400,
        "stream_options.include_obfuscation",
    )
    assert_openai_error(chat(http, top_logprobs=2), 400, "top_logprobs")
    assert_openai_error(chat(http, stream_options={"include_usage": True}), 400, "stream_options")
    assert_openai_error(
        chat(http, stream=True, stream_options={"include_usage": True, "x": 1}), 400
    )


def test_unknown_model_route_and_method(http):
    err = assert_openai_error(
        http.post("/v1/completions", json={"model": "gpt-9", "prompt": "x"}), 404, "model"
    )
    assert err["code"] == "model_not_found"
    assert_openai_error(http.get("/v1/nothing-here"), 404)
    assert_openai_error(http.get("/v1/chat/completions"), 405)


# ------------------------------------------------------------------ still serving


def test_server_still_serves_after_bad_input(http):
    r = completion(http, max_tokens=3, temperature=0)
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1
    assert http.get("/health").status_code == 200
    assert http.get("/ready").json() == {"status": "ready"}


def test_tokenize_detokenize_version(http):
    r = http.post("/tokenize", json={"prompt": PROMPT, "add_special_tokens": False})
    ids = r.json()["tokens"]
    assert r.json()["count"] == len(ids) > 0
    assert http.post("/detokenize", json={"tokens": ids}).json()["prompt"] == PROMPT
    assert_openai_error(http.post("/detokenize", json={"tokens": [10**9]}), 400, "tokens")
    assert_openai_error(http.post("/tokenize", json={}), 400)
    assert http.get("/version").json()["version"]


def test_queue_full_is_503(server):
    # max_num_seqs 2 + max_waiting_requests 2: at most 4 requests in flight.
    async def run():
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            body = {"model": "tiny", "prompt": PROMPT, "max_tokens": 200, "ignore_eos": True}
            return await asyncio.gather(*[c.post("/v1/completions", json=body) for _ in range(10)])

    responses = asyncio.run(run())
    codes = sorted(r.status_code for r in responses)
    assert codes.count(200) >= 4
    assert 503 in codes and set(codes) <= {200, 503}
    for r in responses:
        if r.status_code == 503:
            assert assert_openai_error(r, 503)["code"] == "queue_full"


# ------------------------------------------------------------------ engine death (runs last)


def test_dead_engine_reports_503_and_server_exits_nonzero(server, http):
    os.kill(server.engine_pid(), signal.SIGKILL)
    wait_until(lambda: http.get("/health").status_code == 503, timeout_s=20)
    assert_openai_error(http.get("/health"), 503)
    err = assert_openai_error(completion(http, max_tokens=2), 503)
    assert err["code"] == "engine_dead"
    assert server.proc.wait(timeout=30) != 0
    assert "exiting non-zero" in server.log_tail()


def test_engine_that_cannot_start_makes_the_server_exit_nonzero(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    broken = tmp_path_factory.mktemp("broken_model")
    for f in model.iterdir():
        if not f.name.endswith(".safetensors"):
            shutil.copy(f, broken / f.name)
    s = RemoteServer(broken, [])
    try:
        assert s.proc.wait(timeout=90) != 0
        assert "engine start-up failed" in s.log_tail()
    finally:
        s.stop()


def test_a_busy_port_stops_the_server_before_anything_loads(tmp_path_factory):
    # Before, the engine loaded the whole model and then uvicorn failed to bind.
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        s = RemoteServer(tiny_model(tmp_path_factory), [], port=port)
        try:
            assert s.proc.wait(timeout=60) == 2
            log = s.log_tail()
            assert f"cannot serve on 127.0.0.1:{port}: Address already in use" in log
            assert "[engine]" not in log
        finally:
            s.stop()


def test_two_servers_on_one_port_one_serves_the_other_exits_cleanly(tmp_path_factory):
    """The port is listened on as soon as it is bound: a second `tandem serve` on the same port
    (started while the first loads) stops at once with the "address in use" error and exit 2;
    an only-bound port let both bind and the loser died later with a traceback."""
    model = tiny_model(tmp_path_factory)
    first = RemoteServer(model, [])
    second = RemoteServer(model, [], port=first.port)
    try:
        exited = wait_until(
            lambda: next((s for s in (first, second) if s.proc.poll() is not None), None), 120
        )
        other = second if exited is first else first
        assert exited.proc.returncode == 2, exited.log_tail()
        log = exited.log_tail()
        assert f"cannot serve on 127.0.0.1:{first.port}: Address already in use" in log
        assert "Traceback" not in log and "[engine]" not in log
        other.wait_ready()
        assert httpx.get(other.url("/v1/models"), timeout=30).status_code == 200
    finally:
        first.stop()
        second.stop()


def test_a_picked_port_taken_before_the_server_binds_it_is_retried(tmp_path_factory, monkeypatch):
    """The test harness's own race (one CI run lost a module's server to it): a port that
    ``free_port`` picked can be taken (an outgoing connection's ephemeral port) before the
    server binds it; ``RemoteServer`` starts the server again on another picked port."""
    import server_utils

    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen()
    picks = iter([taken.getsockname()[1]])
    real = server_utils.free_port
    monkeypatch.setattr(server_utils, "free_port", lambda: next(picks, None) or real())
    try:
        with RemoteServer(tiny_model(tmp_path_factory), []) as server:
            assert server.port != taken.getsockname()[1]
            assert httpx.get(server.url("/v1/models"), timeout=30).status_code == 200
    finally:
        taken.close()
