"""CUDA-graph runner logic: batch-size buckets, key selection, the attention-DP agreement (one
all-gather over two gloo ranks) and the eager fallback; capture and replay through the static
buffers on CPU (``TANDEM_TEST_STATIC_GRAPHS=1``: the CUDA code path minus the graph) for every key
variant, with and without speculation. Real CUDA graphs: ``test_gpu.py``."""

from __future__ import annotations

import multiprocessing
from pathlib import Path
from typing import Any

import pytest
import torch

from graph_checks import (
    GREEDY as GREEDY_PARAMS,
)
from graph_checks import (
    MIXED,
    build_graph_models,
    check_adp_dummy,
    check_variant,
    generation_step,
    method_worker,
    spec_config,
)
from tandem import LLM, SamplingParams
from tandem import cli as tandem_cli
from tandem.engine.config import CUDAGraphConfig, EngineArgs
from tandem.engine.cuda_graph import (
    ADVANCED,
    GREEDY,
    SAMPLED,
    STATIC_GRAPHS_ENV,
    CUDAGraphRunner,
    GraphKey,
    GraphPlan,
    batch_size_buckets,
    dummy_kv_tokens,
    graph_batch_sizes,
    graph_key,
    graph_mode,
    is_generation_request,
    padded_batch_size,
    sampling_variant,
    step_can_graph,
)
from tandem.engine.presets import validate_preset
from tandem.engine.step import RequestStep
from tandem.models.parallel import ParallelMapping
from tandem.server import cli

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


# ------------------------------------------------------------------ capture and replay


def test_graph_batch_sizes_above_max_num_seqs_are_refused(tiny: dict[str, Path]) -> None:
    """They were dropped without a word; now the engine config names them."""
    args = EngineArgs(model=str(tiny["target"]), max_num_seqs=4, cuda_graph_batch_sizes=(1, 8, 16))
    with pytest.raises(ValueError, match=r"cuda_graph_batch_sizes \[8, 16\] exceed max_num_seqs=4"):
        args.create_engine_config()
    ok = EngineArgs(model=str(tiny["target"]), max_num_seqs=4, cuda_graph_batch_sizes=(1, 4))
    assert ok.create_engine_config().graph_config.cuda_graph_batch_sizes == (1, 4)


