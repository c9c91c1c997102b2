"""Presence, frequency and repetition penalties and ``logit_bias`` under speculation: each verified
position is penalised with the output counts plus the drafts before it (on its path, for draft
trees), and drafts are drawn from the penalised draft distribution. Greedy output with speculation
equals the output without it; sampled output is distributed the same (tests/
test_rejection_sampling.py, the penalties case)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from checkpoints import add_mtp_layers, build_llama, make_echo_target, perfect_eagle3_draft
from tandem import LLM, SamplingParams

PROMPTS = [[5, 6, 7], list(range(40, 61)), [100, 101, 100], list(range(120, 131))]
# A near-echo target repeats its last token (its greedy next token is the current one) until
# the penalties push it off, then echoes the next; its near-perfect drafts are accepted as long
# as they are penalised as the target is. Each request of the batch has its own penalties.
PARAMS = [
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=2.0),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, frequency_penalty=0.7),
    SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, repetition_penalty=1.6),
    SamplingParams(
        temperature=0, max_tokens=24, ignore_eos=True, presence_penalty=0.5,
        frequency_penalty=0.3, repetition_penalty=1.2, logit_bias={7: 1.5, 11: -100.0},
    ),
]  # fmt: skip


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("penalties")
    echo = build_llama(root / "echo", layers=2, seed=5)
    make_echo_target(echo, residual_scale=0.3)
    add_mtp_layers(echo, 1, perfect=True)
    return {"echo": echo, "eagle3": perfect_eagle3_draft(root / "head", echo, residual_scale=0.3)}


@pytest.fixture(scope="module")
def plain(models: dict[str, Path]) -> list[list[int]]:
    with LLM(str(models["echo"])) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


def _spec(models: dict[str, Path], method: str) -> dict:
    head = {"method": "eagle3", "model": str(models["eagle3"])}
    return {
        "mtp": {"method": "mtp"},
        "eagle3": head,
        "eagle3-tree": {**head, "topk": 2, "num_draft_tokens": 6},
        "mtp-tree": {"method": "mtp", "topk": 2, "num_draft_tokens": 5},
    }[method] | {"num_speculative_tokens": 3}


def test_the_penalties_change_the_output(models, plain) -> None:
    """The cases mean something: without penalties the output is another one."""
    bare = [SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)] * len(PROMPTS)
    with LLM(str(models["echo"])) as llm:
        unpenalised = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, bare)]
    for got, base in zip(plain, unpenalised, strict=True):
        assert got != base
    assert 11 not in plain[3]  # a -100 bias: never chosen


@pytest.mark.parametrize("method", ["mtp", "eagle3", "eagle3-tree", "mtp-tree"])
def test_greedy_output_with_penalties_equals_without_speculation(models, plain, method) -> None:
    with LLM(str(models["echo"]), speculative_config=_spec(models, method)) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
        stats = llm.engine.spec_stats
    assert [o.outputs[0].token_ids for o in outs] == plain
    # Drafts are accepted, also after earlier drafts (positions whose penalties counted them).
    assert stats.accepted_per_pos[1] > 0, stats
    assert method != "mtp" or stats.acceptance_rate > 0.5, stats


def test_a_generation_config_with_a_repetition_penalty_serves_with_a_draft_head(
    models, plain, tmp_path: Path
) -> None:
    """A folder whose generation_config.json sets repetition_penalty (Qwen2.5-Instruct's 1.05)
    serves with a draft head on: its defaults (what the server applies to a request that sets
    none) run under speculation, and the output is the penalised one."""
    import shutil

    from tandem.engine.engine_core import generation_defaults

    folder = tmp_path / "qwen-like"
    shutil.copytree(models["echo"], folder)
    (folder / "generation_config.json").write_text(json.dumps({"repetition_penalty": 1.6}))
    with LLM(str(folder), speculative_config={"method": "mtp", "num_speculative_tokens": 3}) as llm:
        defaults = generation_defaults(llm.engine.generation_config)
        assert defaults == {"repetition_penalty": 1.6}
        params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, **defaults)
        outs = llm.generate(PROMPTS[2:3], params)
    assert outs[0].outputs[0].token_ids == plain[2]  # PARAMS[2]: the same penalty
