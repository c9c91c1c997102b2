"""``AsyncLLM``: the API process's client of the engine process.

The API process holds the tokenizer and the config (never the weights): it validates requests
with ``InputProcessor`` (bad input fails here, before it reaches the engine), sends them to the
engine process (``engine/engine_core.py``) and receives each step's outputs on a background
thread, which hands them to the event loop. Every API request becomes a ``RequestGroup`` (one
engine request per prompt and sample) whose outputs arrive on an asyncio queue, so the event
loop never waits on the model.
"""

from __future__ import annotations

import asyncio
import logging
import multiprocessing as mp
import os
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.client import (
    EngineDeadError,
    EngineNotReadyError,
    Prompt,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
    RequestGroup,
    RequestStatsSink,
)
from tandem.engine.config import EngineArgs
from tandem.engine.engine_core import (
    AbortRequests,
    AddRequests,
    EngineDead,
    EngineInfo,
    EngineReady,
    RequestsFailed,
    Shutdown,
    StepOutputs,
    run_engine_core,
)
from tandem.engine.input_processor import InputProcessor
from tandem.engine.outputs import EngineStats, OutputAssembly, OutputDelta, RequestOutput
from tandem.engine.process_exit import at_fork_point, mark_fork_point, name_process
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutputError
from tandem.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)


@dataclass
class _Tracked:
    group: RequestGroup
    index: int
    submitted: float  # time.monotonic() in this process
    last_token_time: float | None = None
    num_tokens: int = 0
    output: OutputAssembly = field(default_factory=OutputAssembly)


