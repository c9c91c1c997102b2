"""Mixture-of-experts kernels: DeepSeek-V3 grouped top-k routing, softmax top-k routing
(Qwen3-MoE; ``softmax_topk``, PyTorch on every device) and grouped expert compute.

Routing (``grouped_topk``), per token: ``s = sigmoid(logits)``; ``c = s + bias`` (the score
correction bias only chooses, it never weighs); the experts are split into ``n_group`` groups,
each group scored by the sum of its two best ``c``; the ``topk_group`` best groups are kept and
the ``top_k`` best ``c`` among their experts are chosen. Weights are the chosen ``s``, divided by
their sum when ``norm_topk_prob`` (plus 1e-20), times ``routed_scaling_factor``. The order of the
``top_k`` chosen experts is unspecified (their weighted sum does not depend on it).

Expert compute (``moe_experts``), per token: ``sum_j w_j * down_e(silu(gate_e(x)) * up_e(x))``
over the token's chosen experts ``e = ids[:, j]`` held by this rank (``first_expert`` ..
``first_expert + num_local - 1``); others contribute nothing (expert parallelism: another rank
holds them and the partial sums are reduced over the group). Weights: ``w13 [E_local, 2I, H]``
(gate rows then up rows), ``w2 [E_local, H, I]``.

Each has a plain-PyTorch reference (CPU path and test oracle), a Triton implementation (CUDA, or
CPU through the Triton interpreter) and one dispatch function.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from tandem.kernels.fp8 import (
    check_gemm_block,
    fp8_block_gemm_reference,
    quantize_per_token_group,
    quantize_per_token_group_reference,
)
from tandem.kernels.launch import HAS_TRITON, gpu_paths, launch, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "grouped_topk",
    "grouped_topk_reference",
    "moe_experts",
    "moe_experts_reference",
    "softmax_topk",
]


# --------------------------------------------------------------------------------------------
# References
# --------------------------------------------------------------------------------------------


def grouped_topk_reference(
    logits: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    """logits [T, E] → (weights [T, top_k] fp32, ids [T, top_k] int64)."""
    num_tokens, num_experts = logits.shape
    scores = logits.float().sigmoid()
    choice = scores + bias.float()
    per_group = num_experts // n_group
    group_scores = choice.view(num_tokens, n_group, per_group).topk(2, dim=-1)[0].sum(-1)
    groups = group_scores.topk(topk_group, dim=-1, sorted=False)[1]  # [T, topk_group]
    keep = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, groups, True)
    keep = keep[:, :, None].expand(num_tokens, n_group, per_group).reshape(num_tokens, num_experts)
    choice = choice.masked_fill(~keep, float("-inf"))
    ids = choice.topk(top_k, dim=-1, sorted=False)[1]
    weights = scores.gather(1, ids)
    if norm_topk_prob:
        weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
    return weights * routed_scaling_factor, ids


def moe_experts_reference(
    x: Tensor, w13: Tensor, w2: Tensor, weights: Tensor, ids: Tensor, first_expert: int = 0
) -> Tensor:
    """x [T, H] → [T, H]: the (token, slot) pairs routed to local experts, sorted by expert, one
    matmul pair per expert over its contiguous run (few ops: small batches are op-bound)."""
    num_tokens, top_k = ids.shape
    num_local = w13.shape[0]
    flat = ids.reshape(-1) - first_expert  # [P] local expert of each pair
    mine = ((flat >= 0) & (flat < num_local)).nonzero().squeeze(1)
    order = mine[flat[mine].argsort(stable=True)]  # our pairs, grouped by expert
    counts = torch.bincount(flat[order], minlength=num_local).tolist()
    runs = x[order // top_k].split(counts)
    ys = [
        F.linear(F.silu(g) * u, w2[e])
        for e, run in enumerate(runs)
        if run.shape[0]
        for g, u in [F.linear(run, w13[e]).chunk(2, dim=-1)]
    ]
    out = torch.zeros(num_tokens * top_k, x.shape[1], dtype=torch.float32, device=x.device)
    if ys:
        y = torch.cat(ys).float() * weights.reshape(-1)[order, None].float()
        out.index_copy_(0, order, y)
    return out.view(num_tokens, top_k, x.shape[1]).sum(1).to(x.dtype)


def moe_experts_fp8_reference(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    s13: Tensor,
    s2: Tensor,
    block: tuple[int, int],
    weights: Tensor,
    ids: Tensor,
    first_expert: int = 0,
) -> Tensor:
    """The FP8 expert compute as the kernel defines it: block-scaled FP8 ``w13`` / ``w2``, the
    tokens and the gated activations quantized per token and group of ``block[1]`` channels
    (``kernels.fp8``), float32 products. [T, H] in x's dtype."""
    num_tokens, top_k = ids.shape
    inter = w2.shape[2]
    q_x, s_x = quantize_per_token_group_reference(x, block[1])
    out = torch.zeros(num_tokens, x.shape[1], dtype=torch.float32, device=x.device)
    for t in range(num_tokens):
        for j in range(top_k):
            e = int(ids[t, j]) - first_expert
            if not 0 <= e < w13.shape[0]:
                continue
            h = fp8_block_gemm_reference(
                q_x[t : t + 1], s_x[t : t + 1], w13[e], s13[e], block, torch.float32
            )
            act = F.silu(h[:, :inter]) * h[:, inter:]
            q_a, s_a = quantize_per_token_group_reference(act, block[1])
            down = fp8_block_gemm_reference(q_a, s_a, w2[e], s2[e], block, torch.float32)
            out[t] += down[0] * weights[t, j].float()
    return out.to(x.dtype)


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def softmax_topk(logits: Tensor, top_k: int, norm_topk_prob: bool) -> tuple[Tensor, Tensor]:
    """Qwen3-MoE / Mixtral routing: logits [T, E] → (weights [T, top_k] fp32, ids [T, top_k]
    int64): the ``top_k`` largest of ``softmax(logits)`` in float32, divided by their sum when
    ``norm_topk_prob``. Plain PyTorch on every device (tensor work only: capture-safe), ties
    broken as ``torch.topk`` breaks them."""
    num_experts = logits.shape[-1]
    if not 0 < top_k <= num_experts:
        raise ValueError(f"num_experts_per_tok={top_k} must be in [1, num_experts={num_experts}]")
    weights, ids = torch.softmax(logits.float(), dim=-1).topk(top_k, dim=-1)
    if norm_topk_prob:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights, ids


