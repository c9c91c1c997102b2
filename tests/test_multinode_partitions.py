"""Two nodes on two hosts with their own addresses (a network namespace and a link the test
controls: tests/partition.py), a real network between them instead of one shared loopback:
`-tp 2 --nnodes 2`, one gloo rank per node, every collective crossing the link.

Faults shorter than the collective timeout lose nothing: 500 ms of added latency, 30 % packet
loss, the link pulled (`ip link set down`) and node 1 frozen (SIGSTOP), each for a few seconds in
the middle of a stream, which then ends with the same tokens as without the fault. Lasting
faults end everything within a minute: the link cut mid-stream or while idle, node 1 frozen.
The client gets an error event then `[DONE]`, `/health` and new requests get 503 until node 0
exits non-zero, node 1 exits non-zero too, and no process of either tree is left."""

from __future__ import annotations

import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest
from partition import Link, unavailable

from server_utils import RemoteServer, free_port, tiny_model
from test_multinode import _assert_gone, _family, _resume, _wait_exit, health_until_exit

REASON = unavailable()
TIMEOUT_S = 6  # the collective timeout (TANDEM_DIST_TIMEOUT_S); faults within it are transient
HOLD_S = 2.0  # how long a transient fault lasts
MAX_TOKENS = 24
FAULT_AT = 3  # the stream event at which the fault starts

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(REASON is not None, reason=f"no second host: {REASON}"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory) -> Path:
    return tiny_model(tmp_path_factory)


class Pair:
    """Node 0 on this host (HTTP on 127.0.0.1), node 1 headless on the link's other host."""

    def __init__(self, model: Path, link: Link) -> None:
        self.model, self.link = model, link
        addr = f"{link.addr0}:{free_port()}"
        env = {"TANDEM_DIST_TIMEOUT_S": str(TIMEOUT_S), "TANDEM_DIST_STARTUP_TIMEOUT_S": "90"}
        launch = ["-tp", "2", "--nnodes", "2", "--dist-init-addr", addr]
        self.node0 = RemoteServer(
            model, [*launch, "--node-rank", "0"], env={**env, "GLOO_SOCKET_IFNAME": link.if0}
        )
        self.node1 = RemoteServer(
            model,
            [*launch, "--node-rank", "1"],
            env={**env, "GLOO_SOCKET_IFNAME": link.if1},
            headless=True,
            launcher=[*link.prefix(), sys.executable, "-m", "tandem.cli"],
        )
        try:
            self.node0.wait_ready()
        except BaseException:  # neither node may outlive a failed start
            self.stop()
            raise
        self.family = _family(self.node0.proc.pid) + _family(self.node1.proc.pid)

    def body(self) -> dict:
        return {
            "model": self.model.name, "prompt": "Hello world! How are you today?",
            "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True, "stream": True,
            "logprobs": 0,
        }  # fmt: skip

    def stream(self, fault: Callable[[], None] | None = None) -> list[str]:
        """The stream's data events (``[DONE]`` included); ``fault()`` runs at event FAULT_AT."""
        events: list[str] = []
        with httpx.stream(
            "POST", self.node0.url("/v1/completions"), json=self.body(), timeout=90
        ) as r:
            assert r.status_code == 200, r.read()
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if fault is not None and len(events) == FAULT_AT:
                        fault()
        return events

    def freeze_node1(self) -> None:
        for pid in _family(self.node1.proc.pid):
            os.kill(pid, signal.SIGSTOP)

    def stop(self) -> None:
        _resume(self.node1)
        self.node0.stop()
        self.node1.stop()


@pytest.fixture
def pair(model_dir) -> Iterator[Pair]:
    with Link(seed=7) as link:
        p = Pair(model_dir, link)
        try:
            yield p
        finally:
            p.stop()


def tokens(events: list[str]) -> list[str]:
    """The streamed tokens (as the logprobs name them), in order."""
    out: list[str] = []
    for e in events:
        choices = json.loads(e).get("choices") if e != "[DONE]" else None
        out += choices[0]["logprobs"]["tokens"] if choices else []
    return out


