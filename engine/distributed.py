"""Process groups for multi-rank execution, set up from one place.

Two groups per replica:

- ``tensor``: the collectives parallel layers run in every forward (all-reduce, all-gather).
  NCCL on CUDA, gloo on CPU. Its timeout bounds how long a dead or hung peer can stall a step.
- ``control``: always gloo (CPU tensors, pickled objects): step broadcasts from rank 0 and
  start-up agreement (KV block count). Timeouts are per process: rank 0 uses the collective
  timeout, so a peer that stops reading fails the step (a gloo send waits for the receiver);
  the other ranks wait on it between steps for as long as the server idles, so theirs is
  effectively unbounded. They learn of a dead rank 0 from the closed connection, or, when it
  spawned them, from ``start_parent_watchdog``. Across nodes rank 0 pings the control group
  while idle and the other ranks wait at most 1.5 times the collective timeout (a lost network
  ends them; rank 0, whose ping times out first, reports it).

Rendezvous: a local spawn uses a ``TCPStore`` on 127.0.0.1 with an OS-picked free port; across
nodes node 0 hosts it at ``--dist-init-addr`` (engine/multinode.py); a launch by ``torchrun`` (or
any launcher that sets ``MASTER_ADDR``, ``MASTER_PORT``, ``WORLD_SIZE``, ``RANK``) uses the
standard ``env://`` rendezvous, and so does ``srun`` with one task per rank once
``adopt_slurm_launch`` has written those variables from ``SLURM_*``. Under a launcher every rank
is its own process: only global rank 0 serves HTTP, rank 0 pings the control group while idle
and the other ranks wait at most 1.5 times the collective timeout, as across nodes.
"""

from __future__ import annotations

import logging
import multiprocessing
import multiprocessing.connection
import os
import socket
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from tandem.engine.config import split_host_port

logger = logging.getLogger(__name__)

TIMEOUT_ENV = "TANDEM_DIST_TIMEOUT_S"
DEFAULT_TIMEOUT_S = 60.0
# Start-up waits (imports, large checkpoints, other nodes still starting) are bounded but generous.
STARTUP_TIMEOUT_ENV = "TANDEM_DIST_STARTUP_TIMEOUT_S"
DEFAULT_STARTUP_TIMEOUT_S = 1800.0
# Ranks 1..N-1 waiting for the next step: not a failure, however long the server idles.
IDLE_TIMEOUT = timedelta(days=365)


def follower_idle_timeout(timeout: timedelta) -> timedelta:
    """How long ranks 1..N-1 across nodes (or under a launcher) wait for the next step or ping:
    half as long again as rank 0's collectives, so that when a peer stops answering, rank 0's
    ping fails first and reports it (a follower that timed out in the same instant raced it, and
    the failure named whichever came first)."""
    return timeout * 1.5


def collective_timeout(timeout_s: float | None = None) -> timedelta:
    """Timeout of tensor collectives and of the rendezvous: ``timeout_s``, else
    ``$TANDEM_DIST_TIMEOUT_S``, else 60 s."""
    if timeout_s is None:
        raw = os.environ.get(TIMEOUT_ENV)
        try:
            timeout_s = float(raw) if raw else DEFAULT_TIMEOUT_S
        except ValueError:
            raise ValueError(f"{TIMEOUT_ENV}={raw!r} is invalid: a number of seconds > 0") from None
    if not timeout_s > 0:
        raise ValueError(f"distributed timeout={timeout_s!r} is invalid: a number of seconds > 0")
    return timedelta(seconds=timeout_s)


def startup_timeout_s() -> float:
    """How long start-up may wait for ranks and nodes: ``$TANDEM_DIST_STARTUP_TIMEOUT_S``, else
    1800 s."""
    raw = os.environ.get(STARTUP_TIMEOUT_ENV)
    try:
        value = float(raw) if raw else DEFAULT_STARTUP_TIMEOUT_S
    except ValueError:
        value = -1.0
    if not value > 0:
        raise ValueError(f"{STARTUP_TIMEOUT_ENV}={raw!r} is invalid: a number of seconds > 0")
    return value


