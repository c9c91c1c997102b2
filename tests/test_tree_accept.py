"""Tree acceptance (engine/speculative/tree_accept.py) is lossless.

A Markov target over a tiny vocabulary (next-token distribution P[t], processed by the engine's
own ``probs_for_rows`` at T in {0.7, 1.3} with top-k / top-p) and a different Markov draft. The
first two emitted tokens of tree speculation must be distributed as P[root, t1] * P[t1, t2]:
exactly (the rule enumerated in plain Python) and empirically (the tensor functions, two-sample
chi-square against plain sampling, 20,000 samples each). Deliberately broken rules fail both.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency
from test_spec_tree import draft_tree

from tandem.engine.sampler import RowSamplingInfo, SamplingTensors, probs_for_rows
from tandem.engine.speculative import tree_accept
from tandem.engine.speculative.tree import DraftTree, ancestor_mask
from tandem.engine.speculative.tree_accept import accept_tree_greedy, accept_tree_sampling
from tandem.kernels.spec_decode import accept_matching_reference, rejection_sample_reference

V = 8
N_SAMPLES = 20_000
ROOT = 3
SETTINGS = {"T0.7-k6-p0.9": (0.7, 6, 0.9), "T1.3-k5-p0.95": (1.3, 5, 0.95)}


def target_probs(temperature: float, top_k: int, top_p: float, seed: int = 0) -> torch.Tensor:
    """P [V, V]: row t is the processed target distribution after token t."""
    logits = 2.0 * torch.randn(V, V, generator=torch.Generator().manual_seed(seed))
    row = RowSamplingInfo(
        temperature=temperature, top_k=top_k, top_p=top_p, min_p=0.0, presence_penalty=0.0,
        frequency_penalty=0.0, repetition_penalty=1.0, prompt_token_ids=[], output_token_ids=[],
        generator=None, num_logprobs=0,
    )  # fmt: skip
    st = SamplingTensors.from_params([row] * V, V, torch.device("cpu"))
    p = probs_for_rows(logits, st).double()
    return p / p.sum(dim=1, keepdim=True)  # rows sum to 1 in float64: exact checks at 1e-12


def draft_logq(seed: int = 1) -> torch.Tensor:
    return (1.5 * torch.randn(V, V, generator=torch.Generator().manual_seed(seed))).log_softmax(-1)


def children_of(tree: DraftTree, b: int = 0) -> dict[int, list[tuple[int, int]]]:
    """node (-1: root) -> [(child node, token)] in node order."""
    kids: dict[int, list[tuple[int, int]]] = {-1: []}
    pairs = zip(tree.parents[b].tolist(), tree.tokens[b].tolist(), strict=True)
    for i, (parent, tok) in enumerate(pairs):
        kids.setdefault(parent, []).append((i, tok))
        kids.setdefault(i, [])
    return kids


# ---------------------------------------------------------------------------------------------
# The rules in plain Python: exact output distributions
# ---------------------------------------------------------------------------------------------


def _norm(d: list[float], fallback: list[float], renormalize: bool = True) -> list[float]:
    mass = sum(d)
    if mass <= 0:
        return fallback
    return [x / mass for x in d] if renormalize else d


def outcomes(r: list[float], kids: list[tuple[int, int]], s: list[float] | None = None,
             wrong: str = "") -> list[tuple[float, int, int | None]]:  # fmt: skip
    """[(probability, emitted token, accepted child node or None)] of one node's step."""
    res, stay = [], 1.0
    for node, x in kids:
        if s is None:
            a = r[x]
        elif wrong == "p_not_ratio":
            a = r[x]
        else:
            a = min(1.0, r[x] / s[x]) if s[x] > 0 else 0.0
        res.append((stay * a, x, node))
        stay *= 1.0 - a
        renorm = wrong != "no_renormalize"
        if s is None:
            r = _norm([0.0 if t == x else y for t, y in enumerate(r)], r, renorm)
        else:
            r = _norm([max(y - z, 0.0) for y, z in zip(r, s, strict=True)], r, renorm)
            s = _norm([0.0 if t == x else y for t, y in enumerate(s)], [0.0] * V)
    res += [(stay * r[t] / sum(r), t, None) for t in range(V)]  # the final draw
    return res


