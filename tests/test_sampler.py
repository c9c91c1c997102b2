"""Specification of engine/sampler.py.

Distributions are checked with chi-square goodness-of-fit tests against expected probabilities
computed independently here with numpy; penalties against a naive per-row loop.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from scipy.stats import chisquare

from tandem.engine.sampler import (
    RowSamplingInfo,
    SamplingTensors,
    apply_min_p,
    apply_penalties,
    apply_temperature,
    apply_top_k_top_p,
    compute_logprobs,
    probs_for_rows,
    random_sample,
    sample,
)

CPU = torch.device("cpu")
NUM_SAMPLES = 20_000
# Fixed, unsorted logits over a small vocabulary; no two values equal.
LOGITS = np.array([-0.5, 1.1, -1.7, 0.2, 1.8, -1.0, 0.9, -2.2, -0.1, 0.4, -1.3, -0.6])
V = len(LOGITS)


def row(
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
    presence_penalty: float = 0.0,
    frequency_penalty: float = 0.0,
    repetition_penalty: float = 1.0,
    prompt: list[int] | None = None,
    output: list[int] | None = None,
    generator: torch.Generator | None = None,
    num_logprobs: int = 0,
) -> RowSamplingInfo:
    return RowSamplingInfo(
        temperature=temperature,
        top_k=top_k,
        top_p=top_p,
        min_p=min_p,
        presence_penalty=presence_penalty,
        frequency_penalty=frequency_penalty,
        repetition_penalty=repetition_penalty,
        prompt_token_ids=prompt or [],
        output_token_ids=output or [],
        generator=generator,
        num_logprobs=num_logprobs,
    )


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- independent numpy oracle


def np_softmax(z: np.ndarray) -> np.ndarray:
    e = np.exp(z - z[np.isfinite(z)].max())
    return e / e.sum()


def expected_probs(
    logits: np.ndarray,
    temperature: float = 1.0,
    top_k: int = 0,
    top_p: float = 1.0,
    min_p: float = 0.0,
) -> np.ndarray:
    """Analytic target distribution: temperature -> min_p -> top-k -> top-p (float64).

    Also asserts that no token sits within 1e-4 of a cut (1000x float32 error), so float
    rounding cannot flip a token across it.
    """
    z = logits.astype(np.float64) / temperature
    if min_p > 0:
        p = np_softmax(z)
        cut = min_p * p.max()
        assert np.abs(p - cut).min() > 1e-4, "min_p cut too close to a token"
        z = np.where(p >= cut, z, -np.inf)
    if top_k > 0:
        kth = np.sort(z)[::-1][top_k - 1]
        z = np.where(z >= kth, z, -np.inf)
    if top_p < 1:
        p = np_softmax(z)
        order = np.argsort(-p, kind="stable")
        before = np.cumsum(p[order]) - p[order]  # mass strictly before each token
        assert np.abs(before - top_p).min() > 1e-4, "top_p cut too close to a token"
        drop = before >= top_p
        drop[0] = False
        z[order[drop]] = -np.inf
    return np_softmax(z)


def chi2_pvalue(samples: np.ndarray, probs: np.ndarray) -> float:
    """Goodness of fit of integer samples to probs; tokens with probability 0 must never appear."""
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, f"sampled a masked token: {counts}"
    expected = probs[support] / probs[support].sum() * len(samples)
    assert expected.min() >= 5, "too few samples for a chi-square test"
    return float(chisquare(counts[support], expected).pvalue)


def draw(logits: np.ndarray, r: RowSamplingInfo, n: int = NUM_SAMPLES, seed: int = 0) -> np.ndarray:
    """n samples of one row's distribution, drawn as one batch of n identical rows."""
    torch.manual_seed(seed)
    batch = torch.tensor(logits, dtype=torch.float32).expand(n, -1).contiguous()
    st = SamplingTensors.from_params([r] * n, len(logits), CPU)
    return sample(batch, st).token_ids.numpy()


# ---------------------------------------------------------------- greedy