@dataclass(frozen=True)
class LaunchEnv:
    """This process's place in a world started by an external launcher (torchrun, srun, ...)."""

    rank: int
    world_size: int
    local_rank: int
    local_world_size: int | None = None  # ranks on this node, when the launcher says
    master: str = ""  # MASTER_ADDR:MASTER_PORT

    @classmethod
    def from_env(cls) -> LaunchEnv | None:
        """The launcher's environment, or None when this process was not started by one."""
        if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
            return None
        missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if k not in os.environ]
        if missing:
            raise ValueError(
                f"RANK and WORLD_SIZE are set but {', '.join(missing)} is not; set all of "
                "MASTER_ADDR, MASTER_PORT, WORLD_SIZE, RANK (or launch with torchrun)"
            )
        env = {k: _env_int(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
        rank, world = env["RANK"], env["WORLD_SIZE"]
        assert rank is not None and world is not None
        if not 0 <= rank < world:
            raise ValueError(f"RANK={rank} must be in [0, WORLD_SIZE={world})")
        local = env["LOCAL_RANK"]
        master = f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}"
        return cls(rank, world, rank if local is None else local, env["LOCAL_WORLD_SIZE"], master)


def _env_int(name: str) -> int | None:
    raw = os.environ.get(name)
    if raw is None or raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"{name}={raw!r} is not an integer") from None


def adopt_slurm_launch(tensor_parallel_size: int, nnodes: int, dist_init_addr: str | None) -> bool:
    """``srun`` with one task per rank (``SLURM_NTASKS`` = tensor-parallel size, no ``--nnodes``):
    write the ``torch.distributed`` variables from ``SLURM_PROCID`` / ``SLURM_NTASKS`` /
    ``SLURM_LOCALID`` (rank 0's address from ``--dist-init-addr``, else ``MASTER_ADDR`` /
    ``MASTER_PORT``) so this process and the ones it spawns see a launcher. True when adopted.

    One ``srun`` task per node with ``--nnodes`` (tandem starts the node's ranks) and a single
    task are not a launch; a task count that is neither is refused, naming both numbers."""
    ntasks = _env_int("SLURM_NTASKS")
    if "RANK" in os.environ or ntasks is None or ntasks == 1 or nnodes > 1:
        return False
    if ntasks != tensor_parallel_size:
        raise ValueError(
            f"srun started SLURM_NTASKS={ntasks} tasks but --tensor-parallel-size is "
            f"{tensor_parallel_size}: run one task per rank (srun --ntasks "
            f"{tensor_parallel_size}) or one per node with --nnodes/--node-rank"
        )
    if dist_init_addr is not None:
        host, port = split_host_port(dist_init_addr)
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = host, str(port)
    missing = [k for k in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(k)]
    if missing:
        raise ValueError(
            f"srun runs one task per rank here (SLURM_NTASKS={ntasks}), and rank 0's address "
            f"is unknown ({', '.join(missing)} not set): pass --dist-init-addr HOST:PORT with "
            "the first node of the allocation, or export MASTER_ADDR and MASTER_PORT"
        )
    procid, localid = _env_int("SLURM_PROCID"), _env_int("SLURM_LOCALID")
    if procid is None:
        raise ValueError("SLURM_NTASKS is set but SLURM_PROCID is not: start the tasks with srun")
    os.environ["RANK"], os.environ["WORLD_SIZE"] = str(procid), str(ntasks)
    os.environ["LOCAL_RANK"] = str(procid if localid is None else localid)
    per_node = os.environ.get("SLURM_NTASKS_PER_NODE", "")
    if per_node.isdigit():  # not "2(x3)" and the like
        os.environ["LOCAL_WORLD_SIZE"] = per_node
    logger.info(
        "srun task %d of %d is rank %d (rendezvous at %s:%s)",
        procid,
        ntasks,
        procid,
        os.environ["MASTER_ADDR"],
        os.environ["MASTER_PORT"],
    )
    return True


@dataclass(frozen=True)
class ProcessGroups:
    tensor: Any  # dist.ProcessGroup: NCCL on CUDA, gloo on CPU
    control: Any  # dist.ProcessGroup: gloo


def store_listener() -> socket.socket:
    """A listening socket on 127.0.0.1 at a port the OS picks, for ``local_store``: the ranks
    learn the port before the store (and its server thread) exists."""
    return socket.create_server(("127.0.0.1", 0))


def local_store(
    world_size: int, timeout: timedelta, listener: socket.socket | None = None
) -> dist.TCPStore:
    """Rank 0's rendezvous store on 127.0.0.1: on ``listener``'s port (the store takes the
    socket over), else a port the OS picks (``.port``)."""
    port, fd = (0, None) if listener is None else (listener.getsockname()[1], listener.detach())
    return dist.TCPStore(
        "127.0.0.1",
        port,
        world_size,
        is_master=True,
        timeout=timeout,
        wait_for_workers=False,
        master_listen_fd=fd,
    )


