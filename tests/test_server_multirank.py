"""`tandem serve -tp 2` (tensor parallel, and attention DP): same greedy text as one rank; a
killed rank makes /health answer 503 and the server exit non-zero."""

from __future__ import annotations

import os
import signal
import time

import httpx
import openai
import pytest

from server_utils import RemoteServer, child_pids, cmdline, comm, tiny_model
from tandem import LLM, SamplingParams

PROMPTS = ["Hello world! How are you today?", "Paris is the capital of"]


def _descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        kids = child_pids(todo.pop())
        out += kids
        todo += kids
    return out


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir):
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(str(model_dir), max_model_len=256) as llm:
        return [o.outputs[0].text for o in llm.generate(PROMPTS, params)]


@pytest.mark.timeout(240)
@pytest.mark.parametrize("args", [["-tp", "2"], ["-tp", "2", "--enable-attention-dp"]])
def test_multirank_server_equals_one_rank_then_a_killed_rank_is_fatal(model_dir, reference, args):
    with RemoteServer(model_dir, args) as server:
        client = openai.OpenAI(
            base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=60
        )
        texts = [
            client.completions.create(
                model=model_dir.name,
                prompt=p,
                max_tokens=16,
                temperature=0,
                extra_body={"ignore_eos": True},
            )
            .choices[0]
            .text
            for p in PROMPTS
        ]
        assert texts == reference
        # Kill one rank process (a grandchild of the engine, not the engine itself).
        engine = server.engine_pid()
        # The leaves below the engine (forked from it, or from its forkserver).
        ranks = [p for p in _descendants(engine) if not child_pids(p)]
        assert ranks, "no rank process found"
        os.kill(ranks[0], signal.SIGKILL)
        # The next step fails; health turns 503 and the server exits non-zero in bounded time.
        with pytest.raises(openai.APIError):
            client.completions.create(model=model_dir.name, prompt=PROMPTS[0], max_tokens=8)
        # /health answers 503 (OpenAI error shape) in the window before the process exits.
        deadline = time.monotonic() + 60
        dead_health = []
        while time.monotonic() < deadline and server.proc.poll() is None:
            try:
                r = httpx.get(server.url("/health"), timeout=2)
                if r.status_code == 503:
                    dead_health.append(r.json())
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        assert server.proc.poll() is not None and server.proc.returncode != 0
        assert dead_health, "/health never answered 503 before the server exited"
        assert dead_health[0]["error"]["code"] == "engine_dead"


@pytest.mark.timeout(180)
def test_sigterm_with_ranks_exits_zero_and_leaves_no_rank_process(model_dir):
    """The engine (forked from the server) and its rank name themselves; SIGTERM ends all."""
    server = RemoteServer(model_dir, ["-tp", "2"])
    with server:
        family = _descendants(server.proc.pid)
        names = sorted(comm(p) for p in family)
        assert names[:2] == ["tandem-engine", "tandem-rank-1"], names  # (+ any helper)
        # A CPU engine is a fork of the server process (its command line), not a fresh one.
        assert cmdline(server.engine_pid()) == cmdline(server.proc.pid)
        started = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)
        assert server.proc.wait(timeout=60) == 0
        elapsed = time.monotonic() - started
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and any(os.path.exists(f"/proc/{p}") for p in family):
            time.sleep(0.2)
        left = [p for p in family if os.path.exists(f"/proc/{p}") and cmdline(p)]
        assert left == [], [cmdline(p) for p in left]
    assert elapsed < 60


def test_ranks_are_forked_only_from_a_marked_process_that_started_no_thread(
    model_dir, monkeypatch: pytest.MonkeyPatch
) -> None:
    """CPU ranks are forked from a process that marked its entry and has started no thread
    since; a thread started after the mark, an unmarked process, a CUDA device or a system that
    cannot count threads get the forkserver."""
    import dataclasses
    import threading

    import torch

    from tandem.engine import process_exit, rank_process
    from tandem.engine.config import EngineArgs

    config = EngineArgs(model=str(model_dir), max_model_len=256).create_engine_config()

    def method(cfg=config) -> str:  # noqa: ANN001
        return rank_process.rank_process_context(cfg).get_start_method()

    monkeypatch.setattr(process_exit, "_fork_point_threads", None)
    assert method() == "forkserver"  # never marked (this test process)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    process_exit.mark_fork_point()
    assert method() == "fork"
    assert method(dataclasses.replace(config, device=torch.device("cuda", 0))) == "forkserver"
    monkeypatch.setattr(process_exit, "os_threads", lambda: process_exit._fork_point_threads + 1)
    assert method() == "forkserver"  # a thread started since the mark
    monkeypatch.setattr(process_exit, "os_threads", lambda: -1)
    process_exit.mark_fork_point()
    assert method() == "forkserver"  # threads cannot be counted here


def test_the_engine_is_forked_only_from_a_marked_process_outside_an_event_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """`tandem serve` forks a CPU engine from the point it marked; an unmarked process, a CUDA
    engine, a thread started since the mark or a running event loop get a fresh interpreter."""
    import asyncio
    import threading

    from tandem.engine import async_llm, process_exit

    monkeypatch.setattr(process_exit, "_fork_point_threads", None)
    assert not async_llm._can_fork_engine("cpu")  # never marked (this test process)
    monkeypatch.setattr(threading, "active_count", lambda: 1)
    process_exit.mark_fork_point()
    assert async_llm._can_fork_engine("cpu")
    assert not async_llm._can_fork_engine("cuda")

    async def in_a_loop() -> bool:
        return async_llm._can_fork_engine("cpu")

    assert not asyncio.run(in_a_loop())
    monkeypatch.setattr(process_exit, "os_threads", lambda: process_exit._fork_point_threads + 1)
    assert not async_llm._can_fork_engine("cpu")
