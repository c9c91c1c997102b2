"""Speculative-decoding verification and the draft loop's step-0 inputs, in one launch each.

Layout: B requests, each with up to K drafts;
``num_drafts[b]`` of them are real. Target rows are [B, K + 1]: row j scores the token after the
j-th verified position; the extra row gives the correction or the bonus token. Outputs are
``num_accepted`` [B] int64 and ``tokens`` [B, K + 1] int64, of which the first
``num_accepted + 1`` are emitted.

Each function has a plain-PyTorch reference (CPU path and test oracle, the same math as the
engine's pure functions) and a Triton kernel (CUDA, or CPU through the Triton interpreter), with
one public dispatcher. This module imports only torch and triton.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.kernels.launch import HAS_TRITON, gpu_paths, launch, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

__all__ = [
    "accept_matching",
    "accept_matching_reference",
    "build_draft_step0_inputs",
    "build_draft_step0_inputs_reference",
    "rejection_sample",
    "rejection_sample_reference",
]

# ``build_draft_step0_inputs`` on CUDA: sequences / requests compared per loop iteration
# against a program's 128 rows. 64 kept a [128, 64] int64 tile live (255 registers and a
# spill on sm_90 in the AOT report).
STEP0_BLOCK_N = 16


# --------------------------------------------------------------------------------------------
# References (CPU path, test oracle)
# --------------------------------------------------------------------------------------------


def _draft_valid(drafts: Tensor, num_drafts: Tensor) -> Tensor:
    k = drafts.shape[1]
    return torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]


def _assemble(drafts: Tensor, extra: Tensor, num_accepted: Tensor) -> Tensor:
    """[B, K + 1]: accepted drafts, then ``extra[b, j]`` for every j >= num_accepted[b]."""
    b, k = drafts.shape
    padded = torch.cat([drafts, drafts.new_zeros(b, 1)], dim=1)
    idx = torch.arange(k + 1, device=drafts.device)[None, :]
    return torch.where(idx < num_accepted[:, None], padded, extra).long()


def accept_matching_reference(
    target_tokens: Tensor, drafts: Tensor, num_drafts: Tensor
) -> tuple[Tensor, Tensor]:
    """Accept drafts while they equal the target's token at that row (greedy / strict)."""
    k = drafts.shape[1]
    match = (drafts == target_tokens[:, :k]) & _draft_valid(drafts, num_drafts)
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return num_accepted, _assemble(drafts, target_tokens, num_accepted)


def rejection_sample_reference(
    p: Tensor,
    q: Tensor,
    drafts: Tensor,
    num_drafts: Tensor,
    uniform: Tensor,
    residual_noise: Tensor,
) -> tuple[Tensor, Tensor]:
    """Speculative sampling; same contract as `rejection_sample`."""
    b, k = drafts.shape
    p_d = p[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    q_d = q.gather(2, drafts[..., None]).squeeze(2)
    ratio = torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), torch.zeros_like(p_d))
    accept = (uniform < ratio) & _draft_valid(drafts, num_drafts)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    residual = (p[:, :k] - q).clamp_min(0)  # [B, K, V]
    mass = residual.sum(-1, keepdim=True)
    # p == q exactly: the residual vanishes and rejection is impossible; use p.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:, :k])
    dist = torch.cat([residual, p[:, k:]], dim=1)  # [B, K + 1, V]
    row = torch.arange(k + 1, device=p.device)[None, :]
    dist = torch.where((row >= num_drafts[:, None])[..., None], p, dist)  # bonus rows: p
    extra = (dist / residual_noise).argmax(dim=-1)  # exponential race: a draw from dist
    return num_accepted, _assemble(drafts, extra, num_accepted)


