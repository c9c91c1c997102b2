"""Speculation with a separate draft model (issue #46, item 3): after every step the drafts equal
the draft checkpoint's own ``transformers`` greedy ``generate`` on the request's tokens so far
(the KV written for every row, accepted, rejected, chunked or cached, is its own); greedy output
equals plain decoding for K = 1 and 3 with chunked prefill, under preemption and prefix caching,
with stop tokens and strings, n = 2, penalties and a logit bias, a grammar, and the static-buffer
graph path; the target as its own draft takes K + 1 tokens a step; TP = 2 with the draft on one
rank or sharded, and attention DP with LM-head TP, equal one rank; the configuration is checked.
The sampled distribution: tests/test_rejection_sampling.py."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import build_llama
from tandem import LLM, SamplingParams
from tandem.engine.structured_output import StructuredSpec

PROMPTS = [[5, 6, 7], list(range(40, 90)), [100, 101], list(range(120, 139))]
GREEDY = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)


def noisy_copy(src: Path, dst: Path, scale: float, seed: int = 1) -> Path:
    """``src`` with Gaussian noise (``scale`` times each matrix's std) on every matrix: a draft
    that agrees with the target often, not always (drafts are accepted and rejected)."""
    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    state = load_file(str(src / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    for name, t in state.items():
        if t.dim() == 2:
            state[name] = t + scale * t.std() * torch.randn(t.shape, generator=gen)
    save_file(state, str(dst / "model.safetensors"))
    return dst


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("draft_model")
    # 4 query heads and 2 KV heads split evenly over 2 ranks.
    target = build_llama(root / "target", layers=4, heads=4, kv_heads=2)
    return {
        "target": target,
        "near": noisy_copy(target, root / "near", 0.1),
        # Another model: fewer layers, a narrower stack, another seed; the same tokenizer.
        "small": build_llama(
            root / "small", layers=2, hidden_size=32, heads=2, kv_heads=1, intermediate=64, seed=7
        ),
    }


@pytest.fixture(scope="module")
def baseline(models: dict[str, Path]) -> list[list[int]]:
    with LLM(str(models["target"])) as llm:
        return tokens(llm.generate(PROMPTS, GREEDY))


def spec(models: dict[str, Path], draft: str, k: int, **kw: Any) -> dict[str, Any]:
    return {"method": "draft_model", "model": str(models[draft]), "num_speculative_tokens": k, **kw}


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


class DraftOracle:
    """The draft checkpoint's own greedy ``generate`` (transformers), memoised."""

    def __init__(self, folder: Path) -> None:
        import transformers as tf

        self.model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32)
        self.model.eval()
        self.model.generation_config.eos_token_id = None
        self.cache: dict[tuple[int, ...], list[int]] = {}

    def drafts(self, ids: list[int], k: int) -> list[int]:
        key = (*ids, -k)
        if key not in self.cache:
            with torch.no_grad():
                out = self.model.generate(
                    torch.tensor([ids]),
                    attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                    max_new_tokens=k,
                    do_sample=False,
                    pad_token_id=0,
                )
            self.cache[key] = out[0, len(ids) :].tolist()
        return self.cache[key]


@pytest.fixture(scope="module")
def oracles(models: dict[str, Path]) -> dict[str, DraftOracle]:
    """One memoised oracle per draft, shared by the tests (equal prefixes are generated once)."""
    return {name: DraftOracle(folder) for name, folder in models.items() if name != "target"}


def check_drafts_step_by_step(
    llm: LLM,
    oracle: DraftOracle,
    k: int,
    params: SamplingParams,
    tag: str,
    prompts: list[list[int]] = PROMPTS,
) -> tuple[list[list[int]], int, int]:
    """Run ``prompts`` step by step; after every step each request's drafts equal the oracle's
    K tokens after its text, cut to the room left. Returns (outputs, checked, accepted)."""
    engine = llm.engine
    reqs = [engine.add_request(f"{tag}{i}", p, params) for i, p in enumerate(prompts)]
    checked = 0
    while engine.has_unfinished_requests():
        for out in engine.step():
            r = reqs[int(out.request_id[len(tag) :])]
            if out.finished:
                continue
            room = max(0, min(k, params.max_tokens - r.num_output_tokens - 1))
            want = oracle.drafts(r.all_token_ids, k)[:room]
            assert r.spec_token_ids == want, (r.request_id, r.num_output_tokens)
            checked += bool(want)
    accepted = sum(r.spec_stats.num_accepted_tokens for r in reqs if r.spec_stats)
    return [r.output_token_ids for r in reqs], checked, accepted


