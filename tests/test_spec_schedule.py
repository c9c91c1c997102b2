"""Draft length by batch size (issue #46, item 4): a ``num_speculative_tokens`` schedule gives
each step the K of its batch size (0 pauses speculation), the draft loop runs only that many
steps, greedy output equals plain decoding as the batch shrinks, and attention-DP ranks follow
one decision. The HTTP side (the K at 1, 4 and 16 streams, from /metrics):
tests/test_server_speculative.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import add_mtp_layers, build_eagle3_draft, build_llama
from tandem import LLM, SamplingParams
from tandem.engine.config import SpeculativeConfig

PROMPTS = [[5, 6, 7, 5, 6, 7], list(range(40, 60)), [100, 101, 100], [9, 8]]
# Requests end one after another: steps run 4, 3, 2, then 1 request.
PARAMS = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (40, 28, 16, 8)]
SCHEDULE = {"1": 4, "2": 3, "3": 1, "4": 0}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("schedule")
    target = build_llama(root / "t", layers=2, heads=4, kv_heads=2)
    add_mtp_layers(target, 1)
    return {"target": target, "eagle3": build_eagle3_draft(root / "e", target)}


@pytest.fixture(scope="module")
def baseline(models: dict[str, Path]) -> list[list[int]]:
    with LLM(str(models["target"])) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def spec(models: dict[str, Path], method: str) -> dict[str, Any]:
    out: dict[str, Any] = {"method": method, "num_speculative_tokens": SCHEDULE}
    if method == "eagle3":
        out["model"] = str(models["eagle3"])
    if method == "ngram":
        out["prompt_lookup_min"] = 1
    return out


def run(
    llm: LLM, params: list[SamplingParams] = PARAMS
) -> tuple[list[list[int]], list[tuple[int, list[int]]]]:
    """(each prompt's tokens, per step: its batch size and every request's new drafts)."""
    engine = llm.engine
    reqs = [engine.add_request(f"r{i}", p, params[i]) for i, p in enumerate(PROMPTS)]
    steps = []
    while engine.has_unfinished_requests():
        ran = engine.step()
        steps.append((len(ran), [len(reqs[int(o.request_id[1:])].spec_token_ids) for o in ran]))
    return [r.output_token_ids for r in reqs], steps


@pytest.mark.parametrize("method", ["mtp", "eagle3", "ngram"])
def test_each_batch_size_drafts_its_k(
    models: dict[str, Path], baseline: list[list[int]], method: str
) -> None:
    config = SpeculativeConfig.from_dict(spec(models, method))
    assert config is not None
    with LLM(str(models["target"]), speculative_config=spec(models, method)) as llm:
        tokens, steps = run(llm)
        by_len = llm.engine.get_stats().spec_steps_by_draft_len
        runner = llm.engine.executor.worker.runner
    assert tokens == baseline
    seen = set()
    for batch, drafts in steps:
        k = config.draft_len(batch)
        assert all(n <= k for n in drafts), (batch, drafts)
        if method != "ngram" and k:  # a head drafts K unless the room left is less
            assert max(drafts) == k or batch == 1, (batch, drafts)
        seen.add(k)
    assert seen == {0, 1, 3, 4}
    assert sum(by_len.values()) == len(steps) and set(by_len) == seen
    if runner.spec.draft is not None:  # the stored q of the last drafts: as many rows as drafts
        assert all(q.shape[0] <= 4 for q in runner.spec.draft_q.values())


def test_sampled_requests_keep_their_q_per_step(models: dict[str, Path]) -> None:
    """Rejection sampling reads q of as many drafts as the step drew (fewer than K at larger
    batches): a seeded sampled run is reproducible and its stats count what was verified."""
    params = [SamplingParams(temperature=0.9, seed=i, max_tokens=p.max_tokens) for i, p in
              enumerate(PARAMS)]  # fmt: skip
    outs = []
    for _ in range(2):
        with LLM(str(models["target"]), speculative_config=spec(models, "mtp")) as llm:
            outs.append([o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)])
            stats = llm.engine.spec_stats
            assert 0 < stats.num_draft_tokens <= 4 * stats.num_drafts
    assert outs[0] == outs[1]


@pytest.mark.parametrize("confidence", [None, 2e-4], ids=["schedule", "confidence"])
def test_attention_dp_ranks_follow_one_schedule(
    models: dict[str, Path], baseline: list[list[int]], confidence: float | None
) -> None:
    """Under attention DP the ranks run one schedule; with a confidence threshold each rank cuts
    its own requests' drafts, and no rank's draft loop stops before the others' (their draft
    layers' collectives need every rank)."""
    cfg = spec(models, "mtp")
    if confidence is not None:
        cfg |= {"adaptive": True, "confidence_threshold": confidence}
    with LLM(
        str(models["target"]),
        speculative_config=cfg,
        tensor_parallel_size=2,
        enable_attention_dp=True,
    ) as llm:
        tokens, steps = run(llm)
        paths = llm.engine.last_rank_paths
    assert tokens == baseline
    assert any(n for _, drafts in steps for n in drafts)
    assert len(paths) == 2 and paths[0] == paths[1]