def exact_first_two_topk(
    p: torch.Tensor, logq: torch.Tensor, shape: tuple, wrong: str = ""
) -> np.ndarray:
    """Top-k trees (deterministic children): P(t1, t2) of the first two emitted tokens."""
    depth, topk, n = shape
    P = p.tolist()

    def kids_at(root: int) -> dict:
        return children_of(draft_tree(torch.tensor([root]), logq, depth, topk, n))

    out = np.zeros((V, V))
    root_kids = kids_at(ROOT)
    for pr, t1, node in outcomes(P[ROOT], root_kids[-1], wrong=wrong):
        if node is not None:  # the walk goes on at node t1 in the same step
            nxt = outcomes(P[t1], root_kids[node], wrong=wrong)
        else:  # the step ended: the next step drafts a fresh tree at t1
            nxt = outcomes(P[t1], kids_at(t1)[-1], wrong=wrong)
        for pr2, t2, _ in nxt:
            out[t1, t2] += pr * pr2
    return out


def draws_without_replacement(s: list[float], m: int) -> list[tuple[float, tuple[int, ...]]]:
    """[(probability, ordered tuple)] of m sequential draws without replacement from s."""
    res = []
    for seq in itertools.permutations(range(V), m):
        pr, left = 1.0, 1.0
        for x in seq:
            pr *= s[x] / left if left > 0 else 0.0
            left -= s[x]
        if pr > 0:
            res.append((pr, seq))
    return res


def exact_first_two_sampled(
    p: torch.Tensor, q: torch.Tensor, m: int, wrong: str = ""
) -> np.ndarray:
    """Depth-2 trees, m siblings drawn without replacement from q at every node."""
    P, Q = p.tolist(), q.tolist()
    out = np.zeros((V, V))
    for w1, kids1 in draws_without_replacement(Q[ROOT], m):
        first = outcomes(P[ROOT], list(enumerate(kids1)), Q[ROOT], wrong)
        for pr, t1, _ in first:
            if pr == 0:
                continue
            for w2, kids2 in draws_without_replacement(Q[t1], m):
                nxt = outcomes(P[t1], list(enumerate(kids2)), Q[t1], wrong)
                for pr2, t2, _ in nxt:
                    out[t1, t2] += w1 * pr * w2 * pr2
    return out


def expected_first_two(p: torch.Tensor) -> np.ndarray:
    P = p.numpy()
    return P[ROOT][:, None] * P


TOPK_SHAPES = [(3, 2, 5), (3, 3, 9), (2, 4, 8)]


@pytest.mark.parametrize("shape", TOPK_SHAPES)
@pytest.mark.parametrize("setting", list(SETTINGS))
def test_topk_rule_is_exact(setting, shape):
    p = target_probs(*SETTINGS[setting])
    exact = exact_first_two_topk(p, draft_logq(), shape)
    np.testing.assert_allclose(exact, expected_first_two(p), atol=1e-12)


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_rule_is_exact(setting):
    p = target_probs(*SETTINGS[setting])
    q = draft_logq().double().exp()
    q = q / q.sum(dim=1, keepdim=True)
    exact = exact_first_two_sampled(p, q, 2)
    np.testing.assert_allclose(exact, expected_first_two(p), atol=1e-12)


@pytest.mark.parametrize(
    ("rule", "wrong"),
    [("topk", "no_renormalize"), ("sampled", "no_renormalize"), ("sampled", "p_not_ratio")],
)
def test_exact_check_rejects_wrong_rules(rule, wrong):
    p = target_probs(*SETTINGS["T1.3-k5-p0.95"])
    if rule == "topk":
        exact = exact_first_two_topk(p, draft_logq(), (3, 3, 9), wrong)
    else:
        exact = exact_first_two_sampled(p, draft_logq().exp().double(), 2, wrong)
    assert np.abs(exact - expected_first_two(p)).max() > 1e-3


