"""Draft trees: top-k expansion per depth, best-node selection, masks and KV compaction.

A step drafts a tree below the request's last accepted token (the *root*). At each depth every
frontier node proposes its top-``topk`` children with their draft log-probabilities; a node's
score is its cumulative draft log-probability (the sum along its path). The next frontier is the
``topk`` best candidates of the depth; after ``num_speculative_tokens`` depths the
``num_draft_tokens`` best candidates over all depths form the verified tree.

Kept nodes are closed under ancestors: a child's score is its parent's plus a log-probability
<= 0, and ties rank the shallower candidate first, so a parent always outranks its children.

Layout of a tree of ``N`` nodes (batched over ``B`` requests, every tensor on the drafts'
device, no host reads): nodes are ordered by depth, then by score (best first), so parents come
before children. ``parents`` holds the parent's node index, -1 for the root; ``depths`` is 1 for
the root's children. Verification runs ``N + 1`` query rows per request, the root then the
nodes in order: row ``i + 1`` is node ``i``, at KV position ``tree_start + 1 + i`` and RoPE
position ``root_position + depths[i]``.

With ``topk = 1`` the tree is today's chain: node i is draft i, at depth i + 1, parent i - 1.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

__all__ = [
    "MAX_TREE_ROWS",
    "DraftLevel",
    "DraftTree",
    "build_tree",
    "check_tree_shape",
    "compaction_slots",
    "copy_kv_slots",
    "expand_level",
    "max_tree_nodes",
    "node_path",
    "root_frontier",
    "select_frontier",
    "tree_attention_words",
    "verified_nodes",
]

# Query rows of one tree request (root + nodes) that the attention mask can describe: one bit
# per row in an int64 word (kernels/paged_attention.py).
MAX_TREE_ROWS = 64


def node_path(tokens: list[int], parents: list[int], node: int) -> list[int]:
    """On the host: the tokens from the root's child down to ``node`` (its ancestors', then its
    own), given every node's parent (-1: the root)."""
    path = []
    while node >= 0:
        path.append(tokens[node])
        node = parents[node]
    return path[::-1]


def verified_nodes(parents: list[int], max_depth: int) -> int:
    """On the host: how many nodes of a tree (every node's parent, -1: the root; parents come
    first) lie at most ``max_depth`` deep, the ones verification does not skip."""
    depths: list[int] = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return sum(d <= max_depth for d in depths)


def max_tree_nodes(num_speculative_tokens: int, topk: int) -> int:
    """Candidates a depth x topk expansion produces: topk at depth 1, topk * topk below (the
    topk frontier nodes each propose topk children)."""
    return topk + (num_speculative_tokens - 1) * topk * topk


def check_tree_shape(num_speculative_tokens: int, topk: int, num_draft_tokens: int) -> None:
    """Raise ValueError unless (depth, topk, num_draft_tokens) describes a verifiable tree.

    num_draft_tokens counts the verified nodes, the root excluded. With topk = 1 the only valid
    value is num_speculative_tokens (the chain).
    """
    for name, value in (
        ("num_speculative_tokens", num_speculative_tokens),
        ("topk", topk),
        ("num_draft_tokens", num_draft_tokens),
    ):
        if isinstance(value, bool) or not isinstance(value, int) or value < 1:
            raise ValueError(f"{name} must be an integer >= 1, got {value!r}")
    if num_draft_tokens < num_speculative_tokens:
        raise ValueError(
            f"num_draft_tokens ({num_draft_tokens}) must be >= num_speculative_tokens "
            f"({num_speculative_tokens}): a tree of fewer nodes than its depth never verifies "
            "its deepest draft steps"
        )
    most = max_tree_nodes(num_speculative_tokens, topk)
    if num_draft_tokens > most:
        raise ValueError(
            f"num_draft_tokens ({num_draft_tokens}) must be <= {most}, the nodes that "
            f"num_speculative_tokens={num_speculative_tokens} depths of topk={topk} produce "
            f"(topk + (num_speculative_tokens - 1) * topk^2)"
        )
    if num_draft_tokens + 1 > MAX_TREE_ROWS:
        raise ValueError(
            f"num_draft_tokens ({num_draft_tokens}) must be <= {MAX_TREE_ROWS - 1}: the root and "
            f"the nodes are verified as at most {MAX_TREE_ROWS} rows with a tree attention mask"
        )


class DraftLevel(NamedTuple):
    """The candidates of one depth. C = frontier size x topk, candidate f * topk + j being the
    j-th best child of frontier node f."""

    tokens: Tensor  # [B, C] int64 token ids
    scores: Tensor  # [B, C] float32 cumulative draft log-probability
    parents: Tensor  # [B, C] int64 index into the previous level's candidates; -1 = the root