def build_draft_step0_inputs_reference(
    first_row: Tensor,
    num_accepted: Tensor,
    tokens: Tensor,
    input_ids: Tensor,
    last_rows: Tensor,
    next_tokens: Tensor,
) -> tuple[Tensor, Tensor]:
    """Same contract as `build_draft_step0_inputs` (mirrors ``SpecDecoder.propose``)."""
    step_tokens = torch.roll(input_ids, -1)
    step_tokens[last_rows] = next_tokens.to(step_tokens.dtype)
    gather_ids = first_row + num_accepted
    picked = tokens.gather(1, num_accepted[:, None].long()).squeeze(1)
    step_tokens[gather_ids] = picked.to(step_tokens.dtype)
    return step_tokens, gather_ids


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def accept_matching(
    target_tokens: Tensor, drafts: Tensor, num_drafts: Tensor, *, use_triton: bool | None = None
) -> tuple[Tensor, Tensor]:
    """Accept drafts [B, K] while they equal ``target_tokens`` [B, K + 1] at that row.

    With argmax target tokens this is greedy verification; with tokens sampled from the target
    it is strict (lossless) acceptance. Only the first ``num_drafts[b]`` drafts can be accepted.
    Returns (num_accepted [B] int64, tokens [B, K + 1] int64: accepted drafts, then the target
    token of every later row). `use_triton=None` picks Triton on CUDA.
    """
    b, k = drafts.shape
    _check_shape("target_tokens", target_tokens, (b, k + 1))
    _check_shape("num_drafts", num_drafts, (b,))
    if not _pick_triton(use_triton, drafts):
        return accept_matching_reference(target_tokens, drafts, num_drafts)
    num_accepted = torch.empty(b, dtype=torch.int64, device=drafts.device)
    tokens = torch.empty(b, k + 1, dtype=torch.int64, device=drafts.device)
    if b == 0:
        return num_accepted, tokens
    target_tokens, drafts = _rows_contiguous(target_tokens), _rows_contiguous(drafts)
    launch(
        _accept_matching_kernel, (b,), drafts.device,
        target_tokens, drafts, num_drafts.contiguous(), num_accepted, tokens,
        target_tokens.stride(0), drafts.stride(0), k, next_pow2(k + 1),
    )  # fmt: skip
    return num_accepted, tokens