@pytest.mark.parametrize(
    ("schedule", "extra", "message"),
    [
        ({"2": 3}, {}, 'needs a value for batch size 1 \\(key "1"\\)'),
        ({"1": 0, "4": 0}, {}, "never speculates"),
        ({"1": 3, "x": 1}, {}, "'x' is not a batch size"),
        ({"1": 17}, {}, r"\['1'\]=17 is invalid"),
        ({"1": 3}, {"disable_by_batch_size": 4}, "either a num_speculative_tokens schedule"),
        ({"1": 3}, {"mtp_mode": "vanilla"}, "does not support mtp_mode 'vanilla'"),
        ({"1": 3}, {"topk": 2, "num_draft_tokens": 4}, "applies to chains"),
    ],
)
def test_bad_schedules_are_refused(schedule: dict, extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": schedule, **extra})


def test_schedule_lookup() -> None:
    config = SpeculativeConfig.from_dict(
        {"method": "mtp", "num_speculative_tokens": {"1": 5, "4": 3, "16": 1, "32": 0}}
    )
    assert config is not None and config.num_speculative_tokens == 5
    assert [config.draft_len(b) for b in (1, 3, 4, 15, 16, 31, 32, 500)] == [5, 5, 3, 3, 1, 1, 0, 0]
    fixed = SpeculativeConfig.from_dict({"method": "mtp", "num_speculative_tokens": 2})
    assert fixed is not None and fixed.draft_len(100) == 2
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        SpeculativeConfig.from_dict({"method": "mtp", "draft_len_schedule": [[1, 2]]})


# ------------------------------------------------------------------ adaptive


def test_adaptive_rule() -> None:
    from tandem.engine.speculative.adaptive import PAUSE_STEPS, AdaptiveDepth, best_depth

    # Position j pays while rate ** j >= cost: 0.5 ** 2 = 0.25 >= 0.15 > 0.5 ** 3.
    assert best_depth(0.5, 0.15, 4) == 2
    assert best_depth(0.9, 0.15, 4) == 4 and best_depth(0.9, 0.15, 3) == 3
    assert best_depth(0.1, 0.15, 4) == 1  # at least one: a probe
    assert best_depth(0.5, 0.05, 8) == 4  # cheaper positions go deeper
    d = AdaptiveDepth(4, cost=0.15)
    assert d.update(0, 0, 4) == 4  # a step without drafts (the prefill) changes nothing
    for _ in range(6):
        assert d.update(4, 4, 4) == 4  # all accepted: as deep as K
    assert d.update(4, 4, 2) == 2  # never past the step's K
    for _ in range(60):
        got = d.update(4, 1, 4)  # one of two positions reached is accepted: rate -> 0.5
    assert got == 2 and abs(d.rate - 0.5) < 0.1, d
    got = [d.update(1, 0, 4) for _ in range(40)]  # nothing accepted any more
    stop = got.index(0)  # the estimate fell below the cost: a pause
    assert stop > 2 and got[:stop] == sorted(got[:stop], reverse=True) and min(got[:stop]) == 1
    assert got[stop : stop + PAUSE_STEPS + 1] == [0] * PAUSE_STEPS + [1]  # then a probe


def test_adaptive_loop_depth() -> None:
    """The step's draft loop: one past the deepest verify of its requests (each may go one
    deeper), rounded up to a captured K; none when every request pauses past this step."""
    from tandem.engine.speculative.adaptive import AdaptiveDepth, loop_depth

    shallow, deep, paused = AdaptiveDepth(4), AdaptiveDepth(4), AdaptiveDepth(4)
    shallow.depth, deep.depth, paused.depth, paused.paused = 1, 2, 0, 5
    assert loop_depth([shallow], 4, (1, 2, 4)) == 2
    assert loop_depth([shallow, deep], 4, (1, 2, 4)) == 4  # 3 is not captured: 4
    assert loop_depth([shallow, None], 4, (2, 4)) == 4  # a new request may verify K
    assert loop_depth([deep], 2, (2, 4)) == 2  # the schedule's K for the batch caps it
    assert loop_depth([paused, paused], 4, (4,)) == 0
    paused.paused = 1  # it probes with one draft after this step
    assert loop_depth([paused], 4, (1, 4)) == 1


def test_adaptive_drafts_less_where_drafts_fail(
    models: dict[str, Path], baseline: list[list[int]]
) -> None:
    """A random Eagle3 head is rarely right: adaptive verifies far fewer drafts for the same
    output; the MTP layer of the same random target likewise; greedy output unchanged."""
    fixed = {"method": "eagle3", "model": str(models["eagle3"]), "num_speculative_tokens": 4}
    counts = {}
    for adaptive in (False, True):
        with LLM(str(models["target"]), speculative_config={**fixed, "adaptive": adaptive}) as llm:
            outs = llm.generate(PROMPTS, PARAMS)
            counts[adaptive] = llm.engine.spec_stats.num_draft_tokens
            assert [o.outputs[0].token_ids for o in outs] == baseline
            assert llm.engine.adaptive is None or not llm.engine.adaptive  # state forgotten
    assert counts[True] < counts[False] / 2, counts


@pytest.mark.parametrize("confidence", [None, 0.5])
def test_adaptive_keeps_a_good_draft_deep(tmp_path: Path, confidence: float | None) -> None:
    """A perfect draft (the target's own next token) is always accepted: K + 1 a step; a head
    that sure of itself keeps every draft under a confidence threshold too."""
    from checkpoints import zero_residual_writes

    target = build_llama(tmp_path / "p", layers=2, seed=3)
    zero_residual_writes(target)
    add_mtp_layers(target, 1, perfect=True)
    spec = {"method": "mtp", "num_speculative_tokens": 3, "adaptive": True}
    if confidence is not None:
        spec["confidence_threshold"] = confidence
    params = SamplingParams(temperature=0, max_tokens=41, ignore_eos=True)
    with LLM(str(target), speculative_config=spec) as llm:
        (out,) = llm.generate([[5, 6, 7]], params)
    stats = out.spec_stats
    assert stats is not None and stats.num_draft_tokens == 3 * stats.num_drafts
    assert stats.num_accepted_tokens == stats.num_draft_tokens


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_paused_steps_draft_kv_waits_and_drafts_the_same(
    models: dict[str, Path], baseline: list[list[int]], method: str, monkeypatch
) -> None:
    """A paused step keeps its draft-KV rows and a later step writes them in one call (before
    it drafts, or when its requests change): every draft proposed is the one written-at-once
    KV gives (draft-side: verification would hide a wrong draft KV), and the rows did wait."""
    from tandem.engine.speculative.decoder import SpecDecoder

    def drafts_with(defer: bool) -> tuple[list, list[int]]:
        stashed: list[int] = []
        stash = SpecDecoder.stash_step_kv

        def counting(self, inp, *args, **kw) -> None:
            stashed.append(int(inp.positions.shape[0]))
            stash(self, inp, *args, **kw)

        with monkeypatch.context() as m:
            m.setattr(SpecDecoder, "stash_step_kv", counting)
            if not defer:
                m.setattr(SpecDecoder, "defers_step_kv", lambda self, meta: False)
            with LLM(str(models["target"]), speculative_config=spec(models, method)) as llm:
                engine = llm.engine
                reqs = [engine.add_request(f"r{i}", q, PARAMS[i]) for i, q in enumerate(PROMPTS)]
                proposed = []
                while engine.has_unfinished_requests():
                    engine.step()
                    proposed.append([list(r.spec_token_ids) for r in reqs])
        assert [r.output_token_ids for r in reqs] == baseline
        return proposed, stashed

    at_once, none = drafts_with(defer=False)
    deferred, stashed = drafts_with(defer=True)
    assert none == [] and sum(stashed) >= 4 * 2, stashed  # paused steps of 4 requests waited
    assert deferred == at_once


def test_paused_steps_sample_as_plain_decoding(models: dict[str, Path], monkeypatch) -> None:
    """A paused step with nothing to verify samples each request's row as plain decoding does
    (its sampler, logprobs and min_tokens included) and keeps its draft-KV rows: sampled
    requests of every kind run through a schedule that pauses at 4 requests."""
    from tandem.engine.model_runner import ModelRunner

    plain_steps = []
    sample = ModelRunner._sample_last_rows

    def counting(self, inp, hidden):
        if self.spec is not None:
            plain_steps.append(len(inp.sampled))
        return sample(self, inp, hidden)

    monkeypatch.setattr(ModelRunner, "_sample_last_rows", counting)
    params = [
        SamplingParams(temperature=0.8, seed=7, max_tokens=24, logprobs=2, ignore_eos=True),
        SamplingParams(temperature=1.0, top_k=5, max_tokens=16, min_tokens=16),
        SamplingParams(temperature=0, max_tokens=12, logprobs=1, ignore_eos=True),
        SamplingParams(temperature=0.5, top_p=0.9, max_tokens=8, ignore_eos=True),
    ]
    with LLM(str(models["target"]), speculative_config=spec(models, "eagle3")) as llm:
        outs = llm.generate(PROMPTS, params)
    assert plain_steps and set(plain_steps) == {4}  # the paused steps, all four requests
    for out, p in zip(outs, params, strict=True):
        got = out.outputs[0]
        assert len(got.token_ids) == p.max_tokens  # min_tokens: no EOS before 16
        if p.logprobs:
            assert got.logprobs is not None and len(got.logprobs) == len(got.token_ids)
            for tok, lp in zip(got.token_ids, got.logprobs, strict=True):
                assert lp.token_id == tok and lp.logprob <= 0
                assert len(lp.top_token_ids) == p.logprobs and max(lp.top_logprobs) <= 0


def test_last_writes_keeps_each_slots_later_row() -> None:
    from tandem.engine.speculative.decoder import last_writes

    slots = torch.tensor([7, 3, 9, 3, -1, 7, 5, -1])
    assert last_writes(slots).tolist() == [2, 3, 5, 6, 7]


def _drive(
    costs: Any, batch: int, seconds: dict[int, float], tokens: float, steps: int
) -> list[int]:
    """The engine's use of ``StepCosts``: choose, run (``seconds`` a request by choice; each
    request's verification of its drafts emits ``tokens``), record."""
    ks, drafted = [], False
    for _ in range(steps):
        k = costs.choose(batch, 3)
        if drafted:  # this step verifies the last step's drafts
            for _ in range(batch):
                costs.verified(tokens - 1)  # type: ignore[arg-type]  (a mean)
        costs.record(batch, k, seconds[k] * batch, decode=True)
        ks.append(k)
        drafted = k > 0
    return ks


def test_cost_aware_rule_follows_the_measured_step_costs() -> None:
    """Drafts where their tokens per second (tokens per verification over a drafted step's
    time) beat plain decoding's, none elsewhere; the other choice probed for PROBE_STEPS steps
    every PROBE_EVERY; a step is timed only after a step of the same choice (the first after a
    change verifies the old one's drafts)."""
    from tandem.engine.speculative.adaptive import (
        MARGIN,
        MIN_TIMED,
        PROBE_EVERY,
        PROBE_STEPS,
        StepCosts,
        batch_bucket,
    )

    assert [batch_bucket(b) for b in (1, 2, 3, 4, 5, 8, 9, 16, 17)] == [
        1,
        2,
        4,
        4,
        8,
        8,
        16,
        16,
        32,
    ]
    # A drafted step costs 2x a plain one and emits 3 tokens: drafts pay.
    costs = StepCosts()
    ks = _drive(costs, 1, {3: 0.008, 0: 0.004}, 3.0, 400)
    warm = int(MIN_TIMED) + 1
    assert ks[: warm + PROBE_STEPS] == [3] * warm + [0] * PROBE_STEPS  # timed, then plain probed
    assert costs.seconds((1, 1)) == pytest.approx(0.008)
    assert costs.seconds((1, 0)) == pytest.approx(0.004)
    assert costs.tokens_per_verification() == pytest.approx(3.0)
    rest = ks[warm + PROBE_STEPS :]
    runs = "".join("s" if k else "p" for k in rest).split("s")
    assert {len(r) for r in runs} == {0, PROBE_STEPS}  # plain only in probes
    assert len(rest) // (PROBE_EVERY + PROBE_STEPS) <= rest.count(0) // PROBE_STEPS
    assert rest.count(0) // PROBE_STEPS <= len(rest) // PROBE_EVERY

    # Four requests, 1.5 tokens each at 2x the cost: plain gives more; only the probes draft.
    costs = StepCosts()
    ks = _drive(costs, 4, {3: 0.008, 0: 0.004}, 1.5, 400)
    rest = ks[warm + PROBE_STEPS :]
    runs = "".join("s" if k else "p" for k in rest).split("p")
    assert {len(r) for r in runs} == {0, PROBE_STEPS}
    assert costs.seconds((4, 1)) == pytest.approx(0.008)

    # The load changes (drafts get cheaper): the probes move the estimate, and it switches.
    ks = _drive(costs, 4, {3: 0.005, 0: 0.004}, 1.5, 12 * PROBE_EVERY)
    assert ks[-PROBE_EVERY:].count(3) >= PROBE_EVERY - PROBE_STEPS
    # Near a tie (within MARGIN) it keeps its choice rather than flip on noise.
    tie = {3: 0.006 * MARGIN**0.5, 0: 0.004}  # plain 2.5 % ahead
    ks = _drive(costs, 4, tie, 1.5, 3 * PROBE_EVERY)
    assert ks[-PROBE_EVERY:].count(3) >= PROBE_EVERY - PROBE_STEPS

    # A stall counts for at most MAX_JUMP times the estimate; other batch sizes apart.
    costs = StepCosts()
    _drive(costs, 1, {3: 0.008, 0: 0.004}, 2.0, 3)
    costs.record(1, 3, 10.0, decode=True)
    assert costs.seconds((1, 1)) < 0.02  # not the 5 s of an unclamped mean
    # Steps with drafts count together, whatever their length (the per-request rule's).
    steps = costs.sums[(1, 1)][1]
    costs.record(1, 2, 0.008, decode=True)
    assert costs.sums[(1, 1)][1] > steps
    costs.record(3, 3, 1.0, decode=True)  # bucket 4: not the same as the last step's
    costs.record(3, 3, 0.04, decode=False)  # prompt rows: not timed
    assert costs.seconds((4, 1)) is None


def test_cost_aware_keeps_greedy_output_and_pauses_where_plain_measured_faster(
    models: dict[str, Path], baseline: list[list[int]], monkeypatch
) -> None:
    """Through the engine: steps timed as if drafted steps cost 10x plain ones run without
    drafts but the probes; greedy output is plain decoding's either way."""
    from tandem.engine.speculative import adaptive

    record = adaptive.StepCosts.record

    def slow_drafts(self, batch_size: int, k: int, seconds: float, decode: bool) -> None:
        record(self, batch_size, k, 0.001 * batch_size * (10 if k else 1), decode)

    cfg = {**spec(models, "eagle3"), "adaptive": True, "cost_aware": True}
    with LLM(str(models["target"]), speculative_config=cfg) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        assert [o.outputs[0].token_ids for o in outs] == baseline
        costs = llm.engine.step_costs
    assert costs.sums and all(v[0] > 0 and v[1] > 0 for v in costs.sums.values())
    assert costs.tokens_per_verification() >= 1.0
    long = [SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)]
    with LLM(str(models["target"])) as plain:
        want = plain.generate([PROMPTS[0]], long)[0].outputs[0].token_ids
    monkeypatch.setattr(adaptive.StepCosts, "record", slow_drafts)
    with LLM(str(models["target"]), speculative_config=cfg) as llm:
        (out,) = llm.generate([PROMPTS[0]], long)
        steps = llm.engine.steps_by_draft_len
    assert out.outputs[0].token_ids == want
    drafted = sum(n for k, n in steps.items() if k)
    # Each draft length is measured on its own (two steps), then only the probes draft.
    probes = (200 // adaptive.PROBE_EVERY + 1) * adaptive.PROBE_STEPS
    assert steps.get(0, 0) > 150 and drafted <= 2 * 4 + probes + 4, steps


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"adaptive": "yes"}, "speculative_config.adaptive='yes' is invalid"),
        ({"adaptive": True, "topk": 2, "num_draft_tokens": 4}, "adaptive applies to chains"),
        ({"adaptive": True, "mtp_mode": "vanilla"}, "adaptive applies to chains"),
        ({"adaptive": True, "method": "suffix"}, "adaptive applies to chains"),  # trees
        ({"cost_aware": True}, "cost_aware needs adaptive: true"),
        ({"adaptive": True, "cost_aware": 1}, "speculative_config.cost_aware=1 is invalid"),
        (
            {"method": "ngram", "adaptive": True, "cost_aware": True},
            "cost_aware applies to eagle3, mtp and draft_model",
        ),
        ({"confidence_threshold": 0.3}, "confidence_threshold needs adaptive: true"),
        ({"adaptive": True, "confidence_threshold": 1.0}, "confidence_threshold=1.0 is invalid"),
        ({"adaptive": True, "confidence_threshold": True}, "confidence_threshold=True is invalid"),
        ({"adaptive": True, "confidence_threshold": "0.3"}, "confidence_threshold='0.3' is inv"),
        (
            {"method": "ngram", "adaptive": True, "confidence_threshold": 0.3},
            "confidence_threshold applies to eagle3 and mtp",
        ),
    ],
)
def test_bad_adaptive_settings_are_refused(extra: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        SpeculativeConfig.from_dict({"method": "mtp", **extra})


@pytest.mark.parametrize("method", ["mtp", "ngram"])
def test_graph_keys_carry_the_scheduled_k(
    models: dict[str, Path], baseline: list[list[int]], method: str, monkeypatch
) -> None:
    """Every K of the schedule has its captured steps (the static-buffer path, run eagerly on a
    CPU): steps that verify as many drafts as they draw replay the graph of their K."""
    from tandem.engine.graph_runner import GraphReplay

    replayed = []
    forward = GraphReplay.forward

    def record(self: GraphReplay) -> Any:
        replayed.append(self.captured.key.draft_len)
        return forward(self)

    # The longest request runs on alone: batch-1 steps with room for K = 4.
    lengths = (80, 24, 16, 8)
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in lengths]
    with LLM(str(models["target"])) as llm:
        want = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert want[1:] == [t[:n] for t, n in zip(baseline[1:], lengths[1:], strict=True)]
    monkeypatch.setattr(GraphReplay, "forward", record)
    monkeypatch.setenv("TANDEM_TEST_STATIC_GRAPHS", "1")
    with LLM(str(models["target"]), speculative_config=spec(models, method), max_num_seqs=4) as llm:
        tokens, _ = run(llm, params)
        graphs = llm.engine.executor.worker.runner.graph_runner
    assert tokens == want
    assert graphs is not None and {key.draft_len for key in graphs.graphs} == {1, 3, 4}
    assert {1, 4} <= set(replayed), replayed  # batches of 3 (K 1), then of 1 (K 4)


