"""Suffix decoding (issue #46, item 2): the proposals equal a brute-force reference over the text
and the cached outputs (unit, and after every engine step), the output cache keeps its bound,
the tree shapes travel to the ranks intact, point-mass tree acceptance is lossless, and greedy
output equals plain decoding for several tree sizes with chunked prefill, under preemption and
prefix caching, stop tokens and strings, n = 2, penalties and a bias, a grammar, the static
graph path, TP = 2 and attention DP = 2; the configuration is checked. The sampled
distribution: tests/test_rejection_sampling.py."""

from __future__ import annotations

import json
import math
import random
import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from checkpoints import build_llama, make_echo_target
from tandem import LLM, SamplingParams
from tandem.engine.speculative.suffix import OutputCache, SuffixProposer, SuffixTrie
from tandem.engine.speculative.suffix_decoder import tree_rows
from tandem.engine.speculative.tree import DraftTree, ancestor_mask, tree_attention_words
from tandem.engine.speculative.tree_accept import accept_tree_sampling
from tandem.engine.structured_output import StructuredSpec

# Prompts that repeat themselves, one that does not, and a long one (chunked under a budget).
PROMPTS = [
    [5, 6, 7, 8, 9] * 4,
    list(range(40, 64)) + list(range(40, 52)),
    [100, 101, 102, 100, 101],
    [7, 3, 9],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def suffix(k: int = 4, **kw: Any) -> dict[str, Any]:
    return {"method": "suffix", "num_speculative_tokens": k, **kw}


# ------------------------------------------------------------------ the reference


def _ends(sources: list[list[int]], s: list[int], followed: bool) -> list[tuple[int, int]]:
    """(source, end) of every occurrence of ``s``; ``followed``: only those with a token after."""
    n = len(s)
    return [
        (i, e)
        for i, src in enumerate(sources)
        for e in range(n, len(src) + 1)
        if src[e - n : e] == s and (not followed or e < len(src))
    ]


def _grow(sources: list[list[int]], w: list[int], depth: int, nodes: int, min_p: float) -> tuple:
    """Every continuation of ``w`` at most ``depth`` deep with its probability (the product of
    count / followed-count ratios), the best ``nodes`` by (-p, depth, tokens), ordered by depth
    then rank: (tokens, parents, probabilities)."""
    found: list[tuple[tuple[int, ...], float]] = []
    frontier: list[tuple[tuple[int, ...], float]] = [((), 1.0)]
    while frontier:
        path, p = frontier.pop()
        if len(path) >= depth:
            continue
        ctx = w + list(path)
        followed = _ends(sources, ctx, followed=True)
        for c in sorted({sources[i][e] for i, e in followed}):
            q = p * (len(_ends(sources, [*ctx, c], followed=False)) / len(followed))
            if q >= min_p:
                found.append(((*path, c), q))
                frontier.append(((*path, c), q))
    ranked = sorted(found, key=lambda x: (-x[1], len(x[0]), x[0]))[:nodes]
    order = sorted(range(len(ranked)), key=lambda r: (len(ranked[r][0]), r))
    paths = [ranked[r][0] for r in order]
    parents = [paths.index(p[:-1]) if len(p) > 1 else -1 for p in paths]
    return [p[-1] for p in paths], parents, [ranked[r][1] for r in order]


def reference(text: list[int], outputs: list[list[int]], depth: int, cfg: dict) -> tuple:
    """The proposal for ``text`` with ``outputs`` cached, from scratch: (tokens, parents,
    which: "own" / "cached" / None)."""
    depth = min(depth, cfg["max_depth"])
    best: tuple = ([], [], [])
    which = None
    if depth < 1:
        return [], [], None
    lm = cfg["max_match_length"]
    for name, sources, longest in (
        ("own", [text], min(lm, len(text) - 1)),
        ("cached", outputs, min(lm, len(text))),
    ):
        for n in range(longest, 0, -1):
            if _ends(sources, text[-n:], followed=True):
                break
        else:
            continue
        d = min(depth, math.floor(cfg["spec_factor"] * n))
        tree = _grow(sources, text[-n:], d, cfg["max_nodes"], cfg["min_probability"])
        if sum(tree[2]) > sum(best[2]):
            best, which = tree, name
    return best[0], best[1], which


def _trie_dump(trie: SuffixTrie) -> dict[tuple[int, ...], tuple[int, int]]:
    out: dict[tuple[int, ...], tuple[int, int]] = {}
    stack = [((), trie.root)]
    while stack:
        path, node = stack.pop()
        out[path] = (node.count, node.out)
        for tok, child in (node.children or {}).items():
            stack.append(((*path, tok), child))
    return out


# ------------------------------------------------------------------ the index (pure Python)

CONFIGS = [
    dict(max_depth=3, max_nodes=6, min_probability=0.1, spec_factor=1.0, max_match_length=4),
    dict(max_depth=5, max_nodes=16, min_probability=0.0, spec_factor=2.0, max_match_length=2),
    dict(max_depth=4, max_nodes=3, min_probability=0.3, spec_factor=0.5, max_match_length=6),
    dict(max_depth=1, max_nodes=1, min_probability=0.2, spec_factor=1.0, max_match_length=1),
]


@pytest.mark.parametrize("cfg", CONFIGS)
def test_proposals_equal_reference(cfg: dict) -> None:
    """Random texts arriving a few tokens at a time (as under speculation); finished requests'
    outputs feed the cache (the last two kept). Every proposal equals the brute force."""
    rng = random.Random(str(cfg))
    proposer = SuffixProposer(**cfg, max_cached_requests=2)
    cached: list[list[int]] = []
    seen = {"own": 0, "cached": 0}
    for r in range(6):
        vocab = rng.choice((2, 3, 5))
        prompt = [rng.randrange(vocab) for _ in range(rng.randint(1, 30))]
        text = list(prompt)
        while len(text) < 90:
            text += [rng.randrange(vocab) for _ in range(rng.randint(1, 5))]
            depth = rng.randint(0, cfg["max_depth"] + 1)  # the room left may cut the tree
            tree = proposer.propose(f"r{r}", text, depth)
            tokens, parents, which = reference(text, cached, depth, cfg)
            assert (tree.tokens, tree.parents) == (tokens, parents), (r, len(text), depth)
            assert len(tokens) <= cfg["max_nodes"]
            seen[which or "own"] += bool(tokens)
        proposer.finish(f"r{r}", text[len(prompt) :])
        cached = (cached + [text[len(prompt) :]])[-2:]
    assert seen["own"] > 10 and seen["cached"] > 0  # both sources won proposals
    assert not proposer.indexes  # finished requests' indexes are gone


def test_trees_adapt_to_the_match() -> None:
    """A long match whose continuation never varied drafts a full-depth chain; one token of
    match drafts one level (spec factor 1); an ambiguous continuation branches, and below the
    minimum probability drafts nothing."""
    cfg = dict(max_depth=5, max_nodes=8, min_probability=0.3, spec_factor=1.0, max_match_length=8)
    p = SuffixProposer(**cfg, max_cached_requests=0)
    text = [1, 2, 3, 4, 5, 6, 7, 8, 9] * 2 + [1, 2, 3, 4, 5]
    tree = p.propose("a", text, 5)
    assert (tree.tokens, tree.parents) == ([6, 7, 8, 9, 1], [-1, 0, 1, 2, 3])
    assert tree.probabilities == [1.0] * 5
    assert p.propose("b", [3, 1, 4, 1], 5).tokens == [4]  # "1" matched: one level deep
    tree = p.propose("c", [7, 1, 2, 8, 1, 3, 9, 1, 2, 5, 1], 5)  # "1" before 2, 3 and 2
    assert (tree.tokens, tree.parents, tree.probabilities) == ([2, 3], [-1, -1], [2 / 3, 1 / 3])
    assert p.propose("d", [1, 2, 1, 3, 1, 4, 1, 5, 1], 5).tokens == []  # each 1/4 < 0.3


def test_cached_outputs_propose_for_new_requests() -> None:
    """A request's text that never repeated itself drafts from a finished request's output:
    the longest suffix found there with a token after it ("4 1 2" only ends that output, so
    "1 2" matches). Past the bound, the oldest output no longer proposes."""
    cfg = dict(max_depth=3, max_nodes=4, min_probability=0.1, spec_factor=1.0, max_match_length=4)
    p = SuffixProposer(**cfg, max_cached_requests=1)
    p.finish("done", [1, 2, 7, 4, 1, 2])
    tree = p.propose("new", [4, 1, 2], 3)
    assert (tree.tokens, tree.parents) == ([7, 4], [-1, 0])
    p.finish("other", [3, 3])
    assert p.propose("new", [4, 1, 2, 5], 3).tokens == []  # "5" was never seen anywhere
    assert p.propose("late", [9, 1, 2], 3).tokens == []  # the first output was evicted


def test_output_cache_keeps_the_last_requests() -> None:
    rng = random.Random(7)
    outputs = [[rng.randrange(4) for _ in range(rng.randint(1, 40))] for _ in range(7)]
    cache = OutputCache(3, max_match_length=3, max_depth=2)
    for i, out in enumerate(outputs):
        cache.add(out)
        fresh = SuffixTrie(5)
        for kept in outputs[max(0, i - 2) : i + 1]:
            fresh.add(kept)
        # Exactly the last three: evicted outputs leave no count and no empty node behind.
        assert _trie_dump(cache.trie) == _trie_dump(fresh)
        assert len(cache.outputs) == min(i + 1, 3)
    assert cache.trie.num_nodes() == fresh.num_nodes() > 0
    off = OutputCache(0, max_match_length=3, max_depth=2)
    off.add(outputs[0])
    assert off.trie.num_nodes() == 0 and off.match(outputs[0][:3]) is None


def test_tree_rows_match_the_tree_masks() -> None:
    """The ranks' host-built shapes equal the tree module's masks; a malformed tree is
    refused."""
    rng = random.Random(3)
    for n in (1, 5, 63):
        parents: list[int] = []
        for i in range(rng.randint(1, n)):
            parents.append(rng.randrange(-1, i))
        got_p, got_d, got_w = tree_rows(parents, n, max_depth=n)
        want_p = torch.tensor([parents + [-1] * (n - len(parents))])
        want_w = tree_attention_words(ancestor_mask(want_p, n))[0]
        assert got_p == want_p[0].tolist() and got_w == want_w.tolist()
        assert all(d == (1 if p < 0 else got_d[p] + 1) for p, d in zip(got_p, got_d, strict=True))
    with pytest.raises(ValueError, match="parents come first"):
        tree_rows([-1, 1], 4, 4)
    with pytest.raises(ValueError, match="3 deep"):
        tree_rows([-1, 0, 1], 4, 2)


def test_point_mass_tree_acceptance_is_lossless() -> None:
    """Suffix drafts are deterministic: ``accept_tree_sampling`` with q = None tries each child
    x with probability r(x) and otherwise draws from r without it. The first emitted token is
    distributed as the target's first row, and the token after an accepted node as the target
    after that node (a repeated sibling, as graph padding adds, changes nothing). A rule that
    accepts every draft fails the same test."""
    gen = torch.Generator().manual_seed(0)
    v, b = 6, 200_000
    tokens = torch.tensor([[1, 4, 1, 2]])  # node 2 repeats node 0; node 3 is node 0's child
    parents = torch.tensor([[-1, -1, -1, 0]])
    ancestors = ancestor_mask(parents, 2)
    tree = DraftTree(
        tokens=tokens.expand(b, 4),
        parents=parents.expand(b, 4),
        depths=torch.tensor([[1, 1, 1, 2]]).expand(b, 4),
        scores=torch.zeros(b, 4),
        ancestors=ancestors.expand(b, 4, 4),
        max_depth=2,
    )
    p = torch.softmax(torch.randn(5, v, generator=gen) * 1.5, dim=-1)  # rows: root, nodes 0-3
    uniform = torch.rand(b, 4, generator=gen)
    noise = torch.empty(b, v).exponential_(generator=gen)
    acc = accept_tree_sampling(tree, p.expand(b, 5, v), uniform, noise)

    def p_value(sample: torch.Tensor, probs: torch.Tensor) -> float:
        counts = np.bincount(sample.numpy(), minlength=v)
        expected = probs.double().numpy()
        expected = expected / expected.sum() * len(sample)
        keep = expected > 0
        assert counts[~keep].sum() == 0
        return float(chisquare(counts[keep], expected[keep])[1])

    first = acc.tokens[:, 0]
    assert p_value(first, p[0]) > 0.001
    after_node0 = acc.num_accepted >= 1
    after_node0 &= acc.path[:, 0] == 0
    assert p_value(acc.tokens[after_node0, 1], p[1]) > 0.001
    after_node1 = (acc.num_accepted == 1) & (acc.path[:, 0] == 1)
    assert p_value(acc.tokens[after_node1, 1], p[2]) > 0.001
    assert not (acc.path == 2).any()  # the repeated sibling is never accepted
    # Power: accepting every first child puts all the mass on token 1.
    wrong = accept_tree_sampling(tree, p.expand(b, 5, v), torch.zeros(b, 4), noise)
    assert p_value(wrong.tokens[:, 0], p[0]) < 1e-6


# ------------------------------------------------------------------ end to end


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("suffix") / "m", layers=2)


