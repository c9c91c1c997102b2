"""N-gram (prompt-lookup) speculation (issue #46, item 1): the drafts equal a brute-force search
over the request's text after every step; greedy output equals plain decoding for K = 1, 3, 5
with chunked prefill, under preemption and prefix caching, with stop strings and tokens, n > 1,
penalties, a grammar, and the static-buffer graph path; the configuration is checked. TP = 2 and
attention DP: tests/test_tensor_parallel_spec.py and tests/test_attention_dp.py; the sampled
distribution: tests/test_rejection_sampling.py."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from checkpoints import build_llama
from tandem import LLM, SamplingParams
from tandem.engine.speculative.ngram import NgramIndex, NgramProposer
from tandem.engine.structured_output import StructuredSpec

# Prompts that repeat themselves (what n-gram drafting is for), and one that does not.
PROMPTS = [
    [5, 6, 7, 8, 9] * 4,
    list(range(40, 64)) + list(range(40, 52)),
    [100, 101, 102, 100, 101],
    [7, 3, 9],
]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)


def ngram(k: int, lo: int = 1, hi: int = 3) -> dict:
    return {
        "method": "ngram",
        "num_speculative_tokens": k,
        "prompt_lookup_min": lo,
        "prompt_lookup_max": hi,
    }


def brute_force(tokens: list[int], lo: int, hi: int, k: int) -> list[int]:
    """The tokens after the latest earlier occurrence of the longest suffix, n in [lo, hi]."""
    for n in range(hi, lo - 1, -1):
        if len(tokens) <= n:
            continue
        suffix = tokens[-n:]
        for end in range(len(tokens) - 1, n - 1, -1):
            if tokens[end - n : end] == suffix:
                return tokens[end : end + k]
    return []


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("ngram") / "m", layers=2)


@pytest.fixture(scope="module")
def baseline(model: Path) -> list[list[int]]:
    with LLM(str(model)) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]


def tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


# ------------------------------------------------------------------ the index


@pytest.mark.parametrize(("lo", "hi"), [(1, 1), (1, 3), (2, 4), (5, 5)])
def test_index_equals_brute_force(lo: int, hi: int) -> None:
    rng = random.Random(lo * 10 + hi)
    for vocab in (2, 4, 9):
        seq = [rng.randrange(vocab) for _ in range(300)]
        index, at = NgramIndex(lo, hi), 0
        while at < len(seq):
            step = rng.randint(1, 6)  # tokens arrive several at a time, as under speculation
            index.extend(seq[at : at + step])
            at = min(len(seq), at + step)
            for k in (1, 3, 7):
                assert index.propose(k) == brute_force(seq[:at], lo, hi, k), (vocab, at, k)


def test_proposer_keeps_one_index_per_request() -> None:
    proposer = NgramProposer(1, 2)
    assert proposer.propose("a", [1, 2, 3, 1], 2) == [2, 3]
    assert proposer.propose("b", [4, 4], 3) == [4]
    assert proposer.propose("a", [1, 2, 3, 1, 2], 2) == [3, 1]  # the longest suffix, (1, 2)
    assert proposer.propose("a", [1, 2, 3, 1, 2, 9], 2) == []
    assert proposer.propose("a", [1, 2, 3, 1, 2, 9], 0) == []
    proposer.forget("a")
    assert set(proposer.indexes) == {"b"}


# ------------------------------------------------------------------ end to end


def test_drafts_after_every_step_equal_brute_force(model: Path, baseline: list[list[int]]) -> None:
    """Verification would hide a wrong draft: every step's drafts are checked against the
    search over the request's text at that point (cut to the room left)."""
    k = 4
    with LLM(str(model), speculative_config=ngram(k, 2, 3), max_num_batched_tokens=16) as llm:
        engine = llm.engine
        reqs = [engine.add_request(f"r{i}", p, GREEDY) for i, p in enumerate(PROMPTS)]
        checked = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                r = reqs[int(out.request_id[1:])]
                if out.finished:
                    continue
                room = min(k, GREEDY.max_tokens - r.num_output_tokens - 1)
                assert r.spec_token_ids == brute_force(r.all_token_ids, 2, 3, max(0, room))
                checked += bool(r.spec_token_ids)
        assert [r.output_token_ids for r in reqs] == baseline
        assert checked > 10
        assert engine.spec_stats.num_accepted_tokens > 0