def _watch_confidence(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Each draft loop's record: the head's softmax probability of its argmax at each position
    it drafted (float64, from the logits it drafted from), its drafts, the running products it
    kept (``last_confidence``) and the drafts the runner then keeps per request."""
    from tandem.engine.speculative import decoder

    loops: list[dict[str, Any]] = []
    draft_token, draft_loop = decoder.SpecDecoder._draft_token, decoder.SpecDecoder.draft_loop
    kept = decoder.SpecDecoder.confident_drafts

    def token(self: Any, logits: torch.Tensor, *args: Any, **kw: Any) -> Any:
        loops[-1]["top"].append(logits.double().softmax(-1).amax(-1).tolist())
        return draft_token(self, logits, *args, **kw)

    def loop(self: Any, *args: Any, **kw: Any) -> Any:
        loops.append({"top": []})
        drafts, q = draft_loop(self, *args, **kw)
        conf = self.last_confidence
        loops[-1] |= {"drafts": drafts.tolist(), "conf": None if conf is None else conf.tolist()}
        return drafts, q

    def confident(self: Any) -> torch.Tensor:
        out = kept(self)
        loops[-1]["kept"] = out.tolist()
        return out

    monkeypatch.setattr(decoder.SpecDecoder, "_draft_token", token)
    monkeypatch.setattr(decoder.SpecDecoder, "draft_loop", loop)
    monkeypatch.setattr(decoder.SpecDecoder, "confident_drafts", confident)
    return loops


@pytest.mark.parametrize("method", ["mtp", "eagle3"])
def test_confidence_keeps_the_drafts_the_head_is_sure_of(
    models: dict[str, Path], baseline: list[list[int]], method: str, monkeypatch
) -> None:
    """``confidence_threshold`` (step-by-step loop): each draft's running product is the product
    of the head's softmax probabilities of its argmax (computed here in float64 from the logits
    it drafted from), a request keeps the drafts whose product reaches the threshold, the loop
    stops once no request's does (never before), and greedy output is unchanged."""
    thr = 2e-4  # a random head: about 0.015 at the first draft, 2e-4 at the second, 3e-6 next
    cfg = {**spec(models, method), "num_speculative_tokens": 4, "adaptive": True}
    loops = _watch_confidence(monkeypatch)
    with LLM(str(models["target"]), speculative_config={**cfg, "confidence_threshold": thr}) as llm:
        llm.engine.executor.worker.runner.spec.fast_chain = False
        tokens, _ = run(llm)
        verified = llm.engine.spec_stats.num_draft_tokens
    assert tokens == baseline
    kept_seen = set()
    for rec in loops:
        if rec["conf"] is None:  # a loop of the schedule's K = 0 steps: none
            continue
        run_steps, k = len(rec["top"]), len(rec["drafts"][0])
        assert 1 <= run_steps <= k
        for b, conf in enumerate(rec["conf"]):
            want, product = [], 1.0
            for j in range(run_steps):
                product *= rec["top"][j][b]
                want.append(product)
            assert conf[:run_steps] == pytest.approx(want, rel=1e-5), (conf, want)
            assert conf[run_steps:] == [0.0] * (k - run_steps)  # the steps not run
            lead = next((j for j, c in enumerate(conf) if not c >= thr), k)
            assert rec["kept"][b] == lead
            kept_seen.add(lead)
        # It went on while some request's product reached the threshold, and stopped once none
        # did.
        for j in range(run_steps - 1):
            assert any(c[j] >= thr for c in rec["conf"]), rec
        if run_steps < k:
            assert not any(c[run_steps - 1] >= thr for c in rec["conf"]), rec
    assert len(kept_seen) >= 2, kept_seen  # cuts at more than one depth
    # The engine verifies at most the kept drafts (K = 4 of each would be far more).
    assert 0 < verified <= sum(sum(r["kept"]) for r in loops if "kept" in r)


