"""Draft trees end to end (issue #35): greedy exactness, a perfect draft's full depth, the
draft's trees against a reference, seeded sampling, and what is refused."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import torch
from stats import two_sample_p

from checkpoints import (
    _read_state,
    _write_state,
    add_deepseek_mtp_layers,
    add_mtp_layers,
    build_deepseek_v3,
    build_eagle3_draft,
    build_llama,
    eagle3_tree_spec,
    make_echo_target,
    perfect_eagle3_draft,
    random_eagle3_head,
    scale_residual_writes,
    write_eagle3_layout,
    zero_residual_writes,
)
from tandem import LLM, SamplingParams
from tandem.engine.speculative.tree import max_tree_nodes

# The 50-token prompt runs in chunks (chunked prefill next to decodes) under a small budget.
PROMPTS = [[5, 6, 7], list(range(40, 90)), [100, 101], list(range(120, 139))]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tree")
    target = build_llama(root / "target", layers=4)
    draft = build_eagle3_draft(root / "eagle3", target, draft_vocab=160)
    return {"target": target, "eagle3": draft}


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


_tree = eagle3_tree_spec


@pytest.fixture(scope="module")
def baseline(models: dict[str, Path]) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    with LLM(str(models["target"])) as llm:
        return _tokens(llm.generate(PROMPTS, params))


@pytest.mark.parametrize(("topk", "n"), [(2, 4), (2, 8), (4, 4), (4, 8)])
def test_greedy_tree_speculation_is_exact(models, baseline, topk: int, n: int) -> None:
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    spec = _tree(models["eagle3"], topk, n)
    # 40 tokens a step: four decoding trees of up to 8 nodes fit (so every request verifies
    # trees), and the 50-token prompt is still chunked next to them.
    with LLM(str(models["target"]), speculative_config=spec, max_num_batched_tokens=40) as llm:
        outs = llm.generate(PROMPTS, params)
        assert _tokens(outs) == baseline
        assert all(o.spec_stats.num_drafts > 0 for o in outs)
        stats = llm.engine.get_stats()
        # Whole trees, but near max_tokens the nodes past the room are not verified (nor
        # counted): at most the last k - 1 = 2 steps of each request verify part of a tree.
        drafts = stats.spec_num_drafts
        assert n * (drafts - 2 * len(PROMPTS)) <= stats.spec_num_draft_tokens <= n * drafts
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
    max_tokens = 1 + steps * (k + 1)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    spec = _tree(head, topk, n, k)
    with LLM(str(target), dtype="float32", speculative_config=spec, max_num_seqs=4) as llm:
        reqs, full = _full_depth_steps(llm, prompts, params, n, k)
    for prompt, r in zip(prompts, reqs, strict=True):
        assert r.output_token_ids == [prompt[-1]] * params.max_tokens  # the echo
    assert full >= steps * len(prompts)


def test_statistics_count_only_the_verified_nodes(tmp_path: Path) -> None:
    """A perfect head, topk 2, depth 3, every candidate (10 nodes) verified: the first tree
    accepts all 3 depths; the next, with room for 1 more draft, verifies only its 2 depth-1
    nodes (they were counted as 10)."""
    topk, k = 2, 3
    target = build_llama(tmp_path / "echo", layers=2, seed=5)
    make_echo_target(target)
    head = perfect_eagle3_draft(tmp_path / "head", target)
    n = max_tree_nodes(k, topk)
    params = SamplingParams(temperature=0, max_tokens=1 + (k + 1) + 2, ignore_eos=True)
    with LLM(str(target), speculative_config=_tree(head, topk, n, k)) as llm:
        (out,) = llm.generate([[5, 6, 7]], params)
        engine = llm.engine.get_stats()
    stats = out.spec_stats
    assert (stats.num_drafts, stats.num_accepted_tokens) == (2, k + 1)
    assert stats.num_draft_tokens == n + topk
    assert stats.mean_draft_tokens_per_step == (n + topk) / 2
    assert stats.acceptance_rate == (k + 1) / (n + topk)
    assert (engine.spec_num_drafts, engine.spec_num_draft_tokens) == (2, n + topk)


def _full_depth_steps(
    llm: LLM, prompts: list[list[int]], params: SamplingParams, n: int, k: int
) -> tuple[list, int]:
    """Step ``prompts`` through ``llm``: every step that verified a whole tree of ``n`` nodes
    with room for all ``k`` depths must emit k + 1 tokens. Returns (the requests, such steps)."""
    engine = llm.engine
    reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
    full = 0
    while engine.has_unfinished_requests():
        before = {r.request_id: (len(r.output_token_ids), len(r.spec_token_ids)) for r in reqs}
        for out in engine.step():
            done, drafts = before[out.request_id]
            new = len(out.outputs[0].token_ids) - done
            if drafts == n and params.max_tokens - done - 1 >= k:  # room for the whole depth
                assert new == k + 1, (out.request_id, new)
                full += 1
    return reqs, full


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


def test_multi_layer_head_trees(models, baseline, tmp_path: Path) -> None:
    """A two-layer Eagle3 head (``layers.{i}``; the later layer attends with the tree mask over
    its own draft KV): greedy output unchanged, and the top-1 path through each first tree is
    the chain decoder's drafts from the same state."""
    state, cfg = random_eagle3_head(models["target"], layers=2, draft_vocab=160, seed=11)
    head = write_eagle3_layout(tmp_path / "two", state, cfg, "layers")
    k, topk = 3, 2
    chain = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    tree = {**chain, "topk": topk, "num_draft_tokens": max_tree_nodes(k, topk)}
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    with LLM(str(models["target"]), speculative_config=chain) as llm:
        chain_first = _first_drafts(llm, PROMPTS)
    with LLM(str(models["target"]), speculative_config=tree) as llm:
        assert len(llm.engine.executor.worker.runner.spec.draft.layers) == 2
        tree_first = _first_drafts(llm, PROMPTS)
        assert _tokens(llm.generate(PROMPTS, params)) == baseline
    for rid, (drafts, _) in chain_first.items():
        path = _top1_path(*tree_first[rid])
        assert len(path) >= 2 and path == drafts[: len(path)], (rid, path, drafts)


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
    spec = {**_tree(head, 2, 6, 3), "use_rejection_sampling": rejection}
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


