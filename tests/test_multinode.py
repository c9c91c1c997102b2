"""Two "nodes" on one machine: two independent `tandem serve` process trees, started separately
with `--nnodes 2 --node-rank 0/1 --dist-init-addr 127.0.0.1:PORT` and `-tp 4` (two gloo ranks
each). Node 0 serves greedy output equal to one rank, token for token, and node 1 binds no HTTP
port; arguments that differ across the nodes stop both at start-up with a message naming the
difference; a killed node makes the other exit non-zero (node 0's /health answering 503 first),
and no process of either tree is left behind."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from pathlib import Path

import httpx
import openai
import partition
import pytest
import torch
from transformers import AutoTokenizer

from server_utils import RemoteServer, child_pids, cmdline, free_port, tiny_model
from tandem import LLM, SamplingParams
from tandem.cli import build_parser
from tandem.engine.config import ParallelConfig
from tandem.engine.multinode import host_listener, host_store, mismatches, report_failure, within
from tandem.server.cli import engine_args_from
from tandem.server.logprobs import TokenText

PROMPTS = ["Hello world! How are you today?", "Paris is the capital of"]
MAX_TOKENS = 12
# Short collective timeout: a vanished node is noticed within seconds, not a minute.
ENV = {"TANDEM_DIST_TIMEOUT_S": "10", "TANDEM_DIST_STARTUP_TIMEOUT_S": "90"}
EXIT_WITHIN_S = 60.0

pytestmark = pytest.mark.timeout(180)


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def _family(pid: int) -> list[int]:
    """``pid`` and all its descendants."""
    out, todo = [pid], [pid]
    while todo:
        kids = child_pids(todo.pop())
        out += kids
        todo += kids
    return out


def _start(
    model: Path,
    node_rank: int,
    addr: str,
    nnodes: int = 2,
    args: list[str] | None = None,
    env: dict[str, str] | None = None,
) -> RemoteServer:
    """One node's ``tandem serve -tp 4``; ``args`` and ``env`` add to the command and ``ENV``."""
    launch = ["-tp", "4", "--nnodes", str(nnodes), "--node-rank", str(node_rank)]
    launch += ["--dist-init-addr", addr, *(args or [])]
    return RemoteServer(model, launch, env={**ENV, **(env or {})}, headless=node_rank != 0)


def _wait_exit(node: RemoteServer, timeout_s: float = EXIT_WITHIN_S) -> int:
    try:
        return node.proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        pytest.fail(f"still running after {timeout_s} s:\n{node.log_tail()}")


def served_greedy(server: RemoteServer, model: Path) -> list[tuple[str, list[str]]]:
    """PROMPTS' greedy texts and tokens, as ``server`` answers them over the openai client."""
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    got = []
    for p in PROMPTS:
        choice = client.completions.create(
            model=model.name,
            prompt=p,
            max_tokens=MAX_TOKENS,
            temperature=0,
            logprobs=0,
            extra_body={"ignore_eos": True},
        ).choices[0]
        got.append((choice.text, choice.logprobs.tokens))
    return got


def health_until_exit(server: RemoteServer) -> list[int]:
    """What /health answers while ``server`` runs (polled for at most EXIT_WITHIN_S)."""
    statuses = []
    started = time.monotonic()
    while server.proc.poll() is None and time.monotonic() - started < EXIT_WITHIN_S:
        try:
            statuses.append(httpx.get(server.url("/health"), timeout=2).status_code)
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    return statuses


def family_until_both_exit(a: RemoteServer, b: RemoteServer) -> set[int]:
    """Every process either tree had while they ran (at most EXIT_WITHIN_S)."""
    family: set[int] = set()
    deadline = time.monotonic() + EXIT_WITHIN_S
    while time.monotonic() < deadline and None in (a.proc.poll(), b.proc.poll()):
        family.update(_family(a.proc.pid) + _family(b.proc.pid))
        time.sleep(0.2)
    return family


def _resume(node: RemoteServer) -> None:
    """SIGCONT to every process of ``node``'s tree (one a test stopped), so it can be stopped."""
    for pid in _family(node.proc.pid):
        try:
            os.kill(pid, signal.SIGCONT)
        except ProcessLookupError:
            pass


def _assert_gone(pids: list[int]) -> None:
    """No process of ``pids`` runs any more (zombies, reaped by nobody yet, count as gone)."""
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and any(_alive(p) for p in pids):
        time.sleep(0.2)
    left = [p for p in pids if _alive(p)]
    assert left == [], [cmdline(p) for p in left]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


# ---------------------------------------------------------------- arguments (no processes)


