"""Moving a prefilled request from a prefill instance to a decode instance (``--role``).

A prefill instance runs a request's prompt, samples its first token and its drafts, then holds
the request's KV blocks and its draft state (``offer``) until the decode instance named by the
router pulls them, or ``timeout_s`` passes. The decode instance allocates blocks of its own,
pulls into them (``pull``: a future) and continues the request as if it had prefilled it.

What moves, per request: the rows of every cache tensor for its blocks, in the cache's order
(the target's layers, then the draft head's: its KV for the prompt positions, written by the
prefill step's draft pass), and a small state blob (the draft probabilities a sampled first
verification needs, the request's random generator). The first token, its log-probs and the
drafts travel in the response's ``kv_transfer_params`` through the router.

``KVTransfer`` is the interface; ``DistKVTransfer`` implements it on ``torch.distributed``
point-to-point (gloo; the same calls run on NCCL): the prefill instance hosts a ``TCPStore`` at
its transfer address, each decode instance that pulls from it registers a pair there (its cache
layout first: a mismatch is refused naming both), and the two build a 2-rank process group of
their own. Per pair the prefill side serves one pull at a time on a thread: the decode side
posts (transfer id, block count) in the pair's store (no gloo call waits while a pair idles: a
gloo timeout would close it, and a thread inside gloo at exit aborts the process), the prefill
side answers over the group (found, data bytes, state bytes) and the bytes. Another transport (NIXL, Mooncake) implements the same five methods.
"""

from __future__ import annotations

import atexit
import datetime
import logging
import threading
import time
import weakref
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

logger = logging.getLogger(__name__)

__all__ = ["DistKVTransfer", "KVTransfer", "TransferError", "cache_layout"]

ENDED_KEPT = 65536  # transfers remembered as taken or expired
REQUEST_POLL_S = (0.002, 0.02)  # a prefill rank polls for pulls: 2 ms after one, then up to 20


@dataclass
class Pull:
    """A pull in progress: its future (the state blob) and its deadline."""

    address: str
    deadline: float
    future: Future[bytes] | None = None
    abandoned: bool = False
    lock: threading.Lock = field(default_factory=threading.Lock)


class TransferError(RuntimeError):
    """A pull that did not complete: the request fails (nothing was streamed yet)."""


class KVTransfer(Protocol):
    address: str  # where decode instances reach this one ("HOST:PORT"; "" on a decode side)
    bytes_per_block: int  # one block over every cache tensor of this rank

    def offer(self, transfer_id: int, block_ids: list[int], state: bytes) -> None:
        """Prefill side: make a request's blocks and state pullable until taken or expired."""
        ...

    def finished(self) -> list[tuple[int, bool]]:
        """Prefill side: (transfer id, sent) for offers taken or expired since the last call;
        their blocks may be freed."""
        ...

    def pull(self, address: str, transfer_id: int, block_ids: list[int]) -> Pull:
        """Decode side: copy the offer into ``block_ids``; the future's result is the state."""
        ...

    def abandon(self, handle: Pull) -> None:
        """Decode side: give up on a pull past its deadline (its blocks are never written)."""
        ...

    def close(self) -> None: ...


def cache_layout(caches: list[tuple[Tensor, ...]]) -> str:
    """What both sides must agree on: every cache tensor's per-block shape and dtype."""
    return ";".join(
        f"{tuple(t.shape[1:])}:{str(t.dtype).removeprefix('torch.')}"
        for layer in caches
        for t in layer
    )


@dataclass
class _Offer:
    block_ids: list[int]
    state: bytes
    deadline: float