# ------------------------------------------------------------------ drafts and exactness


@pytest.mark.parametrize("draft", ["near", "small", "small-eager"])
def test_drafts_equal_the_draft_models_own_generate(
    models: dict[str, Path],
    oracles: dict[str, DraftOracle],
    baseline: list[list[int]],
    draft: str,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Verification would hide a wrong draft: after every step (chunked prefill, a lone prompt's
    chunks that sample nothing, accepted and rejected drafts, preemption, then again with the
    prompts' blocks cached) the drafts are the draft checkpoint's own greedy continuation, by
    transformers; with the CPU fast path and without ("-eager")."""
    if draft.endswith("-eager"):
        monkeypatch.setenv("TANDEM_CPU_FAST_DECODE", "0")
        draft = draft.removesuffix("-eager")
    oracle = oracles[draft]
    k = 3
    with LLM(
        str(models["target"]),
        speculative_config=spec(models, draft, k),
        max_num_batched_tokens=16,
        num_kv_blocks=10,  # not all four requests at once: preemption
        max_model_len=96,
    ) as llm:
        outs, checked, accepted = check_drafts_step_by_step(llm, oracle, k, GREEDY, "a")
        assert outs == baseline and checked > 20
        assert llm.engine.get_stats().num_preemptions > 0
        hits = llm.engine.get_stats().prefix_cache_hits
        outs, _, _ = check_drafts_step_by_step(llm, oracle, k, GREEDY, "b")
        assert outs == baseline
        assert llm.engine.get_stats().prefix_cache_hits > hits
        lone = [list(range(150, 190))]  # 40 tokens: two chunks of 16 sample nothing
        check_drafts_step_by_step(llm, oracle, k, GREEDY, "c", lone)
    if draft == "near":  # drafts accepted and rejected: both rewind paths are checked
        assert 0 < accepted < checked * k


@pytest.mark.parametrize(
    ("by_load", "static"),
    [({"disable_by_batch_size": 2}, False), ({"num_speculative_tokens": {"1": 3, "2": 1}}, True)],
    ids=["paused", "schedule-static"],
)
def test_draft_length_by_batch_size(
    models: dict[str, Path],
    oracles: dict[str, DraftOracle],
    by_load: dict[str, Any],
    static: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Steps of two requests draft fewer tokens (a schedule: 1, through the static-buffer graph
    path) or none (``disable_by_batch_size``: the step still writes the draft KV of its rows);
    after every step the drafts are the draft model's own, cut to the step's length, and a step
    of n drafts ran n + 1 draft forwards."""
    if static:
        monkeypatch.setenv("TANDEM_TEST_STATIC_GRAPHS", "1")
    oracle = oracles["near"]
    k, two = 3, by_load.get("num_speculative_tokens", {}).get("2", 0)
    long = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    crowded = alone = 0
    with LLM(
        str(models["target"]), speculative_config={**spec(models, "near", k), **by_load}
    ) as llm:
        engine = llm.engine
        draft = engine.executor.worker.runner.spec.draft
        forward, calls = draft.forward, []

        def counted(*args: Any, **kw: Any) -> torch.Tensor:
            calls.append(args[2].shape[0])  # the rows of this draft forward
            return forward(*args, **kw)

        monkeypatch.setattr(draft, "forward", counted)
        a = engine.add_request("a", PROMPTS[1], long)
        engine.add_request("b", PROMPTS[0], short)
        while engine.has_unfinished_requests():
            calls.clear()
            ran = [out.request_id for out in engine.step()]
            if a.is_finished:
                continue
            # Step 0 over the step's rows, then one single-row forward per draft.
            assert len(calls) == 1 + (k if len(ran) == 1 else two), (calls, len(ran))
            assert calls[1:] == [len(ran)] * (len(calls) - 1)
            room = max(
                0, min(k if len(ran) == 1 else two, long.max_tokens - a.num_output_tokens - 1)
            )
            assert a.spec_token_ids == oracle.drafts(a.all_token_ids, k)[:room], len(ran)
            crowded += len(ran) == 2
            alone += len(ran) == 1 and room == k
        graphs = engine.executor.worker.runner.graph_runner
        assert not static or graphs.num_replays > 0
    assert crowded >= 3 and alone >= 3


@pytest.mark.parametrize("k", [1, 3])
def test_greedy_draft_model_is_exact(
    models: dict[str, Path], baseline: list[list[int]], k: int
) -> None:
    with LLM(
        str(models["target"]), speculative_config=spec(models, "near", k), max_num_batched_tokens=16
    ) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        stats = llm.engine.spec_stats
        assert 0 < stats.num_accepted_tokens < stats.num_draft_tokens
        assert llm.engine.get_stats().num_used_kv_blocks == 0


@pytest.mark.parametrize("k", [1, 3])
def test_the_target_as_its_own_draft_takes_k_plus_one_tokens(
    models: dict[str, Path], baseline: list[list[int]], k: int
) -> None:
    target = str(models["target"])
    with LLM(target, speculative_config=spec(models, "target", k)) as llm:
        engine = llm.engine
        reqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        grew: list[int] = []
        while engine.has_unfinished_requests():
            before = {r.request_id: r.num_output_tokens for r in reqs}
            for out in engine.step():
                r = reqs[int(out.request_id[1:])]
                if before[r.request_id] > 0:  # a verify step (the first token is the prefill's)
                    left = GREEDY.max_tokens - before[r.request_id]
                    grew.append(r.num_output_tokens - before[r.request_id])
                    assert grew[-1] == min(k + 1, left), (r.request_id, before[r.request_id])
        assert [r.output_token_ids for r in reqs] == baseline
        stats = engine.spec_stats
        assert stats.num_accepted_tokens == stats.num_draft_tokens > 0
        assert max(grew) == k + 1


def test_preemption_prefix_cache_stops_and_n(
    models: dict[str, Path], baseline: list[list[int]]
) -> None:
    with LLM(
        str(models["target"]),
        speculative_config=spec(models, "near", 3),
        num_kv_blocks=10,
        max_model_len=96,
    ) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        assert llm.engine.get_stats().num_preemptions > 0
        hits = llm.engine.get_stats().prefix_cache_hits
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        assert llm.engine.get_stats().prefix_cache_hits > hits
        ref = baseline[1]
        for max_tokens in (1, 2, 7):  # cut mid-draft
            params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            assert tokens(llm.generate([PROMPTS[1]], params)) == [ref[:max_tokens]]
        stop_tok = ref[9]
        (out,) = llm.generate(
            [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[stop_tok])
        )
        assert out.outputs[0].token_ids == ref[: ref.index(stop_tok) + 1]
        text = llm.tokenizer.decode(ref, skip_special_tokens=True)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        assert stop.strip()
        params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, stop=stop)
        (out,) = llm.generate([PROMPTS[1]], params)
        assert out.outputs[0].text == text[: text.index(stop)]
        two = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, n=2)
        (out,) = llm.generate([PROMPTS[3]], two)
        assert [c.token_ids for c in out.outputs] == [baseline[3]] * 2
        assert llm.engine.get_stats().num_used_kv_blocks == 0


