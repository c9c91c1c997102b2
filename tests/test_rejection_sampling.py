"""Rejection sampling keeps speculation lossless: the first two speculated positions are
distributed as without speculation (two-sample chi-square over 20,000 samples)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import torch
from scipy.stats import chi2_contingency

from checkpoints import build_eagle3_draft, build_llama
from tandem import LLM, SamplingParams

N = 20_000
VOCAB = 12


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rs")
    target = build_llama(root / "t", layers=2, vocab_size=VOCAB, init_std=0.15)
    return target, build_eagle3_draft(root / "d", target)


def _histograms(target: Path, spec: dict | None, params: SamplingParams) -> tuple[list, float]:
    with LLM(
        str(target),
        speculative_config=spec,
        max_num_seqs=1024,
        max_model_len=32,
        max_num_batched_tokens=4096,
        seed=1,
    ) as llm:
        # Token ids only: decoding 20,000 texts would cost a tenth of the run.
        outs = llm.generate([[1, 2, 3]] * N, dataclasses.replace(params, detokenize=False))
        rate = llm.engine.spec_stats.acceptance_rate
    toks = np.array([o.outputs[0].token_ids for o in outs])
    # Position 0 comes from the prefill; positions 1 and 2 from the first speculative step.
    return [np.bincount(toks[:, j], minlength=VOCAB) for j in (1, 2)], rate


def _p_value(a: np.ndarray, b: np.ndarray) -> float:
    table = np.array([a, b])
    return float(chi2_contingency(table[:, table.sum(0) > 0])[1])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_speculated_positions_match_plain_sampling(models) -> None:
    target, draft = models
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    settings = [
        SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True),
        SamplingParams(temperature=1.3, top_k=6, top_p=0.9, max_tokens=3, ignore_eos=True),
    ]
    plain_hists = []
    for params in settings:
        plain, _ = _histograms(target, None, params)
        specd, rate = _histograms(target, spec, params)
        assert rate > 0.2  # drafts are really accepted and rejected: the test exercises both
        for j in range(2):
            assert _p_value(plain[j], specd[j]) > 0.01, (params, j, plain[j], specd[j])
        plain_hists.append(plain)
    # Power: the same test tells the two temperatures apart.
    assert _p_value(plain_hists[0][0], plain_hists[1][0]) < 1e-6
    # min_tokens: the two likeliest tokens as stop tokens are banned at every verified position
    # and from the drafts; what is left is still the (banned) target's distribution.
    ban = np.argsort(plain_hists[0][0])[-2:].tolist()
    params = SamplingParams(
        temperature=0.7, max_tokens=3, min_tokens=3, stop_token_ids=ban, ignore_eos=True
    )
    plain, _ = _histograms(target, None, params)
    specd, rate = _histograms(target, spec, params)
    assert rate > 0.2
    for j in range(2):
        assert plain[j][ban].sum() == specd[j][ban].sum() == 0
        assert _p_value(plain[j], specd[j]) > 0.01, (j, plain[j], specd[j])


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_penalised_positions_match_plain_sampling(models) -> None:
    """Penalties and a logit bias under speculation: a verified position counts the drafts
    before it as output, so positions 1 and 2 are distributed as without speculation."""
    target, draft = models
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    params = SamplingParams(
        temperature=0.8, max_tokens=3, ignore_eos=True, presence_penalty=1.5,
        frequency_penalty=0.5, repetition_penalty=1.4, logit_bias={4: 1.0},
    )  # fmt: skip
    plain, _ = _histograms(target, None, params)
    specd, rate = _histograms(target, spec, params)
    assert rate > 0.2
    for j in range(2):
        assert _p_value(plain[j], specd[j]) > 0.01, (j, plain[j], specd[j])


NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 1}
REPEATING = [1, 2, 3, 1, 2, 3, 1, 2]  # its n-grams recur: drafts after every first token


@pytest.fixture(scope="module")
def repeating_plain(models: tuple[Path, Path]) -> list[np.ndarray]:
    """Positions 1 and 2 after REPEATING without speculation at temperature 0.8: the reference
    of the n-gram, suffix and draft-model tests (one run of N samples for the three)."""
    target, _ = models
    params = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, detokenize=False)
    with LLM(str(target), max_num_seqs=1024, max_model_len=32, max_num_batched_tokens=4096) as llm:
        toks = np.array([o.outputs[0].token_ids for o in llm.generate([REPEATING] * N, params)])
    return [np.bincount(toks[:, j], minlength=VOCAB) for j in (1, 2)]


def _repeating_histograms(
    target: Path, spec: dict, params: SamplingParams, n: int = N
) -> tuple[list, float]:
    """Positions 1 and 2 of ``n`` samples after REPEATING under ``spec``, and its acceptance."""
    with LLM(
        str(target),
        speculative_config=spec,
        max_num_seqs=1024,
        max_model_len=32,
        max_num_batched_tokens=4096,
        seed=1,
    ) as llm:
        outs = llm.generate([REPEATING] * n, dataclasses.replace(params, detokenize=False))
        rate = llm.engine.spec_stats.acceptance_rate
    toks = np.array([o.outputs[0].token_ids for o in outs])
    return [np.bincount(toks[:, j], minlength=VOCAB) for j in (1, 2)], rate


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_ngram_positions_match_plain_sampling(
    models: tuple[Path, Path], repeating_plain: list[np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """N-gram drafts are a point mass: accepted with probability p(d), else the token is drawn
    from p without d. Positions 1 and 2 are distributed as without speculation at temperature
    0.8; the same test rejects a rule that accepts every draft (power, on a quarter of the
    samples)."""
    target, _ = models
    params = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True)
    plain = repeating_plain
    specd, rate = _repeating_histograms(target, NGRAM, params)
    assert 0.05 < rate < 0.95  # drafts are really accepted and rejected
    for j in range(2):
        assert _p_value(plain[j], specd[j]) > 0.01, (j, plain[j], specd[j])

    import tandem.engine.speculative.decoder as decoder

    def accept_all(p, q, drafts, num_drafts, uniform, noise):  # noqa: ANN001, ANN202
        return num_drafts, torch.cat([drafts, drafts[:, -1:]], dim=1)

    monkeypatch.setattr(decoder, "rejection_sample", accept_all)
    wrong, _ = _repeating_histograms(target, NGRAM, params, N // 4)
    assert min(_p_value(plain[j], wrong[j]) for j in range(2)) < 1e-6


@pytest.fixture(scope="module")
def draft_model(models: tuple[Path, Path], tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Another model over the same 12 tokens (another seed, one layer): its q differs from the
    target's p, so drafts are both accepted and rejected."""
    return build_llama(
        tmp_path_factory.mktemp("rs-draft") / "m", layers=1, vocab_size=VOCAB, init_std=0.15, seed=5
    )


