"""Suffix decoding: draft trees from counts of what followed the request's latest tokens, in its
own text (prompt + output) and in the outputs of recently finished requests. No model, no
forward pass: the engine proposes after the step's tokens are read (the step's one host sync),
and the ranks verify the tree in one target forward (``SuffixTreeDecoder``, tree attention and
lossless point-mass tree acceptance).

Index: a counting trie (``SuffixTrie``) holds every substring of at most ``M`` tokens of its
texts with its number of occurrences, ``M = max_match_length + max_depth``. Each request has
its own, extended as its tokens arrive (``RequestIndex``: O(M) per token, the trie nodes of the
text's latest suffixes kept); one more holds the outputs of the last ``max_cached_requests``
finished requests (``OutputCache``: the oldest is removed when one more arrives). Memory: at
most ``M`` nodes (about 0.3 KB each) per token of a running request's text and of each cached
output.

Proposal, from each index: the match is the longest suffix ``w`` of the text, at most
``max_match_length`` tokens, that occurred before with a token after it (in the request's own
text: ending before its last token). A continuation ``x`` of ``w`` is a node of the draft tree;
its probability is the product, along its path, of ``count(w + prefix + c) / out(w + prefix)``,
where ``out`` counts the occurrences followed by some token. The tree is the ``max_nodes`` best
continuations by (probability descending, depth, tokens), among those at most
``min(max_depth, floor(spec_factor * len(w)))`` deep with probability >= ``min_probability``;
an ancestor always ranks before its descendants, so the kept nodes form a tree. A long,
confident match gives a deep tree; a short or ambiguous one a small tree or none. Of the two
trees (own text, cached outputs) the one of larger total probability (the expected number of
accepted drafts) is proposed, the own text's on a tie.

Layout (the tree verifier's, engine/speculative/tree.py): nodes ordered by depth, then rank;
``parents[i]`` is the index of node i's parent, -1 for the root's children. Drafts are
deterministic (a point mass), so verification is exact at any temperature.
"""

from __future__ import annotations

import heapq
import math
from collections import deque
from dataclasses import dataclass

__all__ = [
    "OutputCache",
    "Proposal",
    "RequestIndex",
    "SuffixProposer",
    "SuffixTrie",
    "grow_tree",
    "pad_tree",
]


class _Node:
    """A substring: its occurrences (``count``), the occurrences followed by a token (``out``,
    the sum of its children's counts) and its one-token extensions."""

    __slots__ = ("children", "count", "out")

    def __init__(self) -> None:
        self.count = 0
        self.out = 0
        self.children: dict[int, _Node] | None = None

    def child(self, token: int) -> _Node:
        """The extension by ``token``, created when missing."""
        if self.children is None:
            self.children = {}
        node = self.children.get(token)
        if node is None:
            node = self.children[token] = _Node()
        return node


class SuffixTrie:
    """Occurrence counts of every substring of at most ``depth`` tokens of the texts it holds
    (each text on its own: no substring spans two)."""

    def __init__(self, depth: int) -> None:
        if depth < 1:
            raise ValueError(f"trie depth must be >= 1, got {depth}")
        self.depth = depth
        self.root = _Node()

    def add(self, tokens: list[int]) -> None:
        """Count every substring of ``tokens`` (at most ``depth`` long)."""
        for i in range(len(tokens)):
            node = self.root
            for tok in tokens[i : i + self.depth]:
                node.out += 1
                node = node.child(tok)
                node.count += 1

    def remove(self, tokens: list[int]) -> None:
        """Undo ``add(tokens)`` (the same tokens were added before); nodes no longer counted are
        dropped."""
        for i in range(len(tokens)):
            node = self.root
            for tok in tokens[i : i + self.depth]:
                assert node.children is not None  # added before: the path exists
                child = node.children[tok]
                node.out -= 1
                child.count -= 1
                if child.count == 0:  # its whole subtree counted only this occurrence
                    del node.children[tok]
                    break
                node = child

    def find(self, tokens: list[int]) -> _Node | None:
        """The node of ``tokens`` (at most ``depth`` of them), or None when they never occur."""
        node = self.root
        for tok in tokens:
            if node.children is None or tok not in node.children:
                return None
            node = node.children[tok]
        return node

    def num_nodes(self) -> int:
        """Nodes below the root (a measure of the memory held)."""
        count, stack = 0, [self.root]
        while stack:
            node = stack.pop()
            if node.children:
                count += len(node.children)
                stack.extend(node.children.values())
        return count


class RequestIndex:
    """One request's text in a ``SuffixTrie``, extended as its tokens arrive."""

    def __init__(self, max_match_length: int, max_depth: int) -> None:
        self.max_match_length = max_match_length
        self.trie = SuffixTrie(max_match_length + max_depth)
        self.num_tokens = 0
        # active[n]: the node of the text's last n tokens, n < trie depth (active[0]: the root).
        self.active: list[_Node] = [self.trie.root]

    def extend(self, tokens: list[int]) -> None:
        """Append ``tokens``: each new substring (ending at a new token) is counted once."""
        depth = self.trie.depth
        for tok in tokens:
            nxt = [self.trie.root]
            for node in self.active:
                node.out += 1
                child = node.child(tok)
                child.count += 1
                if len(nxt) < depth:
                    nxt.append(child)
            self.active = nxt
        self.num_tokens += len(tokens)

    def match(self) -> tuple[_Node, int] | None:
        """(node, length) of the longest suffix (<= max_match_length tokens, shorter than the
        text) that occurred before, followed by a token; None when no token did."""
        longest = min(self.max_match_length, self.num_tokens - 1, len(self.active) - 1)
        for n in range(longest, 0, -1):
            if self.active[n].out > 0:
                return self.active[n], n
        return None


class OutputCache:
    """The outputs of the last ``max_requests`` finished requests in one ``SuffixTrie``."""

    def __init__(self, max_requests: int, max_match_length: int, max_depth: int) -> None:
        self.max_requests = max_requests
        self.max_match_length = max_match_length
        self.trie = SuffixTrie(max_match_length + max_depth)
        self.outputs: deque[list[int]] = deque()

    def add(self, tokens: list[int]) -> None:
        """Cache one finished request's output; the oldest is evicted past ``max_requests``."""
        if self.max_requests == 0 or not tokens:
            return
        tokens = list(tokens)
        self.trie.add(tokens)
        self.outputs.append(tokens)
        while len(self.outputs) > self.max_requests:
            self.trie.remove(self.outputs.popleft())

    def match(self, text: list[int]) -> tuple[_Node, int] | None:
        """(node, length) of the longest suffix of ``text`` (<= max_match_length tokens) that a
        cached output holds followed by a token; None when there is none."""
        if not self.outputs:
            return None
        for n in range(min(self.max_match_length, len(text)), 0, -1):
            node = self.trie.find(text[-n:])
            if node is not None and node.out > 0:
                return node, n
        return None


@dataclass(frozen=True)
class Proposal:
    """A proposed draft tree: ``tokens[i]`` with parent ``parents[i]`` (-1: the root), nodes by depth
    then rank; ``probabilities[i]``: node i's estimated probability."""

    tokens: list[int]
    parents: list[int]
    probabilities: list[float]

    @property
    def score(self) -> float:
        """The expected number of accepted drafts, by the estimates."""
        return sum(self.probabilities)


EMPTY = Proposal([], [], [])


def grow_tree(match: _Node, depth: int, max_nodes: int, min_probability: float) -> Proposal:
    """The ``max_nodes`` best continuations of ``match`` (at most ``depth`` deep, probability
    >= ``min_probability``), best first by (probability descending, depth, tokens)."""
    if depth < 1 or max_nodes < 1:
        return EMPTY
    # Heap entries: (-probability, depth, path, node, parent's rank); paths are distinct, so
    # ties never compare nodes.
    heap: list[tuple[float, int, tuple[int, ...], _Node, int]] = []

    def push(node: _Node, p: float, d: int, path: tuple[int, ...], rank: int) -> None:
        if node.children is None or node.out == 0:
            return
        for tok, child in node.children.items():
            # count / out <= 1, so a child's probability never exceeds its parent's (rounded
            # too): the best-first order below is the global order.
            q = p * (child.count / node.out)
            if q >= min_probability:
                heapq.heappush(heap, (-q, d + 1, (*path, tok), child, rank))

    push(match, 1.0, 0, (), -1)
    ranked: list[tuple[int, int, int, float]] = []  # (depth, token, parent's rank, probability)
    while heap and len(ranked) < max_nodes:
        neg_p, d, path, node, parent = heapq.heappop(heap)
        ranked.append((d, path[-1], parent, -neg_p))
        if d < depth:
            push(node, -neg_p, d, path, len(ranked) - 1)
    # By depth, then rank (a parent ranks before its children, so parents come first).
    order = sorted(range(len(ranked)), key=lambda r: (ranked[r][0], r))
    index = {r: i for i, r in enumerate(order)}
    return Proposal(
        tokens=[ranked[r][1] for r in order],
        parents=[index[ranked[r][2]] if ranked[r][2] >= 0 else -1 for r in order],
        probabilities=[ranked[r][3] for r in order],
    )


def pad_tree(tree: Proposal, last_token: int, num_nodes: int) -> tuple[list[int], list[int]]:
    """(tokens, parents) filled to ``num_nodes`` (the shape a captured step verifies) with
    children of the root repeating the first one's token (the request's last token when the
    tree is empty). A repeated sibling is never accepted (its first copy is tried first), so
    the fillers change nothing but the rows verified."""
    filler = tree.tokens[0] if tree.tokens else last_token
    extra = num_nodes - len(tree.tokens)
    return tree.tokens + [filler] * extra, tree.parents + [-1] * extra


class SuffixProposer:
    """The engine's side: one ``RequestIndex`` per running request and the ``OutputCache``;
    ``propose`` after every step that sampled the request, ``finish`` when it ends."""

    def __init__(
        self,
        max_depth: int,
        max_nodes: int,
        min_probability: float,
        spec_factor: float,
        max_match_length: int,
        max_cached_requests: int,
    ) -> None:
        self.max_depth = max_depth
        self.max_nodes = max_nodes
        self.min_probability = min_probability
        self.spec_factor = spec_factor
        self.max_match_length = max_match_length
        self.indexes: dict[str, RequestIndex] = {}
        self.cache = OutputCache(max_cached_requests, max_match_length, max_depth)

    def propose(self, request_id: str, tokens: list[int], depth: int) -> Proposal:
        """The tree for a request whose whole text is ``tokens`` (it only ever grows), at most
        ``depth`` deep (the room left; capped at ``max_depth``)."""
        index = self.indexes.get(request_id)
        if index is None:
            index = self.indexes[request_id] = RequestIndex(self.max_match_length, self.max_depth)
        index.extend(tokens[index.num_tokens :])
        depth = min(depth, self.max_depth)
        if depth < 1:
            return EMPTY
        best = EMPTY
        for found in (index.match(), self.cache.match(tokens)):
            if found is None:
                continue
            node, length = found
            tree = grow_tree(
                node, self.depth_for(length, depth), self.max_nodes, self.min_probability
            )
            if tree.score > best.score:
                best = tree
        return best

    def depth_for(self, match_length: int, depth: int) -> int:
        """How deep a match of ``match_length`` tokens may draft: ``spec_factor`` drafts per
        matched token, at most ``depth``."""
        return min(depth, math.floor(self.spec_factor * match_length))

    def finish(self, request_id: str, output_tokens: list[int]) -> None:
        """A request ended: its output joins the cache, its index goes."""
        self.forget(request_id)
        self.cache.add(output_tokens)

    def forget(self, request_id: str) -> None:
        self.indexes.pop(request_id, None)