@pytest.fixture(scope="module")
def baseline(model: Path) -> list[list[int]]:
    with LLM(str(model)) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def test_trees_after_every_step_equal_reference(model: Path, baseline: list[list[int]]) -> None:
    """Verification would hide a wrong tree: after every step each request's tree is checked
    against the reference on its text and the outputs cached so far (cut to the room left). A
    second wave's prompts start like the first wave's outputs: the cache proposes for them."""
    k = 4
    cfg = dict(max_depth=k, max_nodes=8, min_probability=0.05, spec_factor=1.0)
    cfg["max_match_length"] = 6
    spec = suffix(
        k,
        suffix_max_tree_nodes=8,
        suffix_min_probability=0.05,
        suffix_max_match_length=6,
        suffix_max_cached_requests=3,
    )
    with LLM(str(model), speculative_config=spec, max_num_batched_tokens=16) as llm:
        engine = llm.engine
        cached: list[list[int]] = []
        checked = {"own": 0, "cached": 0}
        waves = [PROMPTS, [b[:6] for b in baseline]]
        for w, prompts in enumerate(waves):
            reqs = {
                f"{w}-{i}": engine.add_request(f"{w}-{i}", p, GREEDY) for i, p in enumerate(prompts)
            }
            while engine.has_unfinished_requests():
                for out in engine.step():
                    r = reqs[out.request_id]
                    if out.finished:
                        cached = (cached + [r.output_token_ids])[-3:]
                        continue
                    room = min(k, GREEDY.max_tokens - r.num_output_tokens - 1)
                    want = reference(r.all_token_ids, cached, room, cfg)
                    assert (r.spec_token_ids, r.spec_parents) == want[:2], out.request_id
                    if want[2]:
                        checked[want[2]] += 1
            if w == 0:
                assert [r.output_token_ids for r in reqs.values()] == baseline
        assert checked["own"] > 10 and checked["cached"] > 3, checked
        assert engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize(("k", "nodes", "min_p"), [(1, 1, 0.1), (3, 8, 0.1), (6, 24, 0.0)])
