"""DeepSeek-V3 across ranks (gloo): TP = 2 (MLA heads and experts split) and attention DP = 2 with
LM-head TP (attention replicated, MoE over both ranks' tokens) equal one rank, with and without
MTP speculation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from checkpoints import build_deepseek_mtp_target
from tandem import LLM, SamplingParams

# Unequal load under ADP: least-loaded assignment gives rank 1 the short requests, so it idles
# (dummy steps) while rank 0 still decodes; a 16-token budget chunks the 30-token prompt.
PROMPTS = [list(range(40, 70)), [5, 6, 7], [100, 101], [9], list(range(10, 22))]
PARAMS = [
    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    for n in (16, 3, 12, 2, 9)
]
SPEC = {"method": "mtp", "num_speculative_tokens": 3}
RUN: dict[str, Any] = {"dtype": "float32", "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek_mtp_target(tmp_path_factory.mktemp("dsv3tp") / "t")


def _generate(llm: LLM) -> tuple[list[list[int]], list[list[float]], list[Any]]:
    outs = llm.generate(PROMPTS, PARAMS)
    return (
        [o.outputs[0].token_ids for o in outs],
        [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs],
        [o.spec_stats.accepted_per_pos if o.spec_stats else None for o in outs],
    )


@pytest.fixture(scope="module")
def single(target: Path) -> dict[str, Any]:
    refs = {}
    for name, spec in (("plain", None), ("mtp", SPEC)):
        with LLM(str(target), speculative_config=spec, **RUN) as llm:
            refs[name] = _generate(llm)
    return refs


def _close(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.mark.timeout(300)
def test_tp2_equals_single_rank(target: Path, single: dict[str, Any]) -> None:
    tokens, logprobs, _ = single["plain"]
    with LLM(str(target), tensor_parallel_size=2, **RUN) as llm:
        model = llm.engine.executor.worker.model
        assert model.model.layers[1].self_attn.num_heads == 2  # 4 heads over 2 ranks
        assert model.model.layers[1].mlp.experts.w13.shape[0] == 4  # 8 experts over 2 ranks
        got_tokens, got_logprobs, _ = _generate(llm)
    assert got_tokens == tokens
    assert _close(got_logprobs, logprobs) < 1e-4
    tokens, _, accepted = single["mtp"]
    assert tokens == single["plain"][0]
    with LLM(str(target), tensor_parallel_size=2, speculative_config=SPEC, **RUN) as llm:
        got_tokens, _, got_accepted = _generate(llm)
    assert got_tokens == tokens
    assert got_accepted == accepted  # the same drafts, position by position
    assert sum(sum(a) for a in accepted) > 0


@pytest.mark.timeout(300)
@pytest.mark.parametrize("spec", [None, SPEC], ids=["plain", "mtp"])
def test_adp2_with_lm_head_tp_equals_single_rank(
    target: Path, single: dict[str, Any], spec: dict[str, Any] | None
) -> None:
    """Plain: the MoE over both ranks' rows (all-gather). MTP: with expert parallelism (rows
    all-to-all to their experts' ranks) and EPLB with 2 redundant experts (10 physical, 5 per
    rank), rebalanced every 3 steps: the weights move mid-run and nothing changes."""
    tokens, logprobs, accepted = single["plain" if spec is None else "mtp"]
    ep: dict[str, Any] = {}
    if spec is not None:
        ep = {
            "enable_expert_parallel": True,
            "enable_eplb": True,
            "num_redundant_experts": 2,
            "eplb_step_interval": 3,
        }
    with LLM(
        str(target),
        tensor_parallel_size=2,
        enable_attention_dp=True,
        enable_lm_head_tp_in_adp=True,
        speculative_config=spec,
        **ep,
        **RUN,
    ) as llm:
        engine = llm.engine
        assert engine.dp_size == 2
        model = engine.executor.worker.model
        assert model.model.layers[1].self_attn.num_heads == 4  # attention replicated
        moe = model.model.layers[1].mlp
        assert moe.experts.w13.shape[0] == (4 if spec is None else 5)  # experts split
        assert (moe.dispatcher is not None) == (spec is not None)
        got_tokens, got_logprobs, got_accepted = _generate(llm)
        stats = engine.get_stats()
        assert stats.num_used_kv_blocks == 0
        if spec is not None:
            assert stats.eplb_rebalances >= 2
            assert stats.eplb_imbalance_after <= stats.eplb_imbalance_before
            # The target's and the MTP layer's MoE are balanced; a placement moved from the start's
            # (a layer the packing would not improve keeps its own).
            draft = engine.executor.worker.runner.spec.draft
            layers = [
                m for part in (model, draft) for m in part.modules() if hasattr(m, "placement")
            ]
            assert len(layers) == 2
            assert any(m.placement.slot_logical != [*range(8), 0, 1] for m in layers)
    assert got_tokens == tokens
    assert _close(got_logprobs, logprobs) < 1e-4
    if spec is not None:
        assert got_accepted == accepted


@pytest.mark.timeout(120)
def test_redundant_experts_that_do_not_divide_over_the_ranks_stop_the_start(target: Path) -> None:
    with pytest.raises(Exception, match=r"num_redundant_experts=3 is not divisible"):
        LLM(
            str(target),
            tensor_parallel_size=2,
            enable_attention_dp=True,
            enable_expert_parallel=True,
            enable_eplb=True,
            num_redundant_experts=3,
            **RUN,
        )