def test_tree_configuration_errors(models, tmp_path: Path) -> None:
    t = str(models["target"])
    small = build_eagle3_draft(tmp_path / "small", models["target"], draft_vocab=6)
    with pytest.raises(ValueError, match=r"topk=8 is larger than the draft head's vocabulary \(6"):
        LLM(t, speculative_config=eagle3_tree_spec(small, 8, 8, k=2))
    base = {"method": "eagle3", "model": str(models["eagle3"]), "num_speculative_tokens": 3}
    for extra, why in (
        ({"topk": 2}, "num_draft_tokens is required"),
        ({"topk": 0, "num_draft_tokens": 4}, "topk must be an integer >= 1"),
        ({"topk": 2, "num_draft_tokens": 2}, r"must be >= num_speculative_tokens"),
        ({"topk": 2, "num_draft_tokens": 11}, r"must be <= 10"),
        ({"topk": 1, "num_draft_tokens": 4}, r"must be <= 3"),
    ):
        with pytest.raises(ValueError, match=why):
            LLM(t, speculative_config={**base, **extra})
    with pytest.raises(ValueError, match="does not support mtp_mode 'vanilla'"):
        LLM(
            t,
            speculative_config={
                "method": "mtp",
                "mtp_mode": "vanilla",
                "topk": 2,
                "num_draft_tokens": 4,
            },
        )


def _pair_counts(
    llm: LLM, n: int, params: dict, seed0: int, max_tokens: int = 2
) -> dict[tuple[int, ...], int]:
    """Counts of the first two sampled tokens over n seeded requests of one prompt."""
    batch = [
        SamplingParams(
            **params, max_tokens=max_tokens, ignore_eos=True, seed=seed0 + i, detokenize=False
        )
        for i in range(n)
    ]
    outs = llm.generate([[5, 6, 7]] * n, batch)
    counts: dict[tuple[int, ...], int] = {}
    for o in outs:
        pair = tuple(o.outputs[0].token_ids[:2])
        counts[pair] = counts.get(pair, 0) + 1
    return counts