def _resample_from_p(p, q, drafts, num_drafts, uniform, noise):  # noqa: ANN001, ANN202
    """A wrong rule: accept with min(1, p / q), but draw a rejected position from p, not from
    the residual max(0, p - q)."""
    from tandem.kernels.spec_decode import rejection_sample_reference

    num_accepted, _ = rejection_sample_reference(p, q, drafts, num_drafts, uniform, noise)
    k = drafts.shape[1]
    extra = (p / noise).argmax(dim=-1)  # [B, K + 1]: a draw from p at every position
    padded = torch.cat([drafts, drafts[:, -1:]], dim=1)
    keep = torch.arange(k + 1, device=p.device)[None, :] < num_accepted[:, None]
    return num_accepted, torch.where(keep, padded, extra)


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_draft_model_positions_match_plain_sampling(
    models: tuple[Path, Path],
    draft_model: Path,
    repeating_plain: list[np.ndarray],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A separate draft model samples its drafts from its own q (method ``draft_model``):
    positions 1 and 2 are distributed as without speculation at temperature 0.8; the same test
    rejects a rule that resamples a rejected position from p instead of the residual
    (power, on a quarter of the samples)."""
    target, _ = models
    spec = {"method": "draft_model", "model": str(draft_model), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True)
    plain = repeating_plain
    specd, rate = _repeating_histograms(target, spec, params)
    assert 0.2 < rate < 0.95, rate  # drafts are really accepted and rejected
    for j in range(2):
        assert _p_value(plain[j], specd[j]) > 0.01, (j, plain[j], specd[j])

    import tandem.engine.speculative.decoder as decoder

    monkeypatch.setattr(decoder, "rejection_sample", _resample_from_p)
    wrong, _ = _repeating_histograms(target, spec, params, N // 4)
    assert min(_p_value(plain[j], wrong[j]) for j in range(2)) < 1e-6


# Suffix trees: every continuation seen (min probability 0), up to 4 nodes: trees with several
# siblings, from the request's own text and, once requests finish, from their cached outputs.
SUFFIX = {
    "method": "suffix",
    "num_speculative_tokens": 3,
    "suffix_max_tree_nodes": 4,
    "suffix_min_probability": 0.0,
}


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_suffix_positions_match_plain_sampling(
    models: tuple[Path, Path], repeating_plain: list[np.ndarray], monkeypatch: pytest.MonkeyPatch
) -> None:
    """Suffix-decoding trees are deterministic drafts: at each node the tree rule tries every
    child x with probability r(x) and otherwise draws from r without it (a point mass q).
    Positions 1 and 2 (the first verified tree, two levels deep: max_tokens 4) are distributed
    as without speculation at temperature 0.8; the same test rejects a rule that always accepts
    a node's first child (power, on a quarter of the samples)."""
    target, _ = models
    plain = repeating_plain
    params = SamplingParams(temperature=0.8, max_tokens=4, ignore_eos=True)
    specd, rate = _repeating_histograms(target, SUFFIX, params)
    assert 0.05 < rate < 0.95, rate  # drafts are really accepted and rejected
    for j in range(2):
        assert _p_value(plain[j], specd[j]) > 0.01, (j, plain[j], specd[j])

    import tandem.engine.speculative.tree_decoder as tree_decoder

    rule = tree_decoder.accept_tree_sampling

    def first_child(tree, p, uniform, noise, q=None):  # noqa: ANN001, ANN202
        return rule(tree, p, torch.zeros_like(uniform), noise, q)

    monkeypatch.setattr(tree_decoder, "accept_tree_sampling", first_child)
    wrong, _ = _repeating_histograms(target, SUFFIX, params, N // 4)
    assert min(_p_value(plain[j], wrong[j]) for j in range(2)) < 1e-6
