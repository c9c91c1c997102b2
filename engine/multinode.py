"""Several nodes, one model: node 0's rendezvous store and the start-up protocol every node runs
on it before joining the world (the headless launcher of nodes 1..M-1 is engine/headless.py).

At start-up, every wait bounded by the start-up timeout (``$TANDEM_DIST_STARTUP_TIMEOUT_S``):

1. Node 0's rank 0 (the engine process) hosts a ``TCPStore`` at ``--dist-init-addr``; every other
   node's launcher connects to it (waiting for node 0 to come up).
2. Every node writes a fingerprint of the arguments that must agree (``fingerprint``) under its
   node rank; node 0 compares each as it arrives and writes a verdict, ``ok`` or the mismatch;
   every node reads it, so a mismatch ends every node with the same message. This runs before
   ``init_process_group``, whose world sizes would otherwise differ and hang.
3. Every node spawns its ranks with their global rank numbers. A rank counts itself in once its
   imports are done and waits for the whole world (or a failure report) before
   ``init_process_group``, so the collective timeout never has to cover a slow node's start.

After start-up a node whose rank fails writes ``FAILED_KEY`` (node 0 reads it while pinging the
control group), and a headless launcher that can no longer reach the store knows node 0 is gone.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import socket
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any, TypeVar

import torch.distributed as dist

from tandem.engine.config import EngineConfig, ParallelConfig, split_host_port
from tandem.engine.speculative.interface import DISABLE_ROW_PICK_ENV, row_pick_disabled_by_env
from tandem.models.checkpoint import checkpoint_digest
from tandem.version import __version__

T = TypeVar("T")
KEY = "tandem/launch/"
VERDICT_KEY = KEY + "verdict"
FAILED_KEY = KEY + "failed"
ARRIVED_KEY = KEY + "arrived"
POLL_S = 0.2
OK = "ok"
# A refused node 0 keeps its store up this long for the other nodes to read why.
VERDICT_READ_S = 10.0
# A node whose own arguments are invalid tries this long to tell node 0 (which may still start).
REPORT_S = 30.0


def _checkpoint_id(config: dict[str, Any], folder: str | os.PathLike) -> str:
    """A checkpoint by what it holds, not where (paths may differ per node): digests of its
    config and of its tensors (``checkpoint_digest``)."""
    d = {k: v for k, v in config.items() if k != "_name_or_path"}
    digest = hashlib.sha256(json.dumps(d, sort_keys=True, default=str).encode()).hexdigest()
    return f"config sha256 {digest[:12]}, tensors sha256 {checkpoint_digest(folder)[:12]}"


def _spec_id(config: EngineConfig) -> str:
    """The speculative config, its draft head named by ``_checkpoint_id`` (not by path)."""
    spec = config.speculative_config
    if spec is None:
        return "none"
    d = dataclasses.asdict(spec)
    if spec.model is not None:
        raw = json.loads((Path(spec.model) / "config.json").read_text())
        d["model"] = _checkpoint_id(raw, spec.model)
    return json.dumps(d, sort_keys=True)


def fingerprint(config: EngineConfig) -> dict[str, str]:
    """What every node must agree on, by the option that sets it."""
    pc, mc, cc = config.parallel_config, config.model_config, config.cache_config
    spec = config.speculative_config
    out = {
        "--nnodes": str(pc.nnodes),
        "--tensor-parallel-size": str(pc.tensor_parallel_size),
        "--enable-attention-dp": str(pc.enable_attention_dp),
        "--enable-lm-head-tp-in-adp": str(pc.enable_lm_head_tp_in_adp),
        "--enable-expert-parallel": str(pc.expert_parallel),
        "--enable-eplb": str(pc.enable_eplb),
        "--num-redundant-experts": str(pc.num_redundant_experts),
        "--eplb-step-interval": str(pc.eplb_step_interval),
        "--eplb-window-size": str(pc.eplb_window_size),
        "model": _checkpoint_id(mc.hf_config.to_dict(), mc.model),
        "--dtype": str(mc.dtype).removeprefix("torch."),
        "--device": config.device.type,
        "--max-model-len": str(mc.max_model_len),
        "--block-size": str(cc.block_size),
        "--max-num-seqs": str(config.scheduler_config.max_num_seqs),
        "--seed": str(mc.seed),
        "--speculative-config": _spec_id(config),
        "CUDA graphs": repr(config.graph_config),
        "tandem version": __version__,
    }
    if spec is not None:
        # Read by every rank: a draft layer that picks rows on some ranks only runs collectives
        # of other shapes than the rest (gloo aborts the step).
        out[f"${DISABLE_ROW_PICK_ENV}"] = "1" if row_pick_disabled_by_env() else "0"
    return out


def mismatches(
    node0: dict[str, str], other: dict[str, str], node: int, unit: str = "node"
) -> list[str]:
    """'node 1 has --nnodes 3, node 0 has 2' for each field that differs (``unit`` "rank":
    'rank 1 has ...' under an external launcher)."""
    return [
        f"{unit} {node} has {name} {other.get(name, '(not set)')}, {unit} 0 has {value}"
        for name, value in node0.items()
        if other.get(name) != value
    ]


def agree_in_world(config: EngineConfig, control: Any) -> None:
    """Under an external launcher (one process per rank, the world already joined): every rank
    gathers every rank's ``fingerprint`` over the gloo ``control`` group and raises the same
    ``ValueError`` on a mismatch, so all of them stop with it instead of hanging in a step."""
    prints: list[Any] = [None] * dist.get_world_size(control)
    dist.all_gather_object(prints, fingerprint(config), group=control)
    problems = [m for r, p in enumerate(prints) if r for m in mismatches(prints[0], p, r, "rank")]
    if problems:
        raise ValueError(
            "the launched ranks were started with different arguments: " + "; ".join(problems)
        )


def _addr(pc: ParallelConfig) -> str:
    host, port = split_host_port(pc.dist_init_addr or "")
    return f"{host}:{port}"


def _open_store(
    pc: ParallelConfig, timeout_s: float, host_it: bool, listener: socket.socket | None = None
) -> dist.TCPStore:
    host, port = split_host_port(pc.dist_init_addr or "")
    try:
        return dist.TCPStore(
            host,
            port,
            pc.tensor_parallel_size,
            is_master=host_it,
            timeout=timedelta(seconds=timeout_s),
            **({"wait_for_workers": False} if host_it else {}),
            **({"master_listen_fd": listener.detach()} if listener is not None else {}),
        )
    except (RuntimeError, OSError) as e:
        if host_it:
            raise _port_taken(host, port, e) from e
        raise ValueError(
            f"node {pc.node_rank} could not reach node 0's rendezvous at {host}:{port} within "
            f"{timeout_s:.0f} s ({e}); start node 0 with --node-rank 0 --dist-init-addr "
            f"{host}:{port} and open port {port} between the nodes"
        ) from e


def _port_taken(host: str, port: int, e: Exception) -> ValueError:
    return ValueError(
        f"node 0 cannot host the rendezvous at {host}:{port} ({e}); is the port taken, "
        "or another node started with --node-rank 0?"
    )


def host_listener(pc: ParallelConfig) -> socket.socket:
    """Node 0's rendezvous port, bound and listening on every address (as the store binds it)
    before the store exists: node 0's ranks are forked before the store's server thread starts
    (engine/rank_process.py), and ``host_store`` takes the socket over."""
    host, port = split_host_port(pc.dist_init_addr or "")
    try:
        if socket.has_dualstack_ipv6():
            return socket.create_server(("", port), family=socket.AF_INET6, dualstack_ipv6=True)
        return socket.create_server(("", port))
    except OSError as e:
        raise _port_taken(host, port, e) from e


def host_store(
    pc: ParallelConfig, timeout_s: float, listener: socket.socket | None = None
) -> dist.TCPStore:
    """Node 0's rendezvous store, listening on ``dist_init_addr``'s port (on ``listener``, from
    ``host_listener``, when given)."""
    return _open_store(pc, timeout_s, host_it=True, listener=listener)


def join_store(pc: ParallelConfig, timeout_s: float) -> dist.TCPStore:
    """A client of node 0's store (waits up to ``timeout_s`` for node 0 to come up)."""
    return _open_store(pc, timeout_s, host_it=False)


