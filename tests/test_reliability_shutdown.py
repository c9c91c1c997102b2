"""SIGTERM and SIGINT with requests in flight: the server stops accepting connections, lets the
requests in flight finish for ``--shutdown-timeout`` seconds, aborts the rest (503 / an error
event, OpenAI shape), stops the engine and exits 0, leaving no process behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from server_utils import RemoteServer, child_pids, metric, scrape_metrics, tiny_model, wait_until

SHUTDOWN_TIMEOUT_S = 6.0
MEDIUM = 150  # max_tokens of requests that finish well within the shutdown timeout (also on a loaded machine)
LONG = 16_000  # max_tokens of requests that cannot (16k steps: > 6 s at 0.4 ms a step)
ARGS = [
    "--max-model-len", str(LONG + 100), "--max-num-seqs", "8", "--served-model-name", "tiny",
    "--shutdown-timeout", str(SHUTDOWN_TIMEOUT_S),
]  # fmt: skip

pytestmark = pytest.mark.timeout(240)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """One server per signal, started together (their start-ups overlap)."""
    model = tmp_path_factory.mktemp("long_context") / "tiny"
    shutil.copytree(tiny_model(tmp_path_factory), model)
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = LONG + 100  # random weights: any length will do
    (model / "config.json").write_text(json.dumps(config))
    started = {sig: RemoteServer(model, ARGS) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        for s in started.values():
            s.wait_ready()
        yield started
    finally:
        for s in started.values():
            s.stop()


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in child_pids(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead, only not yet reaped


def plain(server: RemoteServer, max_tokens: int) -> httpx.Response:
    body = {"model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True}
    return httpx.post(server.url("/v1/completions"), json=body, timeout=120)


def streamed(server: RemoteServer, max_tokens: int, first: threading.Event) -> list[dict | str]:
    body = {
        "model": "tiny", "prompt": "Hello", "max_tokens": max_tokens, "ignore_eos": True,
        "stream": True, "stream_options": {"include_usage": True}, "logprobs": 0,
    }  # fmt: skip
    events: list[dict | str] = []
    with httpx.stream("POST", server.url("/v1/completions"), json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: "):
                payload = line[len("data: ") :]
                events.append(payload if payload == "[DONE]" else json.loads(payload))
                first.set()
    return events


def in_flight(server: RemoteServer) -> float:
    return metric(scrape_metrics(server), "tandem:num_requests_in_flight", model_name="tiny")


@pytest.mark.parametrize(
    "sig,with_long", [(signal.SIGTERM, False), (signal.SIGINT, True)], ids=["SIGTERM", "SIGINT"]
)
def test_signal_drains_then_exits_zero(servers, sig, with_long):
    server = servers[sig]
    pool = ThreadPoolExecutor(8)
    long_first, medium_first = threading.Event(), threading.Event()
    long_jobs = []
    # Each request is in the engine before the next starts, so all are in flight at the signal.
    if with_long:
        long_jobs = [pool.submit(plain, server, LONG)]
        wait_until(lambda: in_flight(server) >= 1, timeout_s=60, interval_s=0.02)
        long_jobs.insert(0, pool.submit(streamed, server, LONG, long_first))
        assert long_first.wait(60)
    medium = [pool.submit(plain, server, MEDIUM)]
    # On a fast machine the request may finish between two scrapes: that is fine too.
    wait_until(
        lambda: medium[0].done() or in_flight(server) >= 1 + 2 * with_long,
        timeout_s=60,
        interval_s=0.02,
    )
    medium.insert(0, pool.submit(streamed, server, MEDIUM, medium_first))
    assert medium_first.wait(60)
    done_at: list[float] = []
    for job in medium:
        job.add_done_callback(lambda _: done_at.append(time.monotonic()))
    procs = descendants(server.proc.pid)
    assert procs  # the engine process at least

    t0 = time.monotonic()
    if sig == signal.SIGINT:  # as Ctrl-C: the whole process group (the engine ignores it)
        os.killpg(server.pgid, sig)
    else:  # as `kill`, `docker stop`, systemd: the server process only
        server.proc.send_signal(sig)
    # Stop accepting: a new connection shortly after the signal is refused or answered 503.
    time.sleep(0.5)
    try:
        r = httpx.post(server.url("/v1/completions"),
                       json={"model": "tiny", "prompt": "x", "max_tokens": 1}, timeout=10)  # fmt: skip
        assert r.status_code == 503 and r.json()["error"]["code"] == "shutting_down", r.text
    except httpx.TransportError:
        pass
    code = server.proc.wait(timeout=SHUTDOWN_TIMEOUT_S + 60)
    exit_s = time.monotonic() - t0

    # In-flight requests that could finish did, with full usage.
    stream_events, plain_resp = medium[0].result(timeout=30), medium[1].result(timeout=30)
    assert (
        plain_resp.status_code == 200 and plain_resp.json()["usage"]["completion_tokens"] == MEDIUM
    )
    usage = [e["usage"] for e in stream_events if isinstance(e, dict) and e.get("usage")]
    assert stream_events[-1] == "[DONE]" and usage and usage[-1]["completion_tokens"] == MEDIUM
    # Those that could not were aborted at the timeout, in OpenAI's error shape.
    if with_long:
        long_events, long_plain = long_jobs[0].result(timeout=30), long_jobs[1].result(timeout=30)
        err = long_events[-2]
        assert long_events[-1] == "[DONE]" and err["error"]["code"] == "request_aborted", err
        assert long_plain.status_code == 503, long_plain.text
        assert long_plain.json()["error"]["code"] == "request_aborted"
        assert exit_s >= SHUTDOWN_TIMEOUT_S * 0.9  # they were given the full timeout
    pool.shutdown()
    after = sum(t > t0 for t in done_at)
    print(f"\n{signal.Signals(sig).name}: exit code {code} {exit_s:.2f} s after the signal; "
          f"{after} of 2 medium requests finished after it"
          f"{', 2 long ones aborted at the timeout' if with_long else ''}")  # fmt: skip
    assert code == 0, server.log_tail()
    # No process left behind (the engine, any rank, the resource tracker).
    wait_until(lambda: not [p for p in procs if alive(p)], timeout_s=15, interval_s=0.1)
    log = server.log_tail(20_000)
    assert "shutting down" in log
    assert "did not stop" not in log  # the engine stopped when told, not by a kill
    # The processes exit without Python's teardown (engine/process_exit.py) but still release
    # what multiprocessing holds: the resource tracker finds nothing left over.
    assert "leaked" not in log and "Traceback" not in log, log[-3000:]
    if with_long:
        assert "aborted 2 request(s)" in log
