"""Training forwards through the inference modules themselves.

The target and the draft are our own ``models/`` modules with their paged attention swapped for
dense attention over a ``[B, T]`` grid of rows (``dense_attention``), so the weights trained here
are exactly the ones that serve. The draft is unrolled the way the engine's draft loop runs it
(``engine/speculative/decoder.py``): step 0 reads every row's target state and the token after
it; step ``j`` of the chain rooted at row ``i`` sits at position ``i + j``, takes the token at
``i + j + 1`` and the previous step's pre-norm output, and attends to the step-0 states of rows
``0..i`` plus its own chain's steps ``1..j`` (the training-time-test pattern).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.attention import PagedAttention


@dataclass
class DenseMeta:
    """Stands in for ``AttentionMetadata`` in training: rows are a ``[batch, seq_len]`` grid,
    flattened row-major; each sequence is padded at its end (causal rows never see padding)."""

    batch: int
    seq_len: int
    # Draft unroll: K/V of step 0 ([B, Hkv, T, D] each), then of each later step (diagonal).
    ttt: list[tuple[torch.Tensor, torch.Tensor]] | None = None
    all_rank_num_tokens: list[int] | None = None  # no attention DP in training
    all_rank_num_picked: list[int] | None = None


class DenseAttention(nn.Module):
    """Dense replacement for one ``PagedAttention`` (same heads, scale and GQA grouping:
    query head ``h`` reads KV head ``h // group``)."""

    def __init__(self, paged: PagedAttention) -> None:
        super().__init__()
        self.num_heads = paged.num_heads
        self.num_kv_heads = paged.num_kv_heads
        self.head_dim = paged.head_dim
        self.scale = paged.scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: DenseMeta
    ) -> torch.Tensor:
        """q: [B*T, Hq, D], k/v: [B*T, Hkv, D] → [B*T, Hq*D]."""
        b, t, d = meta.batch, meta.seq_len, self.head_dim
        hq, hkv = self.num_heads, self.num_kv_heads
        q = q.view(b, t, hq, d).transpose(1, 2)  # [B, Hq, T, D]
        k = k.view(b, t, hkv, d).transpose(1, 2)
        v = v.view(b, t, hkv, d).transpose(1, 2)
        if meta.ttt is None or not meta.ttt:  # the target, or draft step 0
            if meta.ttt is not None:
                meta.ttt.append((k, v))
            out = F.scaled_dot_product_attention(
                q, k, v, is_causal=True, scale=self.scale, enable_gqa=hq != hkv
            )
        else:
            meta.ttt.append((k, v))
            out = self._tree_attention(q, meta.ttt)
        return out.transpose(1, 2).reshape(b * t, hq * d)

    def _tree_attention(
        self, q: torch.Tensor, kv: list[tuple[torch.Tensor, torch.Tensor]]
    ) -> torch.Tensor:
        """Row ``i`` attends to step-0 keys ``0..i`` and to its own keys of steps ``1..j``."""
        b, hq, t, d = q.shape
        hkv = self.num_kv_heads
        qg = q.reshape(b, hkv, hq // hkv, t, d)  # [B, Hkv, G, T, D]
        k0, v0 = kv[0]
        s0 = torch.einsum("bhgtd,bhsd->bhgts", qg, k0) * self.scale  # [B, Hkv, G, T, T]
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).triu(1)
        s0 = s0.masked_fill(causal, float("-inf"))
        diag = [(qg * kj.unsqueeze(2)).sum(-1) * self.scale for kj, _ in kv[1:]]  # [B,Hkv,G,T]
        scores = torch.cat([s0, torch.stack(diag, dim=-1)], dim=-1).float().softmax(-1)
        scores = scores.to(q.dtype)
        out = torch.einsum("bhgts,bhsd->bhgtd", scores[..., :t], v0)
        for j, (_, vj) in enumerate(kv[1:]):
            out = out + scores[..., t + j].unsqueeze(-1) * vj.unsqueeze(2)
        return out.reshape(b, hq, t, d)


@contextlib.contextmanager
def dense_attention(*modules: nn.Module) -> Iterator[None]:
    """Swap every ``PagedAttention`` inside ``modules`` for ``DenseAttention``; restore after."""
    swapped: list[tuple[nn.Module, str, nn.Module]] = []
    for module in modules:
        for parent in list(module.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, PagedAttention):
                    setattr(parent, name, DenseAttention(child))
                    swapped.append((parent, name, child))
    try:
        yield
    finally:
        for parent, name, child in swapped:
            setattr(parent, name, child)


def target_forward(
    target: nn.Module, tokens: torch.Tensor, capture_layers: tuple[int, ...]
) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The target over ``tokens`` [B, T] (inside ``dense_attention(target)``): the final normed
    hidden states [B, T, H] and the residual stream after each capture layer, [B, T, H] each."""
    b, t = tokens.shape
    positions = torch.arange(t, device=tokens.device).repeat(b)
    hidden, captured = target(tokens.reshape(-1), positions, DenseMeta(b, t), capture_layers)
    return hidden.view(b, t, -1), [c.view(b, t, -1) for c in captured]


def shift_tokens(tokens: torch.Tensor, n: int) -> torch.Tensor:
    """Row ``i`` gets ``tokens[:, i + n]`` (0 past the end)."""
    out = torch.zeros_like(tokens)
    if n < tokens.shape[1]:
        out[:, : tokens.shape[1] - n] = tokens[:, n:]
    return out


def unroll_draft(
    draft: nn.Module,
    tokens: torch.Tensor,
    hidden0: torch.Tensor,
    steps: int,
    next_tokens: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
) -> list[torch.Tensor]:
    """Run the draft layer ``steps`` times over every root row (inside
    ``dense_attention(draft)``); returns each step's pre-norm output [B, T, H].

    tokens: [B, T] the sequence; hidden0: [B, T, H] the draft's step-0 hidden input (Eagle3:
    ``fc`` of the captured states; MTP: the target's final hidden). Step ``j`` feeds the token at
    ``i + j + 1`` (teacher forcing: the token a correct chain has drafted), or, with
    ``next_tokens(j, hidden_prev)`` given, what that returns (e.g. the draft's own argmax)."""
    b, t = tokens.shape
    meta = DenseMeta(b, t, ttt=[])
    base = torch.arange(t, device=tokens.device).repeat(b)
    hidden = hidden0.reshape(b * t, -1)
    outs: list[torch.Tensor] = []
    for j in range(steps):
        if j == 0 or next_tokens is None:
            step_tokens = shift_tokens(tokens, j + 1)
        else:
            step_tokens = next_tokens(j, outs[-1])
        hidden = draft(0, base + j, step_tokens.reshape(-1), hidden, meta)
        outs.append(hidden.view(b, t, -1))
    return outs
