"""CUDA-graph keys, batch-size buckets, padding and the attention-DP agreement.

A step can replay a graph only when every request in it is a generation request (one verified
token plus its drafts, sampled); the graph is chosen by ``GraphKey`` = (padded batch size, draft
length, sampling variant). The sampling variant must be final — group-synced under ADP + LM-head
TP — before the key is built. Under attention DP the ranks agree with one all-gather of
``[can_graph, batch_size]``: if every rank can graph, every rank pads to the bucket of the largest
batch with dummy generation requests; if any rank has a context (prefill) request, all run eager.

Capture and replay live in ``engine/graph_runner.py``: on CUDA every key is captured at start-up
and replayed thereafter; on CPU the same key and padding logic runs and execution is eager (a
test-only switch replays through the same static buffers without a graph). ``enforce_eager``
turns graphs off; ``cuda_graph_batch_sizes`` replaces the default buckets.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from tandem.models.parallel import ParallelMapping

GREEDY = "greedy"
ADVANCED = "advanced"  # drafts sampled, rejection sampling reads q
SAMPLED = "sampled"  # no speculation, some row is random


@dataclass(frozen=True, order=True)
class GraphKey:
    batch_size: int  # padded to a bucket
    draft_len: int  # drafts per request: a chain's K, a tree's num_draft_tokens
    variant: str
    topk: int = 1  # the tree's children per node (1: a chain); its depth is the engine's K


def batch_size_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, up to (and including) ``max_batch_size``."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
    buckets = [b for b in (1, 2, 4) if b < max_batch_size]
    buckets += list(range(8, max_batch_size, 8))
    return (*buckets, max_batch_size)


def graph_batch_sizes(max_batch_size: int, configured: Sequence[int] | None) -> tuple[int, ...]:
    """The buckets to capture: the configured sizes (none above ``max_batch_size``: the engine
    config refuses those), else ``batch_size_buckets(max_batch_size)``."""
    if configured is None:
        return batch_size_buckets(max_batch_size)
    if max(configured) > max_batch_size:
        raise ValueError(f"cuda_graph_batch_sizes {tuple(configured)} exceed {max_batch_size}")
    return tuple(configured)


# Test-only: replay through the static buffers on CPU (no graph; the same copy-in and slicing).
STATIC_GRAPHS_ENV = "TANDEM_TEST_STATIC_GRAPHS"


def graph_mode(device: torch.device, enforce_eager: bool) -> str | None:
    """The graph mode: "cuda" (capture and replay CUDA graphs), "static" (CPU, test switch: the
    static-buffer path run eagerly) or None (eager; the CPU default)."""
    if enforce_eager:
        return None
    if device.type == "cuda":
        return "cuda"
    if os.environ.get(STATIC_GRAPHS_ENV, "0").strip().lower() in ("1", "true", "yes"):
        return "static"
    return None


def dummy_kv_tokens(draft_len: int, topk: int = 1, depth: int = 0) -> int:
    """KV positions a dummy generation request writes: its verify rows (0..K) and the draft
    loop's single-row steps (up to K accepted + K - 1 further positions). A tree of ``depth``
    (``topk`` > 1, ``draft_len`` nodes): its verify rows, and the frontier rows, (depth - 1) *
    topk, after a new root up to depth + 1 positions on."""
    if topk == 1:
        return max(draft_len + 1, 2 * draft_len)
    return max(draft_len + 1, depth + 1 + (depth - 1) * topk)


def padded_batch_size(batch_size: int, buckets: tuple[int, ...]) -> int | None:
    """The smallest bucket that holds ``batch_size``; None when it exceeds the largest."""
    for b in buckets:
        if b >= batch_size:
            return b
    return None


def sampling_variant(draft_len: int, advanced: bool, all_greedy: bool) -> str:
    if draft_len:
        return ADVANCED if advanced else GREEDY
    return GREEDY if all_greedy else SAMPLED


def graph_key(
    batch_size: int, draft_len: int, variant: str, buckets: tuple[int, ...], topk: int = 1
) -> GraphKey | None:
    """The graph for a generation-only batch, or None (eager) when it exceeds every bucket."""
    padded = padded_batch_size(batch_size, buckets)
    if padded is None:
        return None
    return GraphKey(padded, draft_len, variant, topk)


def is_generation_request(num_rows: int, num_drafts: int, sample: bool) -> bool:
    """One verified token plus its drafts, sampled: the only shape a graph is captured for."""
    return sample and num_rows == 1 + num_drafts


def step_can_graph(requests: Sequence[Any], draft_len: int) -> bool:
    """Every request is a generation request with all ``draft_len`` drafts (the captured
    shape: K + 1 rows each); drafts cut short near ``max_tokens`` run eagerly."""
    return bool(requests) and all(
        is_generation_request(len(r.token_ids), r.num_drafts, r.sample)
        and r.num_drafts == draft_len
        for r in requests
    )


def agree_across_ranks(
    can_graph: bool, batch_size: int, mapping: ParallelMapping, device: torch.device
) -> tuple[bool, int]:
    """(every rank can graph, the largest batch size) over the attention-DP group — one
    all-gather of ``[can_graph, batch_size]``. Without attention DP: this rank's values."""
    if not mapping.uses_adp_collectives:
        return can_graph, batch_size
    local = torch.tensor([int(can_graph), batch_size], dtype=torch.int64, device=device)
    parts = [torch.empty_like(local) for _ in range(mapping.tp_size)]
    dist.all_gather(parts, local, group=mapping.group)
    rows = torch.stack(parts).cpu()
    return bool(rows[:, 0].min().item()), int(rows[:, 1].max().item())


@dataclass(frozen=True)
class GraphPlan:
    key: GraphKey | None  # None: eager
    num_padding: int  # dummy generation requests to append


class CUDAGraphRunner:
    """Picks the graph key and padding of a step. ``enabled``: plan graphs at all (under ADP
    the agreement must run on every rank every step, so it is enabled on all of them)."""

    def __init__(
        self,
        max_batch_size: int,
        draft_len: int,
        mapping: ParallelMapping,
        device: torch.device,
        enabled: bool,
        batch_sizes: Sequence[int] | None = None,
        topk: int = 1,
    ) -> None:
        self.buckets = graph_batch_sizes(max_batch_size, batch_sizes)
        self.draft_len = draft_len
        self.topk = topk  # draft trees: every rank has the engine's tree shape
        self.mapping = mapping
        self.device = device
        self.enabled = enabled

    def plan(
        self, can_graph: bool, batch_size: int, variant: str, draft_len: int | None = None
    ) -> GraphPlan:
        """``can_graph``: this rank's step holds generation requests only. ``variant`` must be
        the step's final (group-synced) sampling variant; ``draft_len`` its drafts per request
        (None: the configured K)."""
        if not self.enabled:
            return GraphPlan(None, 0)
        all_can, max_bs = agree_across_ranks(can_graph, batch_size, self.mapping, self.device)
        if not all_can:
            return GraphPlan(None, 0)
        k = self.draft_len if draft_len is None else draft_len
        key = graph_key(max_bs, k, variant, self.buckets, self.topk)
        if key is None:
            return GraphPlan(None, 0)
        return GraphPlan(key, key.batch_size - batch_size)
