"""A preemption storm (issue #49 item 3, the bounded slice ``make test`` runs): a KV cache for
about ten of the requests, 200 requests with long prompts arriving at once, every one speculating
with draft trees, a third of them held to a JSON schema, and a tenth cancelled at random points.
Every request that completes gives the output it gives without pressure; none is lost or
finished twice; the oldest finishes (no livelock); no KV block is left in use."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest

from checkpoints import add_mtp_layers, build_llama, make_echo_target
from tandem import LLM, SamplingParams
from tandem.engine.structured_output import StructuredSpec

NUM_REQUESTS = 200
MAX_TOKENS = 12
SCHEMA = StructuredSpec(
    "json_schema",
    json.dumps({"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}),
    "response_format",
)
TREES = {"method": "mtp", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    # A near-echo target with a near-perfect MTP layer: tree nodes past the first are accepted,
    # so preempted requests carry accepted drafts and drafted KV.
    folder = build_llama(tmp_path_factory.mktemp("storm") / "t", layers=2, seed=5)
    make_echo_target(folder, residual_scale=0.3)
    add_mtp_layers(folder, 1, perfect=True)
    return folder


def _requests() -> list[tuple[list[int], SamplingParams]]:
    rng = random.Random(7)
    out = []
    for i in range(NUM_REQUESTS):
        prompt = [rng.randrange(5, 300) for _ in range(rng.randrange(40, 90))]
        structured = SCHEMA if i % 3 == 0 else None
        params = SamplingParams(
            temperature=0, max_tokens=MAX_TOKENS, ignore_eos=structured is None,
            structured=structured, detokenize=False,
        )  # fmt: skip
        out.append((prompt, params))
    return out


@pytest.mark.timeout(300)
def test_a_preemption_storm_loses_nothing_and_changes_no_output(target: Path) -> None:
    requests = _requests()
    with LLM(str(target), dtype="float32", max_model_len=112) as llm:
        outs = llm.generate([p for p, _ in requests], [s for _, s in requests])
        alone = [o.outputs[0].token_ids for o in outs]
    rng = random.Random(11)
    cancel = set(rng.sample(range(1, NUM_REQUESTS), NUM_REQUESTS // 10))
    with LLM(
        str(target),
        dtype="float32",
        max_model_len=112,
        speculative_config=TREES,
        num_kv_blocks=10 * 7,  # ~10 requests of 90 + 12 tokens (+ the tree's look-ahead)
        max_num_seqs=64,
    ) as llm:
        engine = llm.engine
        for i, (prompt, params) in enumerate(requests):
            engine.add_request(str(i), prompt, params)
        finished: dict[str, list[int]] = {}
        cancelled: set[str] = set()
        steps = 0
        while engine.has_unfinished_requests():
            steps += 1
            assert steps < 5000, "no progress"
            for out in engine.step():
                if out.finished:
                    assert out.request_id not in finished, f"{out.request_id} finished twice"
                    finished[out.request_id] = out.outputs[0].token_ids
            for i in sorted(cancel):
                rid = str(i)
                if rid not in finished and rid not in cancelled and rng.random() < 0.02:
                    engine.abort_request(rid)
                    cancelled.add(rid)
            assert not engine.take_failed()
        stats = engine.get_stats()
    assert stats.num_preemptions >= 10, stats.num_preemptions
    assert stats.spec_num_accepted_tokens > stats.spec_num_drafts  # tree nodes were accepted
    assert stats.num_used_kv_blocks == 0
    assert "0" in finished  # the oldest request finished
    assert set(finished) | cancelled == {str(i) for i in range(NUM_REQUESTS)}
    assert len(cancelled) >= NUM_REQUESTS // 40  # some were cancelled mid-flight
    for rid, tokens in finished.items():
        assert tokens == alone[int(rid)], rid
