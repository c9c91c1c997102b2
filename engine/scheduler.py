"""Continuous batching: running requests first, then new prefill chunks, within a token budget.

Every request carries ``num_computed_tokens``; a step schedules ``num_new`` more tokens for it.
A prefill is just a request far behind its token list, so chunked prefill and decode share one
path. When KV blocks run out the most recently admitted request is preempted (its blocks are
freed and it is recomputed later).
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field

from tandem.engine.block_manager import BlockManager
from tandem.engine.config import SchedulerConfig
from tandem.engine.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # rows this request contributes to the step
    start: int  # num_computed_tokens before the step
    num_drafts: int = 0  # trailing rows that are draft tokens to verify

    @property
    def samples(self) -> bool:
        """The step reaches the end of the request's tokens, so its last rows are sampled."""
        return self.start + self.num_new_tokens - self.num_drafts == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    finished_request_ids: list[str] = field(default_factory=list)
    num_preempted: int = 0

    @property
    def total_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class Scheduler:
    def __init__(
        self, config: SchedulerConfig, block_manager: BlockManager, lookahead: int = 0
    ) -> None:
        self.config = config
        # Speculation: the draft loop writes KV up to 2K positions past the verified tokens.
        self.lookahead = lookahead
        self.blocks = block_manager
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.finished_ids: list[str] = []  # finished since the last schedule (workers drop state)
        self.num_preemptions = 0

    # -------------------------------------------------------------- bookkeeping

    def add(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """Mark finished and release its blocks (idempotent)."""
        if request.request_id not in self.requests:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.blocks.free(request)
        del self.requests[request.request_id]
        self.finished_ids.append(request.request_id)

    def detach(self, request: Request) -> None:
        """Stop scheduling a request whose blocks someone else now holds (a hand-over to a
        decode instance): the ranks forget it; the caller frees its blocks later."""
        if request in self.running:
            self.running.remove(request)
        del self.requests[request.request_id]
        self.finished_ids.append(request.request_id)

    def adopt(self, request: Request) -> None:
        """Run a request that arrives computed (its blocks allocated and filled elsewhere)."""
        if request.request_id in self.requests:
            raise ValueError(f"request id {request.request_id!r} is already in use")
        self.requests[request.request_id] = request
        request.status = RequestStatus.RUNNING
        self.running.append(request)

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is not None:
            self.finish(request, RequestStatus.FINISHED_ABORTED)
        return request

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.blocks.free(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.spec_token_ids = []
        self.num_preemptions += 1
        self.waiting.appendleft(request)

    # -------------------------------------------------------------- scheduling

    def _tokens_for(self, request: Request, budget: int) -> int:
        pending = request.num_tokens - request.num_computed_tokens
        if request.spec_token_ids:
            if pending == 1 and pending + len(request.spec_token_ids) <= budget:
                return pending + len(request.spec_token_ids)
            request.spec_token_ids = []  # no room (or not decoding): verify nothing this step
        return min(pending, budget)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self.finished_ids)
        self.finished_ids = []
        budget = self.config.max_num_batched_tokens
        preempted = False

        i = 0
        while i < len(self.running) and budget > 0:
            request = self.running[i]
            num_new = self._tokens_for(request, budget)
            if num_new <= 0:
                i += 1
                continue
            while not self.blocks.allocate(
                request, request.num_computed_tokens + num_new + self.lookahead
            ):
                victim = self.running[-1]
                self._preempt(victim)
                preempted = True
                out.num_preempted += 1
                if victim is request:
                    break
            else:
                drafts = max(0, num_new - (request.num_tokens - request.num_computed_tokens))
                out.scheduled.append(
                    ScheduledRequest(request, num_new, request.num_computed_tokens, drafts)
                )
                budget -= num_new
                i += 1
                continue
            break  # the request preempted itself; nothing after it can run either

        if not preempted:
            now = time.monotonic()
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                request = self.waiting[0]
                if request.num_computed_tokens == 0 and not request.block_ids:
                    cached = self.blocks.match_prefix(request)
                    request.num_computed_tokens = cached
                    if request.num_preemptions == 0:
                        request.num_cached_tokens = cached
                num_new = self._tokens_for(request, budget)
                if not self.blocks.allocate(
                    request, request.num_computed_tokens + num_new + self.lookahead
                ):
                    # Wait for running requests to free blocks (the engine rejects requests
                    # larger than the whole cache, so this cannot wait forever).
                    self.blocks.free(request)
                    request.num_computed_tokens = 0
                    break
                self.waiting.popleft()
                if request.num_preemptions == 0:
                    self.blocks.count_prefix_lookup(request.num_tokens, request.num_cached_tokens)
                request.status = RequestStatus.RUNNING
                if request.first_scheduled_time is None:
                    request.first_scheduled_time = now
                self.running.append(request)
                out.scheduled.append(
                    ScheduledRequest(request, num_new, request.num_computed_tokens)
                )
                budget -= num_new

        for s in out.scheduled:
            s.request.num_computed_tokens += s.num_new_tokens
        return out

    def cache_computed_blocks(self, requests: list[Request]) -> None:
        """Register the requests' full, computed blocks for prefix reuse (after the step's
        tokens are appended and, under speculation, the KV rewound), then release the window
        blocks their next queries no longer read."""
        for request in requests:
            if not request.is_finished:
                self.blocks.cache_full_blocks(request, request.num_computed_tokens)
                self.blocks.release_left_window(request)
