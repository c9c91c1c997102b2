"""CUDA-graph runner logic: batch-size buckets, key selection, the attention-DP agreement (one
all-gather over two gloo ranks) and the eager fallback."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from engine.cuda_graph import (
    ADVANCED,
    GREEDY,
    SAMPLED,
    CUDAGraphRunner,
    GraphKey,
    GraphPlan,
    batch_size_buckets,
    graph_key,
    is_generation_request,
    padded_batch_size,
    sampling_variant,
)
from models.parallel import ParallelMapping

CPU = torch.device("cpu")


def test_buckets_and_padding() -> None:
    assert batch_size_buckets(1) == (1,)
    assert batch_size_buckets(3) == (1, 2, 3)
    assert batch_size_buckets(8) == (1, 2, 4, 8)
    assert batch_size_buckets(20) == (1, 2, 4, 8, 16, 20)
    buckets = batch_size_buckets(32)
    assert buckets == (1, 2, 4, 8, 16, 24, 32)
    assert [padded_batch_size(b, buckets) for b in (1, 2, 3, 5, 8, 9, 17, 32)] == [
        1,
        2,
        4,
        8,
        8,
        16,
        24,
        32,
    ]
    assert padded_batch_size(33, buckets) is None
    with pytest.raises(ValueError, match="max_batch_size"):
        batch_size_buckets(0)


def test_key_selection() -> None:
    buckets = batch_size_buckets(16)
    assert graph_key(3, 2, ADVANCED, buckets) == GraphKey(4, 2, ADVANCED)
    assert graph_key(3, 2, GREEDY, buckets) != graph_key(3, 2, ADVANCED, buckets)
    assert graph_key(3, 1, GREEDY, buckets) != graph_key(3, 2, GREEDY, buckets)
    assert graph_key(17, 2, GREEDY, buckets) is None  # too large: eager
    # The variant: drafts sampled only on the advanced path; without drafts, greedy or sampled.
    assert sampling_variant(3, advanced=True, all_greedy=False) == ADVANCED
    assert sampling_variant(3, advanced=False, all_greedy=False) == GREEDY
    assert sampling_variant(0, advanced=False, all_greedy=True) == GREEDY
    assert sampling_variant(0, advanced=False, all_greedy=False) == SAMPLED
    # Generation requests only: one verified token plus its drafts, sampled.
    assert is_generation_request(4, 3, True)
    assert not is_generation_request(5, 3, True)  # a prefill chunk
    assert not is_generation_request(1, 0, False)


def test_single_rank_plan_and_eager_fallback() -> None:
    runner = CUDAGraphRunner(8, 2, ParallelMapping(), CPU, enabled=True)
    assert runner.plan(True, 3, GREEDY) == GraphPlan(GraphKey(4, 2, GREEDY), 1)
    assert runner.plan(True, 8, ADVANCED) == GraphPlan(GraphKey(8, 2, ADVANCED), 0)
    assert runner.plan(False, 3, GREEDY) == GraphPlan(None, 0)  # a context request
    assert runner.plan(True, 9, GREEDY) == GraphPlan(None, 0)  # past the largest bucket
    off = CUDAGraphRunner(8, 2, ParallelMapping(), CPU, enabled=False)
    assert off.plan(True, 3, GREEDY) == GraphPlan(None, 0)


# Per rank: (can_graph, batch_size) for each consecutive plan() call.
CASES = [
    [(True, 1), (True, 3)],  # both graph: pad to the bucket of the max (4)
    [(True, 5), (True, 0)],  # an idle rank (dummies only) pads to the other's bucket (8)
    [(False, 2), (True, 2)],  # rank 0 has a prefill: both eager
    [(True, 9), (True, 1)],  # past the largest bucket: both eager
]


def _rank(rank: int, store_path: str, queue: Any) -> None:
    import torch.distributed as dist

    dist.init_process_group(
        "gloo", rank=rank, world_size=2, init_method=f"file://{store_path}", timeout=_timeout()
    )
    mapping = ParallelMapping(tp_size=2, tp_rank=rank, enable_attention_dp=True)
    runner = CUDAGraphRunner(8, 3, mapping, CPU, enabled=True)
    plans = [runner.plan(*case[rank], GREEDY) for case in CASES]
    queue.put((rank, plans))
    dist.destroy_process_group()


def _timeout() -> Any:
    from datetime import timedelta

    return timedelta(seconds=30)


@pytest.mark.timeout(90)
def test_adp_agreement_over_two_ranks(tmp_path: Path) -> None:
    ctx = multiprocessing.get_context("spawn")
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_rank, args=(r, str(tmp_path / "store"), queue), daemon=True)
        for r in range(2)
    ]
    for p in procs:
        p.start()
    try:
        results = dict(queue.get(timeout=60) for _ in procs)
    finally:
        for p in procs:
            p.join(10)
            if p.is_alive():
                p.kill()
                p.join()
    assert all(p.exitcode == 0 for p in procs)
    expected = [
        (GraphKey(4, 3, GREEDY), (3, 1)),
        (GraphKey(8, 3, GREEDY), (3, 8)),
        (None, (0, 0)),
        (None, (0, 0)),
    ]
    for i, (key, padding) in enumerate(expected):
        for rank in range(2):
            assert results[rank][i] == GraphPlan(key, padding[rank]), (i, rank)
