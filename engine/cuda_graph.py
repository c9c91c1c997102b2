"""CUDA-graph keys, batch-size buckets, padding and the attention-DP agreement.

A step can replay a graph only when every request in it is a generation request (one verified
token plus its drafts, sampled); the graph is chosen by ``GraphKey`` = (padded batch size, draft
length, sampling variant). The sampling variant must be final — group-synced under ADP + LM-head
TP — before the key is built. Under attention DP the ranks agree with one all-gather of
``[can_graph, batch_size]``: if every rank can graph, every rank pads to the bucket of the largest
batch with dummy generation requests; if any rank has a context (prefill) request, all run eager.

Capture is not implemented yet: every device executes eagerly. The key, the buckets, the padding
and the agreement run exactly as they would around a capture, so they are tested on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist

from models.parallel import ParallelMapping

GREEDY = "greedy"
ADVANCED = "advanced"  # drafts sampled, rejection sampling reads q
SAMPLED = "sampled"  # no speculation, some row is random


@dataclass(frozen=True)
class GraphKey:
    batch_size: int  # padded to a bucket
    draft_len: int
    variant: str


def batch_size_buckets(max_batch_size: int) -> tuple[int, ...]:
    """1, 2, 4, 8, then every multiple of 8, up to (and including) ``max_batch_size``."""
    if max_batch_size < 1:
        raise ValueError(f"max_batch_size={max_batch_size} must be >= 1")
    buckets = [b for b in (1, 2, 4) if b < max_batch_size]
    buckets += list(range(8, max_batch_size, 8))
    return (*buckets, max_batch_size)


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
    batch_size: int, draft_len: int, variant: str, buckets: tuple[int, ...]
) -> GraphKey | None:
    """The graph for a generation-only batch, or None (eager) when it exceeds every bucket."""
    padded = padded_batch_size(batch_size, buckets)
    if padded is None:
        return None
    return GraphKey(padded, draft_len, variant)


def is_generation_request(num_rows: int, num_drafts: int, sample: bool) -> bool:
    """One verified token plus its drafts, sampled: the only shape a graph is captured for."""
    return sample and num_rows == 1 + num_drafts


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
    ) -> None:
        self.buckets = batch_size_buckets(max_batch_size)
        self.draft_len = draft_len
        self.mapping = mapping
        self.device = device
        self.enabled = enabled

    def plan(self, can_graph: bool, batch_size: int, variant: str) -> GraphPlan:
        """``can_graph``: this rank's step holds generation requests only. ``variant`` must be
        the step's final (group-synced) sampling variant."""
        if not self.enabled:
            return GraphPlan(None, 0)
        all_can, max_bs = agree_across_ranks(can_graph, batch_size, self.mapping, self.device)
        if not all_can:
            return GraphPlan(None, 0)
        key = graph_key(max_bs, self.draft_len, variant, self.buckets)
        if key is None:
            return GraphPlan(None, 0)
        return GraphPlan(key, key.batch_size - batch_size)