def _use_triton(use_triton: bool | None, like: Tensor) -> bool:
    if use_triton is None:
        return gpu_paths(like) and HAS_TRITON
    if use_triton and not HAS_TRITON:
        raise RuntimeError("use_triton=True but triton is not installed")
    return use_triton


def grouped_topk(
    logits: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
    *,
    use_triton: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """DeepSeek-V3 routing (see the module docstring); ``use_triton=None`` picks Triton on CUDA."""
    num_experts = logits.shape[-1]
    if num_experts % n_group != 0 or num_experts // n_group < 2:
        raise ValueError(
            f"n_routed_experts={num_experts} must split into n_group={n_group} groups of at "
            "least 2 experts"
        )
    if not 0 < topk_group <= n_group or top_k > topk_group * (num_experts // n_group):
        raise ValueError(
            f"topk_group={topk_group} of n_group={n_group} groups cannot supply "
            f"num_experts_per_tok={top_k} experts"
        )
    if _use_triton(use_triton, logits):
        return _grouped_topk_triton(
            logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
        )
    return grouped_topk_reference(
        logits, bias, top_k, n_group, topk_group, norm_topk_prob, routed_scaling_factor
    )


def moe_experts(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    weights: Tensor,
    ids: Tensor,
    first_expert: int = 0,
    *,
    fp8_scales: tuple[Tensor, Tensor, tuple[int, int]] | None = None,
    use_triton: bool | None = None,
) -> Tensor:
    """Grouped expert compute (see the module docstring); ``use_triton=None`` picks Triton on
    CUDA and the per-expert PyTorch loop elsewhere. ``fp8_scales``: (w13 scales, w2 scales,
    block) for float8_e4m3fn ``w13`` / ``w2`` (``moe_experts_fp8_reference``)."""
    if w13.shape[1] != 2 * w2.shape[2] or w13.shape[2] != x.shape[1] != w2.shape[1]:
        raise ValueError(
            f"expert weights do not fit: x {tuple(x.shape)}, w13 {tuple(w13.shape)}, "
            f"w2 {tuple(w2.shape)}"
        )
    if fp8_scales is not None:
        if _use_triton(use_triton, x):
            return _moe_experts_triton(x, w13, w2, weights, ids, first_expert, fp8_scales)
        return moe_experts_fp8_reference(x, w13, w2, *fp8_scales, weights, ids, first_expert)
    if _use_triton(use_triton, x):
        return _moe_experts_triton(x, w13, w2, weights, ids, first_expert)
    return moe_experts_reference(x, w13, w2, weights, ids, first_expert)


# --------------------------------------------------------------------------------------------
# Triton (CUDA; CPU through the interpreter)
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _grouped_topk_kernel(
        logits_ptr: tl.tensor, bias_ptr: tl.tensor, w_out_ptr: tl.tensor, id_out_ptr: tl.tensor,
        stride_t: tl.tensor, scaling: tl.tensor,
        NUM_EXPERTS: tl.constexpr, PER_GROUP: tl.constexpr, N_GROUP: tl.constexpr,
        TOPK_GROUP: tl.constexpr, TOP_K: tl.constexpr, NORM: tl.constexpr,
        BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr,
    ) -> None:  # fmt: skip
        # One program per token; every selection is an iterated (max, lowest index) pick.
        t = tl.program_id(0).to(tl.int64)
        e = tl.arange(0, BLOCK_E)
        valid = e < NUM_EXPERTS
        logit = tl.load(logits_ptr + t * stride_t + e, mask=valid, other=0.0).to(tl.float32)
        score = 1.0 / (1.0 + tl.exp(-logit))
        choice = score + tl.load(bias_ptr + e, mask=valid, other=0.0).to(tl.float32)
        choice = tl.where(valid, choice, float("-inf"))
        group = e // PER_GROUP
        # Each expert carries its group's score (sum of the group's two best choices).
        group_score = tl.full([BLOCK_E], float("-inf"), tl.float32)
        for g in tl.static_range(N_GROUP):
            in_g = (group == g) & valid
            c = tl.where(in_g, choice, float("-inf"))
            best = tl.max(c, 0)
            first = tl.min(tl.where(c == best, e, BLOCK_E), 0)
            second = tl.max(tl.where(e == first, float("-inf"), c), 0)
            group_score = tl.where(in_g, best + second, group_score)
        kept = e < 0  # all False
        for _ in tl.static_range(TOPK_GROUP):
            gs = tl.where(kept, float("-inf"), group_score)
            best = tl.max(gs, 0)
            g_best = tl.min(tl.where((gs == best) & valid, group, N_GROUP), 0)
            kept = kept | (group == g_best)
        choice = tl.where(kept, choice, float("-inf"))
        jj = tl.arange(0, BLOCK_K)
        ws = tl.zeros([BLOCK_K], tl.float32)
        idv = tl.zeros([BLOCK_K], tl.int64)
        for j in tl.static_range(TOP_K):
            best = tl.max(choice, 0)
            idx = tl.min(tl.where(choice == best, e, BLOCK_E), 0)
            ws = tl.where(jj == j, tl.sum(tl.where(e == idx, score, 0.0), 0), ws)
            idv = tl.where(jj == j, idx.to(tl.int64), idv)
            choice = tl.where(e == idx, float("-inf"), choice)
        if NORM:
            ws = ws / (tl.sum(ws, 0) + 1e-20)
        out_mask = jj < TOP_K
        tl.store(w_out_ptr + t * TOP_K + jj, ws * scaling, mask=out_mask)
        tl.store(id_out_ptr + t * TOP_K + jj, idv, mask=out_mask)

    @triton.jit
    def _moe_gemm_kernel(
        a_ptr: tl.tensor, w_ptr: tl.tensor, out_ptr: tl.tensor,
        sorted_pairs_ptr: tl.tensor, block_expert_ptr: tl.tensor, pair_weight_ptr: tl.tensor,
        num_pairs: tl.tensor, N: tl.tensor, K: tl.tensor,
        stride_a: tl.tensor, stride_we: tl.tensor, stride_wn: tl.tensor, stride_out: tl.tensor,
        w_offset: tl.tensor,
        as_ptr: tl.tensor, ws_ptr: tl.tensor, stride_as: tl.tensor, stride_wse: tl.tensor,
        stride_wsn: tl.tensor,
        TOP_K: tl.constexpr, GATED: tl.constexpr, WEIGHTED: tl.constexpr, A_BY_TOKEN: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
        FP8: tl.constexpr, GROUP_N: tl.constexpr, GROUP_K: tl.constexpr, UPCAST: tl.constexpr,
    ) -> None:  # fmt: skip
        # Program = (block of BLOCK_M (token, slot) pairs routed to one expert, BLOCK_N outputs).
        # GATED: out = silu(A @ W[n].T) * (A @ W[w_offset + n].T) (gate and up rows of w13);
        # WEIGHTED: out = (A @ W[n].T) * pair weight. A rows: the pair's token (A_BY_TOKEN) or
        # the pair itself; out rows: the pair. FP8: A and W are float8 with scales per (A row,
        # K block) and per (W block of GROUP_N rows, K block); BLOCK_K is the K block, and each
        # step's product is scaled before it is accumulated (UPCAST: float32 operands, for the
        # interpreter).
        b = tl.program_id(0)
        n0 = tl.program_id(1) * BLOCK_N
        expert = tl.load(block_expert_ptr + b).to(tl.int64)
        if expert >= 0:
            m = tl.arange(0, BLOCK_M)
            pair = tl.load(sorted_pairs_ptr + b * BLOCK_M + m).to(tl.int64)
            row_valid = pair < num_pairs
            a_row = pair // TOP_K if A_BY_TOKEN else pair
            n = n0 + tl.arange(0, BLOCK_N)
            n_valid = n < N
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            acc_up = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            w_base = w_ptr + expert * stride_we
            for k0 in range(0, K, BLOCK_K):
                k = k0 + tl.arange(0, BLOCK_K)
                k_valid = k < K
                a = tl.load(a_ptr + a_row[:, None] * stride_a + k[None, :],
                            mask=row_valid[:, None] & k_valid[None, :], other=0.0)  # fmt: skip
                w_mask = n_valid[:, None] & k_valid[None, :]
                w = tl.load(w_base + n[:, None] * stride_wn + k[None, :], mask=w_mask, other=0.0)
                if FP8:
                    kb = k0 // GROUP_K
                    sa = tl.load(as_ptr + a_row * stride_as + kb, mask=row_valid, other=0.0)
                    ws_base = ws_ptr + expert * stride_wse + kb
                    sw = tl.load(ws_base + (n // GROUP_N) * stride_wsn, mask=n_valid, other=0.0)
                    if UPCAST:
                        part = tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)),
                                      input_precision="ieee")  # fmt: skip
                    else:
                        part = tl.dot(a, tl.trans(w))
                    acc += part * sa[:, None] * sw[None, :]
                else:
                    acc += tl.dot(a.to(tl.float32), tl.trans(w.to(tl.float32)),
                                  input_precision="ieee")  # fmt: skip
                if GATED:
                    w_up = tl.load(w_base + (w_offset + n)[:, None] * stride_wn + k[None, :],
                                   mask=w_mask, other=0.0)  # fmt: skip
                    if FP8:
                        sw_up = tl.load(ws_base + ((w_offset + n) // GROUP_N) * stride_wsn,
                                        mask=n_valid, other=0.0)  # fmt: skip
                        if UPCAST:
                            part_up = tl.dot(a.to(tl.float32), tl.trans(w_up.to(tl.float32)),
                                             input_precision="ieee")  # fmt: skip
                        else:
                            part_up = tl.dot(a, tl.trans(w_up))
                        acc_up += part_up * sa[:, None] * sw_up[None, :]
                    else:
                        acc_up += tl.dot(a.to(tl.float32), tl.trans(w_up.to(tl.float32)),
                                         input_precision="ieee")  # fmt: skip
            if GATED:
                acc = acc / (1.0 + tl.exp(-acc)) * acc_up
            if WEIGHTED:
                acc = acc * tl.load(pair_weight_ptr + pair, mask=row_valid, other=0.0)[:, None]
            o_ptrs = out_ptr + pair[:, None] * stride_out + n[None, :]
            tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                     mask=row_valid[:, None] & n_valid[None, :])  # fmt: skip


def _grouped_topk_triton(
    logits: Tensor,
    bias: Tensor,
    top_k: int,
    n_group: int,
    topk_group: int,
    norm_topk_prob: bool,
    routed_scaling_factor: float,
) -> tuple[Tensor, Tensor]:
    num_tokens, num_experts = logits.shape
    weights = torch.empty(num_tokens, top_k, dtype=torch.float32, device=logits.device)
    ids = torch.empty(num_tokens, top_k, dtype=torch.int64, device=logits.device)
    if num_tokens == 0:
        return weights, ids
    logits = logits if logits.stride(-1) == 1 else logits.contiguous()
    launch(
        _grouped_topk_kernel, (num_tokens,), logits.device,
        logits, bias.float().contiguous(), weights, ids, logits.stride(0), routed_scaling_factor,
        num_experts, num_experts // n_group, n_group, topk_group, top_k, norm_topk_prob,
        next_pow2(num_experts), next_pow2(top_k),
    )  # fmt: skip
    return weights, ids


def moe_align_blocks(
    ids: Tensor, first_expert: int, num_local: int, block_m: int
) -> tuple[Tensor, Tensor]:
    """Sort the (token, slot) pairs routed to local experts by expert, each expert's run padded to
    a multiple of ``block_m`` (pad = ``num_pairs``). Sized by the worst case, so no host sync.
    Returns (sorted_pairs [num_blocks * block_m], block_expert [num_blocks], -1 = empty)."""
    num_pairs = ids.numel()
    dev = ids.device
    local = ids.reshape(-1) - first_expert
    key = torch.where((local >= 0) & (local < num_local), local, num_local)  # num_local: not ours
    # Not torch.bincount: on CUDA it reads the largest key back to the host (a sync, and an
    # error inside CUDA-graph capture); a scatter-add has a fixed output size.
    counts = torch.zeros(num_local + 1, dtype=torch.int64, device=dev)
    counts = counts.scatter_add_(0, key, torch.ones_like(key))[:num_local]
    padded = (counts + block_m - 1) // block_m * block_m
    pad_end = padded.cumsum(0)
    order = torch.sort(key, stable=True)[1]
    sorted_key = key[order]
    run_start = counts.cumsum(0) - counts
    ours = sorted_key < num_local
    k = sorted_key.clamp(max=num_local - 1)
    dest = pad_end[k] - padded[k] + torch.arange(num_pairs, device=dev) - run_start[k]
    num_blocks = -(-num_pairs // block_m) + num_local
    trash = num_blocks * block_m  # one extra slot takes the pairs that are not ours
    sorted_pairs = torch.full((trash + 1,), num_pairs, dtype=torch.int64, device=dev)
    sorted_pairs.scatter_(0, torch.where(ours, dest, trash), order)
    starts = torch.arange(num_blocks, device=dev) * block_m
    block_expert = torch.searchsorted(pad_end, starts, right=True)
    block_expert = torch.where(block_expert < num_local, block_expert, -1)
    return sorted_pairs[:trash], block_expert


def _moe_experts_triton(
    x: Tensor,
    w13: Tensor,
    w2: Tensor,
    weights: Tensor,
    ids: Tensor,
    first_expert: int,
    fp8_scales: tuple[Tensor, Tensor, tuple[int, int]] | None = None,
) -> Tensor:
    num_tokens, hidden = x.shape
    top_k = ids.shape[1]
    num_local, inter = w13.shape[0], w13.shape[1] // 2
    num_pairs = num_tokens * top_k
    if num_pairs == 0:
        return torch.zeros_like(x)
    block_m = 16 if not x.is_cuda else 32
    sorted_pairs, block_expert = moe_align_blocks(ids, first_expert, num_local, block_m)
    x = x.contiguous()
    w13, w2 = w13.contiguous(), w2.contiguous()
    act = torch.zeros(num_pairs, inter, dtype=torch.float32, device=x.device)
    out_pairs = torch.zeros(num_pairs, hidden, dtype=torch.float32, device=x.device)
    pair_w = weights.reshape(-1).float().contiguous()
    block_n, block_k = (64, 32) if x.is_cuda else (16, 16)
    # Eight warps, and half-width tiles for the gated GEMM (two accumulators): otherwise both
    # GEMMs spill on sm_80 and sm_90 (python -m tandem.bench.aot).
    options = {"num_warps": 8} if x.is_cuda else {}
    gate_n = block_n // 2 if x.is_cuda else block_n
    num_blocks = block_expert.shape[0]
    a, s_a, s13, s2, group_n, group_k = x, x, x, x, 1, 1  # (unused without FP8)
    fp8 = fp8_scales is not None
    if fp8:
        s13, s2, (group_n, group_k) = fp8_scales
        check_gemm_block((group_n, group_k))
        # K steps inside a scale block: a whole 128-wide block spills the gated GEMM (gpu-aot).
        block_k = min(group_k, 64 if x.is_cuda else 16)
        if group_k % block_k:
            raise ValueError(f"FP8 experts: K blocks of {group_k} are not a multiple of {block_k}")
        a, s_a = quantize_per_token_group(x, group_k, use_triton=True)
    upcast = not x.is_cuda
    launch(
        _moe_gemm_kernel, (num_blocks, triton.cdiv(inter, gate_n)), x.device,
        a, w13, act, sorted_pairs, block_expert, pair_w, num_pairs, inter, hidden,
        a.stride(0), w13.stride(0), w13.stride(1), act.stride(0), inter,
        s_a, s13, s_a.stride(0), s13.stride(0), s13.stride(1),
        top_k, True, False, True, block_m, gate_n, block_k, fp8, group_n, group_k, upcast,
        **options,
    )  # fmt: skip
    a, s_a = act, act
    if fp8:
        a, s_a = quantize_per_token_group(act, group_k, use_triton=True)
    launch(
        _moe_gemm_kernel, (num_blocks, triton.cdiv(hidden, block_n)), x.device,
        a, w2, out_pairs, sorted_pairs, block_expert, pair_w, num_pairs, hidden, inter,
        a.stride(0), w2.stride(0), w2.stride(1), out_pairs.stride(0), 0,
        s_a, s2, s_a.stride(0), s2.stride(0), s2.stride(1),
        top_k, False, True, False, block_m, block_n, block_k, fp8, group_n, group_k, upcast,
        **options,
    )  # fmt: skip
    return out_pairs.view(num_tokens, top_k, hidden).sum(1).to(x.dtype)