def test_greedy_suffix_is_exact(model: Path, baseline: list[list[int]], k, nodes, min_p) -> None:
    """Twice: the second time the cached outputs propose the very continuations, so whole
    trees are accepted (a wrong tree mask or position would change the tokens)."""
    spec = suffix(k, suffix_max_tree_nodes=nodes, suffix_min_probability=min_p)
    with LLM(str(model), speculative_config=spec, max_num_batched_tokens=16) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        stats = llm.engine.spec_stats
        assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
        first = (stats.accepted_per_pos + [0] * k)[k - 1]
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        assert (stats.accepted_per_pos + [0] * k)[k - 1] > first, stats  # full depth accepted
        assert llm.engine.get_stats().num_used_kv_blocks == 0
        # No draft model: no draft KV, nothing loaded beside the target.
        assert llm.engine.executor.worker.runner.spec.draft is None


def test_preemption_prefix_cache_stops_and_n(model: Path, baseline: list[list[int]]) -> None:
    spec = suffix(3, suffix_max_tree_nodes=6)
    with LLM(str(model), speculative_config=spec, num_kv_blocks=12, max_model_len=96) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        assert llm.engine.get_stats().num_preemptions > 0
        hits = llm.engine.get_stats().prefix_cache_hits
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline  # and the cache proposes
        assert llm.engine.get_stats().prefix_cache_hits > hits
        ref = baseline[0]
        for max_tokens in (1, 2, 7):  # cut mid-tree
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            assert tokens(llm.generate([PROMPTS[0]], params)) == [ref[:max_tokens]]
        stop_tok = ref[9]
        (out,) = llm.generate(
            [PROMPTS[0]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[stop_tok])
        )
        assert out.outputs[0].token_ids == ref[: ref.index(stop_tok) + 1]
        text = llm.tokenizer.decode(ref, skip_special_tokens=True)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip()
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop)
        (out,) = llm.generate([PROMPTS[0]], params)
        assert out.outputs[0].text == text[: text.index(stop)]
        two = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, n=2)
        (out,) = llm.generate([PROMPTS[1]], two)
        assert [c.token_ids for c in out.outputs] == [baseline[1]] * 2
        assert llm.engine.get_stats().num_used_kv_blocks == 0
        assert llm.engine.suffix.indexes == {}  # every request's index went with it
        assert len(llm.engine.suffix.cache.outputs) == 15  # every output so far (<= 64 kept)


