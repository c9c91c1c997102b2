"""Executors run a step on every rank and return rank 0's sampled tokens.

``UniProcExecutor`` runs the single rank in-process. ``MultiProcExecutor`` runs tensor-parallel
ranks: rank 0 in the calling process, ranks 1..N-1 in spawned processes (or, under an external
launcher such as ``torchrun``, in the launcher's processes). Both keep the same interface: the
engine never knows how many ranks there are. Under attention DP the engine hands over every
rank's ``StepInput`` at once (``DPStepInput``); each rank runs its own entry and rank 0 gathers
and merges every rank's output.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import multiprocessing.connection
import os
import signal
import time
import traceback
from typing import Any

import torch

from tandem.engine.config import EngineConfig
from tandem.engine.distributed import (
    LaunchEnv,
    ProcessGroups,
    all_reduce_min,
    broadcast_object,
    collective_timeout,
    connect_store,
    destroy_distributed,
    gather_objects,
    init_distributed,
    local_store,
    rank_device,
    start_parent_watchdog,
)
from tandem.engine.step import DPStepInput, StepInput, StepOutput, merge_outputs
from tandem.engine.worker import Worker
from tandem.models.parallel import ParallelMapping

logger = logging.getLogger(__name__)

# Start-up waits are bounded but generous (imports, large checkpoints); a rank that dies while
# starting is noticed at once through its process sentinel.
STARTUP_TIMEOUT_S = 1800.0
JOIN_TIMEOUT_S = 5.0


class Executor:
    num_blocks: int

    def execute(self, step: StepInput | DPStepInput) -> StepOutput:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a rank is gone."""

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.num_blocks = self.worker.num_blocks

    def execute(self, step: StepInput | DPStepInput) -> StepOutput:
        return self.worker.execute(step)


class RankFailedError(RuntimeError):
    """A rank died, hung past the collective timeout, or failed while starting."""


def serve_steps(worker: Worker, control: Any) -> None:
    """Ranks 1..N-1: run every step rank 0 broadcasts until it broadcasts ``None`` (stop); under
    attention DP send this rank's output back to rank 0."""
    while True:
        step = broadcast_object(None, control)
        if step is None:
            return
        out = worker.execute(step)
        if isinstance(step, DPStepInput):
            gather_objects(out, control)


def rank_process_context(config: EngineConfig) -> multiprocessing.context.BaseContext:
    """Fresh interpreters, never a fork of the engine (CUDA and thread pools do not survive
    ``fork``). A forkserver pays the heavy imports once per engine process, not once per rank
    and per executor; spawn where there is no forkserver."""
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return multiprocessing.get_context("spawn")
    ctx = multiprocessing.get_context("forkserver")
    hf_module = type(config.model_config.hf_config).__module__
    ctx.set_forkserver_preload(["tandem.engine.executor", hf_module])
    return ctx


def _rank_config(config: EngineConfig, local_rank: int) -> EngineConfig:
    return dataclasses.replace(config, device=rank_device(config.device, local_rank))


def _mapping(config: EngineConfig, rank: int, groups: ProcessGroups) -> ParallelMapping:
    pc = config.parallel_config
    return ParallelMapping(
        tp_size=pc.tensor_parallel_size,
        tp_rank=rank,
        enable_attention_dp=pc.enable_attention_dp,
        enable_lm_head_tp_in_adp=pc.enable_lm_head_tp_in_adp,
        group=groups.tensor,
    )


