"""Speculative decoding across tensor-parallel ranks equals a single rank, token for token."""

from __future__ import annotations

from pathlib import Path

import pytest

from checkpoints import add_mtp_layers, build_eagle3_draft, build_llama
from engine import LLM, SamplingParams

PROMPTS = [[5, 6, 7], list(range(40, 70)), [100, 101]]
PARAMS = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("tpspec")
    # 2 KV heads over 4 ranks would replicate; 4 heads and 2 KV heads split evenly over 2.
    target = build_llama(root / "t", layers=4, heads=4, kv_heads=2, vocab_size=322)
    add_mtp_layers(target, 1)
    return target, build_eagle3_draft(root / "d", target, draft_vocab=161)


@pytest.mark.timeout(300)
def test_tp_speculation_equals_single_rank(ckpts: tuple[Path, Path]) -> None:
    target, draft = ckpts
    specs = [
        {"method": "mtp", "num_speculative_tokens": 3},
        {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3},
    ]
    with LLM(str(target), dtype="float32") as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]
    for spec in specs:
        with LLM(str(target), dtype="float32", speculative_config=spec) as llm:
            one = llm.generate(PROMPTS, PARAMS)
        assert [o.outputs[0].token_ids for o in one] == base
        # TP = 4 replicates the 2 KV heads (fewer KV heads than ranks).
        for tp in (2, 4) if spec["method"] == "mtp" else (2,):
            with LLM(
                str(target), dtype="float32", speculative_config=spec, tensor_parallel_size=tp
            ) as llm:
                many = llm.generate(PROMPTS, PARAMS)
            assert [o.outputs[0].token_ids for o in many] == base
            # Same drafts on both layouts: identical acceptance, position by position.
            assert [o.spec_stats.accepted_per_pos for o in many] == [
                o.spec_stats.accepted_per_pos for o in one
            ]
