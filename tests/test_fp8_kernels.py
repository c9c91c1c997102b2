"""FP8 kernels: the references against the format's definition (dequantize, then multiply in
float64), the Triton per-token-group quantizer and block-scaled GEMM (interpreter) against the
references; on a GPU the compiled kernels against them, and a bf16-vs-FP8 timing table at
DeepSeek-V3 shapes.

As in the other kernel tests, the interpreter is switched on before `triton` is first imported
on a CPU machine; if triton was imported earlier in this pytest process, the interpreter tests
skip and `test_triton_in_fresh_interpreter` re-runs them in a subprocess.
"""

from __future__ import annotations

import os
from typing import Any

import pytest
import torch

from triton_utils import run_in_fresh_interpreter

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton / kernels are imported

from tandem.kernels.fp8 import (  # noqa: E402
    fp8_block_gemm,
    fp8_block_gemm_reference,
    fp8_linear,
    quantize_per_token_group,
    quantize_per_token_group_reference,
)
from tandem.kernels.launch import triton_interpreter_enabled  # noqa: E402
from tandem.kernels.moe import (  # noqa: E402
    moe_experts,
    moe_experts_fp8_reference,
    moe_experts_reference,
)
from tandem.models.quantization import quantize_fp8_blockwise  # noqa: E402

INTERPRETER = triton_interpreter_enabled()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason="Triton interpreter not active in this process; see test_triton_in_fresh_interpreter",
)
# (rows, out features, in features, weight block): partial row, output and K blocks included
GEMMS = [
    (1, 64, 64, (16, 32)),
    (7, 80, 48, (32, 32)),
    (33, 50, 70, (64, 32)),
    (4, 128, 96, (128, 64)),
]


def _case(m: int, n: int, k: int, block: tuple[int, int], seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=gen)
    x[0, : block[1]] *= 40  # one group of one row much larger than the rest
    w = torch.randn(n, k, generator=gen) * 0.1
    q_w, s_w = quantize_fp8_blockwise(w, block)
    return {"x": x, "w": w, "q_w": q_w, "s_w": s_w}


@pytest.mark.parametrize("m,n,k,block", GEMMS)
def test_references_follow_the_format(m: int, n: int, k: int, block: tuple[int, int]) -> None:
    c = _case(m, n, k, block, seed=m)
    q_a, s_a = quantize_per_token_group_reference(c["x"], block[1])
    assert s_a.shape == (m, -(-k // block[1]))
    # Each row's group scale: its amax / 448, so the group's largest value maps to +-448.
    assert torch.allclose(s_a[0, 0], c["x"][0, : block[1]].abs().max() / 448)
    assert q_a.float().abs().amax() == 448
    got = fp8_block_gemm_reference(q_a, s_a, c["q_w"], c["s_w"], block, torch.float32)
    a = q_a.double() * s_a.double().repeat_interleave(block[1], 1)[:, :k]
    s_w = c["s_w"].double().repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    w = c["q_w"].double() * s_w[:n, :k]
    assert torch.allclose(got.double(), a @ w.T, rtol=1e-5, atol=1e-5)
    # The quantized product is near the float one (e4m3: 3 mantissa bits on both sides).
    exact = c["x"] @ c["w"].T
    assert (got - exact).abs().max() < 0.08 * exact.abs().max()


@needs_interpreter
@pytest.mark.parametrize("m,n,k,block", GEMMS)
def test_triton_fp8_quantize_and_gemm_match_references(
    m: int, n: int, k: int, block: tuple[int, int]
) -> None:
    c = _case(m, n, k, block, seed=m)
    q_ref, s_ref = quantize_per_token_group_reference(c["x"], block[1])
    q_a, s_a = quantize_per_token_group(c["x"], block[1], use_triton=True)
    torch.testing.assert_close(s_a, s_ref)
    assert torch.equal(q_a.float(), q_ref.float())  # round to nearest even, as torch casts
    ref = fp8_block_gemm_reference(q_a, s_a, c["q_w"], c["s_w"], block, torch.float32)
    got = fp8_block_gemm(q_a, s_a, c["q_w"], c["s_w"], block, torch.float32, use_triton=True)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    lin = fp8_linear(c["x"].view(1, m, k), c["q_w"], c["s_w"], block, use_triton=True)
    assert lin.shape == (1, m, n)
    torch.testing.assert_close(lin[0], ref, rtol=1e-5, atol=1e-5)


# (tokens, hidden, intermediate, experts, local experts, first local, top_k, weight block)
MOE = [
    (5, 32, 32, 4, 4, 0, 2, (16, 32)),
    (9, 48, 32, 6, 3, 3, 3, (32, 32)),
    (3, 64, 64, 4, 2, 0, 2, (32, 64)),
]


def _moe_case(
    t: int, h: int, i: int, e: int, local: int, k: int, block: tuple[int, int]
) -> dict[str, Any]:
    gen = torch.Generator().manual_seed(t)
    w13, w2 = (
        torch.randn(local, 2 * i, h, generator=gen) * 0.2,
        torch.randn(local, h, i, generator=gen) * 0.2,
    )
    q13, s13 = quantize_fp8_blockwise(w13, block)
    q2, s2 = quantize_fp8_blockwise(w2, block)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(t)])
    return {
        "x": torch.randn(t, h, generator=gen), "w13": q13, "w2": q2,
        "weights": torch.rand(t, k, generator=gen), "ids": ids, "scales": (s13, s2, block),
        "dense": (w13, w2),
    }  # fmt: skip