def test_penalties_and_a_grammar_equal_plain_decoding(model: Path) -> None:
    """Penalties count the nodes on each node's path; a grammar masks every node's verified
    row by the state after its path (a node it forbids is never accepted)."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array"}},
        "required": ["a", "b"],
    }
    params = [
        SamplingParams(
            temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.5,
            frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={5: 6.0, 6: 5.0},
        ),
        SamplingParams(
            temperature=0, max_tokens=40, structured=StructuredSpec("json_schema", json.dumps(schema))
        ),
    ]  # fmt: skip
    prompts = [PROMPTS[0], PROMPTS[1]]
    with LLM(str(model)) as llm:
        want = tokens(llm.generate(prompts, params))
    spec = suffix(3, suffix_min_probability=0.0)
    with LLM(str(model), speculative_config=spec) as llm:
        outs = llm.generate(prompts, params)
        assert tokens(outs) == want
        assert all(o.spec_stats.num_accepted_tokens > 0 for o in outs)
    assert outs[1].outputs[0].text.startswith('{"a":')  # the grammar held (cut by max_tokens)


def test_static_graph_path_equals_eager(
    model: Path, baseline: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The captured-step path (its static buffers, run eagerly on the CPU): trees are filled to
    the captured node count, the target's tree verify step replays; nothing is drafted."""
    monkeypatch.setenv("TANDEM_TEST_STATIC_GRAPHS", "1")
    spec = suffix(3, suffix_max_tree_nodes=5)
    with LLM(str(model), speculative_config=spec, max_num_seqs=4) as llm:
        engine = llm.engine
        reqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        sizes = set()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if not out.finished:
                    sizes.add(len(reqs[int(out.request_id[1:])].spec_token_ids))
        assert [r.output_token_ids for r in reqs] == baseline
        assert sizes <= {0, 5} and 5 in sizes  # filled (0: no room left)
        graphs = engine.executor.worker.runner.graph_runner
        assert graphs is not None and graphs.num_replays > 0
        assert all(step.draft is None for step in graphs.graphs.values())


