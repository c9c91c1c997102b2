"""What the API process holds of the engine: the ``EngineClient`` contract the server is written
against (``AsyncLLM``, one engine process; ``ReplicatedLLM``, data-parallel replicas), the
``RequestGroup`` stream of one API request, and the errors a client raises."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

from tandem.engine.config import EngineConfig
from tandem.engine.outputs import EngineStats, RequestOutput
from tandem.engine.sampling_params import SamplingParams

Prompt = str | list[int]


@runtime_checkable
class EngineClient(Protocol):
    """The engine as the HTTP server uses it; ``AsyncLLM`` and ``ReplicatedLLM`` satisfy it
    (tests/test_server_async_llm.py checks both against it)."""

    config: EngineConfig
    tokenizer: Any

    @property
    def dead_reason(self) -> str | None: ...

    @property
    def max_model_len(self) -> int: ...

    @property
    def is_ready(self) -> bool: ...

    @property
    def is_healthy(self) -> bool: ...

    @property
    def num_in_flight(self) -> int: ...

    @property
    def replica_stats(self) -> list[EngineStats | None]: ...

    def launch(self) -> None: ...

    async def start(self) -> Any: ...

    def shutdown(self, timeout_s: float = 10.0) -> None: ...

    def add_requests(self, items: Sequence[tuple[str, Prompt, SamplingParams]]) -> RequestGroup: ...

    def check_grammar(self, params: SamplingParams) -> None: ...

    def abort(self, request_ids: str | list[str]) -> None: ...

    def abort_all(self, reason: str) -> int: ...


class EngineError(RuntimeError):
    """Base of the errors the engine client raises for reasons other than bad input."""


class EngineDeadError(EngineError):
    """The engine process is gone (or stopped answering)."""


class EngineNotReadyError(EngineError):
    """The engine is still loading or warming up."""


class QueueFullError(EngineError):
    """Admitting the request would exceed the bounded waiting queue."""


class RequestFailedError(EngineError):
    """The engine failed while running the request (a server fault, not the client's)."""


class RequestAbortedError(EngineError):
    """The server aborted the request before it finished (e.g. it is shutting down)."""


class RequestStatsSink(Protocol):
    """Receives per-request latency observations (the server's Prometheus metrics)."""

    def observe_first_token(self, seconds: float) -> None: ...

    def observe_inter_token(self, seconds: float) -> None: ...

    def observe_finished(
        self, e2e_seconds: float, queue_seconds: float | None, finish_reason: str | None
    ) -> None: ...


@dataclass
class RequestGroup:
    """The engine requests of one API request (n samples x prompts), merged into one stream.

    ``stream()`` yields ``(index, output)`` with cumulative outputs; when the consumer is slower
    than the engine, intermediate outputs of the same index are skipped (the next one contains
    them). Closing or cancelling the stream before every request finished aborts the rest."""

    client: EngineClient
    request_ids: list[str]
    _queue: asyncio.Queue[tuple[int, RequestOutput] | BaseException] = field(
        default_factory=asyncio.Queue
    )
    _finished: list[bool] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._finished = [False] * len(self.request_ids)

    @property
    def done(self) -> bool:
        return all(self._finished)

    def _put(self, item: tuple[int, RequestOutput] | BaseException) -> None:
        self._queue.put_nowait(item)

    async def stream(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        try:
            while not self.done:
                batch = [await self._queue.get()]
                while not self._queue.empty():
                    batch.append(self._queue.get_nowait())
                latest: dict[int, RequestOutput] = {}
                error: BaseException | None = None
                for item in batch:
                    if isinstance(item, BaseException):
                        error = item  # after what arrived before it
                        break
                    latest[item[0]] = item[1]
                for index, out in latest.items():
                    if out.finished:
                        self._finished[index] = True
                    yield index, out
                if error is not None:
                    raise error
        finally:
            self.abort()

    async def final_outputs(self) -> list[RequestOutput]:
        """Wait for every request to finish; outputs in index order."""
        last: dict[int, RequestOutput] = {}
        async for index, out in self.stream():
            last[index] = out
        return [last[i] for i in range(len(self.request_ids))]

    def abort(self) -> None:
        """Abort whatever has not finished yet (idempotent)."""
        pending = [
            rid for rid, fin in zip(self.request_ids, self._finished, strict=True) if not fin
        ]
        for i in range(len(self._finished)):
            self._finished[i] = True
        if pending:
            self.client.abort(pending)
