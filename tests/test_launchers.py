"""`tandem serve` with every rank started by an external launcher, on loopback: two `torchrun
--nnodes 2` invocations (one rank each, TP=2) and two processes carrying srun's `SLURM_*`
variables (one task per rank). Only global rank 0 binds HTTP and answers equal to one rank over
the openai client; ranks started with different arguments stop naming the difference; a killed
node or rank 0 ends the others non-zero, and no process is left behind."""

from __future__ import annotations

import os
import signal
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from server_utils import RemoteServer, free_port, tiny_model
from tandem.engine.config import ParallelConfig
from tandem.engine.distributed import LaunchEnv, adopt_slurm_launch
from tandem.engine.executor import check_launch
from test_multinode import (
    ENV,
    _assert_gone,
    _family,
    _wait_exit,
    family_until_both_exit,
    health_until_exit,
    one_rank_reference,
    served_greedy,
)

pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def reference(model_dir):
    return one_rank_reference(model_dir)


def _torchrun_node(model: Path, node_rank: int, master_port: int) -> RemoteServer:
    launcher = [
        *(sys.executable, "-m", "torch.distributed.run", "--nnodes", "2"),
        *("--node-rank", str(node_rank), "--nproc-per-node", "1", "--max-restarts", "0"),
        *("--master-addr", "127.0.0.1", "--master-port", str(master_port), "--no-python"),
        *(sys.executable, "-m", "tandem.cli"),
    ]
    return RemoteServer(model, ["-tp", "2"], launcher=launcher, env=ENV, headless=node_rank != 0)


def _srun_task(
    model: Path, rank: int, addr: str, args: tuple[str, ...] = (), **env_extra: str
) -> RemoteServer:
    slurm = {"SLURM_NTASKS": "2", "SLURM_PROCID": str(rank), "SLURM_LOCALID": str(rank)}
    env = {**ENV, **slurm, "SLURM_NTASKS_PER_NODE": "2", **env_extra}
    argv = ["-tp", "2", "--dist-init-addr", addr, *args]
    return RemoteServer(model, argv, env=env, headless=rank != 0)