def test_graph_mode_and_config(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(STATIC_GRAPHS_ENV, raising=False)
    assert graph_mode(CPU, enforce_eager=False) is None  # CPU stays eager by default
    assert graph_mode(torch.device("cuda"), enforce_eager=False) == "cuda"
    assert graph_mode(torch.device("cuda"), enforce_eager=True) is None
    monkeypatch.setenv(STATIC_GRAPHS_ENV, "1")
    assert graph_mode(CPU, enforce_eager=False) == "static"
    assert graph_mode(CPU, enforce_eager=True) is None
    assert graph_batch_sizes(16, None) == batch_size_buckets(16)
    assert graph_batch_sizes(8, (1, 4, 8)) == (1, 4, 8)
    with pytest.raises(ValueError, match="exceed"):
        graph_batch_sizes(6, (1, 4, 8))
    for bad in ((), (2, 1), (1, 1), (0, 2)):
        with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
            CUDAGraphConfig(cuda_graph_batch_sizes=bad)
    # CLI and presets map one to one onto EngineArgs.
    argv = ["serve", "/m", "--enforce-eager", "--cuda-graph-batch-sizes", "1", "2", "8"]
    args = cli.engine_args_from(tandem_cli.build_parser().parse_args(argv))
    assert args.enforce_eager is True and args.cuda_graph_batch_sizes == (1, 2, 8)
    preset = validate_preset({"enforce_eager": True, "cuda_graph_batch_sizes": [1, 4]})
    assert preset == {"enforce_eager": True, "cuda_graph_batch_sizes": (1, 4)}
    with pytest.raises(ValueError, match="cuda_graph_batch_sizes"):
        validate_preset({"cuda_graph_batch_sizes": [4, 2]})
    # Drafts cut short (near max_tokens) do not have the captured shape: eager.
    full = RequestStep("a", [1, 2, 3], 4, [0], True, num_drafts=2)
    short = RequestStep("b", [1, 2], 4, [0], True, num_drafts=1)
    assert step_can_graph([full], 2) and not step_can_graph([full, short], 2)
    assert not step_can_graph([], 2)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return build_graph_models(tmp_path_factory.mktemp("graphs"))


def _worker(tiny: dict[str, Path], method: str, **kw: Any) -> Any:
    return method_worker(tiny, method, **kw)


@pytest.fixture
def static_graphs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(STATIC_GRAPHS_ENV, "1")


@pytest.mark.parametrize(
    "method", ["none", "mtp-eagle", "eagle3", "mtp-vanilla", "eagle3-tree", "mtp-tree"]
)
def test_static_replay_equals_eager_for_every_key(tiny, static_graphs, method: str) -> None:
    """Target forward plus draft loop through the static buffers equal eager execution for
    every bucket (1, 2, and 3 live rows padded to 4) and both sampling variants."""
    worker = _worker(tiny, method)
    graphs = worker.runner.graph_runner
    assert graphs is not None and not graphs.use_cuda
    spec = method != "none"
    check_variant(worker, [GREEDY_PARAMS] * 4, GREEDY)
    check_variant(worker, MIXED, ADVANCED if spec else SAMPLED)


def test_warm_up_captures_every_bucket(tiny, static_graphs) -> None:
    worker = _worker(tiny, "mtp-eagle", batch_sizes=(1, 3, 4))
    runner = worker.runner
    graphs = runner.graph_runner
    assert graphs is not None
    k = runner.k
    assert set(graphs.graphs) == {GraphKey(b, k, v) for b in (1, 3, 4) for v in (GREEDY, ADVANCED)}
    assert runner.graphs is not None and runner.graphs.buckets == (1, 3, 4)
    # The dummy request's reserved blocks hold everything it writes.
    assert len(runner.dummy_block_ids) * runner.block_size >= dummy_kv_tokens(k)
    # One KV token short: capture fails loudly instead of skipping buckets.
    runner.dummy_block_ids = []
    with pytest.raises(ValueError, match="reserved KV slots"):
        graphs.capture_all()
    # Without speculation the variants share one capture per bucket.
    plain = _worker(tiny, "none", batch_sizes=(2,))
    assert plain.runner.graph_runner is not None
    captured = plain.runner.graph_runner.graphs
    assert set(captured) == {GraphKey(2, 0, GREEDY), GraphKey(2, 0, SAMPLED)}
    assert captured[GraphKey(2, 0, GREEDY)].target is captured[GraphKey(2, 0, SAMPLED)].target


def test_variant_is_decided_before_the_key(tiny, static_graphs) -> None:
    """A temperature > 0 batch plans the advanced key; replaying the greedy graph for it is
    refused rather than run against buffers the step never filled."""
    worker = _worker(tiny, "mtp-eagle")
    runner = worker.runner
    step = generation_step(worker, MIXED[:2])
    _, plan = runner.plan_graph(step.requests)
    assert plan.key == GraphKey(2, runner.k, ADVANCED)
    runner.plan_graph(step.requests)
    with pytest.raises(RuntimeError, match="variant must be decided before the graph key"):
        runner.execute(step, scanned=True, key=GraphKey(2, runner.k, GREEDY))


def test_adp_dummy_replays(tiny, static_graphs) -> None:
    check_adp_dummy(_worker(tiny, "mtp-eagle", adp=True))


@pytest.mark.parametrize("method", ["eagle3", "eagle3-tree"])
def test_engine_replays_and_equals_eager(
    tiny, monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """End to end: greedy and seeded-random generation with graphs equal the eager engine's,
    the engine reserves the dummy blocks, and enforce_eager captures nothing."""
    tree = method.endswith("-tree")  # the near-echo pair: tree nodes are accepted
    spec = spec_config(method, tiny["echo_eagle3" if tree else "eagle3"])
    target = tiny["echo" if tree else "target"]
    params = [
        SamplingParams(temperature=0, max_tokens=10, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=10, ignore_eos=True),
    ]
    prompts = [[5, 6, 7], list(range(40, 61)), [100, 101]]
    kw = dict(speculative_config=spec, max_num_seqs=4, max_model_len=64, dtype="float32")
    outs = {}
    for mode in ("eager", "static", "enforce_eager"):
        monkeypatch.setenv(STATIC_GRAPHS_ENV, "0" if mode == "eager" else "1")
        with LLM(str(target), enforce_eager=mode == "enforce_eager", **kw) as llm:
            engine = llm.engine
            graphs = engine.executor.worker.runner.graph_runner
            reserved = engine.executor.num_blocks - engine.block_manager.num_blocks
            if mode == "static":
                assert graphs is not None and reserved == len(graphs.runner.dummy_block_ids)
            else:
                assert graphs is None and reserved == 0
            outs[mode] = [
                [o.outputs[0].token_ids for o in llm.generate(prompts, p)] for p in params
            ]
            if mode == "static":
                assert graphs is not None and graphs.num_replays > 0
                assert engine.get_stats().num_used_kv_blocks == 0
    assert outs["static"] == outs["eager"] == outs["enforce_eager"]