class AsyncLLM:
    """Starts the engine process and streams its outputs to asyncio callers."""

    def __init__(
        self,
        engine_args: EngineArgs,
        *,
        ready_timeout_s: float = 900.0,
        heartbeat_timeout_s: float = 60.0,
        heartbeat_interval_s: float = 0.5,
        stats_sink: RequestStatsSink | None = None,
        on_dead: Callable[[str], None] | None = None,
        log_level: str = "INFO",
        tokenizer: Any = None,
        env: dict[str, str] | None = None,
        process_name: str = "tandem-engine",
    ) -> None:
        """``tokenizer``: reuse one already loaded (replicas share it); ``env``: variables the
        engine process (and the ranks it spawns) sets before it starts, e.g. a replica's
        ``CUDA_VISIBLE_DEVICES``."""
        self.engine_args = engine_args
        # Config and tokenizer only: the weights load in the engine process.
        self.config = engine_args.create_engine_config()
        if tokenizer is None:
            tokenizer = load_tokenizer(self.config.model_config.tokenizer)
        self.tokenizer = tokenizer
        self.env = dict(env or {})
        self.process_name = process_name
        self.ready_timeout_s = ready_timeout_s
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.heartbeat_interval_s = heartbeat_interval_s
        self.stats_sink = stats_sink
        self.on_dead = on_dead  # called once if the engine dies after start-up
        self.log_level = log_level
        sc = self.config.scheduler_config
        self.max_in_flight = sc.max_num_seqs + sc.max_waiting_requests
        self.info: EngineInfo | None = None
        self.input_processor: InputProcessor | None = None
        self.stats: EngineStats | None = None
        self.dead_reason: str | None = None
        self._tracked: dict[str, _Tracked] = {}
        self._proc: Any = None
        self._in_q: Any = None
        self._out_q: Any = None
        self._reader: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing = False
        self._last_message = time.monotonic()

    # -------------------------------------------------------------- lifecycle

    @property
    def max_model_len(self) -> int:
        # The engine's once ready: --max-model-len auto is resolved when the KV cache is sized.
        if self.info is not None:
            return self.info.max_model_len
        return self.config.model_config.max_model_len

    @property
    def replica_stats(self) -> list[EngineStats | None]:
        """The stats snapshot of each replica: here the one engine's."""
        return [self.stats]

    @property
    def is_ready(self) -> bool:
        return self.info is not None and self.dead_reason is None

    @property
    def is_healthy(self) -> bool:
        """Engine process alive, not failed, and (once ready) heard from recently."""
        if self.dead_reason is not None or self._proc is None or not self._proc.is_alive():
            return False
        if self.info is None:
            return True  # still loading; start() enforces the ready timeout
        return time.monotonic() - self._last_message < self.heartbeat_timeout_s

    def launch(self) -> None:
        """Start the engine process (returns at once; ``start`` waits for it): forked from this
        process where that is safe (``_can_fork_engine``), else a fresh interpreter."""
        if self._proc is not None:
            return
        ctx = mp.get_context("fork" if _can_fork_engine(self.config.device.type) else "spawn")
        self._in_q = ctx.Queue()
        self._out_q = ctx.Queue()
        self._proc = ctx.Process(
            target=_run_engine_core_in_env,
            args=(
                self.env,
                self.process_name,
                self.engine_args,
                self._in_q,
                self._out_q,
                self.log_level,
                self.heartbeat_interval_s,
            ),
            name=self.process_name,
        )
        self._proc.start()

    async def start(self) -> EngineInfo:
        """Spawn the engine process if needed and wait until it has warmed up."""
        self._loop = asyncio.get_running_loop()
        self.launch()
        try:
            info = await asyncio.to_thread(self._wait_ready)
        except Exception as e:
            self.dead_reason = str(e) or type(e).__name__
            if self._proc.is_alive():  # e.g. the ready timeout passed
                self._proc.kill()
            raise
        processor = info.input_processor
        if processor is None:
            processor = InputProcessor(
                self.tokenizer,
                info.vocab_size,
                info.max_model_len,
                info.eos_token_ids,
                info.block_size,
                info.num_blocks,
            )
        processor.tokenizer = self.tokenizer
        self.input_processor = processor
        self._last_message = time.monotonic()
        self.info = info
        self._reader = threading.Thread(
            target=self._read_outputs, name="engine-reader", daemon=True
        )
        self._reader.start()
        return info

    def _wait_ready(self) -> EngineInfo:
        deadline = time.monotonic() + self.ready_timeout_s
        while time.monotonic() < deadline:
            if self._closing:
                raise EngineDeadError("shut down before the engine was ready")
            try:
                msg = self._out_q.get(timeout=0.2)
            except queue.Empty:
                if not self._proc.is_alive():
                    raise EngineDeadError(
                        f"the engine process exited during start-up (exit code "
                        f"{self._proc.exitcode})"
                    ) from None
                continue
            if isinstance(msg, EngineReady):
                return msg.info
            if isinstance(msg, EngineDead):
                raise EngineDeadError(msg.message)
        raise EngineDeadError(f"the engine was not ready within {self.ready_timeout_s:.0f} s")

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop the engine process (politely, then by force) and the reader thread."""
        self._closing = True
        if self._proc is not None and self._proc.is_alive():
            try:
                self._in_q.put(Shutdown())
            except (ValueError, OSError):
                pass
        self._stop_process(timeout_s)
        if self._reader is not None:
            self._reader.join(timeout=2.0)
        for q in (self._in_q, self._out_q):
            if q is not None:
                q.cancel_join_thread()
                q.close()

    def _stop_process(self, timeout_s: float = 10.0) -> None:
        proc = self._proc
        if proc is None:
            return
        deadline = time.monotonic() + timeout_s
        while proc.is_alive() and time.monotonic() < deadline:
            # Keep reading: an engine exits only once its queue has flushed what it sent, and
            # nobody else reads any more (the reader thread stops when closing).
            self._discard_outputs()
            proc.join(0.05)
        if proc.is_alive():
            logger.warning("engine process did not stop; terminating it")
            proc.terminate()
            proc.join(5.0)
        if proc.is_alive():
            proc.kill()
            proc.join(5.0)

    def _discard_outputs(self) -> None:
        try:
            while True:
                self._out_q.get_nowait()
        except (queue.Empty, EOFError, OSError, ValueError):
            pass

    # -------------------------------------------------------------- requests

    def _check_usable(self) -> InputProcessor:
        if self.dead_reason is not None:
            raise EngineDeadError(f"the engine is not running: {self.dead_reason}")
        if self.input_processor is None:
            raise EngineNotReadyError("the engine is still starting; retry shortly")
        return self.input_processor

    def add_requests(self, items: Sequence[tuple[str, Prompt, SamplingParams]]) -> RequestGroup:
        """Validate every request, then submit them all as one group (or none of them)."""
        return self.submit(self.process(items))

    def process(self, items: Sequence[tuple[str, Prompt, SamplingParams]]) -> list[Request]:
        """Validate and tokenize one group's requests (raises ``ValueError`` for bad input)."""
        processor = self._check_usable()
        if len(items) > self.max_in_flight:
            raise ValueError(
                f"this request asks for {len(items)} sequences (prompts x n); the server holds "
                f"at most {self.max_in_flight} at once"
            )
        return [processor.process(rid, prompt, params) for rid, prompt, params in items]

    def check_grammar(self, params: SamplingParams) -> None:
        """Compile ``params``' grammar, if any, into the input processor's cache (raises
        ``StructuredOutputError`` if it cannot be served). A new grammar can take long to compile:
        the server calls this in a worker thread before ``add_requests``, whose own check then
        hits the cache, so the event loop never waits on a compile."""
        self._check_usable().check_structured(params)

    def submit(self, requests: list[Request]) -> RequestGroup:
        """Send already validated requests to the engine as one group."""
        self._check_usable()
        if len(self._tracked) + len(requests) > self.max_in_flight:
            raise QueueFullError(
                f"the server is at capacity ({len(self._tracked)} requests in flight, limit "
                f"{self.max_in_flight}); retry later"
            )
        ids = [r.request_id for r in requests]
        if len(set(ids)) != len(ids) or any(rid in self._tracked for rid in ids):
            raise ValueError(f"request ids must be unique: {ids}")
        group = RequestGroup(self, ids)
        now = time.monotonic()
        for i, rid in enumerate(ids):
            self._tracked[rid] = _Tracked(group, i, now)
        self._in_q.put(AddRequests(requests))
        return group

    async def generate(
        self, request_id: str, prompt: Prompt, params: SamplingParams
    ) -> AsyncIterator[RequestOutput]:
        """Stream one request's cumulative outputs; closing the iterator aborts it."""
        group = self.add_requests([(request_id, prompt, params)])
        try:
            async for _, out in group.stream():
                yield out
        finally:
            group.abort()

    def abort(self, request_ids: str | list[str]) -> None:
        ids = [request_ids] if isinstance(request_ids, str) else list(request_ids)
        ids = [rid for rid in ids if self._tracked.pop(rid, None) is not None]
        if ids and self.dead_reason is None and not self._closing:
            self._in_q.put(AbortRequests(ids))

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight; each of their streams raises ``RequestAbortedError``
        with ``reason``. Returns how many were aborted."""
        tracked = list(self._tracked.items())
        for _, t in tracked:
            t.group._put(RequestAbortedError(reason))
        self.abort([rid for rid, _ in tracked])
        return len(tracked)

    @property
    def num_in_flight(self) -> int:
        return len(self._tracked)

    # -------------------------------------------------------------- outputs

    def _read_outputs(self) -> None:
        """Reader thread: engine messages -> event loop; notices death and hangs."""
        assert self._loop is not None
        while not self._closing:
            try:
                msg = self._out_q.get(timeout=0.2)
            except queue.Empty:
                if self._closing:
                    return
                if not self._proc.is_alive():
                    self._post(
                        EngineDead(f"the engine process exited (code {self._proc.exitcode})")
                    )
                    return
                silent = time.monotonic() - self._last_message
                if silent > self.heartbeat_timeout_s:
                    self._post(EngineDead(f"the engine sent nothing for {silent:.0f} s"))
                    self._proc.kill()
                    return
                continue
            except (EOFError, OSError, ValueError):
                if not self._closing:
                    self._post(EngineDead("the engine output queue broke"))
                return
            self._last_message = time.monotonic()
            self._post(msg)
            if isinstance(msg, EngineDead):
                return

    def _post(self, msg: Any) -> None:
        try:
            self._loop.call_soon_threadsafe(self._dispatch, msg)  # type: ignore[union-attr]
        except RuntimeError:  # the loop is closed: we are shutting down
            self._closing = True

    def _dispatch(self, msg: Any) -> None:
        if isinstance(msg, StepOutputs):
            self.stats = msg.stats
            now = time.monotonic()
            for out in msg.outputs:
                self._deliver(out, now)
        elif isinstance(msg, RequestsFailed):
            for rid in msg.request_ids:
                tracked = self._tracked.pop(rid, None)
                if tracked is not None:
                    tracked.group._put(
                        RequestFailedError(msg.message)
                        if msg.param is None
                        else StructuredOutputError(msg.message, msg.param)
                    )
        elif isinstance(msg, EngineDead):
            if self._closing:
                return
            logger.error("engine died: %s", msg.message)
            self.dead_reason = msg.message
            tracked_all = list(self._tracked.values())
            self._tracked.clear()
            for tracked in tracked_all:
                tracked.group._put(EngineDeadError(f"the engine died: {msg.message}"))
            if self.on_dead is not None:
                self.on_dead(msg.message)

    def _deliver(self, delta: OutputDelta, now: float) -> None:
        tracked = self._tracked.get(delta.request_id)
        if tracked is None:  # aborted by us while the engine ran it
            return
        out = tracked.output.apply(delta)
        n = len(out.outputs[0].token_ids)
        new = n - tracked.num_tokens
        sink = self.stats_sink
        if sink is not None and new > 0:
            if tracked.last_token_time is None:
                sink.observe_first_token(now - tracked.submitted)
            else:
                gap = (now - tracked.last_token_time) / new
                for _ in range(new):  # a step may bring several tokens (speculation)
                    sink.observe_inter_token(gap)
            tracked.last_token_time = now
        tracked.num_tokens = n
        if out.finished:
            del self._tracked[out.request_id]
            if sink is not None:
                m = out.metrics
                queue_s = None
                if "first_scheduled_time" in m and "arrival_time" in m:
                    queue_s = max(0.0, m["first_scheduled_time"] - m["arrival_time"])
                sink.observe_finished(
                    now - tracked.submitted, queue_s, out.outputs[0].finish_reason
                )
        tracked.group._put((tracked.index, out))


def _can_fork_engine(device_type: str) -> bool:
    """Whether the engine process may be a fork of this one: a CPU engine, from a process at
    the fork point it marked (``tandem serve``'s, before any thread or event loop starts; see
    ``mark_fork_point``), outside any running event loop (whose signal wake-up socket and
    handlers the child would share). A fork saves the fresh interpreter's imports of torch,
    transformers and the engine (some 2.5 s of CPU per server start)."""
    try:
        asyncio.get_running_loop()
        return False
    except RuntimeError:
        pass
    return device_type == "cpu" and at_fork_point()


def _run_engine_core_in_env(env: dict[str, str], name: str, *args: Any) -> None:
    """The engine process's entry: name it (``/proc/PID/comm``: a forked engine keeps its
    parent's command line), set ``env`` first (before CUDA starts, and so that the rank
    processes it spawns inherit it), then run the engine loop."""
    name_process(name)
    os.environ.update(env)
    mark_fork_point()
    run_engine_core(*args)