def _clear_launch_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy of the environment for the test (``adopt_slurm_launch`` writes to it)."""
    monkeypatch.setattr(os, "environ", dict(os.environ))
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE", "MASTER_ADDR"):
        os.environ.pop(name, None)
    os.environ.pop("MASTER_PORT", None)


def test_srun_one_task_per_rank_becomes_the_torch_environment(monkeypatch):
    _clear_launch_env(monkeypatch)
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("SLURM_NTASKS_PER_NODE", "2")
    with pytest.raises(ValueError, match="rank 0's address is unknown"):
        adopt_slurm_launch(4, 1, None)
    assert adopt_slurm_launch(4, 1, "head:29500")
    assert LaunchEnv.from_env() == LaunchEnv(3, 4, 1, 2, "head:29500")


def test_a_launch_refuses_what_starts_ranks_itself():
    launch = LaunchEnv(1, 2, 1, 2, "head:29500")
    for kw, match in [
        ({"data_parallel_size": 2}, "data_parallel_size=2 under a launcher"),
        ({"nnodes": 2, "node_rank": 1, "dist_init_addr": "h:1"}, "nnodes=2 starts ranks itself"),
        ({"tensor_parallel_size": 4}, "WORLD_SIZE=2 processes"),
    ]:
        args = {"tensor_parallel_size": 2, **kw}
        with pytest.raises(ValueError, match=match):
            check_launch(SimpleNamespace(parallel_config=ParallelConfig(**args)), launch)


def test_srun_tasks_that_are_not_one_per_rank(monkeypatch):
    _clear_launch_env(monkeypatch)
    monkeypatch.setenv("SLURM_NTASKS", "2")
    monkeypatch.setenv("SLURM_PROCID", "0")
    # One task per node with --nnodes: tandem starts each node's ranks, srun is no launcher.
    assert not adopt_slurm_launch(16, 2, "head:29500")
    assert LaunchEnv.from_env() is None
    with pytest.raises(ValueError, match="SLURM_NTASKS=2 tasks but --tensor-parallel-size is 4"):
        adopt_slurm_launch(4, 1, "head:29500")
    monkeypatch.setenv("SLURM_NTASKS", "1")  # `srun tandem serve`: one process, as without srun
    assert not adopt_slurm_launch(2, 1, None)


def test_two_torchrun_nodes_serve_like_one_rank_then_a_killed_node_1_ends_node_0(
    model_dir, reference
):
    port = free_port()
    node0, node1 = _torchrun_node(model_dir, 0, port), _torchrun_node(model_dir, 1, port)
    try:
        node0.wait_ready()
        assert served_greedy(node0, model_dir) == reference
        # Only global rank 0 binds HTTP: node 1's rank was given --port too, held bound by the
        # test; serving would end it.
        assert node1.proc.poll() is None, node1.log_tail()
        assert "rank 1 of 2 (local rank 0), started by a launcher" in node1.log_tail(100_000)
        # Rank 0 pings while idle: rank 1 outlives the 10 s collective timeout.
        time.sleep(12)
        assert node1.proc.poll() is None, node1.log_tail()
        assert served_greedy(node0, model_dir)[:1] == reference[:1]

        family = _family(node0.proc.pid) + _family(node1.proc.pid)
        assert len(family) >= 5  # 2 torchrun agents, 2 ranks, node 0's engine (+ helpers)
        # The agent only: torchrun starts its ranks in sessions of their own. The rank follows
        # its launcher, and node 0 follows the rank.
        os.killpg(node1.pgid, signal.SIGKILL)
        statuses = health_until_exit(node0)
        assert _wait_exit(node0, 1) != 0
        assert 503 in statuses, statuses
        _assert_gone(sorted(family))
    finally:
        node0.stop()
        node1.stop()


def test_srun_tasks_serve_like_one_rank_then_a_killed_rank_0_ends_rank_1(model_dir, reference):
    """Rank 1 starts 12 s after rank 0, twice the 4 s collective timeout past rank 0's arrival:
    the rendezvous waits for it (the start-up timeout bounds that wait)."""
    addr = f"127.0.0.1:{free_port()}"
    short = {"TANDEM_DIST_TIMEOUT_S": "4"}
    rank0 = _srun_task(model_dir, 0, addr, **short)
    time.sleep(12)
    rank1 = _srun_task(model_dir, 1, addr, **short)
    try:
        rank0.wait_ready()
        assert served_greedy(rank0, model_dir) == reference
        assert rank1.proc.poll() is None, rank1.log_tail()  # headless: its --port is held
        assert f"srun task 1 of 2 is rank 1 (rendezvous at {addr})" in rank1.log_tail(100_000)
        family = _family(rank0.proc.pid) + _family(rank1.proc.pid)
        os.killpg(rank0.pgid, signal.SIGKILL)
        assert _wait_exit(rank1) != 0
        _assert_gone(sorted(family))
    finally:
        rank0.stop()
        rank1.stop()


def test_launched_ranks_with_different_arguments_stop_naming_them(model_dir):
    addr = f"127.0.0.1:{free_port()}"
    rank0 = _srun_task(model_dir, 0, addr)
    rank1 = _srun_task(model_dir, 1, addr, ("--max-num-seqs", "3"))
    try:
        family = family_until_both_exit(rank0, rank1)
        assert _wait_exit(rank0, 1) != 0
        assert _wait_exit(rank1, 1) != 0
        message = "rank 1 has --max-num-seqs 3, rank 0 has"
        assert message in rank0.log_tail(100_000)
        assert message in rank1.log_tail(100_000)
        _assert_gone(sorted(family))
    finally:
        rank0.stop()
        rank1.stop()