def _node_key(node: int) -> str:
    return f"{KEY}node/{node}"


def agree_as_node0(
    store: dist.Store,
    config: EngineConfig,
    deadline: float,
    check_alive: Callable[[], None] = lambda: None,
) -> None:
    """Compare every node's fingerprint with ours as it arrives, publish the verdict, and raise
    ``ValueError`` on a mismatch (or when a node never joins)."""
    pc = config.parallel_config
    mine = fingerprint(config)
    pending = set(range(1, pc.nnodes))
    problems: list[str] = []
    while pending and not problems:
        check_alive()
        failure = reported_failure(store)
        if failure is not None:  # a node whose own arguments are invalid
            store.set(VERDICT_KEY, failure)
            raise ValueError(f"the {pc.nnodes} nodes cannot start: {failure}")
        for node in sorted(pending):
            if store.check([_node_key(node)]):
                pending.discard(node)
                problems += mismatches(mine, json.loads(store.get(_node_key(node))), node)
        if pending and not problems:
            if time.monotonic() > deadline:
                problems.append(
                    f"node(s) {sorted(pending)} did not join the rendezvous at {_addr(pc)} in "
                    "time (raise $TANDEM_DIST_STARTUP_TIMEOUT_S if they start slowly)"
                )
            else:
                time.sleep(POLL_S)
    if problems:
        verdict = (
            f"the {pc.nnodes} nodes disagree: {'; '.join(problems)}. Start every node with the "
            "same arguments (only --node-rank differs)"
        )
        store.set(VERDICT_KEY, verdict)
        # Node 0's store ends with this process: wait until the joined nodes have read why.
        joined = [n for n in range(1, pc.nnodes) if n not in pending]
        until = time.monotonic() + VERDICT_READ_S
        while time.monotonic() < until and not store.check([f"{KEY}read/{n}" for n in joined]):
            time.sleep(POLL_S)
        raise ValueError(verdict)
    store.set(VERDICT_KEY, OK)


