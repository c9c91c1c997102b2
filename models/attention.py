"""Attention over the paged KV cache, and the per-step metadata the engine fills in."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from tandem.kernels.paged_attention import paged_attention, write_kv_cache


@dataclass
class AttentionMetadata:
    """Where this step's tokens sit in the paged cache. Built once per step by the model runner.

    Rows are the step's tokens, sequence after sequence; sequence ``i`` owns query rows
    ``query_start_loc[i]:query_start_loc[i+1]`` and has ``seq_lens[i]`` KV tokens after the write.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64, flat KV slot of each row (< 0: padding)
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    seq_lens: torch.Tensor  # [num_seqs] int32
    query_start_loc: torch.Tensor  # [num_seqs + 1] int32
    max_query_len: int
    max_seq_len: int
    # Kernel-side index tensors shared by every layer of the step, or a zero-argument builder
    # of them: built at first use (``attention_plan``), so steps that never reach the paged
    # attention kernels (the CPU fast path) never build one.
    plan: Any = None
    # Attention DP: every rank's row count this step (the MLP all-gathers by it), and every
    # rank's picked-row count (one per sampled request) for row-picked draft steps.
    all_rank_num_tokens: list[int] | None = None
    all_rank_num_picked: list[int] | None = None
    # Draft trees: one int64 attention word per row (kernels/paged_attention.py; 0 = causal
    # row). None: every row is causal.
    tree_mask: torch.Tensor | None = None
    # The window group's slots and block tables (same rows and lengths), read by the
    # sliding-window layers whose KV lives in that group (engine/block_manager.py).
    window: AttentionMetadata | None = None

    def attention_plan(self) -> Any:
        """The step's plan (None: the kernels derive their indices themselves)."""
        if callable(self.plan):
            self.plan = self.plan()
        return self.plan


@dataclass(frozen=True)
class KVCacheSpec:
    """What one attention layer keeps per token: ``num_tensors`` cache tensors of shape
    ``[num_blocks, block_size, *token_shape]`` (K and V: 2 × [num_kv_heads, head_dim]; a latent
    cache: 1 × [1, latent_dim])."""

    token_shape: tuple[int, ...]
    num_tensors: int = 2

    def bytes_per_block(self, block_size: int, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return self.num_tensors * block_size * math.prod(self.token_shape) * elem


class PagedAttention(nn.Module):
    """Writes this step's K/V into the layer's cache blocks, then attends over the cache."""

    def __init__(self, num_heads: int, num_kv_heads: int, head_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale
        # gpt-oss's layers (models/gpt_oss.py): a sink logit per query head, a sliding window.
        self.sinks: torch.Tensor | None = None
        self.window: int | None = None
        # Set by the model runner when this layer's KV lives in the window group (its blocks
        # are released as they leave the window): it reads ``meta.window``.
        self.window_group = False
        # Bound by the model runner: [num_blocks, block_size, num_kv_heads, head_dim].
        self.k_cache = torch.empty(0)
        self.v_cache = torch.empty(0)
        # An FP8 cache's per-tensor scales (value = stored x scale): the checkpoint's, else 1.0.
        self.k_scale = 1.0
        self.v_scale = 1.0

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec((self.num_kv_heads, self.head_dim), 2)

    def bind_kv_cache(self, caches: tuple[torch.Tensor, ...]) -> None:
        self.k_cache, self.v_cache = caches

    def group_meta(self, meta: AttentionMetadata) -> AttentionMetadata:
        """The metadata of this layer's KV group."""
        if not self.window_group:
            return meta
        if meta.window is None:
            raise RuntimeError("a window-group layer's step has no window-group block tables")
        return meta.window

    def write(
        self, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata, attend: bool = False
    ) -> None:
        """Write this step's K/V [T, Hkv, D] into the cache. ``attend``: attention follows (it
        builds the step's plan, whose write slots serve here too); alone, a plan is used only
        if one was built already (the write needs none)."""
        if self.k_cache.numel() == 0:
            raise RuntimeError("KV cache is not bound to this attention layer")
        meta = self.group_meta(meta)
        plan = meta.attention_plan() if attend or not callable(meta.plan) else None
        write_kv_cache(
            k, v, self.k_cache, self.v_cache, meta.slot_mapping, plan=plan,
            k_scale=self.k_scale, v_scale=self.v_scale,
        )  # fmt: skip

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        """q: [T, H, D], k/v: [T, Hkv, D] → [T, H * D]."""
        self.write(k, v, meta, attend=True)
        meta = self.group_meta(meta)
        out = paged_attention(
            q,
            self.k_cache,
            self.v_cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            meta.max_query_len,
            meta.max_seq_len,
            plan=meta.attention_plan(),
            tree_mask=meta.tree_mask,
            sinks=self.sinks,
            window=self.window,
            k_scale=self.k_scale,
            v_scale=self.v_scale,
        )
        return out.reshape(q.shape[0], self.num_heads * self.head_dim)