@pytest.mark.parametrize(
    ("kw", "match"),
    [
        ({"tensor_parallel_size": 4, "nnodes": 3}, "not divisible by nnodes=3"),
        ({"tensor_parallel_size": 4, "nnodes": 2}, "needs dist_init_addr"),
        ({"tensor_parallel_size": 2, "nnodes": 2, "node_rank": 2}, "node_rank=2"),
        ({"tensor_parallel_size": 2, "nnodes": 2, "dist_init_addr": "node0"}, "HOST:PORT"),
    ],
)
def test_parallel_config_refuses_layouts_that_cannot_work(kw, match):
    with pytest.raises(ValueError, match=match):
        ParallelConfig(**kw)


def test_each_node_runs_its_share_of_the_global_ranks():
    pc = ParallelConfig(tensor_parallel_size=8, nnodes=4, node_rank=2, dist_init_addr="h:1")
    assert pc.ranks_per_node == 2 and list(pc.node_ranks) == [4, 5]


def test_node_0_binds_the_rendezvous_port_before_its_store_and_names_a_taken_one():
    """Node 0 binds the rendezvous port before it forks its ranks (the store takes the socket
    over after): on every address, as the store would, and a taken port is refused naming it."""
    port = free_port()
    pc = ParallelConfig(tensor_parallel_size=2, nnodes=2, dist_init_addr=f"127.0.0.1:{port}")
    listener = host_listener(pc)
    with pytest.raises(ValueError, match=f"cannot host the rendezvous at 127.0.0.1:{port}.*taken"):
        host_listener(pc)
    store = host_store(pc, 5.0, listener)
    assert listener.fileno() == -1  # the store owns the socket now
    store.set("k", "v")
    client = torch.distributed.TCPStore("127.0.0.1", port, 2, is_master=False)
    assert client.get("k") == b"v"


def test_master_addr_and_port_are_another_spelling_of_dist_init_addr(tmp_path):
    def addr(*argv: str) -> str | None:
        ns = build_parser().parse_args(["serve", str(tmp_path), *argv])
        return engine_args_from(ns).dist_init_addr

    assert addr("--master-addr", "10.0.0.1", "--master-port", "29500") == "10.0.0.1:29500"
    assert addr("--dist-init-addr", "10.0.0.1:29500") == "10.0.0.1:29500"
    with pytest.raises(ValueError, match="go together"):
        addr("--master-addr", "10.0.0.1")
    with pytest.raises(ValueError, match="disagree"):
        addr("--dist-init-addr", "h:1", "--master-addr", "h", "--master-port", "2")


def test_mismatch_names_the_option_and_both_values():
    node0 = {"--nnodes": "2", "--dtype": "float32"}
    assert mismatches(node0, {"--nnodes": "3", "--dtype": "float32"}, 1) == [
        "node 1 has --nnodes 3, node 0 has 2"
    ]
    assert mismatches(node0, dict(node0), 1) == []


def test_fingerprints_name_checkpoints_by_content_not_path(model_dir, tmp_path):
    """A node may store the same target or draft head at another path (they agree), and a
    different head at the same path is a mismatch (the path was compared before)."""
    import shutil

    from checkpoints import build_eagle3_draft
    from tandem.engine.config import EngineArgs
    from tandem.engine.multinode import fingerprint

    def fp(target: Path, head: Path) -> dict[str, str]:
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
        args = EngineArgs(model=str(target), speculative_config=spec, device="cpu")
        return fingerprint(args.create_engine_config())

    head = build_eagle3_draft(tmp_path / "head", model_dir, seed=2)
    node0 = fp(model_dir, head)
    target_copy = shutil.copytree(model_dir, tmp_path / "elsewhere" / "target")
    assert fp(target_copy, shutil.copytree(head, tmp_path / "elsewhere" / "head")) == node0
    shutil.rmtree(head)
    build_eagle3_draft(head, model_dir, seed=3)  # same config and shapes, other weights
    (only,) = mismatches(node0, fp(model_dir, head), 1)
    assert only.startswith("node 1 has --speculative-config")


def test_a_store_that_stops_answering_holds_a_node_no_longer_than_its_bound():
    """Caught by the partition tests: a cut link left node 1's launcher waiting in the store's
    ``check`` (past the store's own timeout), so it never exited. Store calls after start-up are
    bounded."""

    class Silent:
        def check(self, keys: list[str]) -> bool:
            time.sleep(30)
            return False

    started = time.monotonic()
    with pytest.raises(TimeoutError):
        within(0.3, lambda: Silent().check(["k"]))
    report_failure(Silent(), "node 1 failed", wait_s=0.3)  # best effort: gives up quietly
    assert time.monotonic() - started < 2
    assert within(1.0, lambda: 7) == 7
    with pytest.raises(KeyError):
        within(1.0, lambda: {}["missing"])


