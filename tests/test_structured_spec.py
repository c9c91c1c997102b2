"""Structured output under speculative decoding (issue 34, item 3): the target's distribution is
masked at every verified position with the grammar's state after the drafts before it, so greedy
output equals constrained greedy without speculation, sampled output always matches the grammar
and is distributed as constrained sampling without speculation, and the engine's matcher is, after
every step, where the emitted tokens alone would put it."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter
from pathlib import Path
from typing import Any

import jsonschema
import pytest

from checkpoints import (
    add_mtp_layers,
    build_eagle3_draft,
    build_llama,
    make_echo_target,
    perfect_eagle3_draft,
)
from tandem import LLM, SamplingParams
from tandem.engine.outputs import RequestOutput
from tandem.engine.speculative.tree import node_path
from tandem.engine.structured_output import StructuredSpec

PROMPTS: list[list[int]] = [[5, 6, 7], list(range(40, 70)), [100, 101], [200, 201, 202, 203]]
SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "bb", "ccc"]}, "maxItems": 4},
    },
    "required": ["name", "age", "tags"],
    "additionalProperties": False,
}
REGEX = r"[a-e]{2,6}( [a-e]{1,5}){1,4}\."
GRAMMARS: dict[str, StructuredSpec] = {
    "json": StructuredSpec("json_schema", json.dumps(SCHEMA)),
    "regex": StructuredSpec("regex", REGEX),
}
# target folder, speculative_config (without num_speculative_tokens) per setup: random drafts
# (mostly forbidden or rejected) and near-perfect ones (many accepted).
SETUPS = ("eagle3-random", "mtp-random", "eagle3-near", "mtp-perfect")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("structured_spec")
    target = build_llama(root / "target", layers=2)
    add_mtp_layers(target, 1)
    draft = build_eagle3_draft(root / "eagle3", target, draft_vocab=160)
    near = root / "near"
    shutil.copytree(target, near)
    make_echo_target(near, residual_scale=20.0)
    near_draft = perfect_eagle3_draft(root / "near_eagle3", near, residual_scale=3.0)
    vanilla = root / "vanilla"
    shutil.copytree(target, vanilla)
    add_mtp_layers(vanilla, 3, seed=5)  # three MTP layers: vanilla MTP drafts K = 3
    perfect = build_llama(root / "perfect", layers=2, seed=3)
    make_echo_target(perfect, residual_scale=20.0)
    add_mtp_layers(perfect, 1, perfect=True)
    return {
        "target": target,
        "eagle3": draft,
        "near": near,
        "near_eagle3": near_draft,
        "perfect": perfect,
        "vanilla": vanilla,
    }


def setup(models: dict[str, Path], name: str, k: int) -> tuple[Path, dict[str, Any]]:
    """(target, speculative_config) of one setup."""
    if name == "eagle3-random":
        return models["target"], {"method": "eagle3", "model": str(models["eagle3"])} | {
            "num_speculative_tokens": k
        }
    if name == "mtp-random":
        return models["target"], {"method": "mtp", "num_speculative_tokens": k}
    if name == "mtp-vanilla":  # three MTP layers: K = 3 whatever ``k`` says
        return models["vanilla"], {
            "method": "mtp",
            "mtp_mode": "vanilla",
            "num_speculative_tokens": 3,
        }
    if name == "eagle3-near":
        return models["near"], {
            "method": "eagle3",
            "model": str(models["near_eagle3"]),
            "num_speculative_tokens": k,
        }
    return models["perfect"], {"method": "mtp", "num_speculative_tokens": k}


def check(grammar: str, text: str) -> None:
    if grammar == "json":
        jsonschema.validate(json.loads(text), SCHEMA)
    else:
        assert re.fullmatch(REGEX, text), text


def tokens(outs: list[RequestOutput]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def greedy(grammar: str) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=200, structured=GRAMMARS[grammar])


@pytest.fixture(scope="module")
def baseline(models: dict[str, Path]) -> dict[tuple[str, str], list[list[int]]]:
    """Constrained greedy output without speculation, per (target, grammar)."""
    out = {}
    for target in ("target", "near", "perfect"):
        with LLM(str(models[target])) as llm:
            for grammar in GRAMMARS:
                outs = llm.generate(PROMPTS, greedy(grammar))
                for o in outs:
                    assert o.outputs[0].finish_reason == "stop"
                    check(grammar, o.outputs[0].text)
                out[target, grammar] = tokens(outs)
    return out


def test_setups_speculate_and_some_drafts_are_accepted(models: dict[str, Path]) -> None:
    """The near-perfect setups accept many drafts under the grammars (so the masks after
    accepted drafts matter), the random ones few."""
    for name in ("eagle3-near", "mtp-perfect"):
        target, spec = setup(models, name, 3)
        with LLM(str(target), speculative_config=spec) as llm:
            accepted = 0
            for grammar in GRAMMARS:
                outs = llm.generate(PROMPTS, greedy(grammar))
                accepted += sum(o.spec_stats.num_accepted_tokens for o in outs)
            assert accepted >= 10, (name, accepted)


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("name", SETUPS)
def test_greedy_equals_constrained_greedy_without_speculation(
    models: dict[str, Path], baseline: dict[tuple[str, str], list[list[int]]], name: str, k: int
) -> None:
    target, spec = setup(models, name, k)
    # A 16-token budget puts the 30-token prompt in chunks beside decodes.
    with LLM(str(target), speculative_config=spec, max_num_batched_tokens=16) as llm:
        accepted = 0
        for grammar in GRAMMARS:
            outs = llm.generate(PROMPTS, greedy(grammar))
            assert tokens(outs) == baseline[target.name, grammar], (name, k, grammar)
            accepted += sum(o.spec_stats.num_accepted_tokens for o in outs)
            # Mixed with an unconstrained request in the same steps.
            free = SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True)
            mixed = llm.generate(PROMPTS[:2], [greedy(grammar), free])
            assert mixed[0].outputs[0].token_ids == baseline[target.name, grammar][0]
        assert llm.engine.get_stats().num_used_kv_blocks == 0
        assert not llm.engine.structured.matchers
    if "random" not in name:
        assert accepted > 0


def test_vanilla_mtp_greedy_equals_constrained_greedy(models: dict[str, Path]) -> None:
    spec = {"method": "mtp", "mtp_mode": "vanilla", "num_speculative_tokens": 3}
    target = str(models["vanilla"])
    for grammar in GRAMMARS:
        with LLM(target) as llm:
            ref = tokens(llm.generate(PROMPTS, greedy(grammar)))
        with LLM(target, speculative_config=spec, max_num_batched_tokens=16) as llm:
            assert tokens(llm.generate(PROMPTS, greedy(grammar))) == ref, grammar
            hot = SamplingParams(
                temperature=1.0, seed=2, max_tokens=150, structured=GRAMMARS[grammar]
            )
            for o in llm.generate(PROMPTS, hot):
                check(grammar, o.outputs[0].text)


@pytest.mark.parametrize("name", ["eagle3-near", "mtp-perfect", "eagle3-random"])
def test_draft_trees_under_a_grammar(
    models: dict[str, Path], baseline: dict[tuple[str, str], list[list[int]]], name: str
) -> None:
    """Draft trees (2 children per node, 6 nodes) under a grammar: each node's target row is
    masked by the grammar's state after the node's path, and each node's children are the
    top-k tokens the grammar allows there. Greedy output equals constrained greedy without
    speculation; seeded sampled outputs match the grammar; every node drafted is allowed after
    its path (but where the grammar leaves the head's vocabulary nothing); the near-perfect
    heads accept more than one token per step."""
    target, spec = setup(models, name, 3)
    spec |= {"topk": 2, "num_draft_tokens": 6}
    with LLM(str(target), speculative_config=spec, max_num_batched_tokens=32) as llm:
        compiler = llm.engine.structured.compiler
        vocab = int(compiler.ll_tokenizer.vocab_size)
        d2t = getattr(llm.engine.executor.worker.runner.spec.draft, "d2t", None)
        head_vocab = set(range(vocab)) if d2t is None else {i + int(d) for i, d in enumerate(d2t)}
        steps = record_steps(llm)
        checked = 0
        for grammar, structured in GRAMMARS.items():
            steps.clear()
            outs = llm.generate(PROMPTS, greedy(grammar))
            assert tokens(outs) == baseline[target.name, grammar], grammar
            hot = [
                SamplingParams(temperature=1.0, seed=s, max_tokens=150, structured=structured)
                for s in range(8)
            ]
            for o in llm.generate([PROMPTS[s % len(PROMPTS)] for s in range(8)], hot):
                assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
                check(grammar, o.outputs[0].text)
            checked += _check_tree_drafts(steps, compiler.matcher(structured), vocab, head_vocab)
        stats = llm.engine.get_stats()
        assert stats.spec_num_draft_tokens > 0 and not llm.engine.structured.matchers
    assert checked > 50, checked
    if "random" not in name:
        assert stats.spec_num_accepted_tokens > stats.spec_num_drafts


def _check_tree_drafts(
    steps: list[Any], matcher: Any, vocab: int, head_vocab: set[int], topk: int = 2
) -> int:
    """Every tree node of ``steps`` (``record_steps``, parents included) is allowed after the
    request's output and the node's path, or the grammar allows fewer than ``topk`` tokens of
    the head's vocabulary where the node's parent path leaves it (none: an unmasked fallback;
    some: the other children are -inf placeholders); returns the nodes checked."""
    emitted: dict[str, list[int]] = {}
    checked = 0
    for rid, toks, drafts, parents in steps:
        emitted.setdefault(rid, []).extend(toks)
        matcher.reset()
        if matcher.try_consume_tokens(emitted[rid]) < len(emitted[rid]) or matcher.is_stopped():
            continue  # the request finished with this step
        for j in range(len(drafts)):
            path = node_path(drafts, parents, j)
            n = matcher.try_consume_tokens(path[:-1])
            stopped = n < len(path) - 1 or matcher.is_stopped()  # an ancestor's fallback or end
            if not stopped:
                if matcher.try_consume_tokens(path[-1:]):
                    n += 1
                    checked += 1
                else:  # fewer allowed head tokens than children: -inf placeholders
                    assert len(set(_allowed(matcher, vocab)) & head_vocab) < topk, (rid, path)
            if n:
                matcher.rollback(n)
    return checked


@pytest.mark.parametrize("name", SETUPS)
def test_sampled_outputs_match_the_grammar(models: dict[str, Path], name: str) -> None:
    target, spec = setup(models, name, 3)
    with LLM(str(target), speculative_config=spec) as llm:
        for grammar, spec_ in GRAMMARS.items():
            params = [
                SamplingParams(temperature=1.0, seed=s, max_tokens=150, structured=spec_)
                for s in range(12)
            ]
            outs = llm.generate([PROMPTS[s % len(PROMPTS)] for s in range(12)], params)
            for o in outs:
                assert o.outputs[0].finish_reason == "stop", o.outputs[0].text
                check(grammar, o.outputs[0].text)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", ["eagle3-near", "mtp-perfect", "eagle3-random"])
def test_matcher_after_every_step_is_that_of_the_emitted_tokens(
    models: dict[str, Path], name: str, temperature: float
) -> None:
    """After every engine step each live matcher computes the same mask, and agrees on stopped /
    accepting, as a fresh matcher fed exactly the request's output tokens: the speculative
    advance along the drafts is rolled back."""
    target, spec = setup(models, name, 3)
    with LLM(str(target), speculative_config=spec) as llm:
        engine = llm.engine
        specs: dict[str, StructuredSpec] = {}
        real_step = engine.step
        checked = 0

        def step() -> list[RequestOutput]:
            nonlocal checked
            outputs = real_step()
            for out in outputs:
                rid = out.request_id
                live = engine.structured.matchers.get(rid)
                if live is None:
                    continue
                fresh = engine.structured.compiler.matcher(specs[rid])
                assert fresh.consume_tokens(list(out.outputs[0].token_ids))
                assert live.is_stopped() == fresh.is_stopped()
                assert live.is_accepting() == fresh.is_accepting()
                assert live.compute_bitmask() == fresh.compute_bitmask(), rid
                checked += 1
            return outputs

        engine.step = step  # type: ignore[method-assign]
        accepted = 0
        for grammar, spec_ in GRAMMARS.items():
            params = SamplingParams(
                temperature=temperature, seed=7, max_tokens=150, structured=spec_
            )
            rids = [f"{grammar}-{i}" for i in range(len(PROMPTS))]
            for rid, prompt in zip(rids, PROMPTS, strict=True):
                specs[rid] = spec_
                engine.add_request(rid, prompt, params)
            done: dict[str, RequestOutput] = {}
            while engine.has_unfinished_requests():
                for out in engine.step():
                    if out.finished:
                        done[out.request_id] = out
                assert not engine.take_failed()
            for rid in rids:
                check(grammar, done[rid].outputs[0].text)
            accepted += sum(done[rid].spec_stats.num_accepted_tokens for rid in rids)
        assert checked > 20
    if "random" not in name:
        assert accepted > 0


def test_forbidden_drafts_are_not_verified(models: dict[str, Path]) -> None:
    """Drafts the grammar forbids are cut before the step that would verify them: random drafts
    under a narrow regex are nearly all forbidden, so few drafts reach verification, and those
    that do are allowed by the grammar. A sampled request keeps its first forbidden draft (its
    rejection samples the residual) and nothing after it."""
    target, spec = setup(models, "mtp-random", 3)
    with LLM(str(target), speculative_config=spec) as llm:
        engine = llm.engine
        real_masks = engine.structured.masks
        verified: list[bool] = []
        kept: list[tuple[int, list[int]]] = []

        def masks(
            ids: list[str], width: int, drafts: dict[str, list[int]] | None = None, parents=None
        ) -> Any:
            assert drafts is not None and parents is None
            for rid, ds in drafts.items():
                m = engine.structured.matchers[rid]
                n = m.validate_tokens(ds)
                verified.append(n == len(ds))
                kept.append((n, ds))
            return real_masks(ids, width, drafts, parents)

        engine.structured.masks = masks  # type: ignore[method-assign]
        outs = llm.generate(PROMPTS, greedy("regex"))
        assert verified and all(verified)
        verified.clear()
        sampled = SamplingParams(
            temperature=1.0, seed=3, max_tokens=100, structured=GRAMMARS["regex"]
        )
        llm.generate(PROMPTS, sampled)
        assert verified and not all(verified)
        assert all(n >= len(ds) - 1 for n, ds in kept)
        free = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
        unconstrained = llm.generate(PROMPTS, free)
    assert sum(o.spec_stats.num_draft_tokens for o in outs) < sum(
        o.spec_stats.num_draft_tokens for o in unconstrained
    )


def test_distribution_equals_constrained_sampling_without_speculation(
    models: dict[str, Path],
) -> None:
    """Two-sample chi-square on the first two speculated positions (output tokens 1 and 2, the
    drafts proposed at prefill): constrained temperature-1 sampling with near-perfect MTP
    speculation (rejection sampling of the unmasked drafts against the masked target) against
    none, 10,000 samples each."""
    scipy_stats = pytest.importorskip("scipy.stats")
    n = 10000
    spec = StructuredSpec("regex", "[a-d][a-d][a-d]")
    prompts = [PROMPTS[0]] * n
    target, cfg = setup(models, "mtp-perfect", 3)
    counts: list[Counter[tuple[int, ...]]] = []
    for run, kwargs in enumerate(({}, {"speculative_config": cfg})):
        # Seeded (distinct seeds per request and per run): the test is deterministic.
        params = [
            SamplingParams(
                temperature=1.0, max_tokens=3, structured=spec, seed=run * n + i, detokenize=False
            )
            for i in range(n)
        ]
        with LLM(str(target), max_num_seqs=256, **kwargs) as llm:
            outs = llm.generate(prompts, params)
            if kwargs:  # many drafts accepted and many rejected
                drafted = sum(o.spec_stats.num_draft_tokens for o in outs)
                accepted = sum(o.spec_stats.num_accepted_tokens for o in outs)
                assert accepted > n // 4 and drafted - accepted > n // 4, (drafted, accepted)
        counts.append(Counter(tuple(o.outputs[0].token_ids[1:3]) for o in outs))
    keys = sorted(set(counts[0]) | set(counts[1]))
    table = [[c[key] for key in keys] for c in counts]
    # Pool rare cells so each expected count is at least 5.
    rare = [j for j, key in enumerate(keys) if table[0][j] + table[1][j] < 20]
    keep = [j for j in range(len(keys)) if j not in rare]
    rows = [[row[j] for j in keep] + [sum(row[j] for j in rare)] for row in table]
    rows = [[r[j] for j in range(len(rows[0])) if rows[0][j] + rows[1][j] > 0] for r in rows]
    assert len(rows[0]) >= 4
    _, pvalue, _, _ = scipy_stats.chi2_contingency(rows)
    print(f"chi-square p = {pvalue:.4f}")
    assert pvalue > 0.01, (pvalue, rows)


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    ("lm_head_tp", "tree"), [(False, False), (True, False), (True, True)], ids=str
)
def test_attention_dp_masks_each_ranks_requests(
    models: dict[str, Path],
    baseline: dict[tuple[str, str], list[list[int]]],
    lm_head_tp: bool,
    tree: bool,
) -> None:
    """ADP = 2 (with and without LM-head TP, whose draft path is group-synced on greedy; and
    with draft trees): each rank masks the requests it runs; greedy equals constrained greedy
    on one rank without speculation, and sampled requests in the same steps match the
    grammar."""
    target, spec = setup(models, "mtp-perfect", 3)
    if tree:
        spec |= {"topk": 2, "num_draft_tokens": 6}
    with LLM(
        str(target),
        speculative_config=spec,
        tensor_parallel_size=2,
        enable_attention_dp=True,
        enable_lm_head_tp_in_adp=lm_head_tp,
        dtype="float32",
    ) as llm:
        assert llm.engine.dp_size == 2
        for grammar, spec_ in GRAMMARS.items():
            hot = SamplingParams(temperature=1.0, seed=5, max_tokens=150, structured=spec_)
            outs = llm.generate(PROMPTS + PROMPTS, [greedy(grammar)] * len(PROMPTS) + [hot] * 4)
            assert tokens(outs[: len(PROMPTS)]) == baseline["perfect", grammar], grammar
            for o in outs[len(PROMPTS) :]:
                check(grammar, o.outputs[0].text)


def record_steps(llm: LLM) -> list[Any]:
    """Wrap the engine's executor: every step appends (request id, tokens it emitted, drafts it
    proposed for the next step[, their parents: draft trees]) per sampled request, the drafts
    raw (before the engine cuts them)."""
    executor = llm.engine.executor
    real = executor.execute
    seen: list[Any] = []

    def execute(step: Any) -> Any:
        out = real(step)
        for i, rid in enumerate(out.request_ids):
            row = (rid, list(out.token_ids[i]), list(out.draft_token_ids[i]))
            if out.draft_parents:  # draft trees: each draft's parent too
                row += (list(out.draft_parents[i]),)
            seen.append(row)
        return out

    executor.execute = execute  # type: ignore[method-assign]
    return seen


@pytest.mark.parametrize("temperature", [0.0, 1.0])
@pytest.mark.parametrize("name", ["mtp-random", "eagle3-random", "eagle3-near", "mtp-vanilla"])
def test_drafts_are_allowed_by_the_grammar(
    models: dict[str, Path], name: str, temperature: float
) -> None:
    """Masked drafting: every draft proposed for a constrained request is one the grammar allows
    after the request's output and the drafts before it, until the grammar ends. The one
    exception: a position where the grammar allows no token of the draft head's vocabulary
    (an Eagle3 head with a smaller vocabulary) keeps its unmasked draft."""
    target, spec = setup(models, name, 3)
    with LLM(str(target), speculative_config=spec) as llm:
        steps = record_steps(llm)
        compiler = llm.engine.structured.compiler
        draft = llm.engine.executor.worker.runner.spec.draft
        vocab = int(compiler.ll_tokenizer.vocab_size)
        d2t = getattr(draft, "d2t", None)
        drafts_vocab = (
            set(range(vocab)) if d2t is None else {i + int(d) for i, d in enumerate(d2t.tolist())}
        )
        checked = fallback = 0
        for grammar, spec_ in GRAMMARS.items():
            params = SamplingParams(
                temperature=temperature, seed=4, max_tokens=150, structured=spec_
            )
            steps.clear()
            llm.generate(PROMPTS, params)
            emitted: dict[str, list[int]] = {}
            for rid, toks, drafts in steps:
                emitted.setdefault(rid, []).extend(toks)
                m = compiler.matcher(spec_)
                if m.try_consume_tokens(emitted[rid]) < len(emitted[rid]) or m.is_stopped():
                    continue  # the request finished with this step
                for d in drafts:
                    if m.is_stopped():
                        break  # past the grammar's end nothing is masked
                    if not m.try_consume_tokens([d]):
                        allowed = set(_allowed(m, vocab))
                        assert not allowed & drafts_vocab, (grammar, rid, d)
                        fallback += 1
                        break
                    checked += 1
        assert checked > 50, checked
        if d2t is None:
            assert fallback == 0


def _allowed(matcher: Any, vocab: int) -> list[int]:
    """The token ids ``matcher`` allows next."""
    import llguidance.torch
    import torch

    mask = llguidance.torch.allocate_token_bitmask(1, vocab)
    llguidance.torch.fill_next_token_bitmask(matcher, mask, 0)
    bits = (mask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1
    return bits.reshape(-1).nonzero().flatten().tolist()


@pytest.mark.parametrize("name", ["eagle3-near", "mtp-perfect"])
def test_masked_drafting_raises_acceptance_under_a_grammar(
    models: dict[str, Path], baseline: dict[tuple[str, str], list[list[int]]], name: str
) -> None:
    """A near-perfect head drafts the target's unmasked choice, which the grammar often forbids;
    masked, it drafts the target's constrained choice: accepted tokens per step rise, and the
    greedy output is the same either way (constrained greedy without speculation)."""
    target, spec = setup(models, name, 3)
    per_step = {}
    with LLM(str(target), speculative_config=spec) as llm:
        runner = llm.engine.executor.worker.runner
        grammars = runner.grammars
        steps = record_steps(llm)
        for masked in (True, False):
            runner.grammars = grammars if masked else None
            steps.clear()
            outs = llm.generate(PROMPTS, greedy("json"))
            assert tokens(outs) == baseline[target.name, "json"], masked
            per_step[masked] = sum(len(t) for _, t, _ in steps) / len(steps)
    print(f"{name}: tokens per step under the JSON schema, masked drafting {per_step}")
    assert per_step[True] > per_step[False] + 0.3, per_step


@pytest.mark.timeout(300)
def test_tensor_parallel_ranks_mask_the_same_drafts(
    models: dict[str, Path], baseline: dict[tuple[str, str], list[list[int]]]
) -> None:
    """TP = 2: every rank keeps its own matchers (they cannot travel between processes) and masks
    the drafts the same way, or the sharded draft layers would mix two drafts: greedy equals
    constrained greedy, sampled output matches the grammar, and the near-perfect head keeps the
    masked acceptance (unmasked it makes ~1.1 tokens per step here)."""
    target, spec = setup(models, "mtp-perfect", 3)
    with LLM(str(target), speculative_config=spec, tensor_parallel_size=2, dtype="float32") as llm:
        steps = record_steps(llm)
        for grammar, spec_ in GRAMMARS.items():
            steps.clear()
            outs = llm.generate(PROMPTS, greedy(grammar))
            assert tokens(outs) == baseline["perfect", grammar], grammar
            if grammar == "json":
                per_step = sum(len(t) for _, t, _ in steps) / len(steps)
                assert per_step > 1.6, per_step
            hot = SamplingParams(temperature=1.0, seed=5, max_tokens=150, structured=spec_)
            for o in llm.generate(PROMPTS, hot):
                check(grammar, o.outputs[0].text)


def test_ranks_get_each_output_token_once_and_each_grammar_on_arrival(
    models: dict[str, Path], baseline: dict[tuple[str, str], list[list[int]]]
) -> None:
    """What a constrained speculative request costs the ranks per step: its output tokens are
    sent once each (a step carries the ones the ranks have not had; they were all sent every
    step), and its grammar reaches them in the first step after it arrives, before the request
    runs, so the ranks compile it off the step."""
    target, spec = setup(models, "mtp-perfect", 3)
    with LLM(str(target), speculative_config=spec) as llm:
        executor, steps = llm.engine.executor, []
        real = executor.execute

        def execute(step: Any) -> Any:
            steps.append(step)
            return real(step)

        executor.execute = execute  # type: ignore[method-assign]
        (out,) = llm.generate(PROMPTS[:1], greedy("json"))
    assert out.outputs[0].token_ids == baseline["perfect", "json"][0]
    assert [s.grammars for s in steps if s.grammars] == [[GRAMMARS["json"]]]
    first_run = next(i for i, s in enumerate(steps) if s.requests)
    assert steps[first_run - 1].grammars or steps[first_run].grammars
    sent = [r for s in steps for r in s.requests if r.output_offset is not None]
    assert len(sent) > 3
    offsets = [r.output_offset for r in sent]
    assert offsets == [sum(len(r.output_token_ids) for r in sent[:i]) for i in range(len(sent))]
    shipped = [t for r in sent for t in r.output_token_ids]
    assert shipped == out.outputs[0].token_ids[: len(shipped)]
    assert max(len(r.output_token_ids) for r in sent) <= 4  # one step's tokens at most (K + 1)


def test_rank_grammars_compile_off_the_step() -> None:
    """``DraftGrammars.prefetch``: the compiler (a rank's tokenizer) and the grammar are built on
    the background thread, not in the step that first needs them."""
    import threading

    from tandem.engine.speculative.draft_grammar import DraftGrammars

    where: list[str] = []

    class Compiler:
        def __init__(self) -> None:
            where.append(f"built on {threading.current_thread().name}")

        def template(self, spec: StructuredSpec) -> None:
            where.append(f"{spec.text} on {threading.current_thread().name}")

    grammars = DraftGrammars(Compiler)  # type: ignore[arg-type]
    grammars.prefetch([GRAMMARS["regex"]])
    assert grammars._background is not None
    grammars._background.shutdown(wait=True)
    thread = "draft-grammars_0"
    assert where == [f"built on {thread}", f"{REGEX} on {thread}"]
