"""Attention data parallelism (ADP = 2 over gloo): each rank owns its requests and KV cache, the
MLPs run on both ranks' tokens; outputs equal a single rank's, with unequal load and an idle
rank running dummy steps."""

from __future__ import annotations

import dataclasses
import multiprocessing
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from checkpoints import add_mtp_layers, build_eagle3_draft, build_llama, mtp_head_with_vocab
from tandem import LLM, SamplingParams
from tandem.engine.step import (
    ADP_DUMMY_REQUEST_ID,
    RequestStep,
    StepInput,
    StepOutput,
    adp_pad_steps,
    drop_dummy,
    merge_outputs,
)

# Least-loaded assignment alternates: 0, 1, 0, 1, 0. Rank 1 gets short requests and then idles
# while rank 0 still decodes (and prefills a long prompt).
PROMPTS = [list(range(40, 70)), [5, 6, 7], [100, 101], [9], list(range(10, 22))]
MAX_TOKENS = [20, 3, 14, 2, 9]
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in MAX_TOKENS]
# A 16-token budget chunks the 30-token prompt: rank 0 then has a step with a mid-prompt chunk
# and no sampled request (it runs a dummy next to it) while rank 1 decodes.
CHUNKED: dict[str, Any] = {"dtype": "float32", "max_num_batched_tokens": 16}
ADP2: dict[str, Any] = {"tensor_parallel_size": 2, "enable_attention_dp": True}
SPECS: dict[str, dict[str, Any] | None] = {
    "none": None,
    "mtp": {"method": "mtp", "num_speculative_tokens": 3},
    # Vanilla MTP declines row picking under ADP: unpicked drafts must equal the picked ones.
    "mtp-vanilla": {"method": "mtp", "num_speculative_tokens": 2, "mtp_mode": "vanilla"},
    "eagle3": {"method": "eagle3", "num_speculative_tokens": 3},
    # An MTP head drafting from every other token (its own LM head of the target's rows).
    "mtp-vocab": {"method": "mtp", "num_speculative_tokens": 3},
    # Drafts from each request's own text, proposed by the engine for both ranks' requests.
    "ngram": {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 2},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adp")
    target = build_llama(root / "t", layers=4, heads=4, kv_heads=2, vocab_size=322, init_std=0.2)
    add_mtp_layers(target, 1)
    mtp_head_with_vocab(target, root / "mtp-vocab", list(range(0, 322, 2)))
    return target, build_eagle3_draft(root / "d", target, draft_vocab=161)


def _spec(name: str, draft: Path) -> dict[str, Any] | None:
    spec = SPECS[name]
    if spec is not None and spec["method"] == "eagle3":
        spec = {**spec, "model": str(draft)}
    if name == "mtp-vocab":  # built next to the Eagle3 draft by ``ckpts``
        spec = {**spec, "model": str(draft.parent / "mtp-vocab")}
    return spec


def _budget(name: str) -> dict[str, Any]:
    """Chunked prefill for every method (vanilla MTP layers read the prompt tokens that follow
    a chunk, which the engine passes along)."""
    return CHUNKED


def _run(llm: LLM, keyed: bool = True) -> tuple[list[list[int]], list[Any], dict[str, int], int]:
    """Tokens and per-request acceptance by prompt, the DP rank of each request, and the number
    of steps in which rank 1 had nothing scheduled while rank 0 did. Under ADP every step's
    ranks must have taken the same sampling path and graph key; ``keyed``: some decode-only
    step had a key (n-gram steps on a CPU have none: their drafts are padded to K only where
    graphs run)."""
    engine = llm.engine
    ids = [f"r{i}" for i in range(len(PROMPTS))]
    requests = {
        rid: engine.add_request(rid, prompt, p)
        for rid, prompt, p in zip(ids, PROMPTS, PARAMS, strict=True)
    }
    drafts: dict[str, list[list[int]]] = {rid: [] for rid in ids}
    ranks = dict(engine.rank_of)
    final: dict[str, Any] = {}
    idle_steps = 0
    keys: list[Any] = []
    while engine.has_unfinished_requests():
        busy = [bool(s.running or s.waiting) for s in engine.schedulers]
        if len(busy) == 2 and busy[0] and not busy[1]:
            idle_steps += 1
        for out in engine.step():
            drafts[out.request_id].append(list(requests[out.request_id].spec_token_ids))
            if out.finished:
                final[out.request_id] = out
        if engine.dp_size > 1:
            paths = engine.last_rank_paths
            assert len(paths) == 2 and paths[0] == paths[1], paths
            keys.append(paths[0][1])
    if engine.dp_size > 1:  # decode-only steps pick a graph; steps with a prefill run eager
        assert None in keys and any(k is not None for k in keys) == keyed, keys
    tokens = [final[rid].outputs[0].token_ids for rid in ids]
    # Acceptance per position, and every draft proposed after every step, per request.
    accepted = [
        (final[rid].spec_stats.accepted_per_pos if final[rid].spec_stats else None, drafts[rid])
        for rid in ids
    ]
    return tokens, accepted, ranks, idle_steps


@pytest.mark.timeout(300)
def test_adp2_equals_single_rank(ckpts: tuple[Path, Path]) -> None:
    """ADP = 2 (and ADP = 2 with LM-head TP, whose greedy drafts exchange (max, index) pairs)
    without speculation, with MTP-Eagle, vanilla MTP, Eagle3, MTP with a draft vocabulary and
    n-gram drafts."""
    target, draft = ckpts
    runs = [(name, False) for name in SPECS] + [("mtp", True), ("eagle3", True)]
    runs.append(("mtp-vocab", True))
    refs: dict[str, Any] = {}
    for name, lm_head_tp in runs:
        spec = _spec(name, draft)
        if name not in refs:
            with LLM(str(target), speculative_config=spec, **_budget(name)) as llm:
                refs[name] = (*_run(llm)[:2], llm.engine.get_stats())
        ref_tokens, ref_accepted, ref_stats = refs[name]
        with LLM(
            str(target),
            speculative_config=spec,
            enable_lm_head_tp_in_adp=lm_head_tp,
            **ADP2,
            **_budget(name),
        ) as llm:
            engine = llm.engine
            assert engine.dp_size == 2
            model = engine.executor.worker.model
            # Attention and LM head replicated, MLP sharded over the two ranks.
            assert model.model.layers[0].self_attn.num_heads == 4
            assert model.model.layers[0].mlp.gate_up_proj.weight.shape[0] == 128
            assert model.lm_head.weight.shape[0] == 322
            assert engine.executor.worker.runner.spec is None or (
                engine.executor.worker.runner.spec.lm_head_tp == lm_head_tp
            )
            tokens, accepted, ranks, idle = _run(llm, keyed=name != "ngram")
            stats = llm.engine.get_stats()
        assert tokens == ref_tokens, (name, lm_head_tp)
        assert [len(t) for t in tokens] == MAX_TOKENS
        # Same drafts, step by step (row-picked or not; LM-head TP or not); the same acceptance
        # (dummies are never counted).
        assert accepted == ref_accepted, name
        assert stats.spec_num_drafts == ref_stats.spec_num_drafts
        assert stats.spec_num_accepted_tokens == ref_stats.spec_num_accepted_tokens
        assert sorted(set(ranks.values())) == [0, 1]
        assert [ranks[f"r{i}"] for i in range(5)] == [0, 1, 0, 1, 0]
        assert idle > 0, "rank 1 should idle (dummy steps) while rank 0 works"
        assert stats.num_running == stats.num_waiting == 0
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tandem-rank")]


# ------------------------------------------------------------------ dummy padding (pure)


def _req(rid: str, sample: bool, n: int = 1) -> RequestStep:
    return RequestStep(rid, list(range(n)), 0, [0], sample, SamplingParams(temperature=0))


@pytest.mark.timeout(300)
def test_adp2_speculation_pauses_together(ckpts: tuple[Path, Path]) -> None:
    """ADP = 2 + LM-head TP with Eagle3 and ``disable_by_batch_size``: the pause is decided on
    the whole step (both ranks' requests), so both ranks skip the draft loop and its collectives
    together (same path and graph key every step, no hang); greedy output equals no speculation,
    and the engine speculates again once fewer requests run."""
    target, draft = ckpts
    with LLM(str(target), **CHUNKED) as llm:
        ref_tokens = _run(llm)[0]
    spec = {**_spec("eagle3", draft), "disable_by_batch_size": 3}  # type: ignore[dict-item]
    adp = {**ADP2, "enable_lm_head_tp_in_adp": True}
    with LLM(str(target), speculative_config=spec, **adp, **CHUNKED) as llm:
        tokens, accepted, _, _ = _run(llm)
    assert tokens == ref_tokens
    # r0 (20 tokens) runs next to others at first (no drafts), then alone or in pairs (drafts).
    r0_drafts = accepted[0][1]
    assert [] in r0_drafts[:3] and any(d for d in r0_drafts)
    assert accepted[0][0], "no step verified drafts"  # per-position acceptance recorded


def test_pad_steps_gives_every_rank_without_a_sampled_request_the_dummy() -> None:
    dummy = _req(ADP_DUMMY_REQUEST_ID, True)
    busy = StepInput([_req("a", True, 3)])
    chunk = StepInput([_req("b", False, 4)], ["gone"])
    idle = StepInput([])
    padded = adp_pad_steps([busy, chunk, idle], dummy)
    assert padded[0] is busy
    assert [r.request_id for r in padded[1].requests] == ["b", ADP_DUMMY_REQUEST_ID]
    assert padded[1].finished_request_ids == ["gone"]
    assert [r.request_id for r in padded[2].requests] == [ADP_DUMMY_REQUEST_ID]
    # Nobody has work: nobody runs (no collective at all).
    assert adp_pad_steps([idle, StepInput([], ["x"])], dummy)[0] is idle


def test_dummy_outputs_are_dropped_and_ranks_merged_in_order() -> None:
    a = StepOutput(["a", ADP_DUMMY_REQUEST_ID], [[1], [2]], [None, None], [0, 0], [[3], [4]])
    b = StepOutput([ADP_DUMMY_REQUEST_ID], [[5]], [None], [0], [[6]])
    c = StepOutput(["c"], [[7, 8]], [None], [1], [[9]])
    merged = merge_outputs([drop_dummy(a), drop_dummy(b), drop_dummy(c)])
    assert merged.request_ids == ["a", "c"]
    assert merged.token_ids == [[1], [7, 8]]
    assert merged.num_drafts == [0, 1]
    assert merged.draft_token_ids == [[3], [9]]


# ------------------------------------------------------------------ group-synced greedy flag

GREEDY_PROMPTS = [[5, 6, 7], [100, 101], [9, 8, 7, 6], list(range(30, 42))]
HOT_PROMPT = [17, 3, 250]


def _two_token_distribution(folder: Path, prompt: list[int], temperature: float) -> Any:
    """The target's own (transformers) distribution of the 2nd generated token at
    ``temperature``: sum over t1 of p(t1 | prompt) p(t2 | prompt, t1)."""
    import torch
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1] / temperature, -1)
        vocab = p1.shape[0]
        ids = torch.tensor([prompt + [t] for t in range(vocab)])
        p2 = torch.softmax(model(ids).logits[:, -1] / temperature, -1)  # [V, V]
    return (p1[:, None] * p2).sum(0).double()