def test_greedy_is_argmax() -> None:
    logits = torch.randn(16, 50, generator=gen(1))
    st = SamplingTensors.from_params([row(temperature=0.0)] * 16, 50, CPU)
    assert st.all_greedy and not st.all_random
    assert torch.equal(sample(logits, st).token_ids, logits.argmax(-1))


def test_mixed_batch_keeps_greedy_rows_exact() -> None:
    logits = torch.randn(64, 100, generator=gen(2)) * 0.1  # flat: random rows rarely hit argmax
    rows = [row(temperature=0.0 if i % 2 == 0 else 1.0, top_k=50 * (i % 3)) for i in range(64)]
    st = SamplingTensors.from_params(rows, 100, CPU)
    assert not st.all_greedy and not st.all_random
    torch.manual_seed(0)
    tokens = sample(logits, st).token_ids
    argmax = logits.argmax(-1)
    assert torch.equal(tokens[0::2], argmax[0::2])
    assert (tokens[1::2] != argmax[1::2]).sum() > 16  # random rows really sampled


# ---------------------------------------------------------------- distributions


@pytest.mark.parametrize(
    "params",
    [
        {"temperature": 0.7},
        {"temperature": 1.3},
        {"top_k": 3},
        {"top_p": 0.8},
        {"min_p": 0.2},
        {"temperature": 0.8, "top_k": 6, "top_p": 0.9},
        {"temperature": 1.2, "min_p": 0.1, "top_k": 8, "top_p": 0.85},
    ],
    ids=lambda p: ",".join(f"{k}={v}" for k, v in p.items()),
)
def test_sampled_distribution_matches_analytic(params: dict) -> None:
    probs = expected_probs(LOGITS, **params)
    samples = draw(LOGITS, row(**params))
    assert chi2_pvalue(samples, probs) > 1e-3
    # The processed distribution itself matches the oracle exactly (up to float32).
    st = SamplingTensors.from_params([row(**params)], V, CPU)
    got = probs_for_rows(torch.tensor(LOGITS, dtype=torch.float32)[None], st)[0].numpy()
    np.testing.assert_allclose(got, probs, atol=1e-6)


def test_chi_square_rejects_wrong_distribution() -> None:
    """Negative control: the test above has power to detect a missing temperature."""
    samples = draw(LOGITS, row(temperature=0.7))
    assert chi2_pvalue(samples, expected_probs(LOGITS, temperature=0.7)) > 1e-3
    assert chi2_pvalue(samples, expected_probs(LOGITS, temperature=1.0)) < 1e-6


def test_random_sample_frequencies() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05, 0.0])
    torch.manual_seed(3)
    samples = random_sample(probs.expand(NUM_SAMPLES, -1).contiguous(), [None] * NUM_SAMPLES)
    assert chi2_pvalue(samples.numpy(), probs.double().numpy()) > 1e-3


# ---------------------------------------------------------------- seeded reproducibility


def seeded_run(seed: int, position: int, others: list[RowSamplingInfo], steps: int = 30) -> list:
    """Tokens of a seeded target row over `steps` steps, placed at `position` among `others`."""
    target_logits = torch.randn(40, generator=gen(100)) * 0.5
    other_logits = torch.randn(len(others), 40, generator=gen(101))
    g = gen(seed)
    rows = list(others)
    rows.insert(position, row(top_p=0.95, generator=g))
    logits = torch.cat([other_logits[:position], target_logits[None], other_logits[position:]])
    torch.manual_seed(seed + position + len(others))  # the default RNG differs between runs
    out = []
    for _ in range(steps):
        st = SamplingTensors.from_params(rows, 40, CPU)
        out.append(int(sample(logits, st).token_ids[position]))
    return out


def test_seeded_rows_are_independent_of_batch() -> None:
    alone = seeded_run(1234, 0, [])
    crowd = [row(), row(temperature=0.0), row(top_k=5, generator=gen(7)), row(min_p=0.3)]
    assert seeded_run(1234, 2, crowd) == alone
    assert seeded_run(1234, 4, crowd[::-1]) == alone
    assert seeded_run(1234, 0, crowd[:2]) == alone
    assert seeded_run(4321, 0, []) != alone  # the seed matters


