"""Draft trees end to end (issue #35): greedy exactness, a perfect draft's full depth, the
draft's trees against a reference, seeded sampling, and what is refused."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints import build_eagle3_draft, build_llama, make_echo_target, perfect_eagle3_draft
from tandem import LLM, SamplingParams
from tandem.engine.speculative.tree import max_tree_nodes

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
    params = SamplingParams(temperature=0, max_tokens=1 + steps * (k + 1), ignore_eos=True)
    spec = {
        "method": "eagle3",
        "model": str(head),
        "num_speculative_tokens": k,
        "topk": topk,
        "num_draft_tokens": n,
    }
    with LLM(str(target), dtype="float32", speculative_config=spec, max_num_seqs=4) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.get_stats()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == [prompt[-1]] * params.max_tokens  # the echo
    assert stats.spec_num_drafts == steps * len(prompts), stats
    assert stats.spec_num_accepted_tokens == k * stats.spec_num_drafts
    assert stats.spec_accepted_per_pos == [stats.spec_num_drafts] * k


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
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
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