@pytest.mark.parametrize("t,h,i,e,local,first,k,block", MOE)
def test_fp8_experts_reference_is_the_dequantized_computation(
    t: int, h: int, i: int, e: int, local: int, first: int, k: int, block: tuple[int, int]
) -> None:
    """Against the float experts (moe_experts_reference on the unquantized weights): FP8
    error only, and tokens routed to no local expert get zeros."""
    c = _moe_case(t, h, i, e, local, k, block)
    got = moe_experts_fp8_reference(
        c["x"], c["w13"], c["w2"], *c["scales"], c["weights"], c["ids"], first
    )
    want = moe_experts_reference(c["x"], *c["dense"], c["weights"], c["ids"], first)
    assert (got - want).abs().max() < 0.1 * want.abs().max()
    mine = ((c["ids"] >= first) & (c["ids"] < first + local)).any(1)
    assert torch.equal(got[~mine], torch.zeros_like(got[~mine]))


@needs_interpreter
@pytest.mark.parametrize("t,h,i,e,local,first,k,block", MOE)
def test_triton_fp8_experts_match_reference(
    t: int, h: int, i: int, e: int, local: int, first: int, k: int, block: tuple[int, int]
) -> None:
    c = _moe_case(t, h, i, e, local, k, block)
    args = (c["x"], c["w13"], c["w2"], c["weights"], c["ids"], first)
    got = moe_experts(*args, fp8_scales=c["scales"], use_triton=True)
    want = moe_experts_fp8_reference(
        c["x"], c["w13"], c["w2"], *c["scales"], c["weights"], c["ids"], first
    )
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


def test_operands_that_do_not_fit_are_refused() -> None:
    c = _case(4, 64, 64, (16, 32), seed=0)
    q_a, s_a = quantize_per_token_group_reference(c["x"], 32)
    with pytest.raises(ValueError, match="FP8 GEMM operands do not fit"):
        fp8_block_gemm(q_a, s_a, c["q_w"], c["s_w"][:2], (16, 32), torch.float32)
    with pytest.raises(ValueError, match="a power of two of at least 32"):
        q_w, s_w = quantize_fp8_blockwise(c["w"], (16, 8))
        q8, s8 = quantize_per_token_group_reference(c["x"], 8)
        fp8_block_gemm(q8, s8, q_w, s_w, (16, 8), torch.float32, use_triton=True)


def test_triton_in_fresh_interpreter() -> None:
    if INTERPRETER:
        pytest.skip("the interpreter is active here: the tests above ran in this process")
    assert run_in_fresh_interpreter(__file__, "triton_fp8") == len(GEMMS) + len(MOE)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_triton_cuda_fp8_gemm_matches_reference() -> None:
    if INTERPRETER:
        assert run_in_fresh_interpreter(__file__, "cuda_fp8", interpret=False) == 1
        return
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    block = (128, 128)
    for m, n, k in ((1, 1536, 7168), (100, 7168, 2048), (512, 576, 7168)):
        c = {name: t.cuda() for name, t in _case(m, n, k, block, seed=m).items()}
        x = c["x"].to(torch.bfloat16)
        q_a, s_a = quantize_per_token_group(x, 128)
        q_ref, s_ref = quantize_per_token_group_reference(x, 128)
        torch.testing.assert_close(s_a, s_ref)
        assert torch.equal(q_a.float(), q_ref.float())  # the GPU rounds to nearest even
        ref = fp8_block_gemm_reference(q_a, s_a, c["q_w"], c["s_w"], block, torch.float32)
        got = fp8_block_gemm(q_a, s_a, c["q_w"], c["s_w"], block, torch.float32)
        torch.testing.assert_close(got, ref, rtol=2e-3, atol=2e-3 * ref.abs().max().item())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_bf16_versus_fp8_gemm_timing_at_deepseek_v3_shapes() -> None:
    """Prints a table (no assertion on time): bf16 ``F.linear`` against the FP8 path (activation
    quantization + block-scaled GEMM) at DeepSeek-V3's dense shapes, decode and prefill rows."""
    if INTERPRETER:
        assert run_in_fresh_interpreter(__file__, "timing_at", interpret=False) == 1
        return
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    shapes = {
        "q_a_proj": (1536, 7168),
        "q_b_proj/TP8": (3072, 1536),
        "kv_a_proj": (576, 7168),
        "o_proj/TP8": (7168, 2048),
        "shared gate_up": (4096, 7168),
    }
    print(f"\n{'linear':<16}{'rows':>6}{'bf16 us':>10}{'fp8 us':>10}{'fp8/bf16':>10}")
    for name, (n, k) in shapes.items():
        w = torch.randn(n, k, device="cuda") * 0.02
        q_w, s_w = quantize_fp8_blockwise(w, (128, 128))
        w16 = w.to(torch.bfloat16)
        for m in (1, 64, 2048):
            x = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
            t16 = _time(lambda x=x, w16=w16: torch.nn.functional.linear(x, w16))
            t8 = _time(lambda x=x, q_w=q_w, s_w=s_w: fp8_linear(x, q_w, s_w, (128, 128)))
            print(f"{name:<16}{m:>6}{t16:>10.1f}{t8:>10.1f}{t8 / t16:>10.2f}")
        assert q_w.element_size() == 1  # weights resident at 1 byte each (+ scales)


def _time(fn: object, reps: int = 50) -> float:
    for _ in range(5):
        fn()  # type: ignore[operator]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()  # type: ignore[operator]
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000 / reps