def test_tp2_and_adp2_equal_one_rank(tmp_path_factory: pytest.TempPathFactory) -> None:
    """The engine proposes for every rank's requests; each rank builds the same tree shapes."""
    target = build_llama(tmp_path_factory.mktemp("suffix-tp") / "t", layers=2, init_std=0.2)
    spec = suffix(3, suffix_max_tree_nodes=6, suffix_min_probability=0.0)
    kw: dict[str, Any] = {"dtype": "float32", "max_num_batched_tokens": 16}
    runs = {}
    for name, extra in (
        ("one", {}),
        ("tp2", {"tensor_parallel_size": 2}),
        ("adp2", {"tensor_parallel_size": 2, "enable_attention_dp": True}),
    ):
        with LLM(str(target), speculative_config=spec, **kw, **extra) as llm:
            outs = llm.generate(PROMPTS, GREEDY)
            runs[name] = (tokens(outs), [o.spec_stats.num_accepted_tokens for o in outs])
    assert runs["tp2"] == runs["one"] and runs["adp2"] == runs["one"]
    assert sum(runs["one"][1]) > 0


def test_a_repeating_output_is_drafted_deep(tmp_path_factory: pytest.TempPathFactory) -> None:
    """A near-echo target (its greedy token mostly repeats the last one): once the run is long
    enough, whole trees are accepted; the tokens equal plain decoding."""
    root = tmp_path_factory.mktemp("suffix-echo")
    target = build_llama(root / "t", layers=2)
    make_echo_target(target, residual_scale=0.3)
    prompts = [[11, 12, 13, 11, 12, 13, 11, 12], [40, 41, 42]]
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    with LLM(str(target)) as llm:
        want = tokens(llm.generate(prompts, params))
    with LLM(str(target), speculative_config=suffix(6)) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.spec_stats
    assert tokens(outs) == want
    assert len(stats.accepted_per_pos) == 6 and stats.accepted_per_pos[5] > 0  # full depth
    assert (stats.num_accepted_tokens + stats.num_drafts) / stats.num_drafts > 3
    shutil.rmtree(root)


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"suffix_max_tree_nodes": 0}, "suffix_max_tree_nodes=0 is invalid"),
        ({"suffix_max_tree_nodes": 64}, r"suffix_max_tree_nodes=64 is invalid.*\[1, 63\]"),
        ({"suffix_max_tree_nodes": 2}, r"suffix_max_tree_nodes \(2\) must be >= num_spec"),
        ({"suffix_min_probability": 1.5}, "suffix_min_probability=1.5 is invalid"),
        ({"suffix_min_probability": "0.1"}, "suffix_min_probability='0.1' is invalid"),
        ({"suffix_max_spec_factor": 0}, "suffix_max_spec_factor=0 is invalid"),
        ({"suffix_max_match_length": 0}, "suffix_max_match_length=0 is invalid"),
        ({"suffix_max_cached_requests": -1}, "suffix_max_cached_requests=-1 is invalid"),
        ({"suffix_max_cached_requests": True}, "suffix_max_cached_requests=True is invalid"),
        ({"model": "/a/head"}, "model do not apply to method 'suffix'"),
        ({"topk": 2, "num_draft_tokens": 4}, "topk, num_draft_tokens do not apply"),
        ({"prompt_lookup_max": 3}, "prompt_lookup_min / prompt_lookup_max apply to method"),
        (
            {"num_speculative_tokens": {"1": 4, "8": 2}},
            "schedule does not apply to method 'suffix'",
        ),
    ],
)
def test_configuration_errors(model: Path, spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(model), speculative_config={**suffix(3), **spec})


def test_defaults_and_other_methods() -> None:
    from tandem.engine.config import SpeculativeConfig

    c = SpeculativeConfig(method="suffix")
    assert (c.suffix_max_tree_nodes, c.suffix_min_probability, c.suffix_max_spec_factor) == (
        16, 0.1, 1.0,
    )  # fmt: skip
    assert (c.suffix_max_match_length, c.suffix_max_cached_requests) == (16, 64)
    assert c.is_tree and not c.has_draft_model and c.kv_lookahead == 32
    with pytest.raises(ValueError, match="suffix_min_probability apply to method 'suffix' only"):
        SpeculativeConfig(method="ngram", suffix_min_probability=0.2)
