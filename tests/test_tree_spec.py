"""Draft trees end to end (issue #35): greedy exactness, a perfect draft's full depth, the
draft's trees against a reference, seeded sampling, and what is refused."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from checkpoints import (
    _read_state,
    _write_state,
    build_eagle3_draft,
    build_llama,
    make_echo_target,
    perfect_eagle3_draft,
)
from tandem import LLM, SamplingParams
from tandem.engine.speculative.tree import max_tree_nodes
from tandem.engine.structured_output import StructuredSpec

# The 50-token prompt runs in chunks under a 16-token budget (chunked prefill next to decodes).
PROMPTS = [[5, 6, 7], list(range(40, 90)), [100, 101], list(range(120, 139))]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tree")
    target = build_llama(root / "target", layers=4)
    draft = build_eagle3_draft(root / "eagle3", target, draft_vocab=160)
    return {"target": target, "eagle3": draft}


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _tree(models: dict[str, Path], topk: int, n: int, k: int = 3) -> dict:
    return {
        "method": "eagle3",
        "model": str(models["eagle3"]),
        "num_speculative_tokens": k,
        "topk": topk,
        "num_draft_tokens": n,
    }


@pytest.fixture(scope="module")
def baseline(models: dict[str, Path]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    with LLM(str(models["target"])) as llm:
        return _tokens(llm.generate(PROMPTS, params))


@pytest.mark.parametrize(("topk", "n"), [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_greedy_tree_speculation_is_exact(models, baseline, topk: int, n: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    spec = _tree(models, topk, n)
    with LLM(str(models["target"]), speculative_config=spec, max_num_batched_tokens=16) as llm:
        outs = llm.generate(PROMPTS, params)
        assert _tokens(outs) == baseline
        assert all(o.spec_stats.num_drafts > 0 for o in outs)
        stats = llm.engine.get_stats()
        # Whole trees, or their first nodes where max_tokens leaves less room.
        assert stats.spec_num_drafts < stats.spec_num_draft_tokens <= n * stats.spec_num_drafts
        assert stats.num_used_kv_blocks == 0


@pytest.mark.parametrize(("topk", "k"), [(2, 3), (4, 2)])
def test_perfect_draft_accepts_the_full_depth(tmp_path: Path, topk: int, k: int) -> None:
    """An echo target and a head built to match it: with every candidate verified (the most
    nodes the shape allows, so the head's top-1 path is always in the tree), every step
    accepts all k depths: k + 1 tokens per step."""
    target = build_llama(tmp_path / "echo", layers=4, seed=5)
    make_echo_target(target)
    head = perfect_eagle3_draft(tmp_path / "head", target)
    n = max_tree_nodes(k, topk)
    prompts = [[5, 6, 7], list(range(40, 59)), [100], list(range(60, 97))]
    steps = 4
    # Room for `steps` whole trees (the last steps verify only the nodes max_tokens leaves).
    max_tokens = 1 + steps * (k + 1) + n
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    spec = {
        "method": "eagle3",
        "model": str(head),
        "num_speculative_tokens": k,
        "topk": topk,
        "num_draft_tokens": n,
    }
    with LLM(str(target), dtype="float32", speculative_config=spec, max_num_seqs=4) as llm:
        engine = llm.engine
        reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        full = 0
        while engine.has_unfinished_requests():
            before = {r.request_id: (len(r.output_token_ids), len(r.spec_token_ids)) for r in reqs}
            for out in engine.step():
                done, drafts = before[out.request_id]
                new = len(out.outputs[0].token_ids) - done
                if drafts == n:  # a whole tree (near max_tokens only its first nodes fit)
                    assert new == k + 1, (out.request_id, new)
                    full += 1
    for prompt, r in zip(prompts, reqs, strict=True):
        assert r.output_token_ids == [prompt[-1]] * params.max_tokens  # the echo
    assert full >= steps * len(prompts)


def _top1_path(tokens: list[int], parents: list[int]) -> list[int]:
    """The head's greedy chain inside a tree, as deep as the tree keeps it: from the root,
    each node's first child (nodes are ranked best first within a depth, so a node's first
    child is its top-1; a node left off the frontier has no children)."""
    path, cur = [], -1
    while cur in parents:
        cur = parents.index(cur)
        path.append(tokens[cur])
    return path


def _first_drafts(llm: LLM, prompts: list[list[int]]) -> dict[str, tuple[list[int], list[int]]]:
    """Each request's drafts after its prefill step, and the tree's parents (trees only)."""
    engine = llm.engine
    spec = engine.executor.worker.runner.spec
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)  # no room limits
    reqs = {f"r{i}": engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)}
    first: dict[str, tuple[list[int], list[int]]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            rid = out.request_id
            if rid not in first and reqs[rid].spec_token_ids:
                shape = getattr(spec, "shapes", {}).get(rid)
                parents = [] if shape is None else shape[0].tolist()
                first[rid] = (list(reqs[rid].spec_token_ids), parents)
    return first


def test_random_head_tree_contains_the_chain_drafts(models, tmp_path: Path) -> None:
    """Draft side with a random head whose attention writes are amplified (so what a frontier
    row attends to decides its children): the top-1 path through each request's first tree
    equals the chain decoder's drafts from the same state (a wrong draft tree mask, position or
    parent hidden state changes depth 2 or 3)."""
    k, topk = 3, 2
    head = tmp_path / "loud"
    shutil.copytree(models["eagle3"], head)
    state = _read_state(head)
    state["midlayer.self_attn.o_proj.weight"] *= 30.0
    _write_state(head, state)
    chain = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    tree = {**chain, "topk": topk, "num_draft_tokens": max_tree_nodes(k, topk)}
    with LLM(str(models["target"]), speculative_config=chain) as llm:
        chain_first = _first_drafts(llm, PROMPTS)
    with LLM(str(models["target"]), speculative_config=tree) as llm:
        tree_first = _first_drafts(llm, PROMPTS)
    depths = []
    for rid, (drafts, _) in chain_first.items():
        tokens, parents = tree_first[rid]
        path = _top1_path(tokens, parents)
        assert len(path) >= 2 and path == drafts[: len(path)], (rid, path, drafts)
        depths.append(len(path))
    assert k in depths  # some first tree keeps the whole chain (all four do today)


def test_tree_contains_the_chain_drafts(tmp_path: Path) -> None:
    """Draft side: the head's top-1 path through the tree is exactly the chain decoder's drafts
    from the same state (a near-perfect head whose attention and MLP matter, so a wrong tree
    mask, position or frontier hidden state changes the deeper drafts); and over whole runs
    the tree accepts at least as many tokens per step as the chain."""
    target = build_llama(tmp_path / "echo", layers=4, seed=5)
    make_echo_target(target, residual_scale=0.3)
    head = perfect_eagle3_draft(tmp_path / "head", target, residual_scale=0.3)
    k, topk = 3, 2
    prompts = [[5, 6, 7], list(range(40, 59)), [100], list(range(60, 97))]
    chain = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    tree = {**chain, "topk": topk, "num_draft_tokens": max_tree_nodes(k, topk)}
    with LLM(str(target), dtype="float32", speculative_config=chain) as llm:
        chain_first = _first_drafts(llm, prompts)
        params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
        chain_out = _tokens(llm.generate(prompts, params))
        chain_accepted = llm.engine.get_stats().spec_num_accepted_tokens
    with LLM(str(target), dtype="float32", speculative_config=tree) as llm:
        tree_first = _first_drafts(llm, prompts)
        tree_out = _tokens(llm.generate(prompts, params))
        stats = llm.engine.get_stats()
    assert tree_out == chain_out
    depths = []
    for rid, (drafts, _) in chain_first.items():
        tokens, parents = tree_first[rid]
        assert len(tokens) == max_tree_nodes(k, topk) and len(parents) == len(tokens)
        path = _top1_path(tokens, parents)
        assert len(path) >= 2 and path == drafts[: len(path)], rid
        depths.append(len(path))
    assert k in depths  # some tree keeps the whole chain
    # Same output tokens with no more verification steps than the chain.
    assert stats.spec_num_accepted_tokens >= chain_accepted


@pytest.fixture(scope="module")
def near_echo(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("near_echo")
    target = build_llama(root / "echo", layers=4, seed=5)
    make_echo_target(target, residual_scale=0.3)
    return target, perfect_eagle3_draft(root / "head", target, residual_scale=0.3)


@pytest.mark.parametrize("rejection", [True, False], ids=["rejection", "strict"])
def test_seeded_sampling_with_trees(near_echo: tuple[Path, Path], rejection: bool) -> None:
    """Seeded sampling through trees (point-mass rejection sampling, or strict acceptance):
    every request completes, the same seeds give the same tokens, and tree nodes are accepted."""
    target, head = near_echo
    spec = {
        "method": "eagle3",
        "model": str(head),
        "num_speculative_tokens": 3,
        "topk": 2,
        "num_draft_tokens": 6,
        "use_rejection_sampling": rejection,
    }
    prompts = [[5, 6, 7], list(range(40, 59)), [100], list(range(60, 97))]
    params = [
        SamplingParams(temperature=t, top_p=0.9, max_tokens=20, ignore_eos=True, seed=s)
        for s, t in ((1, 0.7), (2, 1.3), (3, 0.0), (4, 1.0))
    ]
    with LLM(str(target), dtype="float32", speculative_config=spec) as llm:
        first = _tokens(llm.generate(prompts, params))
        again = _tokens(llm.generate(prompts, params))
        stats = llm.engine.get_stats()
    assert first == again
    assert all(len(t) == 20 for t in first)
    # The near-echo target samples from flat distributions: some nodes are accepted, not most.
    assert stats.spec_num_accepted_tokens > 0
    assert stats.spec_num_draft_tokens <= 6 * stats.spec_num_drafts


def test_tree_configuration_errors(models) -> None:
    t = str(models["target"])
    base = {"method": "eagle3", "model": str(models["eagle3"]), "num_speculative_tokens": 3}
    for extra, why in (
        ({"topk": 2}, "num_draft_tokens is required"),
        ({"topk": 0, "num_draft_tokens": 4}, "topk must be an integer >= 1"),
        ({"topk": 2, "num_draft_tokens": 2}, r"must be >= num_speculative_tokens"),
        ({"topk": 2, "num_draft_tokens": 11}, r"must be <= 10"),
        ({"topk": 1, "num_draft_tokens": 4}, r"must be <= 3"),
        ({"topk": 2, "num_draft_tokens": 4, "draft_quantization": "int8"}, "draft_quantization"),
        ({"topk": 2, "num_draft_tokens": 4, "disable_by_batch_size": 4}, "disable_by_batch_size"),
    ):
        with pytest.raises(ValueError, match=why):
            LLM(t, speculative_config={**base, **extra})
    with pytest.raises(ValueError, match="does not support method 'mtp'"):
        LLM(t, speculative_config={"method": "mtp", "topk": 2, "num_draft_tokens": 4})
    tree = {**base, "topk": 2, "num_draft_tokens": 4}
    with pytest.raises(ValueError, match="tensor parallelism"):
        LLM(t, speculative_config=tree, tensor_parallel_size=2)
    with pytest.raises(ValueError, match="attention data parallelism"):
        LLM(t, speculative_config=tree, enable_attention_dp=True)
    with LLM(t, speculative_config=tree) as llm:
        with pytest.raises(ValueError, match="not supported with draft trees"):
            llm.generate([[1, 2]], SamplingParams(structured=StructuredSpec("regex", "a+")))
