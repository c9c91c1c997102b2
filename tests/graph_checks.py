"""Replay-versus-eager checks of the graph runner, shared by the CPU tests (static buffers, no
graph) and the GPU tests (real CUDA graphs).

A check prefills a few requests eagerly, then runs one generation step (one token plus K drafts
per request) twice on the same rank: eagerly and through the captured key, from the same RNG
state and the same stored draft probabilities. Both write the same KV slots with the same
values, so the two runs see the same cache.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tandem import EngineArgs, SamplingParams
from tandem.engine.cuda_graph import GraphKey
from tandem.engine.step import DPStepInput, RequestStep, StepInput, StepOutput
from tandem.engine.worker import Worker
from tandem.models.parallel import ParallelMapping

PROMPTS = [[5, 6, 7], list(range(40, 61)), [100, 101], list(range(120, 131))]
GREEDY = SamplingParams(temperature=0.0, max_tokens=64, logprobs=2)
# Random rows with every sampling stage, a greedy row and a seeded row in one batch.
MIXED = [
    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=64, logprobs=2),
    SamplingParams(temperature=0.0, max_tokens=64, logprobs=2),
    SamplingParams(temperature=1.0, top_k=20, min_p=0.05, seed=3, max_tokens=64),
    SamplingParams(temperature=0.7, max_tokens=64),
]


def spec_config(method: str, draft: Path | None) -> dict[str, Any] | None:
    if method == "none":
        return None
    if method == "eagle3":
        return {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    if method == "mtp-vanilla":
        return {"method": "mtp", "mtp_mode": "vanilla", "num_speculative_tokens": 2}
    if method == "eagle3-tree":  # depth 2, 2 children per node, 4 nodes verified
        tree = {"topk": 2, "num_draft_tokens": 4}
        return {**tree, "method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    if method == "mtp-tree":  # depth 3, 4 children per node, 8 nodes verified
        return {"method": "mtp", "num_speculative_tokens": 3, "topk": 4, "num_draft_tokens": 8}
    return {"method": "mtp", "num_speculative_tokens": 2}


def make_worker(
    target: Path,
    spec: dict[str, Any] | None,
    device: str,
    batch_sizes: tuple[int, ...] = (1, 2, 4),
    adp: bool = False,
) -> Worker:
    args = EngineArgs(
        model=str(target),
        device=device,
        dtype="float32",
        max_model_len=64,
        max_num_seqs=max(batch_sizes),
        num_kv_blocks=40,
        speculative_config=spec,
        cuda_graph_batch_sizes=batch_sizes,
    )
    mapping = ParallelMapping(enable_attention_dp=adp)
    return Worker(args.create_engine_config(), mapping=mapping)


def build_graph_models(root: Path) -> dict[str, Path]:
    """The tiny checkpoints the graph checks run: a 2-layer target with one MTP layer, a copy
    with two (vanilla MTP) and an Eagle3 head with a 160-token draft vocabulary; for draft
    trees a near-echo target with a near-perfect MTP layer and Eagle3 head (tree nodes are
    accepted, so their rows' positions and tree mask matter)."""
    import shutil

    from checkpoints import (
        add_mtp_layers,
        build_eagle3_draft,
        build_llama,
        make_echo_target,
        perfect_eagle3_draft,
    )

    # One KV head (two query heads): the checks run the attention kernels through Triton's
    # interpreter, whose cost grows with the programs launched (one per sequence and KV head).
    target = build_llama(root / "target", layers=2, heads=2, kv_heads=1)
    add_mtp_layers(target, 1)
    vanilla = root / "vanilla"
    shutil.copytree(target, vanilla)
    add_mtp_layers(vanilla, 2, seed=5)
    echo = build_llama(root / "echo", layers=2, heads=2, kv_heads=1, seed=5)
    make_echo_target(echo, residual_scale=0.3)
    add_mtp_layers(echo, 1, perfect=True)
    return {
        "target": target,
        "vanilla": vanilla,
        "eagle3": build_eagle3_draft(root / "eagle3", target, draft_vocab=160),
        "echo": echo,
        "echo_eagle3": perfect_eagle3_draft(root / "echo_eagle3", echo, residual_scale=0.3),
    }


def method_worker(models: dict[str, Path], method: str, **kw: Any) -> Worker:
    """A CPU worker for ``method`` (none, mtp-eagle, eagle3, mtp-vanilla, eagle3-tree,
    mtp-tree) on ``models``."""
    if method.endswith("-tree"):
        return make_worker(models["echo"], spec_config(method, models["echo_eagle3"]), "cpu", **kw)
    target = models["vanilla" if method == "mtp-vanilla" else "target"]
    return make_worker(target, spec_config(method, models["eagle3"]), "cpu", **kw)


def _blocks(i: int, worker: Worker) -> list[int]:
    per = -(-(64 + 2 * worker.runner.k) // worker.runner.block_size)
    return list(range(i * per, (i + 1) * per))


def request_step(
    worker: Worker,
    rid: str,
    tokens: list[int],
    start: int,
    i: int,
    params: SamplingParams,
    **kw: Any,
) -> RequestStep:
    """Request ``i``'s step on its blocks (in the window group too, for a model with
    sliding-window layers: the same block numbers in that pool)."""
    blocks = _blocks(i, worker)
    window = list(blocks) if worker.window is not None else []
    return RequestStep(rid, tokens, start, blocks, True, params, window_block_ids=window, **kw)


def generation_step(worker: Worker, params: list[SamplingParams]) -> StepInput:
    """Prefill ``len(params)`` requests eagerly, then their first generation step (the last
    sampled token plus the K drafts the prefill proposed)."""
    runner = worker.runner
    ids = [f"g{i}" for i in range(len(params))]
    prefill = StepInput(
        [request_step(worker, rid, PROMPTS[i], 0, i, params[i]) for i, rid in enumerate(ids)]
    )
    out = runner.execute(prefill)
    steps = []
    for i, rid in enumerate(ids):
        drafts = out.draft_token_ids[i] if runner.k else []
        tokens = [out.token_ids[i][-1], *drafts]
        steps.append(
            request_step(worker, rid, tokens, len(PROMPTS[i]), i, params[i], num_drafts=len(drafts))
        )
    return StepInput(steps)


def _reset(
    worker: Worker, step: StepInput, q: dict[str, torch.Tensor], shapes: dict[str, Any]
) -> None:
    """The same random state for both runs: RNG, per-request generators, stored q (and draft
    trees' shapes)."""
    runner = worker.runner
    torch.manual_seed(1234)
    runner.generators.clear()
    if runner.spec is not None:
        runner.spec.forget([r.request_id for r in step.requests])
        runner.spec.draft_q.update({k: v.clone() for k, v in q.items()})
        if shapes:
            runner.spec.shapes.update(shapes)


def replay_and_eager(
    worker: Worker, step: StepInput, adp: bool = False
) -> tuple[StepOutput, StepOutput, GraphKey, dict[str, Any]]:
    """(eager output, replayed output, the key, stored q after each run and the tree shapes
    before them) of the padded step;
    ``adp``: with the per-rank counts attention DP passes (one rank)."""
    runner, graphs = worker.runner, worker.runner.graph_runner
    assert graphs is not None
    spec = runner.spec
    q0 = {} if spec is None else {k: v.clone() for k, v in spec.draft_q.items()}
    shapes0 = dict(getattr(spec, "shapes", {}))  # draft trees: the shapes being verified
    _, plan = runner.plan_graph(step.requests)  # sampling path, then the key
    assert plan.key is not None, "a generation-only step within the buckets must graph"
    padded = runner.pad_generation(step, plan.num_padding)
    ids = [r.request_id for r in padded.requests]
    counts = None
    if adp:
        counts = ([sum(len(r.token_ids) for r in padded.requests)], [len(padded.requests)])
    _reset(worker, padded, q0, shapes0)
    eager = runner.execute(padded, counts, scanned=True)
    q_eager = {} if spec is None else {r: spec.draft_q[r].clone() for r in ids if r in spec.draft_q}
    shapes_eager = _shapes(spec, ids)
    runner.plan_graph(step.requests)  # the replay's own scan, as a step would do
    _reset(worker, padded, q0, shapes0)
    before = graphs.num_replays
    graphed = runner.execute(padded, counts, scanned=True, key=plan.key)
    assert graphs.num_replays == before + 1, "the step ran eagerly instead of replaying"
    q_graph = {} if spec is None else {r: spec.draft_q[r].clone() for r in ids if r in spec.draft_q}
    # Draft trees: the next trees' shapes (parents, depths, attention words) agree too.
    assert _shapes(spec, ids) == shapes_eager
    return eager, graphed, plan.key, {"eager": q_eager, "graph": q_graph, "shapes": shapes0}


def _shapes(spec: Any, ids: list[str]) -> dict[str, list[list[int]]]:
    shapes = getattr(spec, "shapes", {})
    return {r: [t.tolist() for t in shapes[r]] for r in ids if r in shapes}


def assert_same(eager: StepOutput, graphed: StepOutput, atol: float = 1e-5) -> None:
    assert graphed.request_ids == eager.request_ids
    assert graphed.token_ids == eager.token_ids
    assert graphed.num_drafts == eager.num_drafts
    assert graphed.draft_token_ids == eager.draft_token_ids
    for a, b in zip(eager.logprobs, graphed.logprobs, strict=True):
        assert (a is None) == (b is None)
        for x, y in zip(a or [], b or [], strict=True):
            assert x.token_id == y.token_id and x.top_token_ids == y.top_token_ids
            assert abs(x.logprob - y.logprob) <= atol, (x, y)


def check_variant(worker: Worker, params: list[SamplingParams], expected_variant: str) -> None:
    """Every live batch size of the buckets (1, 2, 3 → 4 with a padding row): replay equals
    eager on every row, q included; under greedy the live rows also equal an unpadded eager
    run (padding rows do not leak into live rows)."""
    for n in (1, 2, 3):
        step = generation_step(worker, params[:n])
        eager, graphed, key, q = replay_and_eager(worker, step)
        assert key.variant == expected_variant and key.draft_len == worker.runner.k
        assert key.batch_size == {1: 1, 2: 2, 3: 4}[n]
        assert len(graphed.request_ids) == key.batch_size  # padding rows ran too
        assert_same(eager, graphed)
        assert q["eager"].keys() == q["graph"].keys()
        for rid, qe in q["eager"].items():
            torch.testing.assert_close(q["graph"][rid], qe, atol=1e-5, rtol=1e-5)
        if all(p.temperature == 0 for p in params[:n]):
            _reset(worker, step, {}, q["shapes"])
            alone = worker.runner.execute(step)
            assert graphed.token_ids[:n] == alone.token_ids
            assert graphed.draft_token_ids[:n] == alone.draft_token_ids


def check_adp_dummy(worker: Worker) -> None:
    """Attention DP on one rank: a batch holding the idle-rank dummy replays with the counts
    baked into the graph, and the dummy never reaches the output."""
    runner = worker.runner
    step = generation_step(worker, [GREEDY])
    padded_live = StepInput([*step.requests, runner.dummy_step(-1)])
    eager, graphed, key, _ = replay_and_eager(worker, padded_live, adp=True)
    assert key.batch_size == 2
    assert_same(eager, graphed)
    out = runner.execute_dp(DPStepInput([step]))
    assert out.request_ids == ["g0"]
    assert out.rank_paths and out.rank_paths[0][1] is not None
    assert out.token_ids == graphed.token_ids[:1]
