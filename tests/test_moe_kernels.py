"""MoE kernels: the references against plain per-token loops, the Triton router and grouped
expert kernels (interpreter) against the references.

As in the other kernel tests, this module switches the Triton interpreter on before `triton` is
first imported on a CPU machine; if triton was imported earlier in this pytest process, the
interpreter tests skip and `test_triton_in_fresh_interpreter` re-runs them in a subprocess.
"""

from __future__ import annotations

import os

import pytest
import torch
import torch.nn.functional as F

from triton_utils import run_in_fresh_interpreter

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton / kernels are imported

from tandem.kernels.launch import (
    HAS_TRITON,  # noqa: E402
    triton_interpreter_enabled,  # noqa: E402
)
from tandem.kernels.moe import (  # noqa: E402
    grouped_topk,
    grouped_topk_reference,
    moe_align_blocks,
    moe_experts,
    moe_experts_reference,
)

INTERPRETER = triton_interpreter_enabled()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason="Triton interpreter not active in this process; see test_triton_in_fresh_interpreter",
)

# (tokens, experts, n_group, topk_group, top_k, norm_topk_prob)
ROUTING = [(5, 8, 4, 2, 3, True), (9, 12, 3, 2, 4, False), (1, 16, 4, 1, 2, True)]
# (tokens, hidden, intermediate, experts, local experts, top_k)
EXPERTS = [(7, 32, 16, 8, 4, 3), (20, 48, 24, 6, 6, 2), (3, 16, 40, 4, 2, 4)]


def _routing_case(t: int, e: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, e, generator=gen), torch.randn(e, generator=gen) * 0.2


def _sorted(weights: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    ids_sorted, order = ids.sort(1)
    return weights.gather(1, order), ids_sorted


def _experts_case(
    t: int, h: int, i: int, e: int, k: int, num_local: int, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return {
        "x": torch.randn(t, h, generator=gen).to(dtype),
        "w13": (torch.randn(num_local, 2 * i, h, generator=gen) * 0.2).to(dtype),
        "w2": (torch.randn(num_local, h, i, generator=gen) * 0.2).to(dtype),
        "weights": torch.rand(t, k, generator=gen),
        "ids": ids,
    }


def _assert_matches_float32_truth(
    got: torch.Tensor, c: dict[str, torch.Tensor], first: int
) -> None:
    """``got`` against the reference run in float32 on the same (possibly bf16) inputs. float32
    must agree to rounding; bf16 within its output rounding (the kernel accumulates in float32,
    so it may not be worse than the bf16 PyTorch reference, which rounds every intermediate)."""
    up = {n: v.float() if v.is_floating_point() else v for n, v in c.items()}
    truth = moe_experts_reference(**up, first_expert=first)
    if got.dtype == torch.float32:
        torch.testing.assert_close(got, truth, atol=1e-5, rtol=1e-5)
        return
    torch.testing.assert_close(got.float(), truth, atol=2e-2, rtol=2**-7)
    ref = moe_experts_reference(**c, first_expert=first).float()
    assert (got.float() - truth).abs().max() <= (ref - truth).abs().max() + 1e-3


def _plain_loop(c: dict[str, torch.Tensor], first_expert: int) -> torch.Tensor:
    x, w13, w2 = c["x"].float(), c["w13"].float(), c["w2"].float()
    inter = w13.shape[1] // 2
    out = torch.zeros_like(x)
    for t in range(x.shape[0]):
        for j, e in enumerate(c["ids"][t].tolist()):
            local = e - first_expert
            if 0 <= local < w13.shape[0]:
                h = F.linear(x[t], w13[local])
                out[t] += c["weights"][t, j] * F.linear(F.silu(h[:inter]) * h[inter:], w2[local])
    return out


@pytest.mark.parametrize(("t", "h", "i", "e", "num_local", "k"), EXPERTS)
def test_reference_experts_equal_plain_loop(t: int, h: int, i: int, e: int, num_local: int, k: int):
    c = _experts_case(t, h, i, e, k, num_local, seed=t + h, dtype=torch.float32)
    for first in range(0, e, num_local):  # every rank's share (expert parallelism)
        torch.testing.assert_close(
            moe_experts_reference(**c, first_expert=first), _plain_loop(c, first)
        )


def test_align_blocks_groups_pairs_by_expert() -> None:
    ids = torch.tensor([[3, 0], [1, 3], [3, 2], [5, 4]])  # experts 4, 5 belong to another rank
    pairs, block_expert = moe_align_blocks(ids, first_expert=0, num_local=4, block_m=2)
    flat = ids.view(-1)
    for b, e in enumerate(block_expert.tolist()):
        run = pairs[2 * b : 2 * b + 2]
        real = run[run < flat.numel()]
        if e < 0:
            assert real.numel() == 0
        else:
            assert (flat[real] == e).all()
    got = sorted(p for p in pairs.tolist() if p < flat.numel())
    assert got == [i for i, e in enumerate(flat.tolist()) if e < 4]


def test_bad_groups_are_rejected() -> None:
    logits, bias = _routing_case(2, 8, 0)
    with pytest.raises(ValueError, match="n_group"):
        grouped_topk(logits, bias, 2, 3, 1, True, 1.0)
    with pytest.raises(ValueError, match="cannot supply"):
        grouped_topk(logits, bias, 5, 4, 2, True, 1.0)


@needs_interpreter
@pytest.mark.parametrize(("t", "e", "n_group", "topk_group", "k", "norm"), ROUTING)
def test_triton_router_matches_reference(
    t: int, e: int, n_group: int, topk_group: int, k: int, norm: bool
) -> None:
    logits, bias = _routing_case(t, e, seed=t * e)
    args = (logits, bias, k, n_group, topk_group, norm, 2.5)
    ref_w, ref_ids = _sorted(*grouped_topk_reference(*args))
    got_w, got_ids = _sorted(*grouped_topk(*args, use_triton=True))
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w)


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("t", "h", "i", "e", "num_local", "k"), EXPERTS)
def test_triton_experts_match_reference(
    t: int, h: int, i: int, e: int, num_local: int, k: int, dtype: torch.dtype
) -> None:
    c = _experts_case(t, h, i, e, k, num_local, seed=t + i, dtype=dtype)
    for first in range(0, e, num_local):
        got = moe_experts(**c, first_expert=first, use_triton=True)
        assert got.dtype == dtype
        _assert_matches_float32_truth(got, c, first)


@pytest.mark.skipif(INTERPRETER or not HAS_TRITON, reason="Triton tests ran in this process")
def test_triton_in_fresh_interpreter() -> None:
    passed = run_in_fresh_interpreter(__file__, "triton and not cuda and not fresh")
    assert passed >= len(ROUTING) + 2 * len(EXPERTS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_cuda_matches_reference() -> None:
    if INTERPRETER:
        assert run_in_fresh_interpreter(__file__, "cuda_matches", interpret=False) == 1
        return
    logits, bias = _routing_case(300, 256, 0)
    args = (logits.cuda(), bias.cuda(), 8, 8, 4, True, 2.5)
    ref_w, ref_ids = _sorted(*grouped_topk_reference(*args))
    got_w, got_ids = _sorted(*grouped_topk(*args))
    assert torch.equal(got_ids, ref_ids)
    torch.testing.assert_close(got_w, ref_w)
    c = _experts_case(300, 256, 128, 64, 8, 32, seed=0, dtype=torch.bfloat16)
    c = {n: v.cuda() for n, v in c.items()}
    for first in (0, 32):  # the bf16 reference differs by up to 0.5 here (output rounding)
        _assert_matches_float32_truth(moe_experts(**c, first_expert=first), c, first)
