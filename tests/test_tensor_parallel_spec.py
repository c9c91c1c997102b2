"""Speculative decoding across tensor-parallel ranks equals a single rank, token for token (with
penalties and a logit bias too)."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints import add_mtp_layers, build_eagle3_draft, build_llama, mtp_head_with_vocab
from tandem import LLM, SamplingParams

PROMPTS = [[5, 6, 7], list(range(40, 70)), [100, 101]]  # the random model's outputs repeat
# Greedy; the second and third requests with penalties and a logit bias (each verified position
# counts the drafts before it: the same on every rank).
PARAMS = [
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True),
    SamplingParams(temperature=0, max_tokens=20, ignore_eos=True, presence_penalty=1.0),
    SamplingParams(
        temperature=0, max_tokens=20, ignore_eos=True, frequency_penalty=0.5,
        repetition_penalty=1.3, logit_bias={102: 3.0},
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, Path]:
    root = tmp_path_factory.mktemp("tpspec")
    # 2 KV heads over 4 ranks would replicate; 4 heads and 2 KV heads split evenly over 2.
    target = build_llama(root / "t", layers=4, heads=4, kv_heads=2, vocab_size=322)
    add_mtp_layers(target, 1)
    # An MTP head drafting from every other token: its LM-head rows come from both TP shards.
    vocab = mtp_head_with_vocab(target, root / "v", list(range(0, 322, 2)))
    return target, build_eagle3_draft(root / "d", target, draft_vocab=161), vocab


@pytest.mark.timeout(300)
def test_tp_speculation_equals_single_rank(ckpts: tuple[Path, Path, Path]) -> None:
    target, draft, vocab = ckpts
    specs = [
        {"method": "mtp", "num_speculative_tokens": 3},
        {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3},
        {"method": "mtp", "model": str(vocab), "num_speculative_tokens": 3},
        {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1},
    ]
    with LLM(str(target), dtype="float32") as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    for spec in specs:
        with LLM(str(target), dtype="float32", speculative_config=spec) as llm:
            one, one_drafts = _run(llm)
        assert one == base and any(one_drafts)
        if spec is specs[2]:  # only tokens of its vocabulary are drafted
            assert all(t % 2 == 0 for d in one_drafts for t in d)
        # TP = 4 replicates the 2 KV heads (fewer KV heads than ranks).
        for tp in (2, 4) if spec == specs[0] else (2,):
            with LLM(
                str(target), dtype="float32", speculative_config=spec, tensor_parallel_size=tp
            ) as llm:
                many, many_drafts = _run(llm)
            assert many == base
            assert many_drafts == one_drafts, (spec, tp)  # the same drafts after every step


def _run(llm: LLM) -> tuple[list[list[int]], list[list[int]]]:
    """(each prompt's tokens, the drafts each step left on each request) of PROMPTS."""
    engine = llm.engine
    reqs = {f"r{i}": engine.add_request(f"r{i}", p, PARAMS[i]) for i, p in enumerate(PROMPTS)}
    tokens: dict[str, list[int]] = {}
    drafts: list[list[int]] = []
    while engine.has_unfinished_requests():
        for out in engine.step():
            drafts.append(list(reqs[out.request_id].spec_token_ids))
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[f"r{i}"] for i in range(len(PROMPTS))], drafts