def transient(on: Callable[[], None], off: Callable[[], None]) -> Callable[[], None]:
    """A fault that ``on()`` starts and ``off()`` ends HOLD_S later (from a timer thread)."""

    def start() -> None:
        on()
        threading.Timer(HOLD_S, off).start()

    return start


def assert_failed_stream(events: list[str]) -> None:
    """The stream broke off: tokens, then an error event, then ``[DONE]``."""
    assert events[-1] == "[DONE]", events[-3:]
    error = json.loads(events[-2])
    assert set(error) == {"error"} and error["error"]["type"] == "server_error", error
    assert 1 <= len(tokens(events)) < MAX_TOKENS


def assert_everything_ends(pair: Pair, started: float) -> None:
    """Node 0 turns 503 (``/health`` and a new request) and exits non-zero, node 1 exits
    non-zero, both within a minute of the fault, and no process of either tree is left."""
    statuses: list[int] = []
    refused: list[int] = []
    while pair.node0.proc.poll() is None and time.monotonic() - started < 60:
        try:
            statuses.append(httpx.get(pair.node0.url("/health"), timeout=2).status_code)
            if statuses[-1] == 503 and not refused:
                body = {**pair.body(), "stream": False}
                refused.append(httpx.post(pair.node0.url("/v1/completions"), json=body).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    assert _wait_exit(pair.node0, 1) != 0
    assert 503 in statuses and refused == [503], (statuses, refused)
    assert _wait_exit(pair.node1, max(1.0, 60 - (time.monotonic() - started))) != 0
    assert time.monotonic() - started < 60
    _assert_gone(sorted(pair.family))


def test_faults_shorter_than_the_timeout_lose_nothing_then_a_cut_link_ends_both_nodes(pair):
    link = pair.link
    reference = pair.stream()
    assert len(tokens(reference)) == MAX_TOKENS and reference[-1] == "[DONE]"
    faults = {
        "500 ms latency": (lambda: link.degrade(delay_s=0.5), link.degrade),
        "30% loss": (lambda: link.degrade(loss=0.3), link.degrade),
        "link down": (link.down, link.up),
        "node 1 frozen": (pair.freeze_node1, lambda: _resume(pair.node1)),
    }
    for name, (on, off) in faults.items():
        events = pair.stream(transient(on, off))
        assert events[-1] == "[DONE]" and tokens(events) == tokens(reference), (name, events[-2:])
    assert link.frames["dropped"] > 0  # the loss and the pulled link did drop frames

    started = []
    events = pair.stream(lambda: (link.down(), started.append(time.monotonic())))
    assert_failed_stream(events)
    assert_everything_ends(pair, started[0])
    assert "timed out" in pair.node0.log_tail(100_000) or "failed" in pair.node0.log_tail(100_000)


def test_a_link_cut_while_idle_ends_both_nodes(pair):
    assert len(tokens(pair.stream())) == MAX_TOKENS
    started = time.monotonic()
    pair.link.down()
    assert_everything_ends(pair, started)
    assert "heartbeat failed" in pair.node0.log_tail(100_000)


def test_a_frozen_node_1_ends_node_0_then_itself_once_resumed(pair):
    """A node that stops answering (a paused VM, a stuck host) but keeps its connections: node 0
    gives up within the timeout; node 1, resumed after, finds its peer gone and exits too."""
    started = []
    events = pair.stream(lambda: (pair.freeze_node1(), started.append(time.monotonic())))
    assert_failed_stream(events)
    statuses = health_until_exit(pair.node0)
    assert _wait_exit(pair.node0, 1) != 0
    assert 503 in statuses, statuses
    assert pair.node1.proc.poll() is None  # frozen: it cannot notice anything yet
    _resume(pair.node1)
    assert _wait_exit(pair.node1, 60 - (time.monotonic() - started[0])) != 0
    _assert_gone(sorted(pair.family))
