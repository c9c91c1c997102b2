"""Draft trees (engine/speculative/tree.py): shape checks, top-k expansion and best-node
selection against a plain-Python enumeration, the chain as topk = 1, masks, KV compaction."""

from __future__ import annotations

import itertools

import pytest
import torch

from tandem.engine.speculative.tree import (
    MAX_TREE_ROWS,
    DraftTree,
    build_tree,
    check_tree_shape,
    compaction_slots,
    copy_kv_slots,
    expand_level,
    max_tree_nodes,
    root_frontier,
    select_frontier,
    tree_attention_words,
)


def draft_tree(roots: torch.Tensor, logq: torch.Tensor, depth: int, topk: int, n: int) -> DraftTree:
    """EAGLE-2 drafting with a bigram draft model: logq[t] = log q(. | t), [V, V]."""
    ids, scores = root_frontier(roots.shape[0], roots.device)
    frontier_tokens = roots[:, None]
    levels = []
    for _ in range(depth):
        top_lp, top_tok = logq[frontier_tokens].topk(topk, dim=-1)  # [B, F, topk], best first
        level = expand_level(ids, scores, top_tok, top_lp)
        levels.append(level)
        ids, scores = select_frontier(level, topk)
        frontier_tokens = level.tokens.gather(1, ids)
    return build_tree(levels, n)


def python_tree(root: int, logq: list[list[float]], depth: int, topk: int, n: int) -> list:
    """The same selection, spelled out: [(depth, score, token, parent_path)] sorted by depth
    then rank, where a node is named by its token path from the root."""
    cands = []  # (score, depth, index in level, path)
    frontier = [(0.0, (root,))]
    for d in range(1, depth + 1):
        level = []
        for score, path in frontier:
            row = logq[path[-1]]
            best = sorted(range(len(row)), key=lambda t: -row[t])[:topk]
            level += [(score + min(row[t], 0.0), path + (t,)) for t in best]
        cands += [(s, d, i, path) for i, (s, path) in enumerate(level)]
        frontier = [level[i] for i in sorted(range(len(level)), key=lambda i: -level[i][0])[:topk]]
    kept = sorted(cands, key=lambda c: (-c[0], c[1], c[2]))[:n]
    ranked = sorted(enumerate(kept), key=lambda rc: (rc[1][1], rc[0]))
    return [c for _, c in ranked]


# ---------------------------------------------------------------------------------------------
# Static shape checks
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("k", "topk", "n", "match"),
    [
        (0, 2, 4, "num_speculative_tokens must be an integer >= 1"),
        (3, 0, 4, "topk must be an integer >= 1"),
        (3, 2, 0, "num_draft_tokens must be an integer >= 1"),
        (3, True, 4, "topk must be an integer"),
        (3, 2.0, 4, "topk must be an integer"),
        (4, 2, 3, r"must be >= num_speculative_tokens \(4\)"),
        (3, 2, 11, r"must be <= 10"),  # 2 + 2 * 4
        (3, 1, 4, r"must be <= 3"),  # topk 1: the chain only
        (5, 8, 64, r"must be <= 63"),
    ],
)
def test_bad_tree_shapes_are_rejected(k, topk, n, match):
    with pytest.raises(ValueError, match=match):
        check_tree_shape(k, topk, n)


@pytest.mark.parametrize(("k", "topk", "n"), [(3, 1, 3), (3, 2, 4), (3, 2, 10), (5, 8, 63)])
def test_good_tree_shapes_pass(k, topk, n):
    check_tree_shape(k, topk, n)
    assert max_tree_nodes(k, topk) >= n


