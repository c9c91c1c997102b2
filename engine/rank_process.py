"""The rank side of multi-rank execution: spawning rank processes (on node 0 by the executor,
on other nodes by engine/headless.py), a spawned rank's start-up, and its step loop.

A spawned rank joins through ``RankPlace`` (global and node-local rank, rendezvous store), loads
its shard, agrees on the KV block count, then runs every step rank 0 broadcasts over the control
group until rank 0 broadcasts ``None``. Across nodes rank 0 also broadcasts ``PING`` while idle.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import signal
import time
import traceback
from dataclasses import dataclass
from typing import Any

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.distributed import (
    IDLE_TIMEOUT,
    LaunchEnv,
    ProcessGroups,
    all_reduce_min,
    broadcast_object,
    collective_timeout,
    connect_store,
    destroy_distributed,
    follower_idle_timeout,
    gather_objects,
    init_distributed,
    launched_store,
    rank_device,
    start_parent_watchdog,
    startup_timeout_s,
)
from tandem.engine.multinode import agree_in_world, await_world
from tandem.engine.process_exit import (
    at_fork_point,
    exit_process,
    name_process,
    pace_garbage_collector,
)
from tandem.engine.step import DPStepInput
from tandem.engine.worker import Worker
from tandem.models.device import cpu_threads
from tandem.models.parallel import ParallelMapping

logger = logging.getLogger(__name__)

PING = "ping"


def serve_steps(worker: Worker, control: Any) -> None:
    """Ranks 1..N-1: run every step rank 0 broadcasts until it broadcasts ``None`` (stop); under
    attention DP send this rank's output back to rank 0."""
    while True:
        step = broadcast_object(None, control)
        if step is None:
            worker.close()
            return
        if isinstance(step, str) and step == PING:
            continue
        out = worker.execute(step)
        if isinstance(step, DPStepInput):
            gather_objects(out, control)


def _can_fork(config: EngineConfig) -> bool:
    return config.device.type == "cpu" and at_fork_point()


def rank_process_context(config: EngineConfig) -> multiprocessing.context.BaseContext:
    """Fresh interpreters, never a fork of a process that has run parallel work or holds threads
    (CUDA and thread pools do not survive ``fork``): a fork of this process where
    ``mark_fork_point`` vouches for it (CPU ranks only), else a forkserver, which pays the heavy
    imports once per engine process, not once per rank and per executor; spawn where there is
    no forkserver."""
    if _can_fork(config):
        return multiprocessing.get_context("fork")
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    hf_module = type(config.model_config.hf_config).__module__
    ctx.set_forkserver_preload(["tandem.engine.rank_process", hf_module])
    return ctx


def rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    return dataclasses.replace(config, device=rank_device(config.device, local_rank))


def spawn_ranks(
    config: EngineConfig, places: list[RankPlace]
) -> tuple[list[multiprocessing.process.BaseProcess], list[multiprocessing.connection.Connection]]:
    """Start one process per ``place``; returns the processes and the read ends of their pipes."""
    ctx = rank_process_context(config)
    procs, conns = [], []
    for place in places:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(
            target=_spawned_rank_main,
            args=(config, place, writer),
            name=f"tandem-rank{place.rank}",
            daemon=True,  # also terminated by multiprocessing at interpreter exit
        )
        proc.start()
        writer.close()
        procs.append(proc)
        conns.append(reader)
    return procs, conns


def rank_mapping(config: EngineConfig, rank: int, groups: ProcessGroups) -> ParallelMapping:
    pc = config.parallel_config
    return ParallelMapping(
        tp_size=pc.tensor_parallel_size,
        tp_rank=rank,
        enable_attention_dp=pc.enable_attention_dp,
        enable_lm_head_tp_in_adp=pc.enable_lm_head_tp_in_adp,
        group=groups.tensor,
        enable_expert_parallel=pc.expert_parallel,
        num_redundant_experts=pc.num_redundant_experts,
        enable_eplb=pc.enable_eplb,
        eplb_window_size=pc.eplb_window_size,
    )