def test_greedy_row_does_not_advance_its_generator() -> None:
    g = gen(5)
    st = SamplingTensors.from_params([row(temperature=0.0, generator=g), row()], V, CPU)
    sample(torch.randn(2, V), st)
    assert torch.equal(g.get_state(), gen(5).get_state())


# ---------------------------------------------------------------- penalties


def naive_penalties(logits: torch.Tensor, rows: list[RowSamplingInfo]) -> torch.Tensor:
    out = logits.clone()
    for b, r in enumerate(rows):
        for tok in set(r.prompt_token_ids) | set(r.output_token_ids):
            x = float(out[b, tok])
            p = r.repetition_penalty
            out[b, tok] = x / p if x > 0 else x * p
        for tok in set(r.output_token_ids):
            count = r.output_token_ids.count(tok)
            out[b, tok] -= r.frequency_penalty * count + r.presence_penalty
    return out


PENALTY_ROWS = [
    row(presence_penalty=0.5, prompt=[1, 2, 3], output=[3, 4, 4, 9]),
    row(frequency_penalty=0.3, prompt=[5, 6], output=[6, 6, 6, 7, 0]),
    row(repetition_penalty=1.3, prompt=[1, 10, 11, 12, 13], output=[12, 14, 14]),
    row(
        presence_penalty=-0.4,
        frequency_penalty=0.2,
        repetition_penalty=1.2,
        prompt=[2, 2, 8],
        output=[8, 8, 15, 16, 30, 31],
    ),
    row(temperature=0.0, repetition_penalty=0.8, prompt=[0, 1, 2, 3, 4, 5], output=[]),
    row(prompt=[1, 2, 3], output=[1, 2, 3]),  # neutral
]


def test_penalties_match_naive_loop() -> None:
    logits = torch.randn(len(PENALTY_ROWS), 32, generator=gen(3)) * 3
    st = SamplingTensors.from_params(PENALTY_ROWS, 32, CPU)
    assert not st.no_penalties
    got = apply_penalties(logits, st)
    torch.testing.assert_close(got, naive_penalties(logits, PENALTY_ROWS))
    assert not torch.equal(got, logits)
    assert torch.equal(got[-1], logits[-1])


def test_penalties_apply_to_greedy_rows() -> None:
    logits = torch.tensor([[0.0, 3.0, 2.5, 1.0]])
    rows = [row(temperature=0.0, presence_penalty=1.0, output=[1])]
    st = SamplingTensors.from_params(rows, 4, CPU)
    assert int(sample(logits, st).token_ids[0]) == 2
    probs = probs_for_rows(logits, st)
    assert torch.equal(probs, torch.tensor([[0.0, 0.0, 1.0, 0.0]]))


def test_builder_skips_vocab_tensors_without_penalties() -> None:
    st = SamplingTensors.from_params([row(output=[1, 2]), row(top_k=3)], V, CPU)
    assert st.no_penalties and st.output_token_counts is None and st.prompt_token_mask is None
    st = SamplingTensors.from_params([row(presence_penalty=0.5, output=[1, 1])], V, CPU)
    assert st.prompt_token_mask is None
    assert st.output_token_counts is not None and int(st.output_token_counts[0, 1]) == 2


def test_builder_rejects_bad_params() -> None:
    with pytest.raises(ValueError, match="top_p"):
        SamplingTensors.from_params([row(top_p=0.0)], V, CPU)
    with pytest.raises(ValueError, match="temperature"):
        SamplingTensors.from_params([row(temperature=-1.0)], V, CPU)
    with pytest.raises(ValueError, match="token id"):
        SamplingTensors.from_params([row(repetition_penalty=1.1, prompt=[V])], V, CPU)


# ---------------------------------------------------------------- logprobs


