"""Speculation stays lossless at temperature 0.8 on the MoE targets of issue #48 with an Eagle3
head, as a chain and as a draft tree, with and without draft row pick: gpt-oss (sinks, a
sliding window, experts with biases and the clamped SwiGLU) and Qwen3-MoE. The first two output
tokens (the second one from the first verify step) of 8,000 (gpt-oss) or 20,000 (Qwen3-MoE)
requests are distributed as without speculation: two-sample chi-square, p > 0.01, rare cells
pooled; the same test tells position 1 from position 2 apart (p < 1e-6)."""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Any

import pytest
from stats import two_sample_p

from checkpoints import build_eagle3_draft, build_gpt_oss, build_qwen3_moe
from tandem import LLM, SamplingParams

pytestmark = pytest.mark.slow

# Requests per run: as many as the power check needs (gpt-oss's two positions differ by far
# more than Qwen3-MoE's: p ~ 1e-172 at 8,000 against 3e-3 for Qwen3-MoE, < 1e-6 at 20,000).
N = {"gpt_oss": 8_000, "qwen3_moe": 20_000}
VOCAB = 16  # flat enough that a random head's drafts are often accepted, and often not
PROMPT = [5, 6, 7]
PARAMS = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def targets(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[Path, Path]]:
    root = tmp_path_factory.mktemp("moe_spec")
    out = {}
    for name, build in (("gpt_oss", build_gpt_oss), ("qwen3_moe", build_qwen3_moe)):
        target = build(root / name, vocab_size=VOCAB)
        out[name] = (target, build_eagle3_draft(root / f"{name}-eagle3", target))
    return out


def _counts(target: Path, n: int, spec: dict[str, Any] | None) -> tuple[list[Counter], float]:
    """Positions 1 and 2 of ``n`` samples, and the draft acceptance rate."""
    with LLM(
        str(target),
        dtype="float32",
        speculative_config=spec,
        max_num_seqs=1024,
        max_model_len=32,
        max_num_batched_tokens=4096,
        seed=1,
    ) as llm:
        import time

        t0 = time.time()
        outs = llm.generate([PROMPT] * n, PARAMS)
        print("RUN", spec and spec.get("topk"), time.time() - t0)
        rate = llm.engine.spec_stats.acceptance_rate if spec else 0.0
    return [Counter(o.outputs[0].token_ids[j] for o in outs) for j in (1, 2)], rate


@pytest.mark.timeout(600)
@pytest.mark.parametrize("name", ["gpt_oss", "qwen3_moe"])
def test_speculated_positions_match_plain_sampling(targets, name: str) -> None:
    """A chain and a draft tree on each target; draft row pick off for one of the two (gpt-oss's
    chain, Qwen3-MoE's tree), on for the other."""
    target, head = targets[name]
    chain = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    tree = {**chain, "topk": 2, "num_draft_tokens": 4}
    off = {"disable_draft_row_pick": True}
    specs = [{**chain, **off}, tree] if name == "gpt_oss" else [chain, {**tree, **off}]
    plain, _ = _counts(target, N[name], None)
    assert two_sample_p(plain[0], plain[1]) < 1e-6  # power: the two positions differ
    for spec in specs:
        specd, rate = _counts(target, N[name], spec)
        # Drafts are accepted and rejected (a tree's siblings: at most one of them accepted).
        assert rate > (0.02 if "topk" in spec else 0.05), (spec, rate)
        for j in range(2):
            assert two_sample_p(plain[j], specd[j]) > 0.01, (spec, j)