def test_penalties_stop_bans_and_a_grammar_equal_plain_decoding(
    models: dict[str, Path], baseline: list[list[int]]
) -> None:
    """Drafts are drawn with the penalties and bias the target applies (counting the drafts
    before them), with the stop tokens ``min_tokens`` bans up to its last banned position, and
    masked by the grammar: the output is plain decoding's, drafts are accepted, and the target
    as its own draft has every penalised or banned draft accepted."""
    schema = {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "array"}},
        "required": ["a", "b"],
    }
    grammar = StructuredSpec("json_schema", json.dumps(schema))
    stops = sorted(set(baseline[0][1:6]))  # what greedy decoding emits early: banned
    params = [
        SamplingParams(
            temperature=0, max_tokens=23, ignore_eos=True, presence_penalty=0.5,
            frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={5: 2.0, 6: 1.5},
        ),
        SamplingParams(temperature=0, max_tokens=30, structured=grammar),
        SamplingParams(temperature=0, max_tokens=23, min_tokens=10, stop_token_ids=stops),
    ]  # fmt: skip
    prompts = [PROMPTS[1], PROMPTS[3], PROMPTS[0]]
    target = str(models["target"])
    with LLM(target) as llm:
        want = tokens(llm.generate(prompts, params))
    assert len(want[2]) > 10 and want[2][:10] != baseline[0][:10]  # the ban changed the output
    for draft in ("near", "target"):
        with LLM(target, speculative_config=spec(models, draft, 3)) as llm:
            outs = llm.generate(prompts, params)
        assert tokens(outs) == want, draft
        assert all(o.spec_stats.num_accepted_tokens > 0 for o in outs), draft
    for out in (outs[0], outs[2]):
        assert out.spec_stats.num_accepted_tokens == out.spec_stats.num_draft_tokens
    assert outs[1].outputs[0].text.startswith('{"a":')  # the grammar held (cut by max_tokens)


