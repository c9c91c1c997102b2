"""gpt-oss's experts over MXFP4 weights as released (kernels/mxfp4.py): the Triton kernel that
dequantizes a block per K step in registers (interpreter on CPUs, float32 operands) against the
reference on the dequantized weights, with routing that leaves experts empty, pairs past this
rank's experts, gates past the SwiGLU limit and both nibbles' signs; wrong tensor shapes are
refused naming the tensor; on a GPU (``make gpu-check``) the bf16 kernel against float32.

As in the other kernel tests, this module switches the Triton interpreter on before `triton` is
first imported on a CPU machine; `test_triton_in_fresh_interpreter` re-runs the interpreter tests
in a subprocess when triton was imported earlier in this pytest process.
"""

from __future__ import annotations

import os

import pytest
import torch

from triton_utils import run_in_fresh_interpreter

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton / kernels are imported

from checkpoints import quantize_mxfp4  # noqa: E402
from tandem.kernels.launch import HAS_TRITON, triton_interpreter_enabled  # noqa: E402
from tandem.kernels.mxfp4 import (  # noqa: E402
    dequantize_mxfp4,
    gpt_oss_experts_mxfp4,
    gpt_oss_experts_reference,
)

INTERPRETER = triton_interpreter_enabled()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason="Triton interpreter not active in this process; see test_triton_in_fresh_interpreter",
)
ALPHA, LIMIT = 1.702, 7.0  # gpt-oss's swiglu_alpha and swiglu_limit
# (tokens, hidden, intermediate, experts, this rank's experts, top_k, first expert)
CASES = [(5, 64, 64, 4, 4, 2, 0), (19, 96, 64, 8, 4, 3, 4)]


def _case(t: int, h: int, i: int, e: int, local: int, k: int, seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    w13_blocks, w13_scales = quantize_mxfp4(torch.randn(local, 2 * i, h, generator=gen) * 0.4)
    w2_blocks, w2_scales = quantize_mxfp4(torch.randn(local, h, i, generator=gen) * 0.1)
    logits = torch.randn(t, e, generator=gen)
    logits[:, 1] = -1e9  # expert 1 routed to by no token
    top, ids = logits.topk(k, dim=-1)
    return {
        "x": torch.randn(t, h, generator=gen),
        "w13_blocks": w13_blocks,
        "w13_scales": w13_scales,
        "w13_bias": torch.randn(local, 2 * i, generator=gen) * 0.1,
        "w2_blocks": w2_blocks,
        "w2_scales": w2_scales,
        "w2_bias": torch.randn(local, h, generator=gen) * 0.1,
        "weights": torch.softmax(top, dim=-1),
        "ids": ids,
    }


def _truth(c: dict[str, torch.Tensor], first: int) -> torch.Tensor:
    """The reference on the dequantized weights, float32."""
    w13 = dequantize_mxfp4(c["w13_blocks"], c["w13_scales"], torch.float32).transpose(1, 2)
    w2 = dequantize_mxfp4(c["w2_blocks"], c["w2_scales"], torch.float32).transpose(1, 2)
    return gpt_oss_experts_reference(
        c["x"].float(), w13, c["w13_bias"].float(), w2, c["w2_bias"].float(), c["weights"],
        c["ids"], first, ALPHA, LIMIT,
    )  # fmt: skip


def test_the_case_reaches_the_limit_and_both_signs() -> None:
    """What the kernel cases exercise: gates past the clamp, negative values in both nibbles."""
    c = _case(*CASES[1][:6], seed=0)
    w13 = dequantize_mxfp4(c["w13_blocks"], c["w13_scales"], torch.float32)
    gate = (c["x"] @ w13[0].T + c["w13_bias"][0])[:, 0::2]
    assert (gate > LIMIT).any() and (gate < -LIMIT).any()
    assert ((c["w13_blocks"] & 0x08) != 0).any() and ((c["w13_blocks"] & 0x80) != 0).any()


@needs_interpreter
@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-H{c[1]}-E{c[3]}-first{c[6]}" for c in CASES])
def test_triton_mxfp4_experts_match_reference(case: tuple[int, ...]) -> None:
    *shape, first = case
    c = _case(*shape, seed=first)
    got = gpt_oss_experts_mxfp4(**c, first_expert=first, alpha=ALPHA, limit=LIMIT, use_triton=True)
    torch.testing.assert_close(got, _truth(c, first), atol=1e-4, rtol=1e-4)
    # Tokens whose experts are all on other ranks get zeros.
    mine = ((c["ids"] >= first) & (c["ids"] < first + shape[4])).any(1)
    assert (got[~mine] == 0).all()


def test_wrong_shapes_are_refused_naming_the_tensor() -> None:
    c = _case(*CASES[0][:6], seed=1)
    c["w2_scales"] = c["w2_scales"][:, :, :1]
    with pytest.raises(ValueError, match="w2_scales"):
        gpt_oss_experts_mxfp4(**c, first_expert=0, alpha=ALPHA, limit=LIMIT, use_triton=False)


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_triton_in_fresh_interpreter() -> None:
    passed = run_in_fresh_interpreter(__file__, "triton and not cuda and not fresh")
    assert passed >= len(CASES)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_mxfp4_cuda_matches_reference() -> None:
    """bf16 activations, weights dequantized in registers, float32 accumulation: against the
    float32 reference on the dequantized weights (bf16 rounding of x and of the activations
    between the GEMMs)."""
    if INTERPRETER:
        assert run_in_fresh_interpreter(__file__, "cuda_matches", interpret=False) == 1
        return
    c = _case(300, 2880 // 16, 2880 // 16, 32, 32, 4, seed=3)
    truth = _truth(c, 0)
    cuda = {n: v.cuda() for n, v in c.items()}
    cuda["x"] = cuda["x"].bfloat16()
    got = gpt_oss_experts_mxfp4(**cuda, first_expert=0, alpha=ALPHA, limit=LIMIT)
    assert got.dtype == torch.bfloat16
    err = (got.float().cpu() - truth).abs().max().item()
    assert err < 0.05 * truth.abs().max().item(), err