def root_frontier(batch_size: int, device: torch.device) -> tuple[Tensor, Tensor]:
    """The frontier before depth 1: the root alone, score 0. Returns (ids [B, 1] = -1,
    scores [B, 1] = 0)."""
    ids = torch.full((batch_size, 1), -1, dtype=torch.int64, device=device)
    return ids, torch.zeros(batch_size, 1, dtype=torch.float32, device=device)


def expand_level(
    frontier_ids: Tensor, frontier_scores: Tensor, child_tokens: Tensor, child_logprobs: Tensor
) -> DraftLevel:
    """One depth's candidates from the frontier's top-k children.

    frontier_ids [B, F]: the frontier's indices into the previous level (-1: the root);
    frontier_scores [B, F]; child_tokens, child_logprobs [B, F, topk]: each frontier node's
    top-k tokens and their draft log-probabilities, best first. Log-probabilities are clamped
    to <= 0, so a child never outscores its parent (the selection's ancestor closure).
    """
    b, f, k = child_tokens.shape
    if frontier_ids.shape != (b, f) or frontier_scores.shape != (b, f):
        raise ValueError(
            f"frontier ids {tuple(frontier_ids.shape)} / scores {tuple(frontier_scores.shape)} "
            f"must be [B, F] = {(b, f)} to match child_tokens {tuple(child_tokens.shape)}"
        )
    if child_logprobs.shape != child_tokens.shape:
        raise ValueError(
            f"child_logprobs {tuple(child_logprobs.shape)} must match child_tokens "
            f"{tuple(child_tokens.shape)}"
        )
    scores = frontier_scores.float()[:, :, None] + child_logprobs.float().clamp_max(0.0)
    parents = frontier_ids.long()[:, :, None].expand(b, f, k)
    tokens = child_tokens.long().reshape(b, f * k)
    return DraftLevel(tokens, scores.reshape(b, f * k), parents.reshape(b, f * k))


def select_frontier(level: DraftLevel, topk: int) -> tuple[Tensor, Tensor]:
    """The next frontier: the ``topk`` best candidates of ``level`` (ties: lower index first).
    Returns (ids [B, topk] into the level, scores [B, topk]), best first."""
    if topk > level.scores.shape[1]:
        raise ValueError(f"topk ({topk}) exceeds the level's {level.scores.shape[1]} candidates")
    scores, ids = torch.sort(level.scores, dim=1, descending=True, stable=True)
    return ids[:, :topk], scores[:, :topk]


@dataclass(frozen=True)
class DraftTree:
    """The verified tree of every request of a batch (see the module docstring for the order).

    ancestors[b, i, j] is True iff node j is node i or one of its ancestors (the root, always an
    ancestor, is not a node). ``max_depth`` is the drafting depth (a host int, static shape).
    """

    tokens: Tensor  # [B, N] int64
    parents: Tensor  # [B, N] int64; -1 = the root
    depths: Tensor  # [B, N] int64; 1 = a child of the root
    scores: Tensor  # [B, N] float32 cumulative draft log-probability
    ancestors: Tensor  # [B, N, N] bool
    max_depth: int

    @property
    def num_nodes(self) -> int:
        return self.tokens.shape[1]


def build_tree(levels: Sequence[DraftLevel], num_draft_tokens: int) -> DraftTree:
    """Keep the ``num_draft_tokens`` best candidates over all levels (levels[d] = depth d + 1).

    Ranking: score descending, ties by depth, then by index within the level, so the result is
    deterministic and closed under ancestors. Nodes are returned by depth, then rank.
    """
    if not levels:
        raise ValueError("a tree needs at least one level")
    n = num_draft_tokens
    tokens = torch.cat([lv.tokens for lv in levels], dim=1).long()  # [B, T] all candidates
    scores = torch.cat([lv.scores for lv in levels], dim=1).float()
    b, total = tokens.shape
    if not 1 <= n <= total:
        raise ValueError(f"num_draft_tokens ({n}) must be in [1, {total}] (the candidates)")
    device = tokens.device
    depth_parts, parent_parts, offset = [], [], 0
    for d, lv in enumerate(levels):
        depth_parts.append(torch.full_like(lv.tokens, d + 1, dtype=torch.int64))
        prev = offset - levels[d - 1].tokens.shape[1] if d > 0 else 0
        parent_parts.append(torch.where(lv.parents >= 0, lv.parents.long() + prev, -1))
        offset += lv.tokens.shape[1]
    depth = torch.cat(depth_parts, dim=1)  # [B, T]
    flat_parent = torch.cat(parent_parts, dim=1)  # [B, T] candidate index; -1 = the root

    # The concatenation runs depth by depth, so a stable sort breaks score ties by depth, then
    # by index within the level.
    ranked = torch.sort(scores, dim=1, descending=True, stable=True).indices[:, :n]  # [B, N]
    rank = torch.arange(n, device=device).expand(b, n)
    order = (depth.gather(1, ranked) * n + rank).argsort(dim=1)  # by depth, then rank
    kept = ranked.gather(1, order)  # [B, N] candidate index of each node
    node_of = torch.full((b, total), -1, dtype=torch.int64, device=device)
    node_of.scatter_(1, kept, rank.contiguous())
    cand_parent = flat_parent.gather(1, kept)
    parents = torch.where(cand_parent >= 0, node_of.gather(1, cand_parent.clamp_min(0)), -1)

    ancestors = ancestor_mask(parents, len(levels))
    return DraftTree(
        tokens=tokens.gather(1, kept),
        parents=parents,
        depths=depth.gather(1, kept),
        scores=scores.gather(1, kept),
        ancestors=ancestors,
        max_depth=len(levels),
    )