def test_static_graph_path_equals_eager(
    models: dict[str, Path], baseline: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The captured-step path (static buffers, run eagerly on the CPU): greedy output equals
    plain decoding, and seeded sampling (the advanced variant: q and pre-drawn draft noise)
    equals the eager path's."""
    sampled = [SamplingParams(temperature=0.8, max_tokens=12, seed=i) for i in range(4)]
    target, k3 = str(models["target"]), spec(models, "near", 3)
    with LLM(target, speculative_config=k3, max_num_seqs=4) as llm:
        eager = tokens(llm.generate(PROMPTS, sampled))
    monkeypatch.setenv("TANDEM_TEST_STATIC_GRAPHS", "1")
    with LLM(target, speculative_config=k3, max_num_seqs=4) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        graphs = llm.engine.executor.worker.runner.graph_runner
        assert graphs is not None and graphs.num_replays > 0
        assert all(step.draft is not None for step in graphs.graphs.values())
        replays = graphs.num_replays
        assert tokens(llm.generate(PROMPTS, sampled)) == eager
        assert graphs.num_replays > replays


def test_sampled_drafts_keep_the_draft_models_probabilities(
    models: dict[str, Path], oracles: dict[str, DraftOracle]
) -> None:
    """Rejection sampling reads q: each stored row is the draft model's own distribution at
    temperature 0.8 after the request's text and the drafts before it (transformers' logits)."""
    oracle = oracles["small"]
    params = SamplingParams(temperature=0.8, max_tokens=8, seed=3, ignore_eos=True)
    with LLM(str(models["target"]), speculative_config=spec(models, "small", 3)) as llm:
        engine = llm.engine
        r = engine.add_request("s", PROMPTS[3], params)
        decoder = engine.executor.worker.runner.spec
        checked = 0
        while engine.has_unfinished_requests():
            engine.step()
            if r.is_finished:
                break
            q = decoder.draft_q["s"]  # [K, V]
            drafts = r.spec_token_ids
            for j, d in enumerate(drafts):
                with torch.no_grad():
                    ids = torch.tensor([r.all_token_ids + drafts[:j]])
                    logits = oracle.model(ids).logits[0, -1]
                want = torch.softmax(logits / 0.8, dim=-1)
                torch.testing.assert_close(q[j], want, atol=1e-5, rtol=1e-4)
                assert q[j, d] > 0
                checked += 1
        assert checked >= 4


# ------------------------------------------------------------------ parallel


PARALLEL_PARAMS = [
    GREEDY,
    SamplingParams(
        temperature=0, max_tokens=23, ignore_eos=True, frequency_penalty=0.5,
        repetition_penalty=1.3, logit_bias={102: 3.0},
    ),
    GREEDY,
    SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, presence_penalty=1.0),
]  # fmt: skip