@pytest.mark.timeout(300)
def test_group_synced_greedy_flag(ckpts: tuple[Path, Path]) -> None:
    """ADP = 2 + LM-head TP + rejection sampling, rank 0 all greedy, rank 1 at temperature 0.8:
    for >= 200 steps both ranks take the same draft path (advanced while rank 1 samples) and the
    same graph key; nothing hangs; greedy requests still get greedy tokens; rank 1's tokens
    follow the target's distribution."""
    import torch
    from scipy.stats import chisquare

    target, _ = ckpts
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    hot = SamplingParams(temperature=0.8, max_tokens=2, ignore_eos=True)
    with LLM(str(target), dtype="float32", speculative_config=spec) as llm:
        ref = [o.outputs[0].token_ids for o in llm.generate(GREEDY_PROMPTS, greedy)]

    greedy_out: list[tuple[int, list[int]]] = []
    second_tokens: list[int] = []
    steps = advanced_steps = 0
    with LLM(
        str(target),
        dtype="float32",
        speculative_config=spec,
        tensor_parallel_size=2,
        enable_attention_dp=True,
        enable_lm_head_tp_in_adp=True,
    ) as llm:
        engine = llm.engine
        assert engine.executor.worker.runner.spec.lm_head_tp
        prompt_of: dict[str, int] = {}
        n = 0
        while steps < 200 or engine.has_unfinished_requests():
            while steps < 200 and sum(s.num_running + s.num_waiting for s in engine.schedulers) < 8:
                rank = engine._least_loaded_rank()
                rid = f"q{n}"
                if rank == 0:
                    prompt_of[rid] = n % len(GREEDY_PROMPTS)
                    engine.add_request(rid, GREEDY_PROMPTS[prompt_of[rid]], greedy)
                else:  # seeded: the test is deterministic, the samples independent
                    engine.add_request(rid, HOT_PROMPT, dataclasses.replace(hot, seed=n))
                assert engine.rank_of[rid] == rank
                n += 1
            hot_running = bool(engine.schedulers[1].running)
            for out in engine.step():
                if not out.finished:
                    continue
                if out.request_id in prompt_of:
                    greedy_out.append((prompt_of[out.request_id], out.outputs[0].token_ids))
                else:
                    second_tokens.append(out.outputs[0].token_ids[1])
            paths = engine.last_rank_paths
            if paths:
                assert len(paths) == 2 and paths[0] == paths[1], (steps, paths)
                if hot_running:
                    assert paths[0][0], "a sampled rank must pull every rank onto advanced"
                advanced_steps += paths[0][0]
                steps += 1
    assert steps >= 200 and advanced_steps >= 100
    assert len(greedy_out) >= 8
    for i, tokens in greedy_out:
        assert tokens == ref[i]
    # Distribution of the 2nd token (it goes through rejection sampling against sampled drafts).
    dist = _two_token_distribution(target, HOT_PROMPT, 0.8)
    expected = dist / dist.sum() * len(second_tokens)
    counts = torch.bincount(torch.tensor(second_tokens), minlength=expected.shape[0]).double()
    order = torch.argsort(expected, descending=True)
    bins_obs, bins_exp, acc_o, acc_e = [], [], 0.0, 0.0
    for i in order.tolist():  # merge the tail into bins expecting >= 5 each
        acc_o += float(counts[i])
        acc_e += float(expected[i])
        if acc_e >= 5:
            bins_obs.append(acc_o)
            bins_exp.append(acc_e)
            acc_o = acc_e = 0.0
    bins_obs[-1] += acc_o
    bins_exp[-1] += acc_e
    bins_exp[-1] += len(second_tokens) - sum(bins_exp)  # exact totals for scipy's check
    assert len(bins_obs) >= 5
    assert chisquare(bins_obs, bins_exp).pvalue > 1e-3


def test_scan_clears_the_previous_steps_group_flag() -> None:
    """A stale group value (e.g. left by a greedy warm-up dummy) must not outlive its step."""
    from types import SimpleNamespace

    import torch

    from tandem.engine.model_runner import ModelRunner
    from tandem.engine.speculative.interface import SpecMetadata
    from tandem.models.parallel import ParallelMapping

    meta = SpecMetadata(2, use_rejection_sampling=True)
    meta.group_all_greedy_sample = True  # last step: the whole group was greedy
    runner: Any = SimpleNamespace(
        spec=SimpleNamespace(lm_head_tp=False, mapping=ParallelMapping()),
        device=torch.device("cpu"),
    )
    ModelRunner.scan_sampling_path(runner, meta, False)
    assert meta.group_all_greedy_sample is None
    assert meta.wants_advanced_draft_sampling
    # With LM-head TP the group value is re-derived (one rank: the local flag) and then wins
    # over any later local rescan.
    runner.spec.lm_head_tp = True
    ModelRunner.scan_sampling_path(runner, meta, False)
    assert meta.group_all_greedy_sample is False
    meta.is_all_greedy_sample = True  # a rescan
    assert meta.wants_advanced_draft_sampling


def test_warm_up_leaves_no_cached_prompt_on_any_rank(ckpts: tuple[Path, Path]) -> None:
    from tandem.engine.engine_core import warm_up

    with LLM(  # 4-token blocks: the 8-token warm-up prompt fills two
        str(ckpts[0]),
        dtype="float32",
        tensor_parallel_size=2,
        enable_attention_dp=True,
        block_size=4,
    ) as llm:
        engine = llm.engine
        cached: list[int] = []
        reset = engine.reset_prefix_cache

        def spy() -> None:  # how many blocks each rank had cached just before the reset
            cached.extend(len(bm.cached) for bm in engine.block_managers)
            reset()

        engine.reset_prefix_cache = spy  # type: ignore[method-assign]
        warm_up(engine)
        assert len(cached) == 2 and min(cached) > 0, cached  # both ranks ran a warm-up
        assert [len(bm.cached) for bm in engine.block_managers] == [0, 0]
        # A user prompt equal to the warm-up's is no cache hit on either rank.
        hits = engine.get_stats().prefix_cache_hits
        llm.generate([list(range(1, 9))] * 2, SamplingParams(temperature=0, max_tokens=1))
        assert engine.get_stats().prefix_cache_hits == hits


@pytest.mark.timeout(120)
def test_a_killed_rank_fails_the_adp_step(ckpts: tuple[Path, Path]) -> None:
    from tandem.engine.executor import MultiProcExecutor, RankFailedError

    with LLM(
        str(ckpts[0]), dtype="float32", tensor_parallel_size=2, enable_attention_dp=True
    ) as llm:
        engine = llm.engine
        executor = engine.executor
        assert isinstance(executor, MultiProcExecutor)
        for i, (prompt, p) in enumerate(zip(PROMPTS, PARAMS, strict=True)):
            engine.add_request(f"k{i}", prompt, p)
        for _ in range(2):
            engine.step()
        os.kill(executor.procs[0].pid, signal.SIGKILL)
        with pytest.raises(RankFailedError, match="rank 1"):
            while engine.has_unfinished_requests():
                engine.step()
    assert not [p for p in multiprocessing.active_children() if p.name.startswith("tandem-rank")]