class DistKVTransfer:
    """``KVTransfer`` on torch.distributed point-to-point (see the module docstring).
    ``caches``: the rank's KV cache tensors, each [num_blocks, block_size, ...]."""

    def __init__(
        self,
        caches: list[tuple[Tensor, ...]],
        host: str,
        port: int,
        timeout_s: float,
        serve: bool,
    ) -> None:
        self.tensors = [t for layer in caches for t in layer]
        self.bytes_per_block = sum(t[0].numel() * t.element_size() for t in self.tensors)
        self.layout = cache_layout(caches)
        self.timeout = datetime.timedelta(seconds=timeout_s)
        self.timeout_s = timeout_s
        self.lock = threading.Lock()
        self.offers: dict[int, _Offer] = {}
        self.done: list[tuple[int, bool]] = []
        self.ended: OrderedDict[int, None] = OrderedDict()
        self.closed = False
        self.threads: list[threading.Thread] = []
        _LIVE.add(self)
        self.store: Any = None
        self.address = ""
        if serve:  # prefill side: the pairs' rendezvous
            self.store = dist.TCPStore(
                host, port, is_master=True, wait_for_workers=False, timeout=self.timeout
            )
            self.address = f"{host}:{self.store.port}"
            self._start(self._accept, "kv-transfer-accept")
        # Decode side: one pair (and one thread, pulls in order) per prefill instance.
        self.pairs: dict[str, tuple[Any, ThreadPoolExecutor, Any]] = {}

    # ------------------------------------------------------------ prefill side

    def offer(self, transfer_id: int, block_ids: list[int], state: bytes) -> None:
        with self.lock:
            self.offers[transfer_id] = _Offer(
                list(block_ids), state, time.monotonic() + self.timeout_s
            )

    def _ended(self, tid: int) -> None:
        """Remember a transfer that was taken or expired (a pull of it fails at once); the
        lock is held."""
        self.ended[tid] = None
        while len(self.ended) > ENDED_KEPT:
            self.ended.popitem(last=False)

    def finished(self) -> list[tuple[int, bool]]:
        now = time.monotonic()
        with self.lock:
            for tid in [t for t, o in self.offers.items() if o.deadline < now]:
                del self.offers[tid]
                self.done.append((tid, False))
                self._ended(tid)
                logger.warning("KV transfer %d expired: no decode instance pulled it", tid)
            done, self.done = self.done, []
        return done

    def _pair_with(self, store: Any) -> Any:
        """The prefill side of a pair: its group, or None (and the verdict) when the decode
        instance's KV layout differs."""
        theirs = store.get("layout").decode()
        if theirs != self.layout:
            store.set(
                "verdict",
                f"KV cache layouts differ: the prefill instance has [{self.layout}], the decode "
                f"instance [{theirs}] (same model, dtype, block size and --kv-cache-dtype on "
                "both)",
            )
            return None
        store.set("verdict", "ok")
        return dist.ProcessGroupGloo(store, 0, 2, self.timeout)

    def _next_request(self, store: Any, n: int) -> tuple[int, int] | None:
        """The pair's n-th pull request (transfer id, block count), polled from the store
        (every 2 ms after a request, slowing to every 20 ms while idle); None once closed."""
        key = f"req{n}"
        wait = REQUEST_POLL_S[0]
        while not self.closed:
            try:
                if store.check([key]):
                    tid, blocks = store.get(key).decode().split(",")
                    store.delete_key(key)
                    return int(tid), int(blocks)
            except Exception:  # the store is closing
                return None
            time.sleep(wait)
            wait = min(wait * 2, REQUEST_POLL_S[1])
        return None

    def _take(self, tid: int) -> _Offer | None:
        """The offer, waited for while it may still come (the engine offers it with the step
        after the hand-over; a fast decode instance may ask first)."""
        deadline = time.monotonic() + self.timeout_s
        while True:
            with self.lock:
                offer = self.offers.pop(tid, None)
                gone = tid in self.ended
            if offer is not None or gone or time.monotonic() > deadline or self.closed:
                return offer
            time.sleep(0.002)

    def _accept(self) -> None:
        """Each decode instance that registers a pair: check its layout, then serve it."""
        seen = 0
        while not self.closed:
            try:
                count = self.store.add("pairs", 0)
            except Exception:  # the store is closing
                return
            while seen < count:
                key = f"pair{seen}"
                seen += 1
                self._start(lambda key=key: self._serve_pair(key), f"kv-{key}")
            time.sleep(0.05)

    def _serve_pair(self, key: str) -> None:
        store = dist.PrefixStore(key, self.store)
        try:
            group = self._pair_with(store)
        except Exception as e:  # the decode instance left while pairing
            logger.warning("KV transfer pairing %s failed: %s", key, e)
            return
        if group is None:
            return
        n = 0
        while True:  # requests come through the store: no gloo call waits while the pair idles
            n += 1
            request = self._next_request(store, n)
            if request is None:
                return
            tid, num_blocks = request
            offer = self._take(tid)
            sent = False
            try:
                if offer is None or len(offer.block_ids) != num_blocks:
                    group.send([torch.zeros(3, dtype=torch.int64)], 1, 1).wait()
                    continue
                data = self._gather(offer.block_ids)
                with self.lock:  # copied out: the blocks may be freed and reused now
                    self.done.append((tid, True))
                    self._ended(tid)
                    sent = True
                state = torch.tensor(list(offer.state), dtype=torch.uint8)
                status = torch.tensor([1, data.numel(), state.numel()], dtype=torch.int64)
                group.send([status], 1, 1).wait()
                group.send([data], 1, 2).wait()
                if state.numel():
                    group.send([state], 1, 3).wait()
            except Exception as e:  # the decode instance went away: its pull fails there
                logger.warning("KV transfer %d failed: %s", tid, e)
                if offer is not None and not sent:
                    with self.lock:
                        self.done.append((tid, False))
                        self._ended(tid)
                return

    def _gather(self, block_ids: list[int]) -> Tensor:
        parts = []
        for t in self.tensors:  # as bytes: any dtype (FP8 included) travels and indexes alike
            idx = torch.tensor(block_ids, dtype=torch.int64, device=t.device)
            parts.append(t.view(torch.uint8)[idx].reshape(-1).cpu())
        return torch.cat(parts)

    # ------------------------------------------------------------ decode side

    def pull(self, address: str, transfer_id: int, block_ids: list[int]) -> Pull:
        with self.lock:
            pair = self.pairs.get(address)
            if pair is None:
                pool = ThreadPoolExecutor(1, thread_name_prefix="kv-pull")
                pair = self.pairs[address] = (None, pool, None)
        handle = Pull(address, time.monotonic() + self.timeout_s)
        handle.future = pair[1].submit(self._pull, handle, transfer_id, list(block_ids))
        return handle

    def abandon(self, handle: Pull) -> None:
        """A pull past its deadline: its blocks are never written (the caller frees them), and
        the pair is dropped (its thread may be stuck on a peer that stopped answering); the next
        pull from that address pairs again."""
        with handle.lock:
            handle.abandoned = True
        with self.lock:
            old = self.pairs.pop(handle.address, None)
        if old is not None:
            old[1].shutdown(wait=False, cancel_futures=True)

    def _group(self, address: str) -> Any:
        group = self.pairs[address][0]
        if group is not None:
            return group
        host, _, port = address.rpartition(":")
        try:
            store = dist.TCPStore(host, int(port), is_master=False, timeout=self.timeout)
        except Exception as e:
            raise TransferError(f"cannot reach the prefill instance at {address}: {e}") from e
        index = store.add("pairs", 1) - 1
        pair_store = dist.PrefixStore(f"pair{index}", store)
        pair_store.set("layout", self.layout)
        verdict = pair_store.get("verdict").decode()
        if verdict != "ok":
            raise TransferError(verdict)
        group = dist.ProcessGroupGloo(pair_store, 1, 2, self.timeout)
        with self.lock:
            if address in self.pairs:
                self.pairs[address] = (group, self.pairs[address][1], pair_store)
        return group

    def _forget(self, address: str) -> None:
        with self.lock:
            if address in self.pairs:
                self.pairs[address] = (None, self.pairs[address][1], None)

    def _pull(self, handle: Pull, transfer_id: int, block_ids: list[int]) -> bytes:
        address = handle.address
        group = self._group(address)
        try:
            store = self.pairs[address][2]
            n = store.add("requests", 1)
            store.set(f"req{n}", f"{transfer_id},{len(block_ids)}")
            status = torch.zeros(3, dtype=torch.int64)
            group.recv([status], 0, 1).wait()
            if int(status[0]) != 1:
                raise TransferError(
                    f"the prefill instance at {address} no longer holds transfer "
                    f"{transfer_id} (expired, taken, or another block count)"
                )
            data = torch.empty(int(status[1]), dtype=torch.uint8)
            group.recv([data], 0, 2).wait()
            state = torch.empty(int(status[2]), dtype=torch.uint8)
            if state.numel():
                group.recv([state], 0, 3).wait()
        except TransferError:
            raise
        except Exception as e:  # the pair is broken: a later pull pairs again
            self._forget(address)
            raise TransferError(f"KV transfer from {address} failed: {e}") from e
        with handle.lock:  # never into blocks the engine freed after giving up on it
            if handle.abandoned:
                raise TransferError("abandoned")
            self._scatter(block_ids, data)
        return bytes(state.numpy())

    def _scatter(self, block_ids: list[int], data: Tensor) -> None:
        n = len(block_ids)
        offset = 0
        for t in self.tensors:
            raw = t.view(torch.uint8)
            size = n * raw[0].numel()
            rows = data[offset : offset + size].view(n, *raw.shape[1:])
            idx = torch.tensor(block_ids, dtype=torch.int64, device=t.device)
            raw.index_copy_(0, idx, rows.to(t.device))
            offset += size
        if offset != data.numel():
            raise TransferError(f"KV transfer: {data.numel()} bytes for {offset} expected")

    def _start(self, target: Any, name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self.threads.append(thread)
        thread.start()

    def close(self) -> None:
        """Stop the threads (each polls ``closed`` at least every 50 ms, never waiting inside
        gloo while idle): a thread still inside a C++ call when the interpreter finalizes
        aborts the process."""
        self.closed = True
        for _, pool, _ in self.pairs.values():
            pool.shutdown(wait=False, cancel_futures=True)
        for thread in self.threads:
            if thread is not threading.current_thread():
                thread.join(timeout=2.0)


# Every transfer not closed yet is closed at exit, before the interpreter finalizes.
_LIVE: weakref.WeakSet[DistKVTransfer] = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for transfer in list(_LIVE):
        transfer.close()
