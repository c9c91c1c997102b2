"""Paged KV block allocation with prefix caching of full blocks.

Blocks hold ``block_size`` token slots. A full block whose tokens are computed is registered
under a hash of (parent block hash, its tokens, the ``follow`` tokens after it); a later request
with the same prefix reuses it. Freed blocks keep their hash and stay reusable until they are
evicted (least recently freed first) to satisfy an allocation.

The hash is SHA-256 (``hashlib``) over the parent's digest and the tokens as 32-bit integers, so
no crafted prompt can make one request reuse another's blocks. ``follow`` is what else decides
a block's contents: with a draft head, the draft KV of a slot is computed from the token after it
(Eagle3 and MTP), or from the K tokens after it (vanilla MTP's K layers), so a block's last
slots belong to the tokens that followed it, and the block is reusable only before the same ones.

Sliding-window layers (gpt-oss's) keep their KV in a second pool, the *window group*: a request
holds one window block per block of its table, but a query at position p reads keys p - window
+ 1 .. p only, so the blocks wholly before the next step's first query's window are released as
the request advances (``WINDOW_NULL_BLOCK``, never allocated nor written, stands in for them in
the table; the kernels mask those positions). A long request thus holds at most window /
block_size + 1 window blocks between steps, plus its next step's. Window blocks are registered
under the same hashes as the full ones; a prefix is reused only as far as the window blocks its
next query reads are cached too.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from tandem.engine.request import Request


def block_hash(parent: bytes | None, tokens: Sequence[int]) -> bytes:
    """SHA-256 of the parent block's digest (none for the first block) and ``tokens`` as
    little-endian 32-bit integers."""
    data = array("i", tokens)
    if data.itemsize != 4:  # pragma: no cover - every platform Tandem runs on
        raise RuntimeError("block_hash needs 32-bit C ints")
    if array("i", [1]).tobytes() != b"\x01\x00\x00\x00":  # pragma: no cover - big-endian
        data.byteswap()
    return hashlib.sha256((parent or b"") + data.tobytes()).digest()


# The window group's stand-in for a block that left the window (block 0 of its pool).
WINDOW_NULL_BLOCK = 0


class BlockPool:
    """One group's blocks: reference counts, the cached hashes, and the free blocks in eviction
    order (least recently freed first). ``first`` blocks are never handed out."""

    def __init__(self, num_blocks: int, first: int = 0) -> None:
        self.num_blocks = num_blocks
        self.ref_cnt = [0] * num_blocks
        self.hash_of: list[bytes | None] = [None] * num_blocks
        self.cached: dict[bytes, int] = {}  # hash → block id
        self.free_queue: OrderedDict[int, None] = OrderedDict(
            (i, None) for i in range(first, num_blocks)
        )

    def pop_free(self) -> int:
        block, _ = self.free_queue.popitem(last=False)
        h = self.hash_of[block]
        if h is not None:  # evict its cached contents
            if self.cached.get(h) == block:
                del self.cached[h]
            self.hash_of[block] = None
        self.ref_cnt[block] = 1
        return block

    def take(self, block: int) -> None:
        """One more reference to a cached block."""
        if self.ref_cnt[block] == 0:
            del self.free_queue[block]
        self.ref_cnt[block] += 1

    def release(self, block: int) -> None:
        self.ref_cnt[block] -= 1
        if self.ref_cnt[block] == 0:
            self.free_queue[block] = None

    def register(self, h: bytes, block: int) -> None:
        if h not in self.cached:
            self.cached[h] = block
            self.hash_of[block] = h

    def reset(self) -> None:
        self.cached.clear()
        self.hash_of = [None] * self.num_blocks


class BlockManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        enable_prefix_caching: bool,
        follow: int = 0,
        window: int | None = None,
        window_num_blocks: int = 0,
    ) -> None:
        if num_blocks < 1:
            raise ValueError(f"the KV cache has no blocks (num_blocks={num_blocks})")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.follow = follow  # tokens after a block that its contents depend on (see above)
        self.pool = BlockPool(num_blocks)
        # The window group (see above): None when the model has no sliding-window layers.
        self.window = window
        self.window_pool = BlockPool(window_num_blocks, first=1) if window is not None else None
        self.prefix_hits = 0
        self.prefix_queries = 0

    @property
    def ref_cnt(self) -> list[int]:
        return self.pool.ref_cnt

    @property
    def cached(self) -> dict[bytes, int]:
        return self.pool.cached

    @property
    def free_queue(self) -> OrderedDict[int, None]:
        return self.pool.free_queue

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

    @property
    def num_used_window_blocks(self) -> int:
        """Window-group blocks held by requests (0 without a window group)."""
        pool = self.window_pool
        return 0 if pool is None else pool.num_blocks - 1 - len(pool.free_queue)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def first_window_block(self, num_computed_tokens: int) -> int:
        """The first block the window group must hold when the next query is at position
        ``num_computed_tokens``: it reads keys from ``num_computed_tokens - window + 1`` on."""
        assert self.window is not None
        return max(0, num_computed_tokens - self.window + 1) // self.block_size

    # -------------------------------------------------------------- allocation

    def _block_hash(self, parent: bytes | None, tokens: list[int], i: int) -> bytes:
        """Block ``i``'s hash: its tokens and the ``follow`` tokens after it."""
        return block_hash(
            parent, tokens[i * self.block_size : (i + 1) * self.block_size + self.follow]
        )

    def match_prefix(self, request: Request) -> int:
        """Attach cached blocks for the request's prompt prefix; returns tokens covered.

        At least one prompt token is always left to compute (its logits are needed), and a
        block matches only with its ``follow`` tokens in the prompt."""
        if not self.enable_prefix_caching or request.block_ids:
            return 0
        max_blocks = (request.num_tokens - max(1, self.follow)) // self.block_size
        parent: bytes | None = None
        tokens = request.all_token_ids
        hits: list[int] = []
        hashes: list[bytes] = []
        for i in range(max_blocks):
            h = self._block_hash(parent, tokens, i)
            block = self.cached.get(h)
            if block is None:
                break
            hits.append(block)
            hashes.append(h)
            parent = h
        window_hits: list[int] = []
        if self.window_pool is not None:
            # As far as the window blocks the next query reads are cached too.
            cached = self.window_pool.cached
            while hits:
                first = self.first_window_block(len(hits) * self.block_size)
                window_hits = [cached.get(h) for h in hashes[first:]]  # type: ignore[misc]
                if None not in window_hits:
                    window_hits = [WINDOW_NULL_BLOCK] * first + window_hits
                    break
                hits.pop()
                hashes.pop()
            else:
                window_hits = []
            for block in window_hits:
                if block != WINDOW_NULL_BLOCK:
                    self.window_pool.take(block)
        for block in hits:
            self.pool.take(block)
        request.block_ids = hits
        request.block_hashes = hashes
        request.window_block_ids = window_hits
        return len(hits) * self.block_size

    def count_prefix_lookup(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Count one prompt's lookup (the scheduler calls it once per request, when the request
        is first admitted, however often it was matched while it waited)."""
        if self.enable_prefix_caching:
            self.prefix_queries += num_prompt_tokens
            self.prefix_hits += num_cached_tokens

    def allocate(self, request: Request, num_total_tokens: int) -> bool:
        """Make the request hold enough blocks for ``num_total_tokens`` slots; False if full.
        The request's next query is at ``request.num_computed_tokens`` (window group)."""
        pool = self.window_pool
        if pool is not None:
            self.release_left_window(request)
        need = self.blocks_needed(num_total_tokens) - len(request.block_ids)
        if need <= 0:
            return True
        if need > len(self.free_queue):
            return False
        if pool is not None:
            first = self.first_window_block(request.num_computed_tokens)
            owned = len(request.block_ids)
            if sum(i >= first for i in range(owned, owned + need)) > len(pool.free_queue):
                return False
            request.window_block_ids.extend(
                pool.pop_free() if i >= first else WINDOW_NULL_BLOCK
                for i in range(owned, owned + need)
            )
        request.block_ids.extend(self.pool.pop_free() for _ in range(need))
        return True

    def release_left_window(self, request: Request) -> None:
        """Release the window blocks wholly before what the next query (at
        ``request.num_computed_tokens``) reads."""
        if self.window_pool is None:
            return
        ids = request.window_block_ids
        # The released blocks are a prefix: walk back from the first one still needed.
        i = min(self.first_window_block(request.num_computed_tokens), len(ids)) - 1
        while i >= 0 and ids[i] != WINDOW_NULL_BLOCK:
            self.window_pool.release(ids[i])
            ids[i] = WINDOW_NULL_BLOCK
            i -= 1

    def free(self, request: Request) -> None:
        # Reverse order: a request's tail blocks are evicted before its (shareable) head.
        for block in reversed(request.block_ids):
            self.pool.release(block)
        if self.window_pool is not None:
            for block in reversed(request.window_block_ids):
                if block != WINDOW_NULL_BLOCK:
                    self.window_pool.release(block)
        request.block_ids = []
        request.block_hashes = []
        request.window_block_ids = []

    def cache_full_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Register every full, computed block of the request whose ``follow`` tokens are known
        for prefix reuse. ``num_computed_tokens`` counts KV slots whose tokens are final (after
        a speculative step's rewind, never draft rows)."""
        if not self.enable_prefix_caching:
            return
        tokens = request.all_token_ids
        known = min(num_computed_tokens, len(tokens) - self.follow)
        num_full = min(known // self.block_size, len(request.block_ids))
        parent = request.block_hashes[-1] if request.block_hashes else None
        for i in range(len(request.block_hashes), num_full):
            h = self._block_hash(parent, tokens, i)
            request.block_hashes.append(h)
            self.pool.register(h, request.block_ids[i])
            if self.window_pool is not None and request.window_block_ids[i] != WINDOW_NULL_BLOCK:
                self.window_pool.register(h, request.window_block_ids[i])
            parent = h

    def reset_prefix_cache(self) -> None:
        self.pool.reset()
        if self.window_pool is not None:
            self.window_pool.reset()