def test_the_offline_engine_refuses_to_run_on_a_headless_node(model_dir):
    with pytest.raises(ValueError, match="--node-rank 1"):
        LLM(
            str(model_dir),
            tensor_parallel_size=2,
            nnodes=2,
            node_rank=1,
            dist_init_addr="127.0.0.1:29500",
        )


# ---------------------------------------------------------------- two process trees


@pytest.fixture(scope="module")
def reference(model_dir):
    return one_rank_reference(model_dir)


def one_rank_reference(model_dir: Path, **llm_args: str) -> list[tuple[str, list[str]]]:
    """One rank, offline: the greedy texts and tokens (as the API names them) of PROMPTS."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True)
    with LLM(str(model_dir), max_model_len=256, **llm_args) as llm:
        outs = [o.outputs[0] for o in llm.generate(PROMPTS, params)]
    token_text = TokenText(AutoTokenizer.from_pretrained(model_dir))
    return [(o.text, [token_text.text(t) for t in o.token_ids]) for o in outs]


def test_two_nodes_serve_like_one_rank_then_a_killed_node_1_ends_node_0(model_dir, reference):
    addr = f"127.0.0.1:{free_port()}"
    node0, node1 = _start(model_dir, 0, addr), _start(model_dir, 1, addr)
    try:
        node0.wait_ready()
        assert node1.proc.poll() is None, node1.log_tail()
        assert served_greedy(node0, model_dir) == reference
        client = openai.OpenAI(base_url=node0.url("/v1"), api_key="none", max_retries=0)
        # Headless: node 1 was given --port too, held bound by the test; serving would end it.
        assert node1.proc.poll() is None, node1.log_tail()
        assert f"headless node 1 of 2: serving {addr}" in node1.log_tail(100_000)
        # The ping keeps idle ranks alive past the 10 s collective timeout.
        time.sleep(12)
        assert node1.proc.poll() is None, node1.log_tail()
        assert (
            client.completions.create(
                model=model_dir.name, prompt=PROMPTS[0], max_tokens=2, temperature=0
            )
            .choices[0]
            .text
        )

        family = _family(node0.proc.pid) + _family(node1.proc.pid)
        assert len(family) >= 6  # 2 launchers, the engine, 3 spawned ranks (+ helpers)
        os.killpg(node1.pgid, signal.SIGKILL)
        statuses = health_until_exit(node0)
        assert _wait_exit(node0, 1) != 0
        assert 503 in statuses, statuses
        # Idle, node 0 notices at its next ping or, where a local rank saw the closed sockets
        # first and exited, at its next health check (the order depends on the machine's load).
        log = node0.log_tail(100_000)
        assert "heartbeat failed" in log or "a rank process exited" in log, [
            line for line in log.splitlines() if "ERROR" in line
        ]
        node1.proc.wait(timeout=10)
        _assert_gone(sorted(family))
    finally:
        node0.stop()
        node1.stop()


def test_a_killed_node_0_ends_node_1(model_dir):
    addr = f"127.0.0.1:{free_port()}"
    node0, node1 = _start(model_dir, 0, addr), _start(model_dir, 1, addr)
    try:
        node0.wait_ready()
        family = _family(node0.proc.pid) + _family(node1.proc.pid)
        os.killpg(node0.pgid, signal.SIGKILL)
        assert _wait_exit(node1) != 0
        node0.proc.wait(timeout=10)
        _assert_gone(sorted(family))
    finally:
        node0.stop()
        node1.stop()


def test_wrong_nnodes_on_one_node_stops_both_naming_it(model_dir):
    addr = f"127.0.0.1:{free_port()}"
    node0, node1 = _start(model_dir, 0, addr), _start(model_dir, 1, addr, nnodes=4)
    try:
        family = family_until_both_exit(node0, node1)
        assert len(family) >= 3  # the launchers and node 0's engine process
        assert _wait_exit(node1, 1) != 0
        assert _wait_exit(node0, 1) != 0
        message = "node 1 has --nnodes 4, node 0 has 2"
        assert message in node0.log_tail(100_000)
        assert message in node1.log_tail(100_000)
        _assert_gone(sorted(family))
    finally:
        node0.stop()
        node1.stop()


def test_a_node_killed_mid_stream_ends_the_stream_with_an_error(model_dir):
    """SIGKILL of node 1 while node 0 streams: the stream ends with an error event (no hang,
    no silent truncation), /health turns 503 and node 0 exits non-zero."""

    addr = f"127.0.0.1:{free_port()}"
    node0, node1 = _start(model_dir, 0, addr), _start(model_dir, 1, addr)
    try:
        node0.wait_ready()
        family = _family(node0.proc.pid) + _family(node1.proc.pid)
        body = {
            "model": model_dir.name, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True, "logprobs": 0,
        }  # fmt: skip
        events: list[str] = []
        with httpx.stream("POST", node0.url("/v1/completions"), json=body, timeout=90) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 3:
                        os.killpg(node1.pgid, signal.SIGKILL)
        tokens = [e for e in events if e != "[DONE]" and "choices" in json.loads(e)]
        assert 3 <= len(tokens) < 200
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert set(error) == {"error"} and error["error"]["type"] == "server_error", error
        statuses = health_until_exit(node0)
        assert _wait_exit(node0, 1) != 0
        assert 503 in statuses, statuses
        node1.proc.wait(timeout=10)
        _assert_gone(sorted(family))
    finally:
        node0.stop()
        node1.stop()


def _rank_pids(node: RemoteServer) -> list[int]:
    """The rank processes a node started: the leaves of its tree (forked from the launcher or
    the engine process, or from a forkserver), but multiprocessing's resource tracker."""
    return [
        p
        for p in _family(node.proc.pid)[1:]
        if not child_pids(p) and "resource_tracker" not in cmdline(p)
    ]


