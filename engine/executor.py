"""Executors run a step on every rank and return rank 0's sampled tokens.

``UniProcExecutor`` runs the single rank in-process. ``MultiProcExecutor`` runs tensor-parallel
ranks: rank 0 in the calling process, ranks 1..N-1 in spawned processes (or, under an external
launcher such as ``torchrun``, in the launcher's processes; across nodes, node 0's ranks here and
the other nodes' ranks under engine/headless.py). Both keep the same interface: the
engine never knows how many ranks there are. Under attention DP the engine hands over every
rank's ``StepInput`` at once (``DPStepInput``); each rank runs its own entry and rank 0 gathers
and merges every rank's output.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import threading
import time
from typing import Any

import torch

from tandem.engine.config import EngineConfig, split_host_port
from tandem.engine.distributed import (
    IDLE_TIMEOUT,
    LaunchEnv,
    ProcessGroups,
    all_reduce_min,
    broadcast_object,
    collective_timeout,
    destroy_distributed,
    gather_objects,
    init_distributed,
    local_store,
    rank_device,
    startup_timeout_s,
    store_listener,
)
from tandem.engine.multinode import (
    agree_as_node0,
    await_world,
    host_listener,
    host_store,
    report_failure,
    reported_failure,
)
from tandem.engine.rank_process import (
    PING,
    RankPlace,
    join_launched_world,
    rank_config,
    rank_mapping,
    serve_launched_rank,
    spawn_ranks,
)
from tandem.engine.step import DPStepInput, StepInput, StepOutput, merge_outputs
from tandem.engine.worker import Worker

logger = logging.getLogger(__name__)

# Start-up waits are bounded but generous (``startup_timeout_s``: imports, large checkpoints,
# other nodes starting); a rank that dies while starting is noticed at once through its process
# sentinel. A rank told to stop gets this long to exit before it is terminated.
JOIN_TIMEOUT_S = 5.0
# Across nodes rank 0 broadcasts PING when the control group was quiet this long (at most a
# quarter of the collective timeout), so the other ranks' bounded wait for a step never runs out
# while the server idles and a vanished peer fails the ping.
PING_INTERVAL_S = 2.0


class Executor:
    num_blocks: int
    window: int | None  # the window group's window (None: no sliding-window layers)
    window_num_blocks: int
    worker: Worker  # the rank that runs in this process (rank 0)

    def execute(self, step: StepInput | DPStepInput) -> StepOutput:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a rank is gone."""

    def shutdown(self) -> None:
        worker = getattr(self, "worker", None)
        if worker is not None:
            worker.close()


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.num_blocks = self.worker.num_blocks
        self.window = self.worker.window  # the window group (engine/block_manager.py)
        self.window_num_blocks = self.worker.window_num_blocks

    def execute(self, step: StepInput | DPStepInput) -> StepOutput:
        return self.worker.execute(step)


class RankFailedError(RuntimeError):
    """A rank died, hung past the collective timeout, or failed while starting."""


