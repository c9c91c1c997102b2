"""The ranks' side of suffix decoding (``speculative_config.method`` "suffix"): verification of
the draft trees the engine proposes (engine/speculative/suffix.py), no draft model.

Each sampled request's tree arrives with the step: its nodes are the request's drafts, their
parents ``RequestStep.draft_parents`` (-1: the root's children; parents before children). The
verify rows, RoPE positions (root + depth), tree attention mask, acceptance (``tree_accept``:
greedy, or the point-mass rule at temperature > 0, lossless for deterministic drafts) and KV
compaction are the head trees' (``TreeDecoder``); only the shapes come from the step instead
of a draft, and nothing is drafted. Trees of different sizes share a step: nodes past a
request's own are padding (token -1, never accepted).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from tandem.engine.speculative.decoder import EngineDrafted, SpecDecoder
from tandem.engine.speculative.tree_decoder import TreeDecoder
from tandem.models.parallel import ParallelMapping

__all__ = ["SuffixTreeDecoder", "tree_rows"]

_SIGN = 1 << 63  # bit 63 of an attention word is int64's sign bit


def tree_rows(parents: list[int], num_nodes: int, max_depth: int) -> tuple[list[int], ...]:
    """On the host, one request's (parents, depths [N], attention words [N + 1]) from its
    nodes' parents (fewer than N: the rest are children of the root, never verified). Raises
    ValueError for a parent that does not come before its child or a node deeper than
    ``max_depth``."""
    parents = list(parents) + [-1] * (num_nodes - len(parents))
    depths: list[int] = []
    words = [1]  # the root's row sees itself
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"draft tree node {i} has parent {p}: parents come first")
        depths.append(1 if p < 0 else depths[p] + 1)
        if depths[-1] > max_depth:
            raise ValueError(f"draft tree node {i} is {depths[-1]} deep, past {max_depth}")
        # Row i + 1 sees the root, its ancestors' rows and its own.
        words.append(words[p + 1] | (1 << (i + 1)))
    return parents, depths, [w - (1 << 64) if w >= _SIGN else w for w in words]


class SuffixTreeDecoder(EngineDrafted, TreeDecoder):
    """``TreeDecoder`` verification of engine-proposed trees: ``k`` = suffix_max_tree_nodes (the
    verify rows are k + 1), ``depth`` = num_speculative_tokens."""

    def __init__(
        self,
        config: Any,
        mapping: ParallelMapping,
        block_size: int,
        target_layers: list[nn.Module],
    ) -> None:
        SpecDecoder.__init__(self, None, config, mapping, block_size)  # type: ignore[arg-type]
        self.lm_head_tp = False  # verification is the same on every path: nothing to sync
        self.depth = config.num_speculative_tokens
        self.topk = 1
        self.k = config.suffix_max_tree_nodes
        self.fast_chain = False
        self.target_layers = target_layers
        self.shapes: dict[str, tuple[Tensor, Tensor, Tensor]] = {}  # unused: shapes travel
        self._path: Tensor | None = None
        self.last_parents = torch.empty(0, self.k, dtype=torch.int64)

    def tree_shapes(
        self, sampled: list[Any], device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor]:
        """From each request's ``draft_parents`` (none, e.g. a graph's dummy request: every
        node a child of the root), one host-to-device copy."""
        n = self.k
        rows = []
        for r in sampled:
            parents, depths, words = tree_rows(r.draft_parents[: r.num_drafts], n, self.depth)
            rows.append(parents + depths + words)
        flat = torch.tensor(rows, dtype=torch.int64).to(device, non_blocking=True)
        return flat[:, :n], flat[:, n : 2 * n], flat[:, 2 * n :]