def test_logprobs_are_raw_model_logprobs() -> None:
    logits = torch.randn(4, 30, generator=gen(4))
    rows = [
        row(temperature=0.5, presence_penalty=1.0, output=[3], num_logprobs=3),
        row(temperature=0.0, repetition_penalty=1.5, prompt=[int(logits[1].argmax())]),
        row(top_k=2, num_logprobs=5),
        row(min_p=0.1, num_logprobs=1),
    ]
    st = SamplingTensors.from_params(rows, 30, CPU)
    assert st.max_num_logprobs == 5
    out = sample(logits, st)
    ref = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs, ref.gather(1, out.token_ids[:, None]).squeeze(1))
    assert out.topk_ids.shape == (4, 5)
    assert torch.all(out.topk_logprobs[:, :-1] >= out.topk_logprobs[:, 1:])
    torch.testing.assert_close(out.topk_logprobs, ref.gather(1, out.topk_ids))
    assert torch.equal(out.topk_ids[:, 0], logits.argmax(-1))
    chosen, ids, lps = compute_logprobs(logits, logits.argmin(-1), 2)
    torch.testing.assert_close(chosen, ref.min(-1).values)
    assert ids.shape == lps.shape == (4, 2)


def test_no_logprobs_requested() -> None:
    st = SamplingTensors.from_params([row(), row(temperature=0.0)], V, CPU)
    out = sample(torch.randn(2, V), st)
    assert out.logprobs is None and out.topk_ids is None and out.topk_logprobs is None
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (2,)


# ---------------------------------------------------------------- stage edges


def test_top_p_edges() -> None:
    logits = torch.randn(8, 64, generator=gen(6)) * 2
    ones = torch.ones(8)
    assert torch.equal(apply_top_k_top_p(logits, None, ones), logits)
    tiny = apply_top_k_top_p(logits, None, torch.full((8,), 1e-6))
    assert torch.equal(torch.isfinite(tiny).sum(-1), torch.ones(8, dtype=torch.long))
    assert torch.equal(tiny.argmax(-1), logits.argmax(-1))
    assert torch.equal(tiny.max(-1).values, logits.max(-1).values)


def test_top_k_edges() -> None:
    logits = torch.randn(4, 16, generator=gen(7))
    disabled = torch.tensor([0, -1, 16, 100])
    assert torch.equal(apply_top_k_top_p(logits, disabled, None), logits)
    top1 = apply_top_k_top_p(logits, torch.ones(4, dtype=torch.long), None)
    assert torch.equal(torch.isfinite(top1).sum(-1), torch.ones(4, dtype=torch.long))
    assert torch.equal(top1.argmax(-1), logits.argmax(-1))


def test_temperature_and_min_p_edges() -> None:
    logits = torch.randn(2, 16, generator=gen(8))
    scaled = apply_temperature(logits, torch.tensor([0.0, 2.0]))
    assert torch.equal(scaled[0], logits[0])
    torch.testing.assert_close(scaled[1], logits[1] / 2)
    assert torch.equal(apply_min_p(logits, torch.zeros(2)), logits)
    kept = apply_min_p(logits, torch.tensor([0.99, 0.5]))
    assert torch.equal(torch.isfinite(kept[0]).sum(), torch.tensor(1))
    p = logits[1].softmax(-1)
    assert torch.equal(torch.isfinite(kept[1]), p >= 0.5 * p.max())


def test_functions_do_not_mutate_inputs() -> None:
    logits = torch.randn(len(PENALTY_ROWS), 32, generator=gen(9))
    before = logits.clone()
    st = SamplingTensors.from_params(PENALTY_ROWS, 32, CPU)
    sample(logits, st)
    probs_for_rows(logits, st)
    assert torch.equal(logits, before)


def test_no_host_sync() -> None:
    """sample runs on the meta device, where any read of a tensor value on the host fails."""
    meta = torch.device("meta")
    with pytest.raises((RuntimeError, NotImplementedError)):
        torch.ones(2, device=meta).sum().item()  # the check has power
    # (torch.Generator has no meta device: the seeded path is covered by the tests above.)
    rows = [*PENALTY_ROWS, row(top_k=3, top_p=0.9, min_p=0.1, num_logprobs=2)]
    st = SamplingTensors.from_params(rows, 32, meta)
    out = sample(torch.empty(len(rows), 32, device=meta), st)
    assert out.token_ids.shape == (len(rows),) and out.topk_ids.shape == (len(rows), 2)
    assert probs_for_rows(torch.empty(len(rows), 32, device=meta), st).shape == (len(rows), 32)
