"""Engine faults injected into a real server through the test-only ``TANDEM_TEST_FAULTS``
(engine/fault_injection.py): a step that raises fails only that step's requests (500, OpenAI
shape) and the engine keeps serving; a fault that leaves the engine unusable turns /health to 503
and the server exits non-zero; a step that never returns is caught by the heartbeat check.

Steps are counted by the engine from 1 after warm-up, so each test here relies on the steps the
tests before it ran: with ``--max-num-seqs 1`` every step runs exactly one request, and a request
with ``max_tokens`` m (greedy, ``ignore_eos``) runs m steps."""

from __future__ import annotations

import asyncio
import json
import os
import time
from contextlib import contextmanager

import httpx
import pytest

from server_utils import RemoteServer, metric, scrape_metrics, tiny_model, wait_until
from tandem.engine.fault_injection import ENV_VAR

PROMPT = "Hello world!"
LABEL = {"model_name": "tiny"}
ARGS = ["--max-num-seqs", "1", "--max-waiting-requests", "8", "--served-model-name", "tiny"]

pytestmark = pytest.mark.timeout(240)


@contextmanager
def fault_env(spec: str):
    """``TANDEM_TEST_FAULTS`` for the server started inside (Popen copies the environment)."""
    old = os.environ.get(ENV_VAR)
    os.environ[ENV_VAR] = spec
    try:
        yield
    finally:
        if old is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = old


def launch(tmp_path_factory, spec: str, extra: list[str] | None = None) -> RemoteServer:
    with fault_env(spec):
        return RemoteServer(tiny_model(tmp_path_factory), [*ARGS, *(extra or [])])


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """Both servers start together (their start-ups overlap)."""
    # "raise": steps 1-4 reference; 5-14 three concurrent requests (step 6 fails the first);
    # 15-16 a stream (step 16 fails it); 17-20 the reference again; step 21 is fatal.
    # "hang": step 2 never returns; the heartbeat check gives up after 3 s.
    started = {
        "raise": launch(tmp_path_factory, "raise@6,raise@16,fatal@21"),
        "hang": launch(tmp_path_factory, "hang@2", ["--engine-heartbeat-timeout", "3"]),
    }
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


def body(max_tokens: int, **kw) -> dict:
    return {"model": "tiny", "prompt": PROMPT, "max_tokens": max_tokens, "temperature": 0,
            "ignore_eos": True, **kw}  # fmt: skip


def openai_error(r: httpx.Response, status: int) -> dict:
    assert r.status_code == status, r.text
    data = r.json()
    assert set(data) == {"error"} and set(data["error"]) == {"message", "type", "param", "code"}
    return data["error"]


def idle(server: RemoteServer) -> bool:
    m = scrape_metrics(server)
    return all(
        metric(m, f"tandem:{n}", **LABEL) == 0
        for n in ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks",
                  "num_requests_in_flight")
    )  # fmt: skip


# ------------------------------------------------------------------ a step raises


@pytest.fixture(scope="module")
def server(servers):
    return servers["raise"]


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        yield c


@pytest.fixture(scope="module")
def reference(http) -> dict:
    r = http.post("/v1/completions", json=body(4))  # steps 1-4
    assert r.status_code == 200, r.text
    return r.json()


def test_failed_step_fails_only_its_request(server, reference):
    async def three() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as c:
            return await asyncio.gather(*[c.post("/v1/completions", json=body(4))
                                          for _ in range(3)])  # fmt: skip

    responses = asyncio.run(three())  # steps 5-14; step 6 raises
    codes = sorted(r.status_code for r in responses)
    assert codes == [200, 200, 500], [r.text for r in responses]
    for r in responses:
        if r.status_code == 500:
            err = openai_error(r, 500)
            assert err["type"] == "server_error" and err["code"] == "internal_error"
            assert "InjectedFault" in err["message"]
        else:  # the waiting requests were not touched
            assert r.json()["usage"]["completion_tokens"] == 4
            assert r.json()["choices"][0]["text"] == reference["choices"][0]["text"]


def test_failed_step_ends_a_stream_with_an_error_event(server, http):
    events = []
    # With logprobs every token makes an event, even one whose text is not complete yet.
    stream = body(4, stream=True, logprobs=0)
    with http.stream("POST", "/v1/completions", json=stream) as r:  # steps 15-16
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                events.append(line[len("data: ") :])
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert set(error) == {"error"} and error["error"]["type"] == "server_error"
    assert "InjectedFault" in error["error"]["message"]
    assert any("choices" in json.loads(e) for e in events[:-2])  # tokens before the fault


def test_engine_keeps_serving_after_failed_steps(server, http, reference):
    assert http.get("/health").status_code == 200
    assert http.get("/ready").status_code == 200
    r = http.post("/v1/completions", json=body(4))  # steps 17-20
    assert r.status_code == 200
    assert r.json()["choices"][0]["text"] == reference["choices"][0]["text"]
    wait_until(lambda: idle(server), timeout_s=30, interval_s=0.3)


def test_unrecoverable_engine_makes_health_503_and_exit_nonzero(server, http):
    r = http.post("/v1/completions", json=body(4))  # step 21: fatal
    assert openai_error(r, 500)["code"] == "internal_error"
    wait_until(lambda: http.get("/health").status_code == 503, timeout_s=20)
    err = openai_error(http.get("/health"), 503)
    assert err["code"] == "engine_dead"
    assert openai_error(http.post("/v1/completions", json=body(2)), 503)["code"] == "engine_dead"
    assert server.proc.wait(timeout=60) != 0
    log = server.log_tail(20_000)
    assert "cannot recover" in log and "exiting non-zero" in log