@pytest.mark.slow  # ~10 minutes per case on 2 CPU cores (TREE_CHI2_N lowers the count)
@pytest.mark.parametrize(
    "sampling",
    [{"temperature": 0.7, "top_k": 6}, {"temperature": 1.3, "top_k": 8, "top_p": 0.9}],
    ids=["T0.7-topk", "T1.3-topk-topp"],
)
def test_tree_sampling_matches_plain_sampling(near_echo: tuple[Path, Path], sampling: dict) -> None:
    """The first two tokens (the second one emitted by tree verification: an accepted depth-1
    node or the draw from what the rejected children leave) are distributed as plain sampling
    from the target: two-sample chi-square over 10,000 requests each, p > 0.01."""
    target, head = near_echo
    n = int(os.environ.get("TREE_CHI2_N", "10000"))
    spec = _tree(head, 3, 6, 2)
    with LLM(str(target), dtype="float32", max_num_seqs=512) as llm:
        plain = _pair_counts(llm, n, sampling, 0)
    with LLM(str(target), dtype="float32", speculative_config=spec, max_num_seqs=512) as llm:
        # max_tokens 3: the second step verifies the tree's depth-1 nodes (the room left).
        tree = _pair_counts(llm, n, sampling, 10**6, max_tokens=3)
        stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens > n // 20  # the trees are accepted often enough
    assert len(plain) > 5
    assert two_sample_p(plain, tree) > 0.01


def test_stops_and_max_tokens_mid_tree(near_echo: tuple[Path, Path]) -> None:
    """A near-perfect head (several nodes accepted per step): max_tokens, a stop token and a
    stop string that land inside an accepted path end the output where plain decoding does,
    and every KV block comes back."""
    target, head = near_echo
    prompt = list(range(40, 59))
    greedy = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    with LLM(str(target), dtype="float32") as llm:
        (ref_out,) = llm.generate([prompt], greedy)
    ref = ref_out.outputs[0].token_ids
    spec = _tree(head, 2, 6, 3)
    with LLM(str(target), dtype="float32", speculative_config=spec) as llm:
        for max_tokens in (1, 2, 7, 11):
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            (out,) = llm.generate([prompt], params)
            assert out.outputs[0].token_ids == ref[:max_tokens]
        stop_tok = ref[9]
        params = SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[stop_tok])
        (out,) = llm.generate([prompt], params)
        assert out.outputs[0].token_ids == ref[: ref.index(stop_tok) + 1]
        text = llm.tokenizer.decode(ref, skip_special_tokens=True)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        if stop.strip():
            params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, stop=stop)
            (out,) = llm.generate([prompt], params)
            assert out.outputs[0].text == text[: text.index(stop)]
            assert out.outputs[0].finish_reason == "stop"
        stats = llm.engine.get_stats()
        assert stats.spec_num_accepted_tokens > stats.spec_num_drafts  # > 1 node per step
        assert stats.num_used_kv_blocks == 0