# ---------------------------------------------------------------------------------------------
# Construction
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("depth", "topk", "n"), [(3, 2, 4), (3, 2, 10), (4, 3, 12), (2, 4, 20)])
def test_tree_matches_python_enumeration(depth, topk, n):
    v = 9
    gen = torch.Generator().manual_seed(depth * 100 + topk * 10 + n)
    logq = torch.randn(v, v, generator=gen).log_softmax(-1)
    roots = torch.tensor([0, 3, 8, 3])
    tree = draft_tree(roots, logq, depth, topk, n)
    assert tree.tokens.shape == (4, n) and tree.max_depth == depth
    for b, root in enumerate(roots.tolist()):
        expect = python_tree(root, logq.tolist(), depth, topk, n)
        paths = [c[3] for c in expect]
        assert tree.tokens[b].tolist() == [p[-1] for p in paths]
        assert tree.depths[b].tolist() == [c[1] for c in expect]
        torch.testing.assert_close(tree.scores[b], torch.tensor([c[0] for c in expect]))
        # parents: the node whose path is this path minus its last token
        expect_parents = [paths.index(p[:-1]) if len(p) > 2 else -1 for p in paths]
        assert tree.parents[b].tolist() == expect_parents
        for i, j in itertools.product(range(n), repeat=2):
            assert bool(tree.ancestors[b, i, j]) == (paths[i][: len(paths[j])] == paths[j])


def test_tree_is_topological_and_ancestor_closed():
    v, depth, topk, n = 16, 5, 4, 40
    logq = torch.randn(v, v, generator=torch.Generator().manual_seed(1)).log_softmax(-1)
    tree = draft_tree(torch.arange(v), logq, depth, topk, n)
    idx = torch.arange(n)
    assert (tree.parents < idx).all()  # parents first
    assert (tree.depths[:, 1:] >= tree.depths[:, :-1]).all()  # by depth
    has = tree.parents >= 0
    parent_depth = tree.depths.gather(1, tree.parents.clamp_min(0))
    assert torch.equal(torch.where(has, parent_depth + 1, 1), tree.depths)
    parent_score = tree.scores.gather(1, tree.parents.clamp_min(0))
    assert (~has | (parent_score >= tree.scores)).all()


def test_ties_break_by_depth_then_index():
    # A uniform draft: every child of every node scores the same at its depth; with
    # log-probabilities 0 (clamped from +0.5) every candidate ties, and the shallowest,
    # lowest-index ones win, so the kept set is still closed under ancestors.
    v, topk = 6, 2
    for lp in (0.0, 0.5):
        logq = torch.full((v, v), lp)
        tree = draft_tree(torch.tensor([0, 0]), logq, 3, topk, 5)
        assert tree.depths[0].tolist() == [1, 1, 2, 2, 2]
        assert tree.parents[0].tolist() == [-1, -1, 0, 0, 1]
        assert torch.equal(tree.tokens[0], tree.tokens[1])


def test_topk_one_is_the_chain():
    v, k = 10, 4
    logq = torch.randn(v, v, generator=torch.Generator().manual_seed(2)).log_softmax(-1)
    roots = torch.tensor([1, 7, 4])
    tree = draft_tree(roots, logq, k, 1, k)
    chain = [roots]
    for _ in range(k):
        chain.append(logq[chain[-1]].argmax(-1))
    assert torch.equal(tree.tokens, torch.stack(chain[1:], dim=1))
    assert tree.parents.tolist() == [[-1, 0, 1, 2]] * 3
    assert tree.depths.tolist() == [[1, 2, 3, 4]] * 3
    assert torch.equal(tree.ancestors, torch.ones(3, k, k, dtype=torch.bool).tril())
    causal = [(1 << (j + 1)) - 1 for j in range(k + 1)]  # row j sees rows 0..j
    assert tree_attention_words(tree.ancestors).tolist() == [causal] * 3


def test_attention_words_bits():
    logq = torch.randn(8, 8, generator=torch.Generator().manual_seed(3)).log_softmax(-1)
    tree = draft_tree(torch.tensor([2]), logq, 3, 3, 12)
    words = tree_attention_words(tree.ancestors)[0].tolist()
    assert words[0] == 1
    for i in range(12):
        seen = {j for j in range(13) if (words[i + 1] >> j) & 1}
        expect = {0} | {j + 1 for j in range(12) if tree.ancestors[0, i, j]}
        assert seen == expect