@pytest.mark.skipif(
    partition.unavailable() is None,
    reason="node 0's side on two real hosts: test_multinode_partitions' frozen node 1",
)
def test_a_stopped_node_1_rank_ends_the_stream_and_node_0(model_dir):
    """SIGSTOP of one node-1 rank (alive and connected, but no longer answering) while node 0
    streams: the step's collective times out, the stream ends with an error event, /health
    turns 503, node 0 exits non-zero, and node 1 (its stopped rank included) goes too."""

    addr = f"127.0.0.1:{free_port()}"
    node0, node1 = _start(model_dir, 0, addr), _start(model_dir, 1, addr)
    try:
        node0.wait_ready()
        family = _family(node0.proc.pid) + _family(node1.proc.pid)
        ranks = _rank_pids(node1)
        assert len(ranks) == 2, [cmdline(p) for p in _family(node1.proc.pid)]
        body = {
            "model": model_dir.name, "prompt": PROMPTS[0], "max_tokens": 200, "temperature": 0,
            "ignore_eos": True, "stream": True,
        }  # fmt: skip
        events: list[str] = []
        with httpx.stream("POST", node0.url("/v1/completions"), json=body, timeout=90) as r:
            for line in r.iter_lines():
                if line.startswith("data: "):
                    events.append(line[len("data: ") :])
                    if len(events) == 3:
                        os.kill(ranks[-1], signal.SIGSTOP)
        assert events[-1] == "[DONE]"
        error = json.loads(events[-2])
        assert set(error) == {"error"} and error["error"]["type"] == "server_error", error
        statuses = health_until_exit(node0)
        assert _wait_exit(node0, 1) != 0
        assert 503 in statuses, statuses
        assert _wait_exit(node1) != 0
        _assert_gone(sorted(family))
    finally:
        _resume(node1)
        node0.stop()
        node1.stop()


@pytest.mark.skipif(
    partition.unavailable() is None,
    reason="the same ping failure on two real hosts: test_multinode_partitions' cut while idle",
)
def test_a_rank_stopped_while_idle_fails_the_ping(model_dir):
    """SIGSTOP of a node-1 rank while no request runs: rank 0's ping (a gloo broadcast, which
    waits for each receiver) fails within the collective timeout, so node 0 turns 503 and exits
    with no request sent."""
    addr = f"127.0.0.1:{free_port()}"
    node0, node1 = _start(model_dir, 0, addr), _start(model_dir, 1, addr)
    try:
        node0.wait_ready()
        family = _family(node0.proc.pid) + _family(node1.proc.pid)
        os.kill(_rank_pids(node1)[0], signal.SIGSTOP)
        statuses = health_until_exit(node0)
        assert _wait_exit(node0, 1) != 0
        assert 503 in statuses, statuses
        assert "heartbeat failed" in node0.log_tail(100_000)
        assert _wait_exit(node1) != 0
        _assert_gone(sorted(family))
    finally:
        _resume(node1)
        node0.stop()
        node1.stop()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_node_launcher_serves_over_nccl(model_dir):
    """`make gpu-check`: the launcher of this file on one node with NCCL (`--nnodes 1
    --dist-init-addr`, -tp = the GPUs, at most 4; one rank when one GPU is lent) answers like
    one rank on the GPU."""
    tp = 4 if torch.cuda.device_count() >= 4 else 2 if torch.cuda.device_count() >= 2 else 1
    dtype = {"device": "cuda", "dtype": "float32"}
    reference = one_rank_reference(model_dir, **dtype)
    args = ["-tp", str(tp), "--nnodes", "1", "--dist-init-addr", f"127.0.0.1:{free_port()}"]
    args += ["--device", "cuda", "--dtype", "float32"]
    with RemoteServer(model_dir, args, env=ENV) as server:
        assert served_greedy(server, model_dir) == reference
        if tp > 1:
            assert "nccl for tensors" in server.log_tail(1_000_000)