# ------------------------------------------------------------------ a step never returns


def test_stuck_step_turns_into_503_and_exit_nonzero(servers):
    s = servers["hang"]
    t0 = time.monotonic()
    with httpx.Client(base_url=s.base_url, timeout=60) as c:
        r = c.post("/v1/completions", json=body(4))  # step 2 never returns
        waited = time.monotonic() - t0
        err = openai_error(r, 503)
        assert err["code"] == "engine_dead" and "sent nothing" in err["message"]
        assert openai_error(c.get("/health"), 503)["code"] == "engine_dead"
    code = s.proc.wait(timeout=60)
    print(f"\nstuck step: request answered 503 after {waited:.1f} s, server exit code {code}")
    assert code != 0


# ------------------------------------------------------------------ the loop, in-process


class StepEngine:
    """A fake engine whose steps run one request at a time (like ``--max-num-seqs 1``) and
    report it in ``step_request_ids``, as ``LLMEngine`` does."""

    def __init__(self, fail_steps: set[int], healthy: bool = True) -> None:
        self.queue: list[str] = []
        self.left: dict[str, int] = {}
        self.steps = 0
        self.fail_steps = fail_steps
        self.step_request_ids: list[str] | None = None
        self.aborted: list[str] = []
        self.executor = self
        self.healthy = healthy

    def add_request(self, request_id, request):
        self.queue.append(request_id)
        self.left[request_id] = 2
        return request

    def abort_request(self, request_ids):
        for rid in request_ids:
            if rid in self.queue:
                self.queue.remove(rid)
                self.aborted.append(rid)

    def has_unfinished_requests(self):
        return bool(self.queue)

    def check_health(self):
        if not self.healthy:
            raise RuntimeError("rank 1 is gone")

    def step(self):
        from tandem.engine.outputs import CompletionOutput, RequestOutput

        self.steps += 1
        rid = self.queue[0]
        self.step_request_ids = [rid]
        if self.steps in self.fail_steps:
            raise RuntimeError(f"step {self.steps} exploded")
        self.left[rid] -= 1
        done = self.left[rid] == 0
        if done:
            self.queue.pop(0)
        c = CompletionOutput(0, [1] * (2 - self.left[rid]), "", "length" if done else None)
        return [RequestOutput(rid, None, [1], [c], done)]

    def get_stats(self):
        from tandem.engine.outputs import EngineStats

        return EngineStats(len(self.queue), 0, 10, 0, 0.0, 0, 0, 0, 0, 0)


def loop_messages(engine: StepEngine, ids: list[str]) -> tuple[int, list]:
    import queue
    import threading

    from tandem.engine.engine_core import (
        AddRequests,
        EngineDead,
        Shutdown,
        StepOutputs,
        run_engine_loop,
    )
    from tandem.engine.request import Request
    from tandem.engine.sampling_params import SamplingParams

    in_q: queue.Queue = queue.Queue()
    out_q: queue.Queue = queue.Queue()
    params = SamplingParams(max_tokens=2)
    in_q.put(AddRequests([Request(rid, [1], params, frozenset(), max_tokens=2) for rid in ids]))
    code: list[int] = []
    t = threading.Thread(
        target=lambda: code.append(run_engine_loop(engine, in_q, out_q, heartbeat_interval_s=0.05))
    )
    t.start()
    msgs: list = []
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and t.is_alive():
        try:
            msgs.append(out_q.get(timeout=0.1))
        except queue.Empty:
            continue
        finished = [o for m in msgs if isinstance(m, StepOutputs) for o in m.outputs if o.finished]
        if isinstance(msgs[-1], EngineDead) or len(finished) + len(engine.aborted) == len(ids):
            break
    in_q.put(Shutdown())
    t.join(timeout=10)
    assert not t.is_alive()
    while not out_q.empty():
        msgs.append(out_q.get())
    return code[0], msgs


def test_loop_fails_only_the_requests_of_the_failed_step():
    from tandem.engine.engine_core import EngineDead, RequestsFailed, StepOutputs

    engine = StepEngine(fail_steps={2})
    code, msgs = loop_messages(engine, ["a", "b", "c"])
    failed = [m for m in msgs if isinstance(m, RequestsFailed)]
    assert [m.request_ids for m in failed] == [["a"]] and engine.aborted == ["a"]
    finished = [o.request_id for m in msgs if isinstance(m, StepOutputs)
                for o in m.outputs if o.finished]  # fmt: skip
    assert finished == ["b", "c"] and code == 0
    assert not any(isinstance(m, EngineDead) for m in msgs)


def test_loop_gives_up_when_the_executor_is_unhealthy_after_a_failure():
    from tandem.engine.engine_core import EngineDead, RequestsFailed

    engine = StepEngine(fail_steps={1}, healthy=False)
    code, msgs = loop_messages(engine, ["a", "b"])
    assert code == 1
    assert isinstance(msgs[-2], RequestsFailed) and msgs[-2].request_ids == ["a"]
    assert isinstance(msgs[-1], EngineDead) and "rank 1 is gone" in msgs[-1].message


def test_fault_plan_parsing():
    from tandem.engine.fault_injection import FaultPlan

    assert FaultPlan.from_env({}) is None
    plan = FaultPlan.from_env({ENV_VAR: " raise@3, fatal@5,hang@9 "})
    assert plan is not None and plan.faults == {3: "raise", 5: "fatal", 9: "hang"}
    for bad in ("boom@1", "raise@0", "raise", "raise@x", "raise@-1"):
        with pytest.raises(ValueError, match=ENV_VAR):
            FaultPlan.parse(bad)
