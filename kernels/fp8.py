"""Block-scaled FP8 matrix multiply (DeepSeek-V3's format) for weights that stay FP8 on the GPU.

Weights: ``q_w`` float8_e4m3fn [N, K] with ``s_w`` float32 [ceil(N / bn), ceil(K / bk)], the
weight being each (bn x bk) block times its scale. Activations are quantized at run time per
token and per group of ``bk`` channels: ``s_a = amax / 448`` (``quantize_per_token_group``), so
each K block of the product has one scale per row and one per output block:
``C[m, n] = sum_kb s_a[m, kb] * s_w[n // bn, kb] * sum_{k in kb} q_a[m, k] * q_w[n, k]``,
accumulated in float32.

Each has a plain-PyTorch reference (the test oracle) and a Triton implementation (CUDA on
compute capability >= 8.9, where ``tl.dot`` takes FP8 operands; CPU through the interpreter).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tandem.kernels.launch import HAS_TRITON, gpu_paths, launch, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "FP8_MIN_CAPABILITY",
    "fp8_block_gemm",
    "fp8_block_gemm_reference",
    "fp8_gemm_block_unsupported",
    "fp8_linear",
    "quantize_per_token_group",
    "quantize_per_token_group_reference",
]

FP8_MAX = 448.0
FP8_MIN_CAPABILITY = (8, 9)  # FP8 tensor cores: Ada, Hopper, Blackwell
FP8_MIN_BLOCK_K = 32  # an FP8 tl.dot needs K >= 32
_EPS = 1e-10  # the smallest amax a group is scaled by (an all-zero group stays zero)


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def quantize_per_token_group_reference(x: Tensor, group: int) -> tuple[Tensor, Tensor]:
    """x [M, K] → (float8_e4m3fn [M, K], scales float32 [M, ceil(K / group)]) with
    ``x ≈ q * scale`` per row and group of ``group`` channels (the last group may be partial)."""
    m, k = x.shape
    g = math.ceil(k / group)
    padded = torch.zeros(m, g * group, dtype=torch.float32, device=x.device)
    padded[:, :k] = x.float()
    groups = padded.view(m, g, group)
    scale = groups.abs().amax(-1).clamp_min(_EPS) / FP8_MAX  # [M, G]
    q = (groups / scale[:, :, None]).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return q.view(m, g * group)[:, :k].contiguous(), scale


def _expand(scale: Tensor, rows: int, cols: int, block: tuple[int, int]) -> Tensor:
    full = scale.repeat_interleave(block[0], 0).repeat_interleave(block[1], 1)
    return full[:rows, :cols]


def fp8_block_gemm_reference(
    q_a: Tensor,
    s_a: Tensor,
    q_w: Tensor,
    s_w: Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
) -> Tensor:
    """``dequant(q_a) @ dequant(q_w).T`` in float32, cast to ``out_dtype``: [M, N]."""
    (m, k), n = q_a.shape, q_w.shape[0]
    a = q_a.float() * _expand(s_a, m, k, (1, block[1]))
    w = q_w.float() * _expand(s_w, n, k, block)
    return (a @ w.T).to(out_dtype)


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def fp8_gemm_block_unsupported(block: tuple[int, int]) -> str | None:
    """Why the Triton FP8 kernels cannot take weights in ``block`` (None: they can): a K step
    is one scale block's columns, and an FP8 ``tl.dot`` needs K >= 32, a power of two."""
    bk = block[1]
    if bk < FP8_MIN_BLOCK_K or bk & (bk - 1):
        return (
            f"weight_block_size {list(block)}: FP8 GEMMs need column blocks that are a power of "
            f"two of at least {FP8_MIN_BLOCK_K}"
        )
    return None


def check_gemm_block(block: tuple[int, int]) -> None:
    why = fp8_gemm_block_unsupported(block)
    if why is not None:
        raise ValueError(f"FP8 GEMM on the GPU: {why}")


def quantize_per_token_group(
    x: Tensor, group: int, *, use_triton: bool | None = None
) -> tuple[Tensor, Tensor]:
    """Per-token, per-group dynamic FP8 quantization (see the reference)."""
    if use_triton is None:
        use_triton = gpu_paths(x) and HAS_TRITON
    if not use_triton:
        return quantize_per_token_group_reference(x, group)
    m, k = x.shape
    g = triton.cdiv(k, group)
    q = torch.empty(m, k, dtype=torch.float8_e4m3fn, device=x.device)
    scale = torch.empty(m, g, dtype=torch.float32, device=x.device)
    if m == 0:
        return q, scale
    x = x if x.stride(-1) == 1 else x.contiguous()
    launch(
        _quantize_group_kernel, (m, g), x.device,
        x, q, scale, k, x.stride(0), q.stride(0), scale.stride(0), group, next_pow2(group),
    )  # fmt: skip
    return q, scale