# ---------------------------------------------------------------------------------------------
# The tensor functions: two-sample chi-square against plain sampling
# ---------------------------------------------------------------------------------------------


def _uniform_noise(gen: torch.Generator, b: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    uniform = torch.rand(b, n, generator=gen)
    noise = torch.empty(b, V).exponential_(generator=gen)
    return uniform, noise


def _rows(p: torch.Tensor, roots: torch.Tensor, tree: DraftTree) -> torch.Tensor:
    """[B, N + 1, V]: the target's distribution after the root and after each node."""
    return p[torch.cat([roots[:, None], tree.tokens], dim=1)].float()


def speculate_topk(p: torch.Tensor, logq: torch.Tensor, shape: tuple, seed: int) -> np.ndarray:
    """First two emitted tokens of N_SAMPLES streams from ROOT, top-k tree speculation."""
    gen = torch.Generator().manual_seed(seed)
    depth, topk, n = shape
    roots = torch.full((N_SAMPLES,), ROOT)
    tree = draft_tree(roots, logq, depth, topk, n)
    out = accept_tree_sampling(tree, _rows(p, roots, tree), *_uniform_noise(gen, N_SAMPLES, n))
    t1, t2 = out.tokens[:, 0], out.tokens[:, 1]
    # Streams that emitted one token run a second step from it.
    tree2 = draft_tree(t1, logq, depth, topk, n)
    out2 = accept_tree_sampling(tree2, _rows(p, t1, tree2), *_uniform_noise(gen, N_SAMPLES, n))
    t2 = torch.where(out.num_accepted > 0, t2, out2.tokens[:, 0])
    return (t1 * V + t2).numpy()


def speculate_sampled(p: torch.Tensor, q: torch.Tensor, m: int, seed: int) -> np.ndarray:
    """The same with depth-2 trees whose m siblings are drawn without replacement from q."""
    gen = torch.Generator().manual_seed(seed)

    def step(roots: torch.Tensor) -> tree_accept.TreeAcceptance:
        b = roots.shape[0]

        def draw(ctx: torch.Tensor) -> torch.Tensor:  # Gumbel-top-m: an ordered draw
            gumbel = -torch.empty(b, V).exponential_(generator=gen).log()
            return (q[ctx].log() + gumbel).topk(m, dim=1).indices  # [B, m], draw order

        first = draw(roots)
        second = [draw(first[:, j]) for j in range(m)]
        tokens = torch.cat([first, *second], dim=1)  # depth 1, then each child's children
        parents = torch.tensor([-1] * m + [j for j in range(m) for _ in range(m)])
        parents = parents.expand(b, -1).contiguous()
        n = tokens.shape[1]
        tree = DraftTree(tokens, parents, (parents >= 0).long() + 1, torch.zeros(b, n),
                         ancestor_mask(parents, 2), 2)  # fmt: skip
        ctx = torch.cat([roots[:, None], tokens], dim=1)
        return accept_tree_sampling(tree, p[ctx].float(), *_uniform_noise(gen, b, n), q[ctx])

    roots = torch.full((N_SAMPLES,), ROOT)
    out = step(roots)
    t1 = out.tokens[:, 0]
    t2 = torch.where(out.num_accepted > 0, out.tokens[:, 1], step(t1).tokens[:, 0])
    return (t1 * V + t2).numpy()


def plain(p: torch.Tensor, seed: int) -> np.ndarray:
    gen = torch.Generator().manual_seed(seed)
    t1 = torch.multinomial(p[ROOT].float(), N_SAMPLES, replacement=True, generator=gen)
    t2 = torch.multinomial(p[t1].float(), 1, generator=gen).squeeze(1)
    return (t1 * V + t2).numpy()


def p_value(a: np.ndarray, b: np.ndarray) -> float:
    table = np.array([np.bincount(a, minlength=V * V), np.bincount(b, minlength=V * V)])
    return float(chi2_contingency(table[:, table.sum(0) > 0])[1])


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_topk_trees_sample_like_the_target(setting):
    p = target_probs(*SETTINGS[setting])
    spec = speculate_topk(p, draft_logq(), (3, 3, 9), seed=5)
    assert p_value(spec, plain(p, seed=6)) > 0.01


@pytest.mark.parametrize("setting", list(SETTINGS))
def test_sampled_trees_sample_like_the_target(setting):
    p = target_probs(*SETTINGS[setting])
    q = draft_logq().exp()
    spec = speculate_sampled(p, q, 2, seed=7)
    assert p_value(spec, plain(p, seed=8)) > 0.01


def _no_renormalize(dist: torch.Tensor, fallback: torch.Tensor) -> torch.Tensor:
    mass = dist.sum(dim=1, keepdim=True)
    return torch.where(mass > 0, dist, fallback)


def _p_not_ratio(r_x: torch.Tensor, s_x: torch.Tensor) -> torch.Tensor:
    return r_x


def _mass_not_renormalized(
    u: torch.Tensor, p_x: torch.Tensor, rejected: torch.Tensor
) -> torch.Tensor:
    return u < p_x  # p(x), not p(x) / (1 - mass of the rejected siblings)


@pytest.mark.parametrize(
    ("rule", "helper", "broken"),
    [
        ("topk", "_accepts_point_mass", _mass_not_renormalized),
        ("sampled", "_normalize", _no_renormalize),
        ("sampled", "_acceptance_probability", _p_not_ratio),
    ],
)
def test_chi_square_rejects_wrong_rules(monkeypatch, rule, helper, broken):
    p = target_probs(*SETTINGS["T1.3-k5-p0.95"])
    monkeypatch.setattr(tree_accept, helper, broken)
    if rule == "topk":
        spec = speculate_topk(p, draft_logq(), (3, 3, 9), seed=5)
    else:
        spec = speculate_sampled(p, draft_logq().exp(), 2, seed=7)
    assert p_value(spec, plain(p, seed=6)) < 0.01


# ---------------------------------------------------------------------------------------------
# Greedy, perfect drafts, the chain
# ---------------------------------------------------------------------------------------------


def python_greedy(tree: DraftTree, target: list[list[int]]) -> list[tuple[list[int], int]]:
    res = []
    for b in range(tree.tokens.shape[0]):
        kids, cur, path = children_of(tree, b), -1, []
        while True:
            want = target[b][cur + 1]
            nxt = [node for node, tok in kids[cur] if tok == want]
            if not nxt:
                break
            cur = nxt[0]
            path.append(cur)
        res.append((path, target[b][cur + 1]))
    return res


def test_greedy_walk_matches_python():
    gen = torch.Generator().manual_seed(3)
    logq = draft_logq(4)
    roots = torch.randint(0, V, (64,), generator=gen)
    tree = draft_tree(roots, logq, 4, 3, 12)
    # Target tokens that often agree with the draft's best children, sometimes not.
    best = logq.argmax(-1)[torch.cat([roots[:, None], tree.tokens], dim=1)]
    other = torch.randint(0, V, best.shape, generator=gen)
    target = torch.where(torch.rand(best.shape, generator=gen) < 0.7, best, other)
    out = accept_tree_greedy(tree, target)
    for b, (path, bonus) in enumerate(python_greedy(tree, target.tolist())):
        a = len(path)
        assert int(out.num_accepted[b]) == a
        assert out.path[b].tolist() == path + [-1] * (4 - a)
        assert out.tokens[b, :a].tolist() == tree.tokens[b, path].tolist()
        assert int(out.tokens[b, a]) == bonus
    assert 0 < out.num_accepted.float().mean() < 4  # both acceptance and rejection happen


def test_greedy_duplicate_siblings_take_the_first():
    parents = torch.tensor([[-1, -1, 0, 1]])
    tree = DraftTree(torch.tensor([[5, 5, 2, 2]]), parents, torch.tensor([[1, 1, 2, 2]]),
                     torch.zeros(1, 4), ancestor_mask(parents, 2), 2)  # fmt: skip
    out = accept_tree_greedy(tree, torch.tensor([[5, 2, 2, 7, 7]]))
    assert out.path.tolist() == [[0, 2]] and out.tokens.tolist() == [[5, 2, 7]]


def python_walk(tree: DraftTree, p: list, u: list, noise: list, b: int) -> tuple[list[int], int]:
    """The deterministic-children rule, one node at a time: (accepted path, final token)."""
    kids, cur, path = children_of(tree, b), -1, []
    while True:
        r, rejected, excluded, nxt = p[b][cur + 1], 0.0, set(), None
        for node, x in kids[cur]:
            r_x = 0.0 if x in excluded else r[x]
            if u[b][node] * (1.0 - rejected) < r_x:
                nxt = node
                break
            rejected += r_x
            excluded.add(x)
        if nxt is None:
            race = [0.0 if t in excluded else r[t] / noise[b][t] for t in range(V)]
            return path, max(range(V), key=lambda t: race[t])
        cur = nxt
        path.append(cur)


def test_topk_rule_matches_the_walk_sample_by_sample():
    gen = torch.Generator().manual_seed(12)
    b, (depth, topk, n) = 512, (4, 3, 14)
    logq = draft_logq(13)
    roots = torch.randint(0, V, (b,), generator=gen)
    tree = draft_tree(roots, logq, depth, topk, n)
    p = _rows(target_probs(1.3, 0, 1.0, seed=14), roots, tree)
    uniform, noise = _uniform_noise(gen, b, n)
    out = accept_tree_sampling(tree, p, uniform, noise)
    lists = p.tolist(), uniform.tolist(), noise.tolist()
    for i in range(b):
        path, final = python_walk(tree, *lists, i)
        a = len(path)
        assert out.path[i].tolist() == path + [-1] * (depth - a)
        assert out.tokens[i, : a + 1].tolist() == tree.tokens[i, path].tolist() + [final]
    assert 0 < out.num_accepted.float().mean() < depth


def test_repeated_sibling_token_is_never_accepted():
    # Two children with the same token: once the first is rejected, the token has no target
    # mass left, so the second can never be accepted (it would double-count p(5)).
    parents = torch.tensor([[-1, -1]]).expand(4096, 2)
    tree = DraftTree(torch.tensor([[5, 5]]).expand(4096, 2), parents,
                     torch.ones(4096, 2, dtype=torch.long), torch.zeros(4096, 2),
                     ancestor_mask(parents, 1), 1)  # fmt: skip
    p = torch.full((4096, 3, V), 1.0 / V)
    out = accept_tree_sampling(tree, p, *_uniform_noise(torch.Generator().manual_seed(2), 4096, 2))
    assert (out.path[:, 0] != 1).all()
    assert 0.05 < (out.path[:, 0] == 0).float().mean() < 0.2  # p(5) = 1/8
    assert (out.tokens[out.num_accepted == 0, 0] != 5).all()  # the residual draw excludes 5


def test_sampling_with_one_hot_target_is_greedy():
    gen = torch.Generator().manual_seed(5)
    logq = draft_logq(4)
    roots = torch.randint(0, V, (64,), generator=gen)
    tree = draft_tree(roots, logq, 3, 2, 6)
    target = torch.randint(0, V, (64, 7), generator=gen)
    target = torch.where(torch.rand(64, 7, generator=gen) < 0.6, logq.argmax(-1)[
        torch.cat([roots[:, None], tree.tokens], dim=1)], target)  # fmt: skip
    p = torch.nn.functional.one_hot(target, V).float()
    sampled = accept_tree_sampling(tree, p, *_uniform_noise(gen, 64, 6))
    greedy = accept_tree_greedy(tree, target)
    for a, b in zip(sampled, greedy, strict=True):
        assert torch.equal(a, b)


@pytest.mark.parametrize(("depth", "topk", "n"), [(4, 1, 4), (4, 2, 6), (5, 3, 15)])
def test_perfect_draft_accepts_the_full_depth(depth, topk, n):
    # The target's next token is the draft's best guess (and the draft is confident, so the
    # best path is in the tree): every step accepts `depth` nodes.
    gen = torch.Generator().manual_seed(6)
    nxt = torch.randperm(V, generator=gen)
    logq = torch.full((V, V), 0.02 / (V - 1)).scatter_(1, nxt[:, None], 0.98).log()
    roots = torch.randint(0, V, (32,), generator=gen)
    tree = draft_tree(roots, logq, depth, topk, n)
    ctx = torch.cat([roots[:, None], tree.tokens], dim=1)
    greedy = accept_tree_greedy(tree, nxt[ctx])
    p = torch.nn.functional.one_hot(nxt[ctx], V).float()
    sampled = accept_tree_sampling(tree, p, *_uniform_noise(gen, 32, n))
    for out in (greedy, sampled):
        assert (out.num_accepted == depth).all()
        chain = [roots]
        for _ in range(depth + 1):
            chain.append(nxt[chain[-1]])
        assert torch.equal(out.tokens, torch.stack(chain[1:], dim=1))


def test_topk_one_equals_the_chain_verifier():
    gen = torch.Generator().manual_seed(8)
    k, b = 4, 256
    logq = draft_logq(9)
    roots = torch.randint(0, V, (b,), generator=gen)
    tree = draft_tree(roots, logq, k, 1, k)
    drafts = tree.tokens
    num_drafts = torch.full((b,), k)
    # Greedy: the chain's argmax acceptance.
    target = torch.randint(0, V, (b, k + 1), generator=gen)
    target = torch.where(torch.rand(b, k + 1, generator=gen) < 0.6,
                         logq.argmax(-1)[torch.cat([roots[:, None], drafts], 1)], target)  # fmt: skip
    num, tokens = accept_matching_reference(target, drafts, num_drafts)
    out = accept_tree_greedy(tree, target)
    assert torch.equal(out.num_accepted, num) and torch.equal(out.path, tree_path(num, k))
    assert torch.equal(_emitted(out.tokens, num), _emitted(tokens, num))
    # Sampling: the chain's rejection sampling with one-hot q (argmax drafts).
    p = target_probs(1.3, 0, 1.0)[torch.cat([roots[:, None], drafts], 1)].float()
    q = torch.nn.functional.one_hot(drafts, V).float()
    uniform, noise = _uniform_noise(gen, b, k)
    num, tokens = rejection_sample_reference(
        p, q, drafts, num_drafts, uniform, noise[:, None].expand(b, k + 1, V)
    )
    out = accept_tree_sampling(tree, p, uniform, noise)
    assert torch.equal(out.num_accepted, num)
    assert torch.equal(_emitted(out.tokens, num), _emitted(tokens, num))
    assert 0 < num.float().mean() < k


def tree_path(num: torch.Tensor, k: int) -> torch.Tensor:
    idx = torch.arange(k)[None, :]
    return torch.where(idx < num[:, None], idx, -1)


def _emitted(tokens: torch.Tensor, num: torch.Tensor) -> torch.Tensor:
    idx = torch.arange(tokens.shape[1])[None, :]
    return torch.where(idx <= num[:, None], tokens, -1)


def test_bad_shapes_are_rejected():
    tree = draft_tree(torch.tensor([1, 2]), draft_logq(), 2, 2, 4)
    with pytest.raises(ValueError, match="target_tokens must be"):
        accept_tree_greedy(tree, torch.zeros(2, 4, dtype=torch.long))
    p = torch.full((2, 5, V), 1.0 / V)
    with pytest.raises(ValueError, match="uniform must be"):
        accept_tree_sampling(tree, p, torch.zeros(2, 5), torch.ones(2, V))
    with pytest.raises(ValueError, match="residual_noise must be"):
        accept_tree_sampling(tree, p, torch.zeros(2, 4), torch.ones(2, 5, V))
    with pytest.raises(ValueError, match="q must be shaped like p"):
        accept_tree_sampling(tree, p, torch.zeros(2, 4), torch.ones(2, V), q=p[:, :4])