def join_launched_world(config: EngineConfig, launch: LaunchEnv) -> tuple[ProcessGroups, Worker]:
    """Under an external launcher (torchrun, srun): join the launched world, check that every
    rank got the same arguments, and load this rank's shard. Every rank first waits for all
    (up to the start-up timeout: nodes may start apart, imports may be slow), then joins the
    process group, whose rendezvous and collectives the collective timeout bounds. Ranks other
    than 0 wait for a step at most 1.5 times the collective timeout (rank 0 pings the control
    group while idle)."""
    timeout = collective_timeout()
    device = rank_device(config.device, launch.local_rank)
    if device.type == "cpu" and launch.local_world_size:  # ranks share the node's cores
        torch.set_num_threads(cpu_threads(launch.local_world_size))
    idle = follower_idle_timeout(timeout)
    wait_s = startup_timeout_s()
    store = launched_store(launch, collective_timeout(wait_s))
    await_world(store, launch.world_size, time.monotonic() + wait_s)
    store.set_timeout(timeout)
    groups = init_distributed(launch.rank, launch.world_size, device, timeout, store, idle)
    agree_in_world(config, groups.control)
    worker = Worker(
        dataclasses.replace(config, device=device),
        rank_mapping(config, launch.rank, groups),
        lambda n: all_reduce_min(n, groups.control, wait_s=startup_timeout_s()),
    )
    return groups, worker


def serve_launched_rank(config: EngineConfig, launch: LaunchEnv) -> None:
    """A launched rank other than 0 (``tandem serve`` under torchrun or srun binds no HTTP port
    there): serve rank 0's steps until it stops the world; raises when a collective fails or
    times out (rank 0 or a peer is gone)."""
    groups, worker = join_launched_world(config, launch)
    try:
        serve_steps(worker, groups.control)
    finally:
        destroy_distributed()


@dataclass(frozen=True)
class RankPlace:
    """Where a spawned rank joins: its global and node-local rank and the rendezvous store."""

    rank: int
    local_rank: int
    host: str
    port: int
    timeout_s: float  # collective timeout
    multinode: bool  # store barrier before the rendezvous; bounded idle wait (rank 0 pings)


def _spawned_rank_main(
    config: EngineConfig,
    place: RankPlace,
    conn: multiprocessing.connection.Connection,
) -> None:
    """Entry point of a spawned rank. Reports start-up stages and errors to its parent over
    ``conn``; exits when told to stop, when a collective fails or times out, or when its parent
    is gone."""
    name_process(f"tandem-rank-{place.rank}")
    start_parent_watchdog()
    # Ctrl-C reaches the whole process group; rank 0 (or the node's launcher) stops this rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pace_garbage_collector()
    pc = config.parallel_config
    world, rank = pc.tensor_parallel_size, place.rank
    code = 0
    try:
        if config.device.type == "cpu":  # ranks share the host's cores
            torch.set_num_threads(cpu_threads(pc.ranks_per_node))
        timeout = collective_timeout(place.timeout_s)
        conn.send(("hello", None))
        wait_s = startup_timeout_s() if place.multinode else None
        if place.multinode:
            store = connect_store(place.port, world, collective_timeout(wait_s), place.host)
            await_world(store, world, time.monotonic() + (wait_s or 0))
        else:
            store = connect_store(place.port, world, timeout, place.host)
        device = rank_device(config.device, place.local_rank)
        idle = follower_idle_timeout(timeout) if place.multinode else IDLE_TIMEOUT
        groups = init_distributed(rank, world, device, timeout, store, idle)

        def agree(blocks: int) -> int:
            conn.send(("loaded", blocks))
            return all_reduce_min(blocks, groups.control, wait_s=wait_s)

        worker = Worker(
            dataclasses.replace(config, device=device), rank_mapping(config, rank, groups), agree
        )
        serve_steps(worker, groups.control)
        destroy_distributed()
    except BaseException:
        code = 1
        message = traceback.format_exc()
        logger.error("rank %d failed:\n%s", rank, message)
        try:
            conn.send(("error", message))
        except OSError:
            pass
    exit_process(code)