def rejection_sample(
    p: Tensor,
    q: Tensor,
    drafts: Tensor,
    num_drafts: Tensor,
    uniform: Tensor,
    residual_noise: Tensor,
    *,
    use_triton: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al.; Chen et al.): output distributed as the target.

    p: [B, K + 1, V] target probabilities; q: [B, K, V] draft probabilities (one-hot for argmax
    drafts); drafts: [B, K]; num_drafts: [B]; uniform: [B, K] in [0, 1); residual_noise:
    [B, K + 1, V] Exp(1) noise (> 0). Draft i is accepted with probability min(1, p_i(d)/q_i(d));
    row j >= num_accepted draws argmax(dist_j / noise_j) with dist_j = normalize(max(p_j − q_j, 0))
    (p_j where that vanishes) for j < num_drafts and p_j otherwise (bonus). Returns
    (num_accepted [B] int64, tokens [B, K + 1] int64). The Triton path needs float32 p, q,
    uniform and noise; it skips the (order-preserving) division by the residual mass, so it can
    differ from the reference only where two race values are within rounding of each other.
    """
    b, k = drafts.shape
    v = p.shape[-1]
    _check_shape("p", p, (b, k + 1, v))
    _check_shape("q", q, (b, k, v))
    _check_shape("num_drafts", num_drafts, (b,))
    _check_shape("uniform", uniform, (b, k))
    _check_shape("residual_noise", residual_noise, (b, k + 1, v))
    if not _pick_triton(use_triton, p):
        return rejection_sample_reference(p, q, drafts, num_drafts, uniform, residual_noise)
    for name, t in (("p", p), ("q", q), ("uniform", uniform), ("residual_noise", residual_noise)):
        if t.dtype != torch.float32:
            raise ValueError(f"{name} must be float32 for the Triton path, got {t.dtype}")
    num_accepted = torch.empty(b, dtype=torch.int64, device=p.device)
    tokens = torch.empty(b, k + 1, dtype=torch.int64, device=p.device)
    if b == 0:
        return num_accepted, tokens
    p, q, noise = _last_contiguous(p), _last_contiguous(q), _last_contiguous(residual_noise)
    drafts, uniform = _rows_contiguous(drafts), _rows_contiguous(uniform)
    # The interpreter pays per tile: small tiles there so tests cover the multi-tile loop.
    block_v = min(next_pow2(v), 1024 if p.is_cuda else 64)
    launch(
        _rejection_sample_kernel, (b,), p.device,
        p, q, drafts, num_drafts.contiguous(), uniform, noise, num_accepted, tokens,
        p.stride(0), p.stride(1), q.stride(0), q.stride(1), drafts.stride(0), uniform.stride(0),
        noise.stride(0), noise.stride(1), tokens.stride(0),
        k, v, next_pow2(k + 1), block_v,
    )  # fmt: skip
    return num_accepted, tokens


def build_draft_step0_inputs(
    first_row: Tensor,
    num_accepted: Tensor,
    tokens: Tensor,
    input_ids: Tensor,
    last_rows: Tensor,
    next_tokens: Tensor,
    *,
    use_triton: bool | None = None,
) -> tuple[Tensor, Tensor]:
    """Input tokens of draft step 0 and the rows the draft loop reads, in one launch.

    first_row, num_accepted: [B] (row of each sampled request's verify position 0, accepted
    count); tokens: [B, K + 1] verification output; input_ids: [T] the step's rows;
    last_rows, next_tokens: [S] last row of each sequence and the token after it.
    Returns (step_tokens [T]: input_ids shifted left by one (wrapping), then
    ``step_tokens[last_rows] = next_tokens``, then ``step_tokens[gather_ids] =
    tokens[b, num_accepted[b]]``; gather_ids [B] = first_row + num_accepted). Negative rows count
    from the end, as in torch indexing; if a row is named twice within one scatter the later
    entry wins on the Triton path (torch leaves that unspecified).
    """
    b = first_row.shape[0]
    _check_shape("num_accepted", num_accepted, (b,))
    if tokens.dim() != 2 or tokens.shape[0] != b:
        raise ValueError(f"tokens must be [{b}, K + 1], got {tuple(tokens.shape)}")
    _check_shape("next_tokens", next_tokens, tuple(last_rows.shape))
    if input_ids.dim() != 1 or last_rows.dim() != 1:
        raise ValueError("input_ids and last_rows must be 1-D")
    if not _pick_triton(use_triton, input_ids):
        return build_draft_step0_inputs_reference(
            first_row, num_accepted, tokens, input_ids, last_rows, next_tokens
        )
    t, s = input_ids.shape[0], last_rows.shape[0]
    step_tokens = torch.empty_like(input_ids)
    gather_dtype = torch.promote_types(first_row.dtype, num_accepted.dtype)
    gather_ids = torch.empty(b, dtype=gather_dtype, device=input_ids.device)
    if t == 0:
        return step_tokens, first_row + num_accepted
    tokens = _rows_contiguous(tokens)
    block_t = 128 if input_ids.is_cuda else 16
    launch(
        _step0_inputs_kernel, (triton.cdiv(t, block_t),), input_ids.device,
        first_row.contiguous(), num_accepted.contiguous(), tokens, input_ids.contiguous(),
        last_rows.contiguous(),
        next_tokens.contiguous(), step_tokens, gather_ids,
        t, b, s, tokens.stride(0), tokens.shape[1],
        block_t, min(next_pow2(max(b, s, 1)), STEP0_BLOCK_N if input_ids.is_cuda else 8),
    )  # fmt: skip
    return step_tokens, gather_ids


def _pick_triton(use_triton: bool | None, like: Tensor) -> bool:
    if use_triton is None:
        return gpu_paths(like) and HAS_TRITON
    if use_triton and not HAS_TRITON:
        raise RuntimeError("use_triton=True but triton is not installed")
    return use_triton


def _check_shape(name: str, t: Tensor, shape: tuple[int, ...]) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"{name} must have shape {shape}, got {tuple(t.shape)}")


def _last_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _rows_contiguous(x: Tensor) -> Tensor:
    """[B, N] with unit stride along N (1-D inputs are indexed densely by the kernels)."""
    return x if x.stride(-1) == 1 or x.shape[-1] <= 1 else x.contiguous()


# --------------------------------------------------------------------------------------------
# Triton (CUDA; CPU through the interpreter)
# --------------------------------------------------------------------------------------------

if HAS_TRITON:

    @triton.jit
    def _accept_matching_kernel(
        target_ptr: tl.tensor, drafts_ptr: tl.tensor, num_drafts_ptr: tl.tensor,
        num_accepted_ptr: tl.tensor, tokens_ptr: tl.tensor,
        stride_tb: tl.tensor, stride_db: tl.tensor,
        K: tl.tensor, BLOCK_K: tl.constexpr,
    ) -> None:  # fmt: skip
        # One program per request; the K + 1 rows fit one block.
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_K)
        n_drafts = tl.load(num_drafts_ptr + b + j * 0)  # [BLOCK_K] splat (block-only masks)
        is_draft = j < K
        target = tl.load(target_ptr + b * stride_tb + j, mask=j < K + 1, other=0).to(tl.int64)
        drafts = tl.load(drafts_ptr + b * stride_db + j, mask=is_draft, other=0).to(tl.int64)
        match = (drafts == target) & is_draft & (j < n_drafts)
        # Accepted = index of the first non-matching draft (K if all match).
        num_acc = tl.min(tl.where(match | (j >= K), K, j), 0)
        tl.store(num_accepted_ptr + b, num_acc.to(tl.int64))
        out = tl.where(j < num_acc, drafts, target)
        tl.store(tokens_ptr + b * (K + 1) + j, out, mask=j < K + 1)

    @triton.jit
    def _rejection_sample_kernel(
        p_ptr: tl.tensor, q_ptr: tl.tensor, drafts_ptr: tl.tensor, num_drafts_ptr: tl.tensor,
        uniform_ptr: tl.tensor, noise_ptr: tl.tensor, num_accepted_ptr: tl.tensor,
        tokens_ptr: tl.tensor,
        stride_pb: tl.tensor, stride_pk: tl.tensor, stride_qb: tl.tensor, stride_qk: tl.tensor,
        stride_db: tl.tensor, stride_ub: tl.tensor, stride_nb: tl.tensor, stride_nk: tl.tensor,
        stride_tb: tl.tensor,
        K: tl.tensor, V: tl.tensor, BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr,
    ) -> None:  # fmt: skip
        # One program per request. All row offsets are int64 (b * stride can pass 2**31).
        b = tl.program_id(0).to(tl.int64)
        j = tl.arange(0, BLOCK_K)
        is_draft = j < K
        n_drafts = tl.load(num_drafts_ptr + b + j * 0)  # [BLOCK_K] splat (block-only masks)
        drafts = tl.load(drafts_ptr + b * stride_db + j, mask=is_draft, other=0).to(tl.int64)
        u = tl.load(uniform_ptr + b * stride_ub + j, mask=is_draft, other=1.0)
        # Acceptance: u < p(d) / q(d), q(d) > 0. Out-of-range drafts read 0 and are rejected.
        in_vocab = is_draft & (drafts >= 0) & (drafts < V)
        row_off = j.to(tl.int64)
        p_d = tl.load(
            p_ptr + b * stride_pb + row_off * stride_pk + drafts, mask=in_vocab, other=0.0
        )
        q_d = tl.load(
            q_ptr + b * stride_qb + row_off * stride_qk + drafts, mask=in_vocab, other=0.0
        )
        ratio = tl.where(q_d > 0, tl.math.div_rn(p_d, tl.maximum(q_d, 1e-30)), 0.0)
        accept = (u < ratio) & in_vocab & (j < n_drafts)
        num_acc = tl.min(tl.where(accept | (j >= K), K, j), 0)  # first rejected draft
        tl.store(num_accepted_ptr + b, num_acc.to(tl.int64))
        tl.store(tokens_ptr + b * stride_tb + j, drafts, mask=j < num_acc)
        n_drafts_s = tl.load(num_drafts_ptr + b)

        # Rows num_acc..K: correction (row num_acc) and the not-emitted rows after it, each an
        # exponential race argmax(dist / noise). The residual row races max(p - q, 0) * 2**50
        # instead of dividing by its mass (a positive constant: same argmax, one pass over V,
        # and tiny residuals cannot underflow); p where the residual vanishes.
        for row in range(num_acc, K + 1):
            row64 = b * 0 + row  # int64 (the loop index is int32 on GPU, int in the interpreter)
            use_residual = (row64 < n_drafts_s) & (row64 < K)
            # The same as a block: the interpreter rejects scalar & block masks.
            row_lanes = tl.zeros([BLOCK_V], tl.int64) + row64
            residual_lanes = (row_lanes < n_drafts_s) & (row_lanes < K)
            p_row = p_ptr + b * stride_pb + row64 * stride_pk
            q_row = q_ptr + b * stride_qb + row64 * stride_qk
            n_row = noise_ptr + b * stride_nb + row64 * stride_nk
            best_p = tl.full((), -1.0, tl.float32)
            best_r = tl.full((), -1.0, tl.float32)
            idx_p = tl.full((), 0, tl.int64)
            idx_r = tl.full((), 0, tl.int64)
            for v0 in range(0, V, BLOCK_V):
                offs = v0 + tl.arange(0, BLOCK_V)
                valid = offs < V
                pv = tl.load(p_row + offs, mask=valid, other=0.0)
                nv = tl.load(n_row + offs, mask=valid, other=1.0)
                qv = tl.load(q_row + offs, mask=valid & residual_lanes, other=0.0)
                # Padding lanes race at -1 (real values are >= 0); ties keep the first index.
                race_p = tl.where(valid, tl.math.div_rn(pv, nv), -1.0)
                residual = tl.maximum(pv - qv, 0.0) * 1125899906842624.0  # 2**50: exact
                race_r = tl.where(valid, tl.math.div_rn(residual, nv), -1.0)
                tile_p, tile_idx_p = tl.max(race_p, 0, return_indices=True)
                tile_r, tile_idx_r = tl.max(race_r, 0, return_indices=True)
                # Strictly greater: an equal value in a later tile loses (first index wins).
                idx_p = tl.where(tile_p > best_p, (v0 + tile_idx_p).to(tl.int64), idx_p)
                best_p = tl.maximum(best_p, tile_p)
                idx_r = tl.where(tile_r > best_r, (v0 + tile_idx_r).to(tl.int64), idx_r)
                best_r = tl.maximum(best_r, tile_r)
            # Scaled residuals stay normal after the division, so best_r > 0 iff some p > q,
            # i.e. iff the residual has mass (the reference's test).
            token = tl.where(use_residual & (best_r > 0), idx_r, idx_p)
            tl.store(tokens_ptr + b * stride_tb + row64, token)

    @triton.jit
    def _step0_inputs_kernel(
        first_row_ptr: tl.tensor, num_accepted_ptr: tl.tensor, tokens_ptr: tl.tensor,
        input_ids_ptr: tl.tensor, last_rows_ptr: tl.tensor, next_tokens_ptr: tl.tensor,
        step_tokens_ptr: tl.tensor, gather_ids_ptr: tl.tensor,
        T: tl.tensor, B: tl.tensor, S: tl.tensor, stride_tb: tl.tensor, K1: tl.tensor,
        BLOCK_T: tl.constexpr, BLOCK_N: tl.constexpr,
    ) -> None:  # fmt: skip
        # Program = BLOCK_T output rows. Each row *pulls* its value (shifted input, else the
        # last matching next_token, else the last matching correction/bonus token), so no two
        # programs write the same row and the scatter order (corrections last) is exact.
        pid = tl.program_id(0)
        t = (pid * BLOCK_T + tl.arange(0, BLOCK_T)).to(tl.int64)
        t_ok = t < T
        src = tl.where(t + 1 < T, t + 1, 0)
        out = tl.load(input_ids_ptr + src, mask=t_ok, other=0).to(tl.int64)
        n = tl.arange(0, BLOCK_N)
        for s0 in range(0, S, BLOCK_N):
            s = s0 + n
            s_ok = s < S
            row = tl.load(last_rows_ptr + s, mask=s_ok, other=0).to(tl.int64)
            row = tl.where(row < 0, row + T, row)  # torch's negative indexing
            hit = (row[None, :] == t[:, None]) & s_ok[None, :]  # [BLOCK_T, BLOCK_N]
            s_hit = tl.max(tl.where(hit, s[None, :], -1), 1)  # last matching entry
            nxt = tl.load(next_tokens_ptr + tl.maximum(s_hit, 0), mask=s_hit >= 0, other=0)
            out = tl.where(s_hit >= 0, nxt.to(tl.int64), out)
        for b0 in range(0, B, BLOCK_N):
            bi = b0 + n
            b_ok = bi < B
            first = tl.load(first_row_ptr + bi, mask=b_ok, other=0).to(tl.int64)
            acc = tl.load(num_accepted_ptr + bi, mask=b_ok, other=0).to(tl.int64)
            gid = first + acc
            if pid == 0:
                tl.store(gather_ids_ptr + bi, gid.to(gather_ids_ptr.dtype.element_ty), mask=b_ok)
            gid = tl.where(gid < 0, gid + T, gid)
            hit = (gid[None, :] == t[:, None]) & b_ok[None, :]
            b_hit = tl.max(tl.where(hit, bi[None, :], -1), 1)  # [BLOCK_T]
            has = b_hit >= 0
            b_safe = tl.maximum(b_hit, 0).to(tl.int64)
            col = tl.load(num_accepted_ptr + b_safe, mask=has, other=0).to(tl.int64)
            ok = has & (col >= 0) & (col < K1)
            tok = tl.load(tokens_ptr + b_safe * stride_tb + col, mask=ok, other=0)
            out = tl.where(ok, tok.to(tl.int64), out)
        tl.store(step_tokens_ptr + t, out.to(step_tokens_ptr.dtype.element_ty), mask=t_ok)
