"""Verification of draft tokens: pure tensor functions.

Layout: B requests, each with up to K drafts; ``num_drafts[b]`` of them are real (0 for a
request whose prompt just finished). Target rows are [B, K + 1]: row j scores the token after
the j-th verified position; the extra row gives the correction or the bonus token.
"""

from __future__ import annotations

import torch
from torch import Tensor


def _draft_valid(drafts: Tensor, num_drafts: Tensor) -> Tensor:
    k = drafts.shape[1]
    return torch.arange(k, device=drafts.device)[None, :] < num_drafts[:, None]


def _assemble(drafts: Tensor, extra: Tensor, num_accepted: Tensor) -> Tensor:
    """[B, K + 1]: accepted drafts, then ``extra[b, num_accepted[b]]`` (correction or bonus)."""
    b, k = drafts.shape
    padded = torch.cat([drafts, drafts.new_zeros(b, 1)], dim=1)
    idx = torch.arange(k + 1, device=drafts.device)[None, :]
    out = torch.where(idx < num_accepted[:, None], padded, extra)
    return out


def accept_matching(
    target_tokens: Tensor, drafts: Tensor, num_drafts: Tensor
) -> tuple[Tensor, Tensor]:
    """Accept drafts while they equal the target's own token at that row.

    With ``target_tokens = argmax`` this is greedy verification; with tokens sampled from the
    target at each row it is strict (lossless) acceptance. Returns (num_accepted [B],
    tokens [B, K + 1]: the first ``num_accepted + 1`` are emitted)."""
    k = drafts.shape[1]
    match = (drafts == target_tokens[:, :k]) & _draft_valid(drafts, num_drafts)
    num_accepted = match.to(torch.int64).cumprod(dim=1).sum(dim=1)
    return num_accepted, _assemble(drafts, target_tokens, num_accepted)


def rejection_sample(
    p: Tensor,
    q: Tensor,
    drafts: Tensor,
    num_drafts: Tensor,
    uniform: Tensor,
    residual_noise: Tensor,
) -> tuple[Tensor, Tensor]:
    """Speculative sampling (Leviathan et al.; Chen et al.): the output is distributed exactly as
    sampling from the target.

    p: [B, K + 1, V] target probabilities (processed like normal sampling); q: [B, K, V] draft
    probabilities (one-hot for argmax drafts); drafts: [B, K]; uniform: [B, K] in [0, 1);
    residual_noise: [B, K + 1, V] Exp(1) noise for the recovery/bonus draws.
    Accept draft i with probability min(1, p_i(d)/q_i(d)); at the first rejection sample from
    normalize(max(p_i − q_i, 0)); after K acceptances sample the bonus from p_K."""
    b, k = drafts.shape
    p_d = p[:, :k].gather(2, drafts[..., None]).squeeze(2)  # [B, K]
    q_d = q.gather(2, drafts[..., None]).squeeze(2)
    ratio = torch.where(q_d > 0, p_d / q_d.clamp_min(1e-30), torch.zeros_like(p_d))
    accept = (uniform < ratio) & _draft_valid(drafts, num_drafts)
    num_accepted = accept.to(torch.int64).cumprod(dim=1).sum(dim=1)
    # Recovery distribution at each draft row; the bonus row uses p itself.
    residual = (p[:, :k] - q).clamp_min(0)
    mass = residual.sum(-1, keepdim=True)
    # Where p == q exactly the residual vanishes; rejection is then impossible, use p.
    residual = torch.where(mass > 0, residual / mass.clamp_min(1e-30), p[:, :k])
    dist = torch.cat([residual, p[:, k:]], dim=1)  # [B, K + 1, V]
    # Rows at or past a request's own draft count draw from p (its bonus position).
    row = torch.arange(k + 1, device=p.device)[None, :]
    dist = torch.where((row >= num_drafts[:, None])[..., None], p, dist)
    extra = (dist / residual_noise).argmax(dim=-1)  # exponential race: a draw from dist
    return num_accepted, _assemble(drafts, extra, num_accepted)