def fp8_block_gemm(
    q_a: Tensor,
    s_a: Tensor,
    q_w: Tensor,
    s_w: Tensor,
    block: tuple[int, int],
    out_dtype: torch.dtype,
    *,
    use_triton: bool | None = None,
) -> Tensor:
    """The block-scaled product (see the module docstring): [M, N] in ``out_dtype``."""
    (m, k), (n, kw) = q_a.shape, q_w.shape
    bn, bk = block
    grid = (math.ceil(n / bn), math.ceil(k / bk))
    if kw != k or tuple(s_w.shape) != grid or tuple(s_a.shape) != (m, grid[1]):
        raise ValueError(
            f"FP8 GEMM operands do not fit: a {tuple(q_a.shape)} scales {tuple(s_a.shape)}, "
            f"w {tuple(q_w.shape)} scales {tuple(s_w.shape)}, blocks {list(block)}"
        )
    if use_triton is None:
        use_triton = gpu_paths(q_a) and HAS_TRITON
    if not use_triton:
        return fp8_block_gemm_reference(q_a, s_a, q_w, s_w, block, out_dtype)
    check_gemm_block(block)
    out = torch.empty(m, n, dtype=out_dtype, device=q_a.device)
    if m == 0:
        return out
    block_m = 16 if m <= 16 else 64
    block_n = 128 if q_a.is_cuda else 32
    launch(
        _fp8_gemm_kernel, (triton.cdiv(m, block_m), triton.cdiv(n, block_n)), q_a.device,
        q_a, s_a, q_w, s_w, out, m, n, k,
        q_a.stride(0), s_a.stride(0), q_w.stride(0), s_w.stride(0), out.stride(0),
        bn, bk, block_m, block_n, not q_a.is_cuda,
        **({"num_warps": 4, "num_stages": 3} if q_a.is_cuda else {}),
    )  # fmt: skip
    return out


def fp8_linear(
    x: Tensor,
    q_w: Tensor,
    s_w: Tensor,
    block: tuple[int, int],
    bias: Tensor | None = None,
    *,
    use_triton: bool | None = None,
) -> Tensor:
    """``x @ W.T (+ bias)`` for a block-quantized FP8 weight: x [..., K] in bf16/fp16/fp32 is
    quantized per token and group of ``block[1]`` channels, the output is in x's dtype."""
    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    q_a, s_a = quantize_per_token_group(x2, block[1], use_triton=use_triton)
    out = fp8_block_gemm(q_a, s_a, q_w, s_w, block, x.dtype, use_triton=use_triton)
    if bias is not None:
        out = out + bias
    return out.view(*lead, q_w.shape[0])


# --------------------------------------------------------------------------------------------
# Triton (CUDA; CPU through the interpreter)
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _quantize_group_kernel(
        x_ptr: tl.tensor, q_ptr: tl.tensor, s_ptr: tl.tensor, K: tl.tensor,
        stride_x: tl.tensor, stride_q: tl.tensor, stride_s: tl.tensor,
        GROUP: tl.constexpr, BLOCK: tl.constexpr,
    ) -> None:  # fmt: skip
        # Program = (row, group): scale = amax / 448, q = x / scale.
        row = tl.program_id(0).to(tl.int64)
        g = tl.program_id(1)
        k = g * GROUP + tl.arange(0, BLOCK)
        mask = (tl.arange(0, BLOCK) < GROUP) & (k < K)
        x = tl.load(x_ptr + row * stride_x + k, mask=mask, other=0.0).to(tl.float32)
        scale = tl.maximum(tl.max(tl.abs(x), 0), 1e-10) / 448.0
        q = tl.clamp(x / scale, -448.0, 448.0)
        # Round to the nearest float8_e4m3fn value (ties to even) in float32, so the cast is
        # exact on every backend (the Triton interpreter's own cast rounds ties up and loses the
        # carry out of the mantissa): adding 2^(E + 20), whose float32 spacing is e4m3's
        # 2^(E - 3) at exponent E (E >= -6: subnormals share 2^-6's spacing), rounds there.
        mag = tl.abs(q)
        e = tl.maximum((mag.to(tl.int32, bitcast=True) >> 23) & 0xFF, 121)
        magic = ((e + 20) << 23).to(tl.float32, bitcast=True)
        mag = (mag + magic) - magic
        q = tl.where(q < 0, -mag, mag)
        tl.store(q_ptr + row * stride_q + k, q.to(q_ptr.dtype.element_ty), mask=mask)
        tl.store(s_ptr + row * stride_s + g, scale)

    @triton.jit
    def _fp8_gemm_kernel(
        a_ptr: tl.tensor, sa_ptr: tl.tensor, w_ptr: tl.tensor, sw_ptr: tl.tensor,
        c_ptr: tl.tensor, M: tl.tensor, N: tl.tensor, K: tl.tensor,
        stride_a: tl.tensor, stride_sa: tl.tensor, stride_w: tl.tensor, stride_sw: tl.tensor,
        stride_c: tl.tensor,
        GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, UPCAST: tl.constexpr,
    ) -> None:  # fmt: skip
        # Program = (BLOCK_M rows, BLOCK_N outputs); one K step per scale block (GROUP_K), its
        # FP8 product scaled by the rows' and the outputs' scales before it is accumulated.
        # UPCAST: the operands in float32 (the interpreter has no FP8 dot).
        m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
        m_valid, n_valid = m < M, n < N
        m64, n64 = m.to(tl.int64), n.to(tl.int64)
        acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
        for kb in range(0, tl.cdiv(K, GROUP_K)):
            k = kb * GROUP_K + tl.arange(0, GROUP_K)
            k_valid = k < K
            a = tl.load(a_ptr + m64[:, None] * stride_a + k[None, :],
                        mask=m_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
            w = tl.load(w_ptr + n64[:, None] * stride_w + k[None, :],
                        mask=n_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
            sa = tl.load(sa_ptr + m64 * stride_sa + kb, mask=m_valid, other=0.0)
            sw = tl.load(sw_ptr + (n64 // GROUP_N) * stride_sw + kb, mask=n_valid, other=0.0)
            if UPCAST:
                part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)), input_precision="ieee")
            else:
                part = tl.dot(a, tl.trans(w))
            acc += part * sa[:, None] * sw[None, :]
        c_ptrs = c_ptr + m64[:, None] * stride_c + n64[None, :]
        tl.store(c_ptrs, acc.to(c_ptr.dtype.element_ty), mask=m_valid[:, None] & n_valid[None, :])
