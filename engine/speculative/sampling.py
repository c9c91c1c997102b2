"""The sampling pieces both decoders (chain and tree) verify and draft with: noise drawn from
each request's generator, rows sampled with it, the batch's sampling tensors repeated per
verified position, and verify columns widened to the layout's."""

from __future__ import annotations

import dataclasses

import torch
from torch import Tensor

from tandem.engine.sampler import SamplingTensors


def widen_columns(x: Tensor, k1: int) -> Tensor:
    """``x`` [B, C, ...] → [B, k1, ...], column C - 1 repeated (the verify layout's rows past a
    request's drafts repeat its last row, so their logits are the same)."""
    c = x.shape[1]
    if c == k1:
        return x
    idx = torch.arange(k1, device=x.device).clamp(max=c - 1)
    return x[:, idx]


def repeat_rows(st: SamplingTensors, n: int) -> SamplingTensors:
    """The batch's sampling tensors with every row repeated ``n`` times (verify rows)."""

    def rep(t: Tensor | None) -> Tensor | None:
        return None if t is None else t.repeat_interleave(n, dim=0)

    return dataclasses.replace(
        st,
        temperature=rep(st.temperature),
        top_k=rep(st.top_k),
        top_p=rep(st.top_p),
        min_p=rep(st.min_p),
        presence_penalty=rep(st.presence_penalty),
        frequency_penalty=rep(st.frequency_penalty),
        repetition_penalty=rep(st.repetition_penalty),
        output_token_counts=rep(st.output_token_counts),
        prompt_token_mask=rep(st.prompt_token_mask),
        logit_bias=rep(st.logit_bias),
        generators=[g for g in st.generators for _ in range(n)],
        # Verified positions differ in depth: the verifier bans them before (``ban_stop_tokens``).
        stop_ban=None,
        stop_ban_left=None,
    )


def with_path_counts(
    st: SamplingTensors, k1: int, tokens: Tensor, ancestors: Tensor
) -> SamplingTensors:
    """``repeat_rows(st, k1)`` for verification with penalties: the output counts of column
    j + 1 (the position after draft node j) also count the drafts on node j's path, as the
    output would once they are accepted; column 0 keeps the step's counts. ``tokens`` [B, N]
    the drafts (-1: none, counted nowhere), ``ancestors`` [B, N, N] bool (node j's path, itself
    included: ``ancestors[b, j, m]``), N < k1. A chain is the tree whose node j's path is
    nodes 0 .. j. Device work only (no host read)."""
    flat = repeat_rows(st, k1)
    counts = flat.output_token_counts
    if st.no_penalties or counts is None:
        return flat
    b, n = tokens.shape
    dev = tokens.device
    row = torch.arange(b, device=dev)[:, None, None] * k1 + 1 + torch.arange(n, device=dev)
    rows = row.transpose(1, 2).expand(b, n, n)  # [b, j, m]: column j + 1 of request b
    cols = tokens[:, None, :].expand(b, n, n)
    values = ancestors & (cols >= 0)
    counts = counts.index_put(
        (rows.reshape(-1), cols.clamp_min(0).reshape(-1)),
        values.reshape(-1).to(counts.dtype),
        accumulate=True,
    )
    return dataclasses.replace(flat, output_token_counts=counts)


def chain_ancestors(num_drafts: Tensor, k: int) -> tuple[Tensor, Tensor]:
    """A chain as a tree for ``with_path_counts``: (valid [B, K] bool, the drafts each request
    carries; ancestors [B, K, K], node j's path being nodes 0 .. j)."""
    j = torch.arange(k, device=num_drafts.device)
    valid = j < num_drafts[:, None]
    lower = (j[None, :] <= j[:, None]).expand(num_drafts.shape[0], k, k)
    return valid, lower


def count_tokens(counts: Tensor, tokens: Tensor, keep: Tensor | None = None) -> Tensor:
    """``counts`` [B, V] plus one for each of ``tokens`` [B, C] (``keep`` [B, C] bool: only
    those); a new tensor."""
    values = torch.ones_like(tokens, dtype=counts.dtype) if keep is None else keep.to(counts.dtype)
    rows = torch.arange(tokens.shape[0], device=tokens.device)[:, None].expand_as(tokens)
    return counts.index_put(
        (rows.reshape(-1), tokens.clamp_min(0).reshape(-1)), values.reshape(-1), accumulate=True
    )


def exponential_noise(
    shape: tuple[int, ...], gens: list[torch.Generator | None], device: torch.device
) -> Tensor:
    """Exp(1) noise; row i (first dim) from its request's generator when it has one."""
    noise = torch.empty(shape, device=device).exponential_()
    for i, g in enumerate(gens):
        if g is not None:
            noise[i].exponential_(generator=g)
    return noise.clamp_min_(1e-20)


def uniform_noise(
    b: int, k: int, gens: list[torch.Generator | None], device: torch.device
) -> Tensor:
    u = torch.rand((b, k), device=device)
    for i, g in enumerate(gens):
        if g is not None:
            u[i] = torch.rand((k,), device=device, generator=g)
    return u


def sample_rows(
    probs: Tensor, gens: list[torch.Generator | None], noise: Tensor | None = None
) -> Tensor:
    if noise is None:
        noise = exponential_noise(tuple(probs.shape), gens, probs.device)
    return (probs / noise).argmax(-1)
