"""A headless node (``tandem serve ... --nnodes M --node-rank R``, R > 0): no HTTP port, no
scheduler; this process checks its arguments with node 0 (engine/multinode.py), spawns the
node's ranks with their global rank numbers and watches them.

It exits 0 when node 0 stops the ranks or when it is asked to stop (SIGTERM/SIGINT: it stops its
ranks first); non-zero when one of its ranks fails (after telling node 0 why through the store)
or when node 0 is gone (the store no longer answers).
"""

from __future__ import annotations

import logging
import multiprocessing.connection
import signal
import time
from datetime import timedelta
from types import FrameType

from tandem.engine.config import EngineConfig, split_host_port
from tandem.engine.distributed import collective_timeout, startup_timeout_s
from tandem.engine.executor import JOIN_TIMEOUT_S
from tandem.engine.multinode import (
    VERDICT_KEY,
    agree_as_node,
    join_store,
    report_failure,
    within,
)
from tandem.engine.process_exit import mark_fork_point
from tandem.engine.rank_process import RankPlace, spawn_ranks

logger = logging.getLogger(__name__)

STORE_CHECK_S = 2.0  # how often the launcher checks that node 0's store still answers


def run_headless_node(config: EngineConfig) -> int:
    """Run this node's ranks until node 0 stops them; the process's exit code."""
    mark_fork_point()
    pc = config.parallel_config
    host, port = split_host_port(pc.dist_init_addr or "")
    ranks = pc.node_ranks
    timeout = collective_timeout()
    wait_s = startup_timeout_s()
    logger.info(
        "headless node %d of %d: serving %s:%d with global ranks %d..%d of %d (no HTTP port)",
        pc.node_rank,
        pc.nnodes,
        host,
        port,
        ranks[0],
        ranks[-1],
        pc.tensor_parallel_size,
    )
    store = join_store(pc, wait_s)
    agree_as_node(store, config, time.monotonic() + wait_s)
    store.set_timeout(timedelta(seconds=min(timeout.total_seconds(), STORE_CHECK_S * 5)))
    stop: list[str] = []

    def on_signal(signum: int, frame: FrameType | None) -> None:
        stop.append(signal.Signals(signum).name)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    places = [
        RankPlace(r, r - ranks[0], host, port, timeout.total_seconds(), multinode=True)
        for r in ranks
    ]
    procs, conns = spawn_ranks(config, places)
    errors: dict[int, str] = {}
    next_check = time.monotonic() + STORE_CHECK_S
    try:
        while True:
            multiprocessing.connection.wait([p.sentinel for p in procs] + conns, timeout=1.0)
            for rank, conn in zip(ranks, conns, strict=True):
                try:
                    while conn.poll():
                        kind, payload = conn.recv()
                        if kind == "error":
                            errors[rank] = payload
                except (EOFError, OSError):
                    pass
            if stop:
                report_failure(store, f"node {pc.node_rank} was stopped ({stop[0]})")
                logger.info("node %d: %s, stopping its ranks", pc.node_rank, stop[0])
                return 0
            codes = [p.exitcode for p in procs]
            failed = [(r, c) for r, c in zip(ranks, codes, strict=True) if c not in (None, 0)]
            if failed:
                rank, code = failed[0]
                message = f"node {pc.node_rank}: rank {rank} exited with code {code}"
                report_failure(store, message + _last_line(errors.get(rank)))
                logger.error("%s; stopping the node's ranks\n%s", message, errors.get(rank, ""))
                return 1
            if all(c == 0 for c in codes):
                logger.info("node %d: node 0 stopped the ranks; exiting", pc.node_rank)
                return 0
            if time.monotonic() >= next_check:
                next_check = time.monotonic() + STORE_CHECK_S
                try:
                    within(timeout.total_seconds(), lambda: store.check([VERDICT_KEY]))
                except (RuntimeError, OSError) as e:
                    return _node0_gone(procs, f"{host}:{port}", e)
    finally:
        _stop_ranks(procs)
        for conn in conns:
            conn.close()


def _last_line(text: str | None) -> str:
    lines = (text or "").strip().splitlines()
    return f": {lines[-1]}" if lines else ""


def _node0_gone(procs: list[multiprocessing.process.BaseProcess], addr: str, e: Exception) -> int:
    """The store no longer answers: node 0 is gone. Its clean shutdown also ends the store, so
    ranks that are already stopping get a moment to finish with 0."""
    deadline = time.monotonic() + JOIN_TIMEOUT_S
    for proc in procs:
        proc.join(max(0.0, deadline - time.monotonic()))
    if all(p.exitcode == 0 for p in procs):
        return 0
    logger.error("node 0's rendezvous at %s no longer answers (%s): stopping this node", addr, e)
    return 1


def _stop_ranks(procs: list[multiprocessing.process.BaseProcess]) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.terminate()
    for proc in procs:
        proc.join(JOIN_TIMEOUT_S)
        if proc.is_alive():  # stopped, or stuck in native code
            proc.kill()
            proc.join()
