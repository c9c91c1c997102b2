"""Paged KV block allocation with prefix caching of full blocks.

Blocks hold ``block_size`` token slots. A full block whose tokens are computed is registered
under a hash of (parent block hash, its tokens); a later request with the same prefix reuses it.
Freed blocks keep their hash and stay reusable until they are evicted (least recently freed
first) to satisfy an allocation.
"""

from __future__ import annotations

from collections import OrderedDict

from tandem.engine.request import Request


def block_hash(parent: int | None, tokens: tuple[int, ...]) -> int:
    return hash((parent, tokens))


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache has no blocks (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[int | None] = [None] * num_blocks
        self.cached: dict[int, int] = {}  # hash → block id
        self.free_queue: OrderedDict[int, None] = OrderedDict((i, None) for i in range(num_blocks))
        self.prefix_hits = 0
        self.prefix_queries = 0

    # -------------------------------------------------------------- queries

    @property
    def num_free_blocks(self) -> int:
        return len(self.free_queue)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free_queue)

    @property
    def usage(self) -> float:
        return self.num_used_blocks / self.num_blocks

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -------------------------------------------------------------- allocation

    def _pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:  # evict its cached contents
            if self.cached.get(h) == block:
                del self.cached[h]
            self.hash_of[block] = None
        self.ref_cnt[block] = 1
        return block

    def match_prefix(self, request: Request) -> int:
        """Attach cached blocks for the request's prompt prefix; returns tokens covered.

        At least one prompt token is always left to compute (its logits are needed)."""
        if not self.enable_prefix_caching or request.block_ids:
            return 0
        max_blocks = (request.num_tokens - 1) // self.block_size
        parent: int | None = None
        tokens = request.all_token_ids
        hits: list[int] = []
        hashes: list[int] = []
        for i in range(max_blocks):
            h = block_hash(parent, tuple(tokens[i * self.block_size : (i + 1) * self.block_size]))
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        self.prefix_queries += request.num_tokens
        self.prefix_hits += len(hits) * self.block_size
        for block in hits:
            if self.ref_cnt[block] == 0:
                del self.free_queue[block]
            self.ref_cnt[block] += 1
        request.block_ids = hits
        request.block_hashes = hashes
        return len(hits) * self.block_size

    def allocate(self, request: Request, num_total_tokens: int) -> bool:
        """Make the request hold enough blocks for ``num_total_tokens`` slots; False if full."""
        need = self.blocks_needed(num_total_tokens) - len(request.block_ids)
        if need <= 0:
            return True
        if need > len(self.free_queue):
            return False
        request.block_ids.extend(self._pop_free() for _ in range(need))
        return True

    def free(self, request: Request) -> None:
        # Reverse order: a request's tail blocks are evicted before its (shareable) head.
        for block in reversed(request.block_ids):
            self.ref_cnt[block] -= 1
            if self.ref_cnt[block] == 0:
                self.free_queue[block] = None
        request.block_ids = []
        request.block_hashes = []

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register every full, computed block of the request for prefix reuse."""
        if not self.enable_prefix_caching:
            return
        num_full = min(num_computed_tokens // self.block_size, len(request.block_ids))
        tokens = request.all_token_ids
        parent = request.block_hashes[-1] if request.block_hashes else None
        for i in range(len(request.block_hashes), num_full):
            h = block_hash(parent, tuple(tokens[i * self.block_size : (i + 1) * self.block_size]))
            block = request.block_ids[i]
            request.block_hashes.append(h)
            if h not in self.cached:
                self.cached[h] = block
                self.hash_of[block] = h
            parent = h

    def reset_prefix_cache(self) -> None:
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks
