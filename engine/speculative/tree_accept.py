"""Lossless acceptance of a draft tree (engine/speculative/tree.py) in one pass per step.

The target forward scored the verify rows [root, node 0, ..., node N - 1]: row 0 is the target's
distribution after the root, row i + 1 after node i. Acceptance walks down from the root; at the
current node it tries the node's children in node order (best draft score first) and either
moves to an accepted child or, when every child is rejected, ends the walk with one token drawn
from what is left of the target's distribution (the bonus token if the node has no children).

Output (``TreeAcceptance``): ``num_accepted`` [B] nodes, ``path`` [B, D] their node indices by
depth (-1 past num_accepted), ``tokens`` [B, D + 1]: the accepted nodes' tokens, then the
correction / bonus token at index num_accepted (0 past it). The first num_accepted + 1 tokens
are emitted, exactly as the chain verifier's (kernels/spec_decode.py) ``tokens``.

A node whose token is -1 is padding (a request that verifies fewer nodes than the batch's
tree): it is never accepted, and neither are its descendants (padding too, as the kept nodes are
a prefix of the node order).

Every function is a pure tensor function with fixed shapes (loops run over the static node
count), randomness passed in (``uniform``, ``residual_noise``), no host reads.
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor

from tandem.engine.speculative.tree import DraftTree

__all__ = ["TreeAcceptance", "accept_tree_greedy", "accept_tree_sampling"]


class TreeAcceptance(NamedTuple):
    num_accepted: Tensor  # [B] int64 accepted nodes (0..max_depth)
    path: Tensor  # [B, D] int64 accepted node indices by depth; -1 past num_accepted
    tokens: Tensor  # [B, D + 1] int64 accepted tokens, then the correction / bonus token


def accept_tree_greedy(tree: DraftTree, target_tokens: Tensor) -> TreeAcceptance:
    """Follow the target's argmax: target_tokens [B, N + 1] is the target token after the
    root (row 0) and after each node (row i + 1). A node is accepted iff its token equals the
    target token after its parent and its parent is accepted (with duplicate sibling tokens the
    first one wins); the bonus is the target token after the last accepted node."""
    b, n = tree.tokens.shape
    if target_tokens.shape != (b, n + 1):
        raise ValueError(
            f"target_tokens must be [B, N + 1] = {(b, n + 1)}, got {tuple(target_tokens.shape)}"
        )
    target_tokens = target_tokens.long()
    match = tree.tokens == target_tokens.gather(1, tree.parents + 1)  # [B, N]
    return _assemble(tree, _walk(tree, match), target_tokens)


def _earlier_siblings(tree: DraftTree) -> Tensor:
    """[B, N, N] bool: j is a sibling of i tried before it (same parent, j < i)."""
    n = tree.num_nodes
    idx = torch.arange(n, device=tree.tokens.device)
    same_parent = tree.parents[:, :, None] == tree.parents[:, None, :]
    return same_parent & (idx[None, :] < idx[:, None])


def _walk(tree: DraftTree, success: Tensor) -> Tensor:
    """The accepted path [B, N] bool of the walk that, at each node, moves to the first child
    (in node order) whose test succeeds: ``success[b, i]`` is node i's outcome if it is tried,
    which must not depend on the walk beyond "node i is tried"."""
    first = success & ~(_earlier_siblings(tree) & success[:, None, :]).any(dim=2)
    return ~(tree.ancestors & ~first[:, None, :]).any(dim=2)  # it and its ancestors first


def _assemble(tree: DraftTree, on_path: Tensor, target_tokens: Tensor) -> TreeAcceptance:
    b, n = tree.tokens.shape
    d = tree.max_depth
    levels = torch.arange(1, d + 1, device=on_path.device)
    at_depth = on_path[:, None, :] & (tree.depths[:, None, :] == levels[None, :, None])  # [B,D,N]
    idx = torch.arange(n, device=on_path.device)
    path = torch.where(at_depth, idx, -1).amax(dim=2)  # [B, D]
    num_accepted = on_path.sum(dim=1)
    # The deepest accepted node; path[:, 0] is -1 when nothing was accepted: the root's row.
    last = path.gather(1, (num_accepted - 1).clamp_min(0)[:, None]).squeeze(1)
    bonus = target_tokens.gather(1, (last + 1)[:, None])  # [B, 1]
    accepted = torch.where(path >= 0, tree.tokens.gather(1, path.clamp_min(0)), 0)
    tokens = torch.cat([accepted, torch.zeros_like(bonus)], dim=1)
    tokens.scatter_(1, num_accepted[:, None], bonus)
    return TreeAcceptance(num_accepted, path, tokens)


def accept_tree_sampling(
    tree: DraftTree,
    p: Tensor,
    uniform: Tensor,
    residual_noise: Tensor,
    q: Tensor | None = None,
) -> TreeAcceptance:
    """Multi-candidate rejection sampling down the tree; the emitted tokens are distributed
    exactly as sampling from the target one token at a time.

    p [B, N + 1, V]: the target's processed distribution after the root (row 0) and after each
    node (``probs_for_rows``; greedy rows one-hot); uniform [B, N]: U[0, 1) per node;
    residual_noise [B, V]: Exp(1) noise for the one final draw (exponential race).

    At the current node with target distribution r (initially p at the node), its children
    x_1, x_2, ... are tried in node order:

    - ``q is None``: **deterministic children** (top-k drafting, as the tree builder does).
      Each child is a draft whose proposal is the point mass at x: accept x with probability
      min(1, r(x) / 1) = r(x); on rejection r <- normalize(max(r - 1_x, 0)), i.e. r with x
      zeroed and renormalized. Correctness: one speculative-sampling step with a point-mass
      proposal outputs exactly r (accept x w.p. r(x); otherwise a draw from r without x, which
      has mass 1 - r(x)); trying the next child on the rejected branch is that draw, by
      induction on the children left, and the last step draws from r directly. The candidates
      may be any function of the context, which a top-k tree is.
    - ``q`` [B, N + 1, V] given: **children sampled without replacement** from the draft's
      distribution at their parent (row 0: after the root, row i + 1: after node i), siblings
      in node order = their draw order. With s the proposal of the current candidate (q at the
      node, minus the rejected siblings, renormalized): accept x with probability
      min(1, r(x) / s(x)); on rejection r <- normalize(max(r - s, 0)) and s <- normalize(s
      without x). Correctness: x ~ s, so one speculative-sampling step outputs r when the
      rejected branch outputs normalize(max(r - s, 0)); given x rejected (which implies
      r(x) <= s(x), so the new r has no mass on x), the remaining siblings are a draw without
      replacement from s without x, and by induction they output the new r. Not valid when
      siblings are kept or dropped by their drawn values (score-based pruning): use the
      deterministic rule for top-k trees.

    Accepting x moves to node x with r = p after x (and s = q after x). After the last node,
    one token is drawn from the current r. The deterministic rule runs in closed form on
    [B, N] scalars plus one [B, V] pass; the sampled rule updates [B, V] residuals per node.
    """
    b, n = tree.tokens.shape
    v = p.shape[-1]
    if p.shape != (b, n + 1, v):
        raise ValueError(f"p must be [B, N + 1, V] = {(b, n + 1, v)}, got {tuple(p.shape)}")
    if q is not None and q.shape != p.shape:
        raise ValueError(f"q must be shaped like p {tuple(p.shape)}, got {tuple(q.shape)}")
    if uniform.shape != (b, n):
        raise ValueError(f"uniform must be [B, N] = {(b, n)}, got {tuple(uniform.shape)}")
    if residual_noise.shape != (b, v):
        raise ValueError(
            f"residual_noise must be [B, V] = {(b, v)}, got {tuple(residual_noise.shape)}"
        )
    if q is None:
        return _accept_point_masses(tree, p.float(), uniform, residual_noise)
    return _accept_sampled_siblings(tree, p.float(), q.float(), uniform, residual_noise)


def _accept_point_masses(
    tree: DraftTree, p: Tensor, uniform: Tensor, residual_noise: Tensor
) -> TreeAcceptance:
    """The deterministic-children rule in closed form, without a loop: after rejecting siblings
    of total target mass m, r = p without them / (1 - m), so child x is accepted with
    probability p(x) / (1 - m), where m is the mass of x's earlier siblings (they were all
    rejected, or x is not tried). The one final draw masks the rejected children out of p (the
    race needs no normalization)."""
    b, n = tree.tokens.shape
    v = p.shape[-1]
    device = p.device
    # p(x) of every node's token x after its parent: [B, N]; padding nodes (token -1) none.
    valid = tree.tokens >= 0
    tokens = tree.tokens.clamp_min(0)
    p_x = p.flatten(1).gather(1, (tree.parents + 1) * v + tokens)
    p_x = torch.where(valid, p_x, 0.0)
    # A sibling repeating an earlier sibling's token has no mass left when its turn comes.
    earlier = _earlier_siblings(tree)  # [B, N, N]
    repeat = (earlier & (tree.tokens[:, :, None] == tree.tokens[:, None, :])).any(dim=2)
    p_x = torch.where(repeat, 0.0, p_x)
    # Child i is tried iff its earlier siblings were all rejected; their mass is then known.
    # (An elementwise sum, not a matmul: TF32 matmuls would round the probabilities.)
    rejected = (earlier * p_x[:, None, :]).sum(dim=2)  # [B, N]
    on_path = _walk(tree, _accepts_point_mass(uniform, p_x, rejected))
    idx = torch.arange(n, device=device)
    deepest = (on_path * tree.depths).amax(dim=1, keepdim=True)
    cur = torch.where(on_path & (tree.depths == deepest), idx, -1).amax(dim=1)  # -1: the root
    rows = torch.arange(b, device=device)
    r = p[rows, cur + 1]  # [B, V] p after the last accepted node (the root: row 0)
    # Its children were all tried and rejected: the final draw excludes them.
    children = ((tree.parents == cur[:, None]) & valid).to(r.dtype)
    excluded = torch.zeros_like(r).scatter_add_(1, tokens, children) > 0
    left = r.masked_fill(excluded, 0.0)
    # Rounding can leave the rejected children all the mass; keep p then.
    r = torch.where(left.sum(dim=1, keepdim=True) > 0, left, r)
    return _assemble(tree, on_path, _race(r, residual_noise)[:, None].expand(b, n + 1))


def _accepts_point_mass(u: Tensor, p_x: Tensor, rejected_mass: Tensor) -> Tensor:
    """u < p(x) / (1 - rejected mass), without dividing (the mass left may round to <= 0)."""
    return u * (1.0 - rejected_mass).clamp_min(0.0) < p_x


def _race(r: Tensor, residual_noise: Tensor) -> Tensor:
    """One draw per row from r [B, V] (unnormalized) by the exponential race."""
    noise = residual_noise.float().clamp_min(torch.finfo(torch.float32).tiny)
    return (r / noise).argmax(dim=1)


def _accept_sampled_siblings(
    tree: DraftTree, p: Tensor, q: Tensor, uniform: Tensor, residual_noise: Tensor
) -> TreeAcceptance:
    """The sampled-siblings rule, with the residuals r, s as [B, V] tensors along the walk."""
    b, n = tree.tokens.shape
    rows = torch.arange(b, device=p.device)
    cur = torch.full((b,), -1, dtype=torch.int64, device=p.device)
    r, s = p[:, 0], q[:, 0]  # [B, V] what is left of the target / the proposal at the node
    on_path = torch.zeros(b, n, dtype=torch.bool, device=p.device)
    for i in range(n):  # node order is topological: a node's children come after it
        x = tree.tokens[:, i].clamp_min(0)
        # A child of the current node (padding nodes, token -1, are never tried).
        candidate = (tree.parents[:, i] == cur) & (tree.tokens[:, i] >= 0)
        accept = candidate & (uniform[:, i] < _acceptance_probability(r[rows, x], s[rows, x]))
        reject = candidate & ~accept
        on_path[:, i] = accept
        cur = torch.where(accept, i, cur)
        rejected_r = _normalize((r - s).clamp_min(0.0), r)
        s_without_x = s.scatter(1, x[:, None], 0.0)
        # s(x) = 1: no sibling could follow x; zeros make any later one a no-op rejection.
        rejected_s = _normalize(s_without_x, s_without_x)
        r = torch.where(accept[:, None], p[:, i + 1], torch.where(reject[:, None], rejected_r, r))
        s = torch.where(accept[:, None], q[:, i + 1], torch.where(reject[:, None], rejected_s, s))
    return _assemble(tree, on_path, _race(r, residual_noise)[:, None].expand(b, n + 1))


def _acceptance_probability(r_x: Tensor, s_x: Tensor) -> Tensor:
    """min(1, r(x) / s(x)); a candidate the proposal could not have drawn (s(x) = 0) is
    rejected."""
    ratio = r_x / s_x.clamp_min(1e-30)
    return torch.where(s_x > 0, ratio.clamp_max(1.0), torch.zeros_like(ratio))


def _normalize(dist: Tensor, fallback: Tensor) -> Tensor:
    """dist / its row mass; rows without mass keep ``fallback`` (a rejection that had
    probability 0, e.g. r == s)."""
    mass = dist.sum(dim=1, keepdim=True)
    return torch.where(mass > 0, dist / mass.clamp_min(1e-30), fallback)