@pytest.mark.parametrize("k", [1, 3, 5])
def test_greedy_ngram_is_exact(model: Path, baseline: list[list[int]], k: int) -> None:
    with LLM(str(model), speculative_config=ngram(k), max_num_batched_tokens=16) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        assert tokens(outs) == baseline
        stats = llm.engine.spec_stats
        assert stats.num_accepted_tokens > 0 and stats.num_draft_tokens > stats.num_accepted_tokens
        assert llm.engine.get_stats().num_used_kv_blocks == 0
        # No draft model: no draft KV, nothing loaded beside the target.
        assert llm.engine.executor.worker.runner.spec.draft is None


def test_preemption_prefix_cache_stops_and_n(model: Path, baseline: list[list[int]]) -> None:
    with LLM(str(model), speculative_config=ngram(3), num_kv_blocks=10, max_model_len=96) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        assert llm.engine.get_stats().num_preemptions > 0
        hits = llm.engine.get_stats().prefix_cache_hits
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        assert llm.engine.get_stats().prefix_cache_hits > hits
        ref = baseline[0]
        for max_tokens in (1, 2, 7):  # cut mid-draft
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


def test_penalties_and_a_grammar_equal_plain_decoding(model: Path) -> None:
    """Penalties count the drafts before each verified position; a grammar's drafts are cut at
    the first token it forbids. The bias makes the penalised output repeat (so it drafts)."""
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
    with LLM(str(model), speculative_config=ngram(3)) as llm:
        outs = llm.generate(prompts, params)
        assert tokens(outs) == want
        assert all(o.spec_stats.num_accepted_tokens > 0 for o in outs)
    assert outs[1].outputs[0].text.startswith('{"a":')  # the grammar held (cut by max_tokens)


def test_static_graph_path_equals_eager(
    model: Path, baseline: list[list[int]], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The captured-step path (its static buffers, run eagerly on the CPU): the target's verify
    step replays; n-gram steps have no draft segment."""
    monkeypatch.setenv("TANDEM_TEST_STATIC_GRAPHS", "1")
    with LLM(str(model), speculative_config=ngram(3), max_num_seqs=4) as llm:
        assert tokens(llm.generate(PROMPTS, GREEDY)) == baseline
        graphs = llm.engine.executor.worker.runner.graph_runner
        assert graphs is not None and graphs.num_replays > 0
        assert all(step.draft is None for step in graphs.graphs.values())


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        ({"prompt_lookup_min": 4, "prompt_lookup_max": 2}, r"prompt_lookup_min \(4\) must be <="),
        ({"prompt_lookup_min": 0}, "prompt_lookup_min"),
        ({"prompt_lookup_max": True}, "prompt_lookup_max"),
        ({"model": "/a/head"}, "model do not apply to method 'ngram'"),
        ({"topk": 2, "num_draft_tokens": 4}, "topk do not apply"),
        ({"draft_dtype": "bfloat16"}, "draft_dtype do not apply"),
    ],
)
def test_configuration_errors(model: Path, spec: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        LLM(str(model), speculative_config={"method": "ngram", **spec})


def test_lookup_defaults_and_other_methods() -> None:
    from tandem.engine.config import SpeculativeConfig

    def sizes(**kw: int) -> tuple[int | None, int | None]:
        c = SpeculativeConfig(method="ngram", **kw)
        return c.prompt_lookup_min, c.prompt_lookup_max

    assert sizes() == (5, 5)
    assert sizes(prompt_lookup_max=3) == (3, 3)
    assert sizes(prompt_lookup_min=2) == (2, 2)
    assert sizes(prompt_lookup_min=1, prompt_lookup_max=4) == (1, 4)
    with pytest.raises(ValueError, match="apply to method 'ngram' only"):
        SpeculativeConfig(method="mtp", prompt_lookup_max=3)
