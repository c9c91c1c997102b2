"""MXFP4 weights and gpt-oss's experts over them.

MXFP4 (OCP microscaling): blocks of 32 values along a weight row's input dimension, each value
E2M1 (a sign bit, two exponent bits, one mantissa bit: 0, 0.5, 1, 1.5, 2, 3, 4, 6), stored two
to a byte, low nibble first (``*_blocks`` [..., G, 16] uint8), and one E8M0 scale per block (a
power of two, biased by 127: ``*_scales`` [..., G] uint8). gpt-oss releases its experts so:
``gate_up_proj_blocks`` [E, 2I, H / 32, 16] (rows: gate and up interleaved, even rows gate) and
``down_proj_blocks`` [E, H, I / 32, 16], with biases [E, 2I] and [E, H].

gpt-oss's expert compute, per token: for each chosen expert ``e`` with weight ``w``,
``gate, up = x @ W13[e].T + b13[e]`` (interleaved), ``gate = min(gate, limit)``,
``up = clamp(up, -limit, limit)``, ``h = (up + 1) * gate * sigmoid(alpha * gate)``, and
``w * (h @ W2[e].T + b2[e])`` summed over the experts held by this rank.

``gpt_oss_experts_reference`` computes it from float weights (the CPU path: the MXFP4 tensors
are dequantized at load); ``gpt_oss_experts_mxfp4`` from the MXFP4 tensors as released, in a
Triton kernel that dequantizes a block per K step in registers and multiplies in the
activations' dtype with float32 accumulation (CUDA; CPU through the interpreter), or through
the reference on the dequantized tensors elsewhere.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.kernels.launch import HAS_TRITON, gpu_paths, launch
from tandem.kernels.moe import moe_align_blocks

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "MXFP4_BLOCK",
    "dequantize_mxfp4",
    "gpt_oss_experts_mxfp4",
    "gpt_oss_experts_reference",
]

# E2M1 (MXFP4's element): sign bit, two exponent bits, one mantissa bit.
E2M1_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
E8M0_BIAS = 127
MXFP4_BLOCK = 32


def dequantize_mxfp4(blocks: Tensor, scales: Tensor, dtype: torch.dtype) -> Tensor:
    """``blocks`` [..., G, 16] uint8 (32 values per block of a row, low nibble first) and
    ``scales`` [..., G] uint8 (a power of two per block) → [..., G * 32] in ``dtype``."""
    if blocks.shape[:-1] != scales.shape or blocks.shape[-1] != MXFP4_BLOCK // 2:
        raise ValueError(
            f"MXFP4 blocks {tuple(blocks.shape)} and scales {tuple(scales.shape)} do not match "
            f"(expected blocks [..., G, {MXFP4_BLOCK // 2}] and scales [..., G])"
        )
    magnitudes = torch.tensor(E2M1_VALUES, dtype=torch.float32, device=blocks.device)
    table = torch.cat([magnitudes, -magnitudes])  # index = sign * 8 + magnitude code
    b = blocks.to(torch.uint8)
    codes = torch.stack([b & 0x0F, b >> 4], dim=-1).long()  # [..., G, 16, 2]: low, then high
    values = table[codes].flatten(-2)  # [..., G, 32]
    exponent = scales.to(torch.int32) - E8M0_BIAS
    values = torch.ldexp(values, exponent[..., None].to(torch.float32))
    return values.flatten(-2).to(dtype)


def gpt_oss_experts_reference(
    x: Tensor,
    w13: Tensor,
    w13_bias: Tensor,
    w2: Tensor,
    w2_bias: Tensor,
    weights: Tensor,
    ids: Tensor,
    first_expert: int,
    alpha: float,
    limit: float,
) -> Tensor:
    """x [T, H] → [T, H] from float weights: ``w13`` [E, H, 2I] (gate and up interleaved by
    column), ``w13_bias`` [E, 2I], ``w2`` [E, I, H], ``w2_bias`` [E, H]; one matmul pair per
    expert the step routes to."""
    out = torch.zeros(x.shape[0], w2.shape[2], dtype=torch.float32, device=x.device)
    local = ids - first_expert
    for e in torch.unique(local).tolist():
        if not 0 <= e < w13.shape[0]:
            continue
        rows, slot = torch.nonzero(local == e, as_tuple=True)
        gate_up = x[rows] @ w13[e] + w13_bias[e]
        gate = gate_up[:, 0::2].clamp(max=limit)
        up = gate_up[:, 1::2].clamp(-limit, limit)
        h = (up + 1) * gate * torch.sigmoid(gate * alpha)
        y = h @ w2[e] + w2_bias[e]
        out.index_add_(0, rows, y.float() * weights[rows, slot, None])
    return out.to(x.dtype)


def gpt_oss_experts_mxfp4(
    x: Tensor,
    w13_blocks: Tensor,
    w13_scales: Tensor,
    w13_bias: Tensor,
    w2_blocks: Tensor,
    w2_scales: Tensor,
    w2_bias: Tensor,
    weights: Tensor,
    ids: Tensor,
    first_expert: int,
    alpha: float,
    limit: float,
    *,
    use_triton: bool | None = None,
) -> Tensor:
    """gpt-oss's experts from the released MXFP4 tensors (``w13_blocks`` [E, 2I, H/32, 16],
    ``w2_blocks`` [E, H, I/32, 16] and their scales; this rank's E). ``use_triton=None``:
    Triton on CUDA, else the reference on the dequantized weights."""
    e, two_i = w13_blocks.shape[:2]
    hidden = x.shape[1]
    inter = two_i // 2
    shapes = {
        "w13_blocks": (w13_blocks.shape, (e, two_i, hidden // 32, 16)),
        "w13_scales": (w13_scales.shape, (e, two_i, hidden // 32)),
        "w2_blocks": (w2_blocks.shape, (e, hidden, inter // 32, 16)),
        "w2_scales": (w2_scales.shape, (e, hidden, inter // 32)),
        "w13_bias": (w13_bias.shape, (e, two_i)),
        "w2_bias": (w2_bias.shape, (e, hidden)),
    }
    for name, (got, want) in shapes.items():
        if tuple(got) != want or hidden % 32 or inter % 32:
            raise ValueError(
                f"{name} is {tuple(got)}, expected {want} (hidden {hidden} and intermediate "
                f"{inter}, both multiples of {MXFP4_BLOCK})"
            )
    if use_triton is None:
        use_triton = gpu_paths(x) and HAS_TRITON
    if use_triton:
        return _gpt_oss_experts_mxfp4_triton(
            x, w13_blocks, w13_scales, w13_bias, w2_blocks, w2_scales, w2_bias, weights, ids,
            first_expert, alpha, limit,
        )  # fmt: skip
    w13 = dequantize_mxfp4(w13_blocks, w13_scales, torch.float32).transpose(1, 2)
    w2 = dequantize_mxfp4(w2_blocks, w2_scales, torch.float32).transpose(1, 2)
    return gpt_oss_experts_reference(
        x.float(), w13, w13_bias.float(), w2, w2_bias.float(), weights, ids, first_expert,
        alpha, limit,
    ).to(x.dtype)  # fmt: skip


# --------------------------------------------------------------------------------------------
# Triton (CUDA; CPU through the interpreter)
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _mxfp4_moe_gemm_kernel(
        a_ptr: tl.tensor, wb_ptr: tl.tensor, ws_ptr: tl.tensor, bias_ptr: tl.tensor,
        out_ptr: tl.tensor, sorted_pairs_ptr: tl.tensor, block_expert_ptr: tl.tensor,
        pair_weight_ptr: tl.tensor, num_pairs: tl.tensor, N_ROWS: tl.tensor, N_OUT: tl.tensor,
        K: tl.tensor, stride_a: tl.tensor, stride_wbe: tl.tensor, stride_wbn: tl.tensor,
        stride_wse: tl.tensor, stride_wsn: tl.tensor, stride_be: tl.tensor, stride_out: tl.tensor,
        alpha: tl.tensor, limit: tl.tensor,
        TOP_K: tl.constexpr, GATED: tl.constexpr, A_BY_TOKEN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, ROWS: tl.constexpr, UPCAST: tl.constexpr,
    ) -> None:  # fmt: skip
        # Program = (block of BLOCK_M (token, slot) pairs routed to one expert, BLOCK_N outputs
        # from ROWS weight rows). A K step is one MXFP4 block: 32 columns, 16 bytes and a scale
        # per weight row, dequantized here (low nibble: the even column). GATED: ROWS = 2 *
        # BLOCK_N rows, gate and up interleaved as released, output n gpt-oss's activation of
        # rows 2n and 2n + 1, A rows the pairs' tokens; else ROWS = BLOCK_N,
        # out = (A @ W[n].T + b[n]) * pair weight, A rows the pairs.
        b = tl.program_id(0)
        expert = tl.load(block_expert_ptr + b).to(tl.int64)
        if expert >= 0:
            m = tl.arange(0, BLOCK_M)
            pair = tl.load(sorted_pairs_ptr + b * BLOCK_M + m).to(tl.int64)
            row_valid = pair < num_pairs
            a_row = pair // TOP_K if A_BY_TOKEN else pair
            rows = tl.program_id(1) * ROWS + tl.arange(0, ROWS)
            rows_valid = rows < N_ROWS
            wb = wb_ptr + expert * stride_wbe
            ws = ws_ptr + expert * stride_wse
            k32 = tl.arange(0, 32)
            k16 = tl.arange(0, 16)
            acc = tl.zeros([BLOCK_M, ROWS], tl.float32)
            for kb in range(0, K // 32):
                a = tl.load(a_ptr + a_row[:, None] * stride_a + kb * 32 + k32[None, :],
                            mask=row_valid[:, None], other=0.0)  # fmt: skip
                byte = tl.load(wb + rows[:, None] * stride_wbn + kb * 16 + k16[None, :],
                               mask=rows_valid[:, None], other=0).to(tl.int32)  # fmt: skip
                code = tl.reshape(tl.join(byte & 15, byte >> 4), [ROWS, 32])
                mag = code & 7
                e = mag >> 1
                mant = (mag & 1).to(tl.float32)
                value = tl.where(
                    e == 0, 0.5 * mant, (1.0 + 0.5 * mant) * tl.exp2((e - 1).to(tl.float32))
                )
                value = tl.where(code >= 8, -value, value)
                scale = tl.load(ws + rows * stride_wsn + kb, mask=rows_valid, other=127)
                w = value * tl.exp2((scale.to(tl.int32) - 127).to(tl.float32))[:, None]
                if UPCAST:
                    acc += tl.dot(a.to(tl.float32), tl.trans(w), input_precision="ieee")
                else:
                    acc += tl.dot(a, tl.trans(w.to(a.dtype)))
            bias = tl.load(bias_ptr + expert * stride_be + rows, mask=rows_valid, other=0.0)
            acc += bias.to(tl.float32)[None, :]
            n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
            if GATED:
                gate, up = tl.split(tl.reshape(acc, [BLOCK_M, BLOCK_N, 2]))
                gate = tl.minimum(gate, limit)
                up = tl.minimum(tl.maximum(up, -limit), limit)
                out = (up + 1.0) * gate * tl.sigmoid(alpha * gate)
            else:
                out = acc * tl.load(pair_weight_ptr + pair, mask=row_valid, other=0.0)[:, None]
            o_ptrs = out_ptr + pair[:, None] * stride_out + n[None, :]
            tl.store(o_ptrs, out.to(out_ptr.dtype.element_ty),
                     mask=row_valid[:, None] & (n < N_OUT)[None, :])  # fmt: skip


def _gpt_oss_experts_mxfp4_triton(
    x: Tensor,
    w13_blocks: Tensor,
    w13_scales: Tensor,
    w13_bias: Tensor,
    w2_blocks: Tensor,
    w2_scales: Tensor,
    w2_bias: Tensor,
    weights: Tensor,
    ids: Tensor,
    first_expert: int,
    alpha: float,
    limit: float,
) -> Tensor:
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_local, inter = w13_blocks.shape[0], w13_blocks.shape[1] // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    cuda = x.is_cuda
    block_m = 32 if cuda else 16
    block_n = 64 if cuda else 16
    sorted_pairs, block_expert = moe_align_blocks(ids, first_expert, num_local, block_m)
    x = x.contiguous()
    w13_blocks, w13_scales = w13_blocks.contiguous(), w13_scales.contiguous()
    w2_blocks, w2_scales = w2_blocks.contiguous(), w2_scales.contiguous()
    w13_bias, w2_bias = w13_bias.contiguous(), w2_bias.contiguous()
    # The activations between the GEMMs in x's dtype on GPUs (the second GEMM's operand),
    # float32 in the interpreter.
    act = torch.zeros(num_pairs, inter, dtype=x.dtype if cuda else torch.float32, device=x.device)
    out_pairs = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    pair_w = weights.reshape(-1).float().contiguous()
    num_blocks = block_expert.shape[0]
    options = {"num_warps": 8} if cuda else {}
    # float32 products in float32 (not TF32) where the activations are float32, and always in
    # the interpreter.
    upcast = not cuda or x.dtype == torch.float32
    # The gated GEMM reads two weight rows per output: half as many outputs per program.
    gate_n = block_n // 2 if cuda else block_n
    launch(
        _mxfp4_moe_gemm_kernel, (num_blocks, triton.cdiv(inter, gate_n)), x.device,
        x, w13_blocks, w13_scales, w13_bias, act, sorted_pairs, block_expert, pair_w,
        num_pairs, 2 * inter, inter, hidden, x.stride(0), w13_blocks.stride(0),
        w13_blocks.stride(1), w13_scales.stride(0), w13_scales.stride(1), w13_bias.stride(0),
        act.stride(0), float(alpha), float(limit),
        top_k, True, True, block_m, gate_n, 2 * gate_n, upcast, **options,
    )  # fmt: skip
    launch(
        _mxfp4_moe_gemm_kernel, (num_blocks, triton.cdiv(hidden, block_n)), x.device,
        act, w2_blocks, w2_scales, w2_bias, out_pairs, sorted_pairs, block_expert, pair_w,
        num_pairs, hidden, hidden, inter, act.stride(0), w2_blocks.stride(0),
        w2_blocks.stride(1), w2_scales.stride(0), w2_scales.stride(1), w2_bias.stride(0),
        out_pairs.stride(0), float(alpha), float(limit),
        top_k, False, False, block_m, block_n, block_n, upcast, **options,
    )  # fmt: skip
    return out_pairs.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