class MultiProcExecutor(Executor):
    """Tensor parallelism over ``tensor_parallel_size`` ranks.

    Every step rank 0 broadcasts the ``StepInput`` over the gloo control group; all ranks run the
    same forward (the layers' collectives combine the shards) and sample; rank 0's output is
    returned. A rank that dies or hangs makes ``execute`` raise ``RankFailedError`` within the
    collective timeout (``timeout_s``, else ``$TANDEM_DIST_TIMEOUT_S``, else 60 s).

    Under an external launcher (``RANK``/``WORLD_SIZE``/``MASTER_ADDR``/``MASTER_PORT`` set, e.g.
    ``torchrun``) every rank runs the same program: rank 0 returns from this constructor as the
    executor, the other ranks serve steps inside it and exit the process when rank 0 shuts down.

    Across nodes (``nnodes > 1``) this is node 0: it hosts the rendezvous at ``dist_init_addr``,
    checks every node's arguments (engine/multinode.py) and spawns its own ranks 1..N/M-1; a
    thread pings the control group while idle and reads the other nodes' failure reports.
    """

    def __init__(self, config: EngineConfig, timeout_s: float | None = None) -> None:
        pc = config.parallel_config
        if pc.node_rank != 0:
            raise ValueError(
                f"node_rank={pc.node_rank}: the engine runs on node 0; start node "
                f"{pc.node_rank} with `tandem serve MODEL --nnodes {pc.nnodes} --node-rank "
                f"{pc.node_rank} --dist-init-addr {pc.dist_init_addr} ...` (headless ranks)"
            )
        self.world_size = pc.tensor_parallel_size
        self.timeout = collective_timeout(timeout_s)
        self.procs: list[multiprocessing.process.BaseProcess] = []
        self.conns: list[multiprocessing.connection.Connection] = []
        self.groups: ProcessGroups | None = None
        self.failure: str | None = None
        self.closed = False
        self.store: Any = None  # the rendezvous store across nodes (for failure reports)
        self._lock = threading.Lock()  # one user of the control group at a time
        self._last_control = time.monotonic()
        self._stop_ping = threading.Event()
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
        self.window = self.worker.window  # the window group (engine/block_manager.py)
        self.window_num_blocks = self.worker.window_num_blocks

    # ---------------------------------------------------------------- start-up

    def _start_local(self, config: EngineConfig) -> None:
        pc = config.parallel_config
        local = pc.ranks_per_node
        if config.device.type == "cuda" and torch.cuda.device_count() < local:
            raise ValueError(
                f"tensor_parallel_size={self.world_size} over nnodes={pc.nnodes} needs {local} "
                f"CUDA devices per node, {torch.cuda.device_count()} are visible"
            )
        multinode = pc.nnodes > 1
        wait_s = startup_timeout_s() if multinode else None
        deadline = time.monotonic() + (wait_s or 0)
        # The store after the ranks, on a socket bound before them: the store's server thread
        # would keep them from being forked (engine/rank_process.py).
        if multinode:
            listener = host_listener(pc)
            host = split_host_port(pc.dist_init_addr or "")[0]
        else:
            listener, host = store_listener(), "127.0.0.1"
        port = listener.getsockname()[1]
        places = [
            RankPlace(r, r, host, port, self.timeout.total_seconds(), multinode)
            for r in range(1, local)
        ]
        self.procs, self.conns = spawn_ranks(config, places)
        if multinode:
            store = self.store = host_store(pc, wait_s or 0, listener)
            logger.info(
                "node 0 of %d: rendezvous at %s, waiting for the other nodes",
                pc.nnodes,
                pc.dist_init_addr,
            )
            agree_as_node0(store, config, deadline)
        else:
            store = local_store(self.world_size, self.timeout, listener)
        # Enter the rendezvous only once every rank can: its timeout is the collective one.
        self._await_stage("hello")
        if multinode:
            await_world(store, self.world_size, deadline, self._check_starting)
        idle = self.timeout if multinode else IDLE_TIMEOUT
        self.groups = init_distributed(
            0, self.world_size, rank_device(config.device, 0), self.timeout, store, idle
        )
        groups = self.groups

        def agree(blocks: int) -> int:
            self._await_stage("loaded")
            return all_reduce_min(blocks, groups.control, wait_s=wait_s)

        self.worker = Worker(rank_config(config, 0), rank_mapping(config, 0, groups), agree)
        if multinode:
            threading.Thread(target=self._ping_loop, name="control-ping", daemon=True).start()

    def _check_starting(self) -> None:
        if not all(p.is_alive() for p in self.procs):
            self.failure = "a rank process exited during start-up"
            raise RankFailedError(self._describe_failure())

    def _join_launch(self, config: EngineConfig, launch: LaunchEnv) -> None:
        check_launch(config, launch)
        if launch.rank != 0:  # the offline engine: the other ranks stay in here, then exit
            serve_launched_rank(config, launch)
            raise SystemExit(0)
        self.groups, self.worker = join_launched_world(config, launch)
        threading.Thread(target=self._ping_loop, name="control-ping", daemon=True).start()

    def _await_stage(self, stage: str) -> None:
        """Wait until every spawned rank reports ``stage``; raise at once if one fails or dies."""
        pending = dict(enumerate(self.conns, start=1))
        wait_s = startup_timeout_s()
        deadline = time.monotonic() + wait_s
        while pending:
            left = deadline - time.monotonic()
            if left <= 0:
                raise RankFailedError(
                    f"ranks {sorted(pending)} did not reach start-up stage {stage!r} "
                    f"within {wait_s:.0f} s ($TANDEM_DIST_STARTUP_TIMEOUT_S)"
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
            with self._lock:
                self._last_control = time.monotonic()
                broadcast_object(step, self.groups.control)
                out = self.worker.execute(step)
                if isinstance(step, DPStepInput):
                    outs = gather_objects(out, self.groups.control)
                    assert outs is not None
                    out = merge_outputs(outs)
                self._last_control = time.monotonic()
            return out
        except Exception as e:
            self.failure = f"a step failed: {e}"
            # A rank that crashed is usually why; give its exit a moment to show in the report.
            multiprocessing.connection.wait([p.sentinel for p in self.procs], timeout=1.0)
            raise RankFailedError(self._describe_failure()) from e

    def _ping_loop(self) -> None:
        """Across nodes: keep the other ranks' bounded wait alive while idle, and fail (within
        the collective timeout) when a peer is gone or another node reported a failure."""
        interval = min(PING_INTERVAL_S, self.timeout.total_seconds() / 4)
        while not self._stop_ping.wait(interval):
            with self._lock:
                if self.closed or self.failure is not None or self.groups is None:
                    return
                try:
                    remote = None if self.store is None else reported_failure(self.store)
                    if remote is not None:
                        self.failure = f"another node failed: {remote}"
                        return
                    if time.monotonic() - self._last_control >= interval:
                        broadcast_object(PING, self.groups.control)
                        self._last_control = time.monotonic()
                except Exception as e:
                    self.failure = f"the control-group heartbeat failed: {e}"
                    logger.error("%s", self.failure)
                    return

    def check_health(self) -> None:
        if self.closed:
            raise RankFailedError("the executor is shut down")
        if self.failure is None and not all(p.is_alive() for p in self.procs):
            self.failure = "a rank process exited"
        if self.failure is not None:
            raise RankFailedError(self._describe_failure())

    def _describe_failure(self) -> str:
        lines = [f"tensor-parallel executor is unhealthy: {self.failure}"]
        if self.store is not None:
            try:
                remote = reported_failure(self.store)
            except (RuntimeError, OSError):
                remote = None
            if remote is not None and remote not in (self.failure or ""):
                lines.append(f"another node reported: {remote}")
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
        self._stop_ping.set()
        if getattr(self, "worker", None) is not None:
            self.worker.close()
        healthy = self.failure is None and all(p.is_alive() for p in self.procs)
        if self.groups is not None and healthy:
            try:
                with self._lock:  # after a ping in flight (bounded by the collective timeout)
                    broadcast_object(None, self.groups.control)
                for proc in self.procs:
                    proc.join(JOIN_TIMEOUT_S)
            except Exception as e:  # a rank just died or stopped reading; reaped below
                logger.warning("could not stop the ranks cleanly: %s", e)
        elif self.store is not None and self.failure is not None:
            report_failure(self.store, f"node 0 stopped: {self.failure}")
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


def check_launch(config: EngineConfig, launch: LaunchEnv) -> None:
    """What an external launcher's world must match: one process per rank, no --nnodes."""
    pc = config.parallel_config
    if pc.nnodes > 1:
        raise ValueError(
            f"nnodes={pc.nnodes} starts ranks itself, but this process was started by a "
            "launcher (RANK and WORLD_SIZE are set): use one or the other"
        )
    if pc.num_replicas > 1:
        raise ValueError(
            f"data_parallel_size={pc.data_parallel_size} under a launcher (RANK/WORLD_SIZE "
            "set) is not supported: tandem starts each replica's ranks itself"
        )
    if launch.world_size != pc.tensor_parallel_size:
        raise ValueError(
            f"tensor_parallel_size={pc.tensor_parallel_size} but the launcher started "
            f"WORLD_SIZE={launch.world_size} processes; they must be equal"
        )


def make_executor(config: EngineConfig) -> Executor:
    pc = config.parallel_config
    if pc.tensor_parallel_size > 1:
        return MultiProcExecutor(config)
    return UniProcExecutor(config)