@pytest.mark.parametrize(
    ("head_dtype", "target_dtype"), [(torch.float32, "float32"), (torch.bfloat16, "bfloat16")]
)
def test_confidence_of_the_fast_chain_equals_the_loops(
    models: dict[str, Path],
    tmp_path: Path,
    head_dtype: torch.dtype,
    target_dtype: str,
    monkeypatch,
) -> None:
    """The CPU fast path's Eagle3 chain (``cpu_decode.eagle3_chain``) computes the same running
    products and stops where the step-by-step loop does: same drafts, products and kept counts
    after every step, and the same output."""
    from tandem.kernels import cpu_decode

    if cpu_decode.unavailable_reason() is not None:
        pytest.skip(f"no CPU fast path: {cpu_decode.unavailable_reason()}")
    head = build_eagle3_draft(tmp_path / "h", models["target"], draft_vocab=160, dtype=head_dtype)
    cfg = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4, "adaptive": True}
    cfg["confidence_threshold"] = 0.005
    calls: list[int] = []
    chain = cpu_decode.eagle3_chain
    monkeypatch.setattr(cpu_decode, "eagle3_chain", lambda *a: calls.append(1) or chain(*a))
    loops = _watch_confidence(monkeypatch)
    runs = []
    for fast in (True, False):
        loops.clear()
        with LLM(str(models["target"]), dtype=target_dtype, speculative_config=cfg) as llm:
            llm.engine.executor.worker.runner.spec.fast_chain = fast
            tokens, _ = run(llm)
        runs.append((tokens, [(r["drafts"], r["conf"], r.get("kept")) for r in loops]))
        assert bool(calls) == fast
        calls.clear()
    (fast_tokens, fast_loops), (loop_tokens, slow_loops) = runs
    assert fast_tokens == loop_tokens
    assert len(fast_loops) == len(slow_loops)
    stops = 0
    for (d1, c1, k1), (d2, c2, k2) in zip(fast_loops, slow_loops, strict=True):
        assert d1 == d2 and k1 == k2
        if c1 is not None:
            assert torch.tensor(c1) == pytest.approx(torch.tensor(c2), rel=1e-3, abs=1e-7)
            stops += any(row[-1] == 0.0 for row in c1)
    assert stops > 0  # some chains stopped early