@pytest.fixture(scope="module")
def mtp_models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A Llama target with one MTP layer, a perfect-MTP echo pair, and a DeepSeek-V3 (MLA)
    target whose MTP layer nearly echoes it."""
    root = tmp_path_factory.mktemp("tree_mtp")
    target = build_llama(root / "target", layers=4)
    add_mtp_layers(target, 1)
    perfect = build_llama(root / "perfect", layers=2, seed=3)
    zero_residual_writes(perfect)
    add_mtp_layers(perfect, 1, perfect=True)
    dsv3 = build_deepseek_v3(root / "dsv3", layers=2, seed=3)
    scale_residual_writes(dsv3, 0.05)
    add_deepseek_mtp_layers(dsv3, 1, echo=True)
    return {"target": target, "perfect": perfect, "dsv3": dsv3}


def _mtp_tree(topk: int, n: int, k: int = 3) -> dict:
    return {"method": "mtp", "num_speculative_tokens": k, "topk": topk, "num_draft_tokens": n}


@pytest.mark.parametrize("name", ["target", "dsv3"])
@pytest.mark.parametrize(("topk", "n"), [(2, 4), (4, 8)])
def test_mtp_greedy_tree_speculation_is_exact(mtp_models, name: str, topk: int, n: int) -> None:
    """MTP-Eagle trees (one MTP layer per depth), on a Llama target and on an MLA target (the
    tree mask through the latent cache's attention), with chunked prefill."""
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    with LLM(str(mtp_models[name]), dtype="float32") as llm:
        base = _tokens(llm.generate(PROMPTS, params))
    with LLM(
        str(mtp_models[name]),
        dtype="float32",
        speculative_config=_mtp_tree(topk, n),
        max_num_batched_tokens=16,
    ) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.get_stats()
    assert _tokens(outs) == base
    # Nodes skipped near max_tokens are not counted (at most the last 2 steps of a request).
    drafts = stats.spec_num_drafts
    assert n * (drafts - 2 * len(PROMPTS)) <= stats.spec_num_draft_tokens <= n * drafts
    assert stats.num_used_kv_blocks == 0
    if name == "dsv3":  # a near-echo head: nodes past the first are accepted
        assert stats.spec_num_accepted_tokens > stats.spec_num_drafts


def test_mtp_perfect_draft_accepts_the_full_depth(mtp_models) -> None:
    """The perfect MTP layer's trees take k + 1 tokens on every step with room for them. At
    depth 2 every node's children are candidates (the depth-1 frontier is all of depth 1), so
    with every candidate verified the head's top-1 path is always in the tree; deeper, EAGLE-2
    keeps the best cumulative scores, which need not include it."""
    k, topk = 2, 2
    n = max_tree_nodes(k, topk)
    steps = 4
    params = SamplingParams(temperature=0, max_tokens=1 + steps * (k + 1), ignore_eos=True)
    with LLM(str(mtp_models["perfect"])) as llm:
        base = _tokens(llm.generate(PROMPTS, params))
    with LLM(str(mtp_models["perfect"]), speculative_config=_mtp_tree(topk, n, k)) as llm:
        reqs, full = _full_depth_steps(llm, PROMPTS, params, n, k)
    assert [r.output_token_ids for r in reqs] == base
    assert full >= steps * len(PROMPTS)


def test_frontier_rows_equal_their_paths_run_as_chains(
    models, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Draft side, every node: each frontier row of the batched tree-masked draft pass equals
    the chain decoder's computation along that node's path (one row per depth after the
    prefix, each fed the previous row's output, no tree mask), for a head with 30x attention
    writes. A tree word with a missing ancestor or an extra row, a wrong position or parent
    hidden state fails it."""
    from tandem.engine.speculative.tree_decoder import TreeDecoder
    from tandem.kernels.attention_torch import build_attention_plan
    from tandem.models.attention import AttentionMetadata

    head = tmp_path / "loud"
    shutil.copytree(models["eagle3"], head)
    state = _read_state(head)
    state["midlayer.self_attn.o_proj.weight"] *= 30.0
    _write_state(head, state)
    original = TreeDecoder.frontier_forward
    checked: list[int] = []

    def checked_forward(self, layout, root_pos, tokens, hidden, words, positions, counts=None):  # noqa: ANN001, ANN202
        out = original(self, layout, root_pos, tokens, hidden, words, positions, counts)
        b, r, _ = hidden.shape
        k, bs = self.topk, self.block_size
        for i in range(b):
            for f in range(r - k, r):
                word = int(words[i, f])
                path = [j for j in range(r) if (word >> j) & 1]  # depth order
                n = len(path)
                assert path[-1] == f and n == r // k
                # The chain decoder's computation: one row per depth, each fed the previous
                # row's output (the first: the root's hidden state, which every depth-1 row
                # carries), at position and KV slot new root + depth - 1.
                table = layout.block_tables[i : i + 1]
                ref = hidden[i, path[0]][None]
                for t, row in enumerate(path):
                    pos = int(root_pos[i]) + t
                    slot = int(table[0, pos // bs]) * bs + pos % bs
                    seq = torch.tensor([pos + 1], dtype=torch.int32)
                    qsl = torch.tensor([0, 1], dtype=torch.int32)
                    meta = AttentionMetadata(
                        slot_mapping=torch.tensor([slot]),
                        block_tables=table,
                        seq_lens=seq,
                        query_start_loc=qsl,
                        max_query_len=1,
                        max_seq_len=pos + 1,
                        plan=build_attention_plan(table, seq, qsl, bs, 1, pos + 1, num_tokens=1),
                    )
                    ref = self.draft(0, torch.tensor([pos]), tokens[i, row][None], ref, meta)
                torch.testing.assert_close(out[i, f - (r - k)], ref[0], rtol=1e-4, atol=1e-4)
                checked.append(n)
        return out

    monkeypatch.setattr(TreeDecoder, "frontier_forward", checked_forward)
    spec = _tree(head, 2, 6, 3)
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(models["target"]), dtype="float32", speculative_config=spec) as llm:
        llm.generate(PROMPTS, params)
    # Depth-1 and depth-2 frontier rows (depth 3's tokens are the depth-2 rows' children).
    assert set(checked) == {1, 2}


def test_tree_under_preemption_and_prefix_caching(mtp_models) -> None:
    """An MLA target with MTP trees in a cache too small for all four requests (preemption by
    recompute) and a second run over cached prompt blocks: the greedy output is unchanged."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    with LLM(str(mtp_models["dsv3"]), dtype="float32") as llm:
        base = _tokens(llm.generate(PROMPTS, params))
    with LLM(
        str(mtp_models["dsv3"]),
        dtype="float32",
        speculative_config=_mtp_tree(2, 6),
        num_kv_blocks=10,
        max_model_len=80,
    ) as llm:
        assert _tokens(llm.generate(PROMPTS, params)) == base
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0
        hits = stats.prefix_cache_hits
        assert _tokens(llm.generate(PROMPTS, params)) == base
        stats = llm.engine.get_stats()
        assert stats.prefix_cache_hits > hits
        assert stats.num_used_kv_blocks == 0


def test_tree_logprobs_follow_the_accepted_path(near_echo: tuple[Path, Path]) -> None:
    """Logprobs of tokens emitted from accepted tree paths come from the verify row that
    produced each token (the node's, not the column's): equal to plain decoding's."""
    target, head = near_echo
    prompts = [[5, 6, 7], list(range(40, 59)), [100]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=2)
    with LLM(str(target), dtype="float32") as llm:
        base = llm.generate(prompts, params)
    spec = _tree(head, 2, 6, 3)
    with LLM(str(target), dtype="float32", speculative_config=spec) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.get_stats()
    assert stats.spec_num_accepted_tokens > stats.spec_num_drafts
    for want, got in zip(base, outs, strict=True):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        for a, b in zip(want.outputs[0].logprobs, got.outputs[0].logprobs, strict=True):
            assert a.token_id == b.token_id and a.top_token_ids == b.top_token_ids
            assert abs(a.logprob - b.logprob) < 1e-4, (a, b)
            pairs = zip(a.top_logprobs, b.top_logprobs, strict=True)
            assert max(abs(x - y) for x, y in pairs) < 1e-4


@pytest.mark.timeout(300)
def test_tp_and_adp_trees_equal_one_rank(tmp_path: Path) -> None:
    """TP = 2 and attention DP = 2 with LM-head TP give one rank's tokens; TP ranks draft the
    same trees and attention-DP ranks accept as many tokens per request (their drafts come from
    a batch split over ranks: the draft MLP gathers every rank's frontier rows)."""
    # Near-perfect heads on a near-echo target: some nodes past the first are accepted.
    target = build_llama(tmp_path / "t", layers=2, seed=5)
    make_echo_target(target, residual_scale=0.3)
    add_mtp_layers(target, 1, perfect=True)
    eagle3 = perfect_eagle3_draft(tmp_path / "d", target, residual_scale=0.3)
    prompts = PROMPTS[:3]
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)
    adp = {"tensor_parallel_size": 2, "enable_attention_dp": True, "enable_lm_head_tp_in_adp": True}
    with LLM(str(target), dtype="float32") as llm:
        base = _tokens(llm.generate(prompts, params))
    for spec in (_tree(eagle3, 2, 6), _mtp_tree(4, 8)):
        one = _run_steps(
            LLM(str(target), dtype="float32", speculative_config=spec), prompts, params
        )
        assert one[0] == base and any(one[1])
        tp = _run_steps(
            LLM(str(target), dtype="float32", speculative_config=spec, tensor_parallel_size=2),
            prompts,
            params,
        )
        assert tp == one, spec  # tokens, and the tree each step left on each request
        with LLM(str(target), dtype="float32", speculative_config=spec, **adp) as llm:
            outs = llm.generate(prompts, params)
        assert _tokens(outs) == base, spec
        accepted = [(o.spec_stats.num_drafts, o.spec_stats.num_accepted_tokens) for o in outs]
        assert accepted == one[2], spec


def _run_steps(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], list[list[int]], list[tuple[int, int]]]:
    """(each prompt's tokens, the drafts each step left on each request, each request's
    (verification steps, accepted tokens)); closes ``llm``."""
    with llm:
        engine = llm.engine
        reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
        drafts: list[list[int]] = []
        while engine.has_unfinished_requests():
            for out in engine.step():
                drafts.append(list(reqs[int(out.request_id[1:])].spec_token_ids))
        stats = [(r.spec_stats.num_drafts, r.spec_stats.num_accepted_tokens) for r in reqs]
        return [list(r.output_token_ids) for r in reqs], drafts, stats