def test_attention_words_use_all_64_bits():
    n = MAX_TREE_ROWS - 1  # a 63-node chain: the last row sets bit 63 (the sign bit)
    anc = torch.ones(1, n, n, dtype=torch.bool).tril()
    words = tree_attention_words(anc)[0]
    assert int(words[-1]) == -1  # all 64 bits
    assert int(words[-2]) == (1 << 63) - 1
    with pytest.raises(ValueError, match="mask bits"):
        tree_attention_words(torch.ones(1, n + 1, n + 1, dtype=torch.bool))


def test_shape_mismatch_is_rejected():
    ids, scores = root_frontier(2, torch.device("cpu"))
    with pytest.raises(ValueError, match="must be \\[B, F\\]"):
        expand_level(ids, scores, torch.zeros(2, 3, 2, dtype=torch.long), torch.zeros(2, 3, 2))
    level = expand_level(ids, scores, torch.zeros(2, 1, 2, dtype=torch.long), torch.zeros(2, 1, 2))
    with pytest.raises(ValueError, match="num_draft_tokens"):
        build_tree([level], 3)


# ---------------------------------------------------------------------------------------------
# KV compaction
# ---------------------------------------------------------------------------------------------


def test_compaction_moves_the_accepted_path_into_chain_positions():
    block_size, heads, dim = 4, 2, 3
    num_blocks = 12
    gen = torch.Generator().manual_seed(4)
    cache = torch.randn(num_blocks, block_size, heads, dim, generator=gen)
    before = cache.clone()
    # Two requests, shuffled blocks; tree rows start at positions 6 and 3 (root there).
    tables = torch.tensor([[5, 2, 9, 0], [7, 11, 3, 1]])
    tree_start = torch.tensor([6, 3])
    path = torch.tensor([[1, 4, 6], [0, -1, -1]])  # request 1: one node accepted, already home
    num_accepted = torch.tensor([3, 1])
    src, dst = compaction_slots(tables, tree_start, path, num_accepted, block_size)

    def slot(b: int, pos: int) -> int:
        return int(tables[b, pos // block_size]) * block_size + pos % block_size

    copy_kv_slots(cache, src, dst)
    flat, old = cache.flatten(0, 1), before.flatten(0, 1)
    for d, node in enumerate([1, 4, 6]):  # depth d's node -> position 6 + 1 + d
        assert torch.equal(flat[slot(0, 7 + d)], old[slot(0, 7 + node)])
    assert torch.equal(flat[slot(1, 4)], old[slot(1, 4)])
    moved = {slot(0, 7 + d) for d in range(3)}
    for s in range(flat.shape[0]):  # nothing else changed
        if s not in moved:
            assert torch.equal(flat[s], old[s])
    assert (src == dst).sum() == 3  # the stay-put entries copy onto themselves


def test_no_host_reads():
    """CUDA-graph ready: every building block runs on fake tensors (shapes only), which refuse
    anything that reads a value back to the host (.item(), .tolist(), bool(), nonzero)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from tandem.engine.speculative.tree_accept import accept_tree_greedy, accept_tree_sampling

    b, v, depth, topk, n = 4, 32, 3, 2, 6
    with FakeTensorMode():
        ids, scores = root_frontier(b, torch.device("cpu"))
        levels = []
        for _ in range(depth):
            f = ids.shape[1]
            tokens = torch.zeros(b, f, topk, dtype=torch.long)
            level = expand_level(ids, scores, tokens, torch.zeros(b, f, topk))
            levels.append(level)
            ids, scores = select_frontier(level, topk)
        tree = build_tree(levels, n)
        tree_attention_words(tree.ancestors)
        out = accept_tree_greedy(tree, torch.zeros(b, n + 1, dtype=torch.long))
        p, uniform, noise = torch.rand(b, n + 1, v), torch.rand(b, n), torch.rand(b, v)
        accept_tree_sampling(tree, p, uniform, noise)
        accept_tree_sampling(tree, p, uniform, noise, q=torch.rand(b, n + 1, v))
        tables = torch.zeros(b, 8, dtype=torch.long)
        src, dst = compaction_slots(tables, torch.zeros(b, dtype=torch.long), out.path,
                                    out.num_accepted, 4)  # fmt: skip
        copy_kv_slots(torch.zeros(10, 4, 2, 8), src, dst)