def agree_as_node(store: dist.Store, config: EngineConfig, deadline: float) -> None:
    """Publish this node's fingerprint and wait for node 0's verdict (``ValueError`` unless ok)."""
    pc = config.parallel_config
    if store.add(f"{KEY}claim/{pc.node_rank}", 1) != 1:
        raise ValueError(
            f"another node already joined {_addr(pc)} as --node-rank {pc.node_rank}; give every "
            "node its own --node-rank"
        )
    store.set(_node_key(pc.node_rank), json.dumps(fingerprint(config)))
    try:
        while not store.check([VERDICT_KEY]):
            if time.monotonic() > deadline:
                raise ValueError(f"node 0 at {_addr(pc)} gave no verdict on the arguments in time")
            time.sleep(POLL_S)
        verdict = store.get(VERDICT_KEY).decode()
        store.set(f"{KEY}read/{pc.node_rank}", "1")
    except (RuntimeError, OSError) as e:  # DistNetworkError is a RuntimeError
        raise ValueError(
            f"node 0 at {_addr(pc)} went away before it checked the arguments ({e}); see its log"
        ) from e
    if verdict != OK:
        raise ValueError(verdict)


def report_invalid_arguments(dist_init_addr: str | None, node_rank: int, message: str) -> None:
    """A node whose own arguments are invalid tells node 0 (so node 0 stops too instead of
    waiting for it); best effort, for up to ``REPORT_S``."""
    try:
        host, port = split_host_port(dist_init_addr or "")
        store = dist.TCPStore(host, port, is_master=False, timeout=timedelta(seconds=REPORT_S))
    except (ValueError, RuntimeError, OSError):
        return
    report_failure(store, f"node {node_rank} cannot start: {message}")


def within(seconds: float, call: Callable[[], T]) -> T:
    """``call()`` (a store operation) if it returns within ``seconds``, else ``TimeoutError``.
    A store client whose server's host vanished without closing the connection (a cut link, a
    frozen host) can wait in ``check`` far past the store's own timeout; the call is left to
    finish on a daemon thread."""
    result: list[T] = []
    error: list[BaseException] = []
    done = threading.Event()

    def run() -> None:
        try:
            result.append(call())
        except BaseException as e:  # handed to the caller
            error.append(e)
        finally:
            done.set()

    threading.Thread(target=run, name="store-call", daemon=True).start()
    if not done.wait(seconds):
        raise TimeoutError(f"the rendezvous store did not answer within {seconds:g} s")
    if error:
        raise error[0]
    return result[0]


def report_failure(store: dist.Store, message: str, wait_s: float = 5.0) -> None:
    """Tell the other nodes why this one is going away (best effort, for at most ``wait_s``:
    the store may be gone or out of reach)."""

    def report() -> None:
        if not store.check([FAILED_KEY]):  # the first failure is the cause; keep it
            store.set(FAILED_KEY, message)

    try:
        within(wait_s, report)
    except (RuntimeError, OSError):
        pass


def reported_failure(store: dist.Store) -> str | None:
    """What a node reported through ``report_failure``, if anything."""
    if store.check([FAILED_KEY]):
        return store.get(FAILED_KEY).decode()
    return None


def await_world(
    store: dist.Store,
    world_size: int,
    deadline: float,
    check_alive: Callable[[], None] = lambda: None,
) -> None:
    """Count this rank in and wait until all ``world_size`` ranks are (``RuntimeError`` if a node
    reports a failure or the start-up timeout passes first)."""
    store.add(ARRIVED_KEY, 1)
    while True:
        arrived = store.add(ARRIVED_KEY, 0)
        if arrived >= world_size:
            return
        failure = reported_failure(store)
        if failure is not None:
            raise RuntimeError(f"another node failed during start-up: {failure}")
        check_alive()
        if time.monotonic() > deadline:
            raise RuntimeError(
                f"only {arrived} of {world_size} ranks arrived before the start-up timeout "
                "($TANDEM_DIST_STARTUP_TIMEOUT_S)"
            )
        time.sleep(POLL_S)