def _spawned_rank_main(
    config: EngineConfig,
    rank: int,
    port: int,
    timeout_s: float,
    conn: multiprocessing.connection.Connection,
) -> None:
    """Entry point of a spawned rank. Reports start-up stages and errors to rank 0 over ``conn``;
    exits when told to stop, when a collective fails or times out, or when its parent is gone."""
    start_parent_watchdog()
    # Ctrl-C reaches the whole process group; rank 0 handles it and stops this rank.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    world = config.parallel_config.tensor_parallel_size
    code = 0
    try:
        if config.device.type == "cpu":  # ranks share the host's cores
            torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        timeout = collective_timeout(timeout_s)
        conn.send(("hello", None))
        store = connect_store(port, world, timeout)
        groups = init_distributed(rank, world, rank_device(config.device, rank), timeout, store)

        def agree(blocks: int) -> int:
            conn.send(("loaded", blocks))
            return all_reduce_min(blocks, groups.control)

        worker = Worker(_rank_config(config, rank), _mapping(config, rank, groups), agree)
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
    if code:
        raise SystemExit(code)


class MultiProcExecutor(Executor):
    """Tensor parallelism over ``tensor_parallel_size`` ranks.

    Every step rank 0 broadcasts the ``StepInput`` over the gloo control group; all ranks run the
    same forward (the layers' collectives combine the shards) and sample; rank 0's output is
    returned. A rank that dies or hangs makes ``execute`` raise ``RankFailedError`` within the
    collective timeout (``timeout_s``, else ``$TANDEM_DIST_TIMEOUT_S``, else 60 s).

    Under an external launcher (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, e.g.
    ``torchrun``) every rank runs the same program: rank 0 returns from this constructor as the
    executor, the other ranks serve steps inside it and exit the process when rank 0 shuts down.
    """

    def __init__(self, config: EngineConfig, timeout_s: float | None = None) -> None:
        self.world_size = config.parallel_config.tensor_parallel_size
        self.timeout = collective_timeout(timeout_s)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.groups: ProcessGroups | None = None
        self.failure: str | None = None
        self.closed = False
        try:
            launch = LaunchEnv.from_env()
            if launch is None:
                self._start_local(config)
            else:
                self._join_launch(config, launch)
        except BaseException:
            self.failure = "start-up failed"
            self.shutdown()
            raise
        self.num_blocks = self.worker.num_blocks

    # ---------------------------------------------------------------- start-up

    def _start_local(self, config: EngineConfig) -> None:
        if config.device.type == "cuda" and torch.cuda.device_count() < self.world_size:
            raise ValueError(
                f"tensor_parallel_size={self.world_size} needs {self.world_size} CUDA devices, "
                f"{torch.cuda.device_count()} are visible"
            )
        store = local_store(self.world_size, self.timeout)
        ctx = rank_process_context(config)
        for rank in range(1, self.world_size):
            reader, writer = ctx.Pipe(duplex=False)
            proc = ctx.Process(
                target=_spawned_rank_main,
                args=(config, rank, store.port, self.timeout.total_seconds(), writer),
                name=f"tandem-rank{rank}",
                daemon=True,  # also terminated by multiprocessing at interpreter exit
            )
            proc.start()
            writer.close()
            self.procs.append(proc)
            self.conns.append(reader)
        # Enter the rendezvous only once every rank can: its timeout is the collective one.
        self._await_stage("hello")
        self.groups = init_distributed(
            0, self.world_size, rank_device(config.device, 0), self.timeout, store
        )
        groups = self.groups

        def agree(blocks: int) -> int:
            self._await_stage("loaded")
            return all_reduce_min(blocks, groups.control)

        self.worker = Worker(_rank_config(config, 0), _mapping(config, 0, groups), agree)

    def _join_launch(self, config: EngineConfig, launch: LaunchEnv) -> None:
        if launch.world_size != self.world_size:
            raise ValueError(
                f"tensor_parallel_size={self.world_size} but the launcher started "
                f"WORLD_SIZE={launch.world_size} processes; they must be equal"
            )
        device = rank_device(config.device, launch.local_rank)
        self.groups = groups = init_distributed(
            launch.rank, launch.world_size, device, self.timeout
        )
        rank_config = dataclasses.replace(config, device=device)
        mapping = _mapping(config, launch.rank, groups)
        worker = Worker(
            rank_config,
            mapping,
            lambda n: all_reduce_min(n, groups.control, wait_s=STARTUP_TIMEOUT_S),
        )
        if launch.rank == 0:
            self.worker = worker
            return
        serve_steps(worker, groups.control)
        destroy_distributed()
        self.groups = None
        raise SystemExit(0)

    def _await_stage(self, stage: str) -> None:
        """Wait until every spawned rank reports ``stage``; raise at once if one fails or dies."""
        pending = dict(enumerate(self.conns, start=1))
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailedError(
                    f"ranks {sorted(pending)} did not reach start-up stage {stage!r} "
                    f"within {STARTUP_TIMEOUT_S:.0f} s"
                )
            handles = list(pending.values()) + [self.procs[r - 1].sentinel for r in pending]
            multiprocessing.connection.wait(handles, timeout=left)
            for rank, conn in list(pending.items()):
                if conn.poll():
                    try:
                        kind, payload = conn.recv()
                    except EOFError:
                        kind, payload = "error", "exited without a message"
                    if kind == "error":
                        raise RankFailedError(f"rank {rank} failed during start-up:\n{payload}")
                    if kind == stage:
                        del pending[rank]
                elif not self.procs[rank - 1].is_alive():
                    raise RankFailedError(
                        f"rank {rank} exited with code {self.procs[rank - 1].exitcode} "
                        f"during start-up stage {stage!r}"
                    )

    # ---------------------------------------------------------------- steps

    def execute(self, step: StepInput | DPStepInput) -> StepOutput:
        """Run a step on every rank; a plain step returns rank 0's output, an attention-DP step
        every rank's outputs merged in rank order."""
        self.check_health()
        assert self.groups is not None
        try:
            broadcast_object(step, self.groups.control)
            out = self.worker.execute(step)
            if isinstance(step, DPStepInput):
                outs = gather_objects(out, self.groups.control)
                assert outs is not None
                return merge_outputs(outs)
            return out
        except Exception as e:
            self.failure = f"a step failed: {e}"
            # A rank that crashed is usually why; give its exit a moment to show in the report.
            multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=1.0)
            raise RankFailedError(self._describe_failure()) from e

    def check_health(self) -> None:
        if self.closed:
            raise RankFailedError("the executor is shut down")
        if self.failure is None and not all(p.is_alive() for p in self.procs):
            self.failure = "a rank process exited"
        if self.failure is not None:
            raise RankFailedError(self._describe_failure())

    def _describe_failure(self) -> str:
        lines = [f"tensor-parallel executor is unhealthy: {self.failure}"]
        for i, p in enumerate(self.procs):
            if not p.is_alive():
                lines.append(f"rank {i + 1} exited with code {p.exitcode}")
        for i, conn in enumerate(self.conns):
            try:
                while conn.poll():
                    kind, payload = conn.recv()
                    if kind == "error":
                        lines.append(f"rank {i + 1} reported:\n{payload}")
            except (EOFError, OSError):
                pass
        return "\n".join(lines)

    def shutdown(self) -> None:
        """Stop every rank and reap its process; safe to call more than once and after a failure."""
        if self.closed:
            return
        self.closed = True
        healthy = self.failure is None and all(p.is_alive() for p in self.procs)
        if self.groups is not None and healthy:
            try:
                broadcast_object(None, self.groups.control)
                for proc in self.procs:
                    proc.join(JOIN_TIMEOUT_S)
            except Exception as e:  # a rank just died or stopped reading; reaped below
                logger.warning("could not stop the ranks cleanly: %s", e)
        for proc in self.procs:
            if proc.is_alive() and healthy:
                proc.terminate()
                proc.join(JOIN_TIMEOUT_S)
            if proc.is_alive():  # a broken world, a stopped process or one stuck in native code
                proc.kill()
                proc.join()
        for conn in self.conns:
            conn.close()
        if self.groups is not None:
            destroy_distributed()
            self.groups = None


def make_executor(config: EngineConfig) -> Executor:
    pc = config.parallel_config
    if pc.tensor_parallel_size > 1:
        return MultiProcExecutor(config)
    return UniProcExecutor(config)