def step_through(llm: LLM) -> tuple[list[list[int]], list[list[list[int]]]]:
    """(each prompt's tokens, the drafts each step left on it, in order)."""
    engine = llm.engine
    reqs = [engine.add_request(f"r{i}", p, PARALLEL_PARAMS[i]) for i, p in enumerate(PROMPTS)]
    drafts: list[list[list[int]]] = [[] for _ in reqs]
    while engine.has_unfinished_requests():
        for out in engine.step():
            i = int(out.request_id[1:])
            drafts[i].append(list(reqs[i].spec_token_ids))
    return [r.output_token_ids for r in reqs], drafts


@pytest.mark.timeout(300)
def test_tensor_parallel_equals_one_rank(models: dict[str, Path]) -> None:
    """TP = 2 with the draft replicated (draft TP 1) or sharded (2), and attention DP = 2 with
    LM-head TP (greedy drafts from the head's rows sharded over the ranks): the same tokens,
    and each request the same drafts after every step, as one rank."""
    target = str(models["target"])
    k3 = spec(models, "near", 3)
    with LLM(target, speculative_config=k3) as llm:
        want, want_drafts = step_through(llm)
    assert all(any(d) for d in want_drafts)
    runs: list[dict[str, Any]] = [
        {"speculative_config": {**k3, "draft_tensor_parallel_size": 1}},
        {"speculative_config": {**k3, "draft_tensor_parallel_size": 2}},
        {"speculative_config": k3, "enable_attention_dp": True, "enable_lm_head_tp_in_adp": True},
    ]
    for kw in runs:
        with LLM(target, tensor_parallel_size=2, **kw) as llm:
            got, got_drafts = step_through(llm)
        assert got == want, kw
        if kw.get("enable_attention_dp"):
            # LM-head TP's greedy drafts are the sharded head's plain argmax (no penalties or
            # bias, as for every head): compare the requests without them.
            got_drafts, want_drafts = got_drafts[::2], want_drafts[::2]
        assert got_drafts == want_drafts, kw


# ------------------------------------------------------------------ configuration


def test_a_draft_with_another_vocabulary_is_refused(
    models: dict[str, Path], tmp_path: Path
) -> None:
    other = build_llama(tmp_path / "other", layers=1, vocab_size=322)
    with pytest.raises(ValueError, match=r"vocab_size \(322\) differs from the target's \(320\)"):
        LLM(
            str(models["target"]), speculative_config={"method": "draft_model", "model": str(other)}
        )


@pytest.mark.parametrize("tp", [2, 3])
def test_draft_tensor_parallel_size_is_one_or_the_targets(models: dict[str, Path], tp: int) -> None:
    with pytest.raises(
        ValueError, match=rf"draft_tensor_parallel_size={tp}: .* 1 .* tensor_parallel_size \(1\)"
    ):
        LLM(
            str(models["target"]),
            speculative_config=spec(models, "small", 3, draft_tensor_parallel_size=tp),
        )


def test_a_larger_draft_is_served_and_logged(
    models: dict[str, Path], caplog: pytest.LogCaptureFixture
) -> None:
    small = str(models["small"])
    with caplog.at_level(logging.INFO, logger="tandem.models.draft_model"):
        with LLM(small) as llm:
            want = tokens(llm.generate(PROMPTS[:2], GREEDY))
        assert "larger than the target" not in caplog.text
        with LLM(small, speculative_config=spec(models, "target", 2)) as llm:
            assert tokens(llm.generate(PROMPTS[:2], GREEDY)) == want
    assert "larger than the target" in caplog.text


def test_draft_mapping_is_the_targets_or_one_rank() -> None:
    from types import SimpleNamespace

    from tandem.models.draft_model import draft_mapping
    from tandem.models.parallel import ParallelMapping

    target = ParallelMapping(tp_size=2, tp_rank=1)
    for tp in (None, 2):
        assert draft_mapping(SimpleNamespace(draft_tensor_parallel_size=tp), target) is target
    one = draft_mapping(SimpleNamespace(draft_tensor_parallel_size=1), target)
    assert (one.tp_size, one.tp_rank) == (1, 0)
    with pytest.raises(ValueError, match=r"=4: .* tensor_parallel_size \(2\)"):
        draft_mapping(SimpleNamespace(draft_tensor_parallel_size=4), target)