def connect_store(
    port: int, world_size: int, timeout: timedelta, host: str = "127.0.0.1"
) -> dist.TCPStore:
    return dist.TCPStore(host, port, world_size, is_master=False, timeout=timeout)


def launched_store(launch: LaunchEnv, timeout: timedelta) -> dist.Store:
    """The rendezvous store of a launched world at ``MASTER_ADDR:MASTER_PORT``, as ``env://``
    opens it (rank 0 hosts it, unless torchrun's agent already does), but waiting up to
    ``timeout`` (the start-up one: ranks of other nodes may start minutes later)."""
    host, port = split_host_port(launch.master, "MASTER_ADDR:MASTER_PORT")
    agent = os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        host,
        port,
        launch.world_size,
        is_master=launch.rank == 0 and not agent,
        timeout=timeout,
        wait_for_workers=False,
    )
    # A restarted world (torchrun --max-restarts) meets the same agent's store: its own keys.
    return dist.PrefixStore(f"tandem/{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def rank_device(device: torch.device, local_rank: int) -> torch.device:
    """CUDA ranks take one device each (by local rank); CPU ranks share the host."""
    if device.type != "cuda":
        return device
    if local_rank >= torch.cuda.device_count():
        raise ValueError(
            f"local rank {local_rank} needs cuda:{local_rank} but only "
            f"{torch.cuda.device_count()} CUDA devices are visible"
        )
    return torch.device("cuda", local_rank)


def init_distributed(
    rank: int,
    world_size: int,
    device: torch.device,
    timeout: timedelta,
    store: dist.Store | None = None,
    idle_timeout: timedelta = IDLE_TIMEOUT,
) -> ProcessGroups:
    """Join the world (``store`` given: local spawn; else ``env://``) and build both groups.
    ``timeout`` bounds the rendezvous and tensor collectives everywhere, and rank 0's control
    collectives; ``idle_timeout`` the other ranks' control collectives (waiting for a step)."""
    if dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is already initialized in this process; "
            "run one multi-rank engine per process"
        )
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    kw: dict[str, Any] = {"store": store} if store is not None else {"init_method": "env://"}
    dist.init_process_group(backend, rank=rank, world_size=world_size, timeout=timeout, **kw)
    control = dist.new_group(backend="gloo", timeout=timeout if rank == 0 else idle_timeout)
    logger.info("rank %d/%d joined (%s for tensors, gloo for control)", rank, world_size, backend)
    return ProcessGroups(tensor=dist.group.WORLD, control=control)


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_reduce_min(value: int, group: Any, wait_s: float | None = None) -> int:
    """The smallest ``value`` over the ranks of ``group`` (a gloo group). ``wait_s``: first wait
    up to that long for every rank to arrive (ranks finish loading at different times)."""
    if wait_s is not None:
        dist.monitored_barrier(group, timeout=timedelta(seconds=wait_s), wait_all_ranks=True)
    t = torch.tensor([value], dtype=torch.int64)
    dist.all_reduce(t, op=dist.ReduceOp.MIN, group=group)
    return int(t.item())


def broadcast_object(obj: Any, group: Any) -> Any:
    """Rank 0's ``obj`` on every rank of ``group`` (pickled; gloo, CPU)."""
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


def gather_objects(obj: Any, group: Any) -> list[Any] | None:
    """Every rank's ``obj`` on rank 0 of ``group`` (in rank order); None on the other ranks."""
    rank = dist.get_rank(group)
    out: list[Any] | None = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(obj, out, dst=0, group=group)
    return out


def start_parent_watchdog(exit_code: int = 3) -> None:
    """End this (spawned) process as soon as its parent is gone, even while the main thread is
    blocked inside a collective: a worker must never outlive the engine that started it."""
    parent = multiprocessing.parent_process()
    if parent is None:
        return

    def watch() -> None:
        multiprocessing.connection.wait([parent.sentinel])
        logger.error("parent process %s exited; rank process %d exits", parent.pid, os.getpid())
        os._exit(exit_code)

    threading.Thread(target=watch, name="parent-watchdog", daemon=True).start()


LAUNCHER_POLL_S = 1.0


def start_launcher_watchdog(exit_code: int = 3) -> None:
    """Under torchrun or srun: end this rank when the launcher that started it is gone (its
    parent process changes), so a killed agent never leaves a rank that serves on alone."""
    parent = os.getppid()

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(LAUNCHER_POLL_S)
        logger.error("the launcher (pid %d) is gone; rank process %d exits", parent, os.getpid())
        os._exit(exit_code)

    threading.Thread(target=watch, name="launcher-watchdog", daemon=True).start()
