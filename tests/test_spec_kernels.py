"""Speculative-decoding kernels: references against the engine / plain loops / statistics, and
the Triton kernels (interpreter) against the references.

The Triton interpreter must be switched on before `triton` is first imported. On a CPU machine
this module does that. If another test module imported triton earlier in this pytest process, or
on a CUDA machine, the in-process interpreter tests skip and `test_triton_in_fresh_interpreter`
re-runs them in a subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import os

import pytest
import torch
from scipy.stats import chisquare

from triton_utils import run_in_fresh_interpreter

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton / kernels are imported

from tandem.kernels.launch import (
    HAS_TRITON,  # noqa: E402
    triton_interpreter_enabled,  # noqa: E402
)
from tandem.kernels.spec_decode import (  # noqa: E402
    accept_matching,
    accept_matching_reference,
    build_draft_step0_inputs,
    build_draft_step0_inputs_reference,
    rejection_sample,
    rejection_sample_reference,
)

INTERPRETER = triton_interpreter_enabled()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason="Triton interpreter not active in this process; see test_triton_in_fresh_interpreter",
)

# (B, K, V); V > 64 spans several of the interpreter's 64-wide vocabulary tiles.
SHAPES = [(1, 1, 7), (2, 3, 50), (3, 5, 130), (4, 2, 300), (5, 4, 65), (5, 1, 256)]


def _normalize(x: torch.Tensor) -> torch.Tensor:
    return x / x.sum(-1, keepdim=True)


def make_case(b: int, k: int, v: int, seed: int) -> dict[str, torch.Tensor]:
    """Random verification inputs with the edge cases mixed in (see comments)."""
    gen = torch.Generator().manual_seed(seed)
    # Sparse-ish p (exact zeros, as after top-k) so acceptance and rejection both happen.
    p = torch.rand(b, k + 1, v, generator=gen) ** 4
    p = _normalize(p * (torch.rand(b, k + 1, v, generator=gen) > 0.3))
    q = _normalize(torch.rand(b, k, v, generator=gen) ** 4)
    drafts = torch.multinomial(q.view(-1, v), 1, generator=gen).view(b, k)
    num_drafts = torch.arange(b) % (k + 1)  # mixes 0..K
    num_drafts[-1] = k
    if b > 1:  # argmax drafts: q one-hot at the draft
        q[1] = torch.nn.functional.one_hot(drafts[1], v).float()
    if b > 2:  # p == q on a row past the first one: the residual vanishes there
        q[2, k - 1] = p[2, k - 1]
    if b > 3:  # q(d) = 0 for a real draft (stale q): never accepted, whatever p(d) is
        q[3, 0, drafts[3, 0]] = 0.0
        q[3, 0] = _normalize(q[3, 0])
        p[3, 0, drafts[3, 0]] += 1.0
        p[3, 0] = _normalize(p[3, 0])
    uniform = torch.rand(b, k, generator=gen)
    noise = torch.empty(b, k + 1, v).exponential_(generator=gen).clamp_min_(1e-20)
    return {
        "p": p,
        "q": q,
        "drafts": drafts,
        "num_drafts": num_drafts,
        "uniform": uniform,
        "residual_noise": noise,
    }


def race(dist: torch.Tensor, noise: torch.Tensor) -> torch.Tensor:
    return (dist / noise).argmax(-1)


# ---------------------------------------------------------------------------------------------
# References: the engine's semantics, exactly
# ---------------------------------------------------------------------------------------------


def test_cases_cover_acceptance_and_rejection():
    # The random cases compared below must exercise every outcome, not just one.
    outcomes = set()
    for b, k, v in SHAPES:
        case = make_case(b, k, v, seed=b * 100 + k * 10 + v)
        num_accepted, _ = rejection_sample_reference(**case)
        for n, d in zip(num_accepted.tolist(), case["num_drafts"].tolist(), strict=True):
            outcomes.add("no drafts" if d == 0 else "all" if n == d else "some" if n else "none")
    assert outcomes == {"no drafts", "none", "some", "all"}


def test_step0_reference_equals_plain_loop():
    # input_ids [T=9], sequences of 4, 2 and 3 rows; the middle one is not sampled.
    input_ids = torch.arange(100, 109)
    last_rows = torch.tensor([3, 5, 8])
    next_tokens = torch.tensor([7, 8, 9])
    first_row = torch.tensor([0, 6])
    num_accepted = torch.tensor([1, 2])  # request 1 accepted everything: its last row
    tokens = torch.tensor([[50, 51, 52], [60, 61, 62]])
    step, gather = build_draft_step0_inputs_reference(
        first_row, num_accepted, tokens, input_ids, last_rows, next_tokens
    )
    expected = [101, 51, 103, 7, 105, 8, 107, 108, 62]  # row 8: the bonus beats next_token
    assert step.tolist() == expected
    assert gather.tolist() == [1, 8]


# ---------------------------------------------------------------------------------------------
# Statistics: speculative sampling emits the target distribution
# ---------------------------------------------------------------------------------------------

STAT_V, STAT_K, STAT_N = 6, 2, 40_000


def _stat_inputs(one_hot_q: bool, seed: int = 0) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """A target that depends only on the position (p_j fixed per row), so every emitted token at
    position j is distributed as p_j, whatever happened before it."""
    gen = torch.Generator().manual_seed(seed)
    p_rows = torch.tensor(
        [
            [0.30, 0.25, 0.20, 0.10, 0.10, 0.05],
            [0.05, 0.10, 0.15, 0.20, 0.20, 0.30],
            [0.10, 0.30, 0.10, 0.30, 0.10, 0.10],
        ]
    )
    q_rows = torch.tensor(
        [
            [0.35, 0.05, 0.10, 0.20, 0.20, 0.10],  # argmax drafts: accepted w.p. 0.3 ...
            [0.10, 0.10, 0.10, 0.10, 0.20, 0.40],  # ... and 0.3: position 2 in 9% of rows
        ]
    )
    n, k, v = STAT_N, STAT_K, STAT_V
    p = p_rows.expand(n, k + 1, v).contiguous()
    if one_hot_q:  # argmax drafts
        drafts = q_rows.argmax(-1).expand(n, k).contiguous()
        q = torch.nn.functional.one_hot(drafts, v).float()
    else:
        q = q_rows.expand(n, k, v).contiguous()
        drafts = torch.multinomial(q.view(-1, v), 1, generator=gen).view(n, k)
    case = {
        "p": p,
        "q": q,
        "drafts": drafts,
        "num_drafts": torch.full((n,), k),
        "uniform": torch.rand(n, k, generator=gen),
        "residual_noise": torch.empty(n, k + 1, v).exponential_(generator=gen),
    }
    return case, p_rows


def _chisquare_p(tokens: torch.Tensor, probs: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=probs.numel()).double()
    expected = probs.double() / probs.double().sum() * observed.sum()
    return float(chisquare(observed.numpy(), expected.numpy()).pvalue)


@pytest.mark.parametrize("one_hot_q", [False, True], ids=["sampled_q", "one_hot_q"])
def test_reference_emits_target_distribution(one_hot_q):
    case, p_rows = _stat_inputs(one_hot_q)
    num_accepted, tokens = rejection_sample_reference(**case)
    for j in range(STAT_K + 1):
        emitted = num_accepted >= j  # position j is emitted
        assert emitted.sum() > 2_000  # enough samples for the test to have power
        assert _chisquare_p(tokens[emitted, j], p_rows[j]) > 1e-3, f"position {j}"
    # Acceptance rate at position 0 is sum(min(p, q)) (exact expectation, loose tolerance).
    q0 = case["q"][0, 0]
    rate = (num_accepted >= 1).double().mean().item()
    assert abs(rate - torch.minimum(p_rows[0], q0).sum().item()) < 0.015


def test_statistical_check_rejects_wrong_distributions():
    # Negative controls for the check above, on the same samples.
    case, p_rows = _stat_inputs(one_hot_q=False)
    num_accepted, tokens = rejection_sample_reference(**case)
    # Accepting every draft blindly emits q, not p.
    assert _chisquare_p(case["drafts"][:, 0], p_rows[0]) < 1e-3
    # The classic bug: on rejection, resample from p instead of the residual max(p - q, 0).
    from_p = race(case["p"][:, 0], case["residual_noise"][:, 0])
    buggy = torch.where(num_accepted >= 1, case["drafts"][:, 0], from_p)
    assert _chisquare_p(buggy, p_rows[0]) < 1e-3
    assert _chisquare_p(tokens[:, 0], p_rows[0]) > 1e-3  # ... while the real output passes


# ---------------------------------------------------------------------------------------------
# Argument checks and CPU dispatch
# ---------------------------------------------------------------------------------------------


def test_bad_shapes_are_rejected():
    case = make_case(2, 3, 10, seed=1)
    bad = {**case, "uniform": case["uniform"][:, :2]}
    with pytest.raises(ValueError, match="uniform must have shape"):
        rejection_sample(**bad)
    with pytest.raises(ValueError, match="target_tokens must have shape"):
        accept_matching(torch.zeros(2, 3, dtype=torch.long), case["drafts"], case["num_drafts"])


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_path_requires_float32():
    case = make_case(2, 3, 10, seed=1)
    with pytest.raises(ValueError, match="p must be float32"):
        rejection_sample(**{**case, "p": case["p"].double()}, use_triton=True)


def test_cpu_dispatch_uses_reference():
    case = make_case(3, 2, 20, seed=2)
    out, ref = rejection_sample(**case), rejection_sample_reference(**case)
    assert torch.equal(out[0], ref[0]) and torch.equal(out[1], ref[1])


# ---------------------------------------------------------------------------------------------
# Triton kernels through the interpreter
# ---------------------------------------------------------------------------------------------


def _assert_same(out: tuple[torch.Tensor, ...], ref: tuple[torch.Tensor, ...]) -> None:
    for o, r in zip(out, ref, strict=True):
        assert o.dtype == r.dtype and o.shape == r.shape
        assert torch.equal(o, r), f"\n{o}\n!=\n{r}"


@needs_interpreter
@pytest.mark.parametrize(("b", "k", "v"), SHAPES)
def test_triton_rejection_sample_matches_reference(b, k, v):
    case = make_case(b, k, v, seed=b * 100 + k * 10 + v)
    ref = rejection_sample_reference(**case)
    _assert_same(rejection_sample(**case, use_triton=True), ref)


@needs_interpreter
def test_triton_all_accepted_takes_bonus_from_last_row():
    b, k, v = 3, 4, 130
    case = make_case(b, k, v, seed=11)
    case["num_drafts"] = torch.full((b,), k)
    case["q"] = case["p"][:, :k].clone()  # ratio 1 > uniform: every draft is accepted
    case["drafts"] = case["p"][:, :k].argmax(-1)  # p(d) > 0
    num_accepted, tokens = rejection_sample(**case, use_triton=True)
    assert num_accepted.tolist() == [k] * b
    assert torch.equal(tokens[:, :k], case["drafts"])
    assert torch.equal(tokens[:, k], race(case["p"][:, k], case["residual_noise"][:, k]))
    _assert_same((num_accepted, tokens), rejection_sample_reference(**case))


@needs_interpreter
def test_triton_none_accepted_draws_from_residual():
    b, k, v = 4, 3, 100
    case = make_case(b, k, v, seed=12)
    case["num_drafts"] = torch.full((b,), k)
    case["p"][:, :k].scatter_(2, case["drafts"][..., None], 0.0)  # p(d) = 0: always rejected
    case["p"] = _normalize(case["p"])
    num_accepted, tokens = rejection_sample(**case, use_triton=True)
    assert num_accepted.tolist() == [0] * b
    residual = _normalize((case["p"][:, 0] - case["q"][:, 0]).clamp_min(0))
    assert torch.equal(tokens[:, 0], race(residual, case["residual_noise"][:, 0]))
    assert (tokens[:, 0] != case["drafts"][:, 0]).all()
    _assert_same((num_accepted, tokens), rejection_sample_reference(**case))


@needs_interpreter
def test_triton_vanished_residual_falls_back_to_p():
    # Draft 0 rejected (p(d) = 0); row 1 has p == q, so its (not emitted) draw comes from p.
    b, k, v = 2, 2, 90
    case = make_case(b, k, v, seed=13)
    case["num_drafts"] = torch.full((b,), k)
    case["p"][:, 0].scatter_(1, case["drafts"][:, :1], 0.0)
    case["p"] = _normalize(case["p"])
    case["q"][:, 1] = case["p"][:, 1]
    num_accepted, tokens = rejection_sample(**case, use_triton=True)
    assert num_accepted.tolist() == [0, 0]
    assert torch.equal(tokens[:, 1], race(case["p"][:, 1], case["residual_noise"][:, 1]))
    _assert_same((num_accepted, tokens), rejection_sample_reference(**case))


@needs_interpreter
def test_triton_race_ties_keep_first_index_across_tiles():
    # Equal maxima at vocab ids 3 and 200 (different 64-wide tiles): argmax takes the first.
    v = 260
    p = torch.full((1, 2, v), 0.5 / (v - 2))
    p[..., 3] = p[..., 200] = 0.25
    q = torch.zeros(1, 1, v)
    q[0, 0, 0] = 1.0  # draft 0 with p(0) < 1: rejected whenever uniform >= p(0)
    case = {
        "p": p,
        "q": q,
        "drafts": torch.zeros(1, 1, dtype=torch.long),
        "num_drafts": torch.ones(1, dtype=torch.long),
        "uniform": torch.full((1, 1), 0.99),
        "residual_noise": torch.ones(1, 2, v),
    }
    ref = rejection_sample_reference(**case)
    assert ref[1].tolist() == [[3, 3]]
    _assert_same(rejection_sample(**case, use_triton=True), ref)


@needs_interpreter
def test_triton_rejection_sample_strided_inputs():
    b, k, v = 3, 2, 70
    case = make_case(b, k, v, seed=14)
    wide = torch.zeros(b, k + 1, v + 9)
    wide[..., :v] = case["p"]
    strided = {**case, "p": wide[..., :v], "drafts": case["drafts"].t().contiguous().t()}
    assert not strided["p"].is_contiguous() and not strided["drafts"].is_contiguous()
    _assert_same(rejection_sample(**strided, use_triton=True), rejection_sample_reference(**case))


@needs_interpreter
@pytest.mark.parametrize(("b", "k"), [(1, 1), (3, 2), (5, 5), (4, 4)])
def test_triton_accept_matching_matches_reference(b, k):
    gen = torch.Generator().manual_seed(b * 10 + k)
    target = torch.randint(0, 50, (b, k + 1), generator=gen)
    drafts = target[:, :k].clone()
    num_drafts = torch.arange(b) % (k + 1)
    num_drafts[0] = k
    drafts[0, k // 2] += 1  # a mismatch in the middle, matches after it
    if b > 2:
        num_drafts[2] = k  # all drafts match: bonus
        drafts[-1] = torch.randint(0, 2, (k,), generator=gen)  # random matches
        target[-1] = torch.randint(0, 2, (k + 1,), generator=gen)
    ref = accept_matching_reference(target, drafts, num_drafts)
    assert ref[0][0] == k // 2
    assert ref[0].max() > 0 or b == 1
    _assert_same(accept_matching(target, drafts, num_drafts, use_triton=True), ref)


STEP0_CASES = {
    # name: (sequence query lengths, sampled sequences, K)
    "decode_verify": ([3, 3, 3], [0, 1, 2], 2),
    "mixed_prefill": ([5, 4, 1, 4], [1, 3], 3),
    "one_token": ([1], [0], 1),
    "many_rows": ([6, 25, 5, 5, 2], [0, 2, 3, 4], 4),  # > one 16-row program, > 8 sequences
}


def _step0_case(name: str, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    lens, sampled, k = STEP0_CASES[name]
    gen = torch.Generator().manual_seed(len(name))
    starts = torch.tensor([0, *lens]).cumsum(0)
    t = int(starts[-1])
    input_ids = torch.randint(0, 1000, (t,), generator=gen).to(dtype)
    last_rows = starts[1:] - 1
    next_tokens = torch.randint(1000, 2000, (len(lens),), generator=gen).to(dtype)
    # Verify position 0 at the first of each sampled sequence's K + 1 rows (its last K + 1).
    first_row = starts[1:][sampled] - (k + 1)
    first_row = first_row.clamp_min(starts[:-1][sampled])
    room = starts[1:][sampled] - 1 - first_row
    num_accepted = torch.minimum(torch.randint(0, k + 1, (len(sampled),), generator=gen), room)
    num_accepted[0] = room[0]  # lands on the last row: the correction beats next_token
    tokens = torch.randint(2000, 3000, (len(sampled), k + 1), generator=gen)
    return first_row, num_accepted, tokens, input_ids, last_rows, next_tokens


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.int64, torch.int32], ids=["i64", "i32"])
@pytest.mark.parametrize("name", list(STEP0_CASES))
def test_triton_step0_inputs_match_reference(name, dtype):
    args = _step0_case(name, dtype)
    ref = build_draft_step0_inputs_reference(*args)
    assert ref[0][ref[1][0]] == args[2][0, args[1][0]]  # the override the case is built for
    _assert_same(build_draft_step0_inputs(*args, use_triton=True), ref)


@needs_interpreter
def test_triton_step0_negative_last_row_and_wrap():
    # A negative row counts from the end, as in torch indexing.
    input_ids = torch.arange(10, 16)
    args = (
        torch.tensor([2]),
        torch.tensor([1]),
        torch.tensor([[70, 71]]),
        input_ids,
        torch.tensor([-1, 1]),
        torch.tensor([90, 91]),
    )
    ref = build_draft_step0_inputs_reference(*args)
    assert ref[0].tolist() == [11, 91, 13, 71, 15, 90]
    _assert_same(build_draft_step0_inputs(*args, use_triton=True), ref)
    # No last row at the end: the shift wraps around (the last row reads row 0).
    args = (*args[:4], torch.tensor([1]), torch.tensor([91]))
    ref = build_draft_step0_inputs_reference(*args)
    assert ref[0].tolist() == [11, 91, 13, 71, 15, 10]
    _assert_same(build_draft_step0_inputs(*args, use_triton=True), ref)


@pytest.mark.skipif(INTERPRETER or not HAS_TRITON, reason="Triton tests ran in this process")
def test_triton_in_fresh_interpreter():
    passed = run_in_fresh_interpreter(__file__, "triton and not cuda and not fresh")
    assert passed >= 25  # every interpreter test above


# ---------------------------------------------------------------------------------------------
# CUDA (compiled Triton)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_cuda_matches_reference():
    if INTERPRETER:  # this process interprets Triton; check the compiled kernels in a fresh one
        selector = "test_triton_cuda_matches_reference"
        assert run_in_fresh_interpreter(__file__, selector, interpret=False) == 1
        return
    for b, k, v in [*SHAPES, (64, 4, 151_936)]:
        case = make_case(b, k, v, seed=b + k + v)
        ref = rejection_sample_reference(**case)
        out = rejection_sample(**{n: t.cuda() for n, t in case.items()})
        _assert_same(tuple(o.cpu() for o in out), ref)
        target = torch.cat([case["drafts"], case["drafts"][:, :1]], dim=1)
        target[:, 1::3] += 1  # mismatches at rows 1, 4, ...
        ref_m = accept_matching_reference(target, case["drafts"], case["num_drafts"])
        out_m = accept_matching(target.cuda(), case["drafts"].cuda(), case["num_drafts"].cuda())
        _assert_same(tuple(o.cpu() for o in out_m), ref_m)
    for name in STEP0_CASES:
        args = _step0_case(name, torch.int64)
        out_s = build_draft_step0_inputs(*(a.cuda() for a in args))
        _assert_same(tuple(o.cpu() for o in out_s), build_draft_step0_inputs_reference(*args))