def ancestor_mask(parents: Tensor, max_depth: int) -> Tensor:
    """[B, N, N] bool: node i sees node j iff j is i or an ancestor of i (parents [B, N], -1 =
    the root; a path has at most ``max_depth`` nodes)."""
    b, n = parents.shape
    eye = torch.eye(n, dtype=torch.bool, device=parents.device)
    anc = eye.expand(b, n, n).clone()
    cur = parents
    for _ in range(max_depth - 1):
        has = cur >= 0
        anc |= eye[cur.clamp_min(0)] & has[:, :, None]
        cur = torch.where(has, parents.gather(1, cur.clamp_min(0)), -1)
    return anc


def tree_attention_words(ancestors: Tensor) -> Tensor:
    """The tree attention mask of the verify rows [root, node 0, ..., node N - 1] as one int64
    word per row ([B, N + 1]): bit j set iff the row sees verify row j. The root sees itself;
    node i sees the root, its ancestors and itself. Needs N + 1 <= MAX_TREE_ROWS."""
    b, n, _ = ancestors.shape
    if n + 1 > MAX_TREE_ROWS:
        raise ValueError(f"a tree of {n} nodes needs {n + 1} > {MAX_TREE_ROWS} mask bits")
    shifts = torch.arange(1, n + 1, device=ancestors.device)
    # Distinct bits: the sum is their OR (bit 63 wraps to the sign bit, as intended).
    node_words = (ancestors.long() << shifts).sum(dim=2) | 1  # [B, N]; bit 0: the root
    root_word = torch.ones(b, 1, dtype=torch.int64, device=ancestors.device)
    return torch.cat([root_word, node_words], dim=1)


# --------------------------------------------------------------------------------------------
# KV compaction of the accepted path
# --------------------------------------------------------------------------------------------


def compaction_slots(
    block_tables: Tensor, tree_start: Tensor, path: Tensor, num_accepted: Tensor, block_size: int
) -> tuple[Tensor, Tensor]:
    """Flat cache slots that move the accepted path's KV to the positions a chain would use.

    The verify rows of request b were written at KV positions tree_start[b] + r (r = 0: the
    root, r = i + 1: node i). path [B, D] holds the accepted nodes by depth (-1 past
    num_accepted [B]); depth d's node moves from tree_start + 1 + path[d] to
    tree_start + 1 + d. Returns (src, dst) [B * D] int64; entries that stay put (not accepted,
    or already in place) have src == dst, so ``copy_kv_slots`` needs no host-side filtering.
    """
    b, d = path.shape
    depth = torch.arange(d, device=path.device).expand(b, d)
    moves = depth < num_accepted[:, None]
    base = tree_start.long()[:, None] + 1
    dst_pos = base + depth
    src_pos = torch.where(moves, base + path.clamp_min(0), dst_pos)

    def slot(pos: Tensor) -> Tensor:
        blk = block_tables.long().gather(1, pos // block_size)
        return blk * block_size + pos % block_size

    return slot(src_pos).reshape(-1), slot(dst_pos).reshape(-1)


def copy_kv_slots(cache: Tensor, src: Tensor, dst: Tensor) -> None:
    """cache[dst] = cache[src] over flat slots of cache [num_blocks, block_size, ...], every
    source read before any write (a node moves to a slot at or before its own, and dst slots
    are distinct). Call once per cache (K, V, each layer) with the step's ``compaction_slots``."""
    flat = cache.view(-1, *cache.shape[2:])
    flat.index_copy_(0, dst, flat.index_select(0, src))
