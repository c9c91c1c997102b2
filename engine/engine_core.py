"""The engine process: build the engine, warm up, report ready, then run the step loop.

The API process talks to this loop through two queues of the message types below. The loop
blocks on its input queue only when it has nothing to run; otherwise it drains what arrived,
runs one ``step()`` and sends that step's outputs in one message (as ``OutputDelta``: what each
request gained) together with a stats snapshot and a heartbeat timestamp. When idle it still
sends a heartbeat every ``heartbeat_interval_s``, so the API process can tell a busy engine from
a dead or hung one.

A step that raises fails the requests that step was running (``RequestsFailed``; waiting and
other requests are untouched) and the loop carries on, unless the engine cannot be trusted any
more: aborting the failed requests raised, the executor's health check fails (a rank is gone;
also checked at every idle heartbeat), or ``max_consecutive_failures`` steps failed in a row.
Then it reports ``EngineDead`` and the process exits non-zero. Test-only fault injection: ``engine/fault_injection.py``.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import multiprocessing.queues
import os
import queue
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

from tandem.engine.config import EngineArgs
from tandem.engine.fault_injection import FaultPlan
from tandem.engine.input_processor import InputProcessor
from tandem.engine.outputs import EngineStats, OutputDelta, OutputEncoder, RequestOutput
from tandem.engine.process_exit import exit_process, pace_garbage_collector
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

WARMUP_REQUEST_PREFIX = "__tandem_warmup__"
# generation_config.json keys that become per-request sampling defaults (HF name -> ours).
GENERATION_DEFAULT_KEYS = {
    "temperature": "temperature",
    "top_p": "top_p",
    "top_k": "top_k",
    "min_p": "min_p",
    "repetition_penalty": "repetition_penalty",
}


# ------------------------------------------------------------------ messages: API -> engine


@dataclass
class AddRequests:
    requests: list[Request]  # validated by the API process's InputProcessor


@dataclass
class AbortRequests:
    request_ids: list[str]


@dataclass
class Shutdown:
    pass


# ------------------------------------------------------------------ messages: engine -> API


@dataclass
class EngineInfo:
    """What the API process needs to know about the engine once it is ready."""

    num_blocks: int
    block_size: int
    max_model_len: int
    vocab_size: int
    eos_token_ids: frozenset[int]
    served_model_name: str
    generation_defaults: dict[str, Any] = field(default_factory=dict)
    pid: int = 0
    # The engine's own validator without its tokenizer: the API process validates exactly as
    # the engine would (KV lookahead, speculation limits, ...), with its own tokenizer.
    input_processor: InputProcessor | None = None


@dataclass
class EngineReady:
    info: EngineInfo


@dataclass
class StepOutputs:
    """One step's outputs (possibly none: then it is a heartbeat) and the stats after it."""

    outputs: list[OutputDelta]
    stats: EngineStats
    timestamp: float  # time.time() when sent


@dataclass
class RequestsFailed:
    request_ids: list[str]
    message: str
    param: str | None = None  # the request field at fault (RequestFailure); None: the server's


@dataclass
class EngineDead:
    message: str


class QueueLike(Protocol):
    def put(self, item: Any) -> None: ...

    def get(self, block: bool = True, timeout: float | None = None) -> Any: ...


class EngineLike(Protocol):
    """The part of ``LLMEngine`` the loop uses (tests substitute a fake)."""

    def add_request(self, request_id: str, prompt: Request) -> Request: ...

    def abort_request(self, request_ids: list[str]) -> None: ...

    def has_unfinished_requests(self) -> bool: ...

    def step(self) -> list[RequestOutput]: ...

    def get_stats(self) -> EngineStats: ...


# ------------------------------------------------------------------ helpers


def generation_defaults(generation_config: dict[str, Any]) -> dict[str, Any]:
    """Sampling defaults a checkpoint's generation_config.json asks for (only keys it sets)."""
    out: dict[str, Any] = {}
    for hf_key, key in GENERATION_DEFAULT_KEYS.items():
        value = generation_config.get(hf_key)
        if value is not None:
            out[key] = value
    return out


_COUNTERS = (
    "num_preemptions",
    "prompt_tokens",
    "generation_tokens",
    "prefix_cache_queries",
    "prefix_cache_hits",
    "spec_num_drafts",
    "spec_num_draft_tokens",
    "spec_num_accepted_tokens",
    "spec_constrained_draft_tokens",
    "spec_constrained_accepted_tokens",
)


def stats_since(base: EngineStats | None, now: EngineStats) -> EngineStats:
    """``now`` with counters measured from ``base`` (so warm-up work is not counted)."""
    if base is None:
        return now
    per_pos = list(now.spec_accepted_per_pos)
    for i, count in enumerate(base.spec_accepted_per_pos):
        per_pos[i] -= count
    return dataclasses.replace(
        now,
        spec_accepted_per_pos=per_pos,
        **{k: getattr(now, k) - getattr(base, k) for k in _COUNTERS},
    )


def warm_up(engine: Any) -> None:
    """Run a greedy and a seeded random dummy request through every stage once."""
    vocab = int(engine.config.model_config.vocab_size)
    prompt = [i % vocab for i in range(1, 9)]
    variants = [
        SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True),
        SamplingParams(temperature=1.0, top_p=0.9, seed=0, max_tokens=2, ignore_eos=True),
    ]
    for i, params in enumerate(variants):
        engine.add_request(f"{WARMUP_REQUEST_PREFIX}{i}", prompt, params)
    for _ in range(64):  # two tokens each: a few steps at most
        if not engine.has_unfinished_requests():
            break
        engine.step()
    if engine.has_unfinished_requests():
        raise RuntimeError("the warm-up requests did not finish")
    # The warm-up's prompt blocks must not be served as a cache hit to users (on any DP rank:
    # under attention DP the two requests run on different ranks).
    engine.reset_prefix_cache()


def _failed_step_requests(engine: EngineLike, live: set[str]) -> list[str]:
    """The live requests the failed step was running (all live ones if the engine cannot say:
    ``LLMEngine.step_request_ids`` is None until a step has scheduled)."""
    ids = getattr(engine, "step_request_ids", None)
    return sorted(live if ids is None else live.intersection(ids))


def _check_recoverable(engine: EngineLike) -> None:
    """Raise if the engine cannot go on after a failed step (e.g. a rank is gone)."""
    executor = getattr(engine, "executor", None)
    if executor is not None:
        executor.check_health()


def _drain(in_q: QueueLike, block: bool, timeout: float) -> list[Any]:
    msgs: list[Any] = []
    if block:
        try:
            msgs.append(in_q.get(timeout=timeout))
        except queue.Empty:
            return msgs
    while True:
        try:
            msgs.append(in_q.get(block=False))
        except queue.Empty:
            return msgs


# ------------------------------------------------------------------ the loop


def run_engine_loop(
    engine: EngineLike,
    in_q: QueueLike,
    out_q: QueueLike,
    *,
    heartbeat_interval_s: float = 0.5,
    max_consecutive_failures: int = 3,
    base_stats: EngineStats | None = None,
    parent_pid: int | None = None,
) -> int:
    """Serve until ``Shutdown`` (returns 0) or until the engine cannot go on (returns 1)."""
    live: set[str] = set()  # requests added and not yet finished or aborted
    encoder = OutputEncoder()
    failures = 0
    last_sent = 0.0
    while True:
        idle = not engine.has_unfinished_requests()
        msgs = _drain(in_q, block=idle, timeout=heartbeat_interval_s)
        for msg in msgs:
            if isinstance(msg, Shutdown):
                return 0
            if isinstance(msg, AddRequests):
                for request in msg.requests:
                    try:
                        engine.add_request(request.request_id, request)
                        live.add(request.request_id)
                    except Exception as e:  # e.g. a duplicate id: fail this request only
                        out_q.put(RequestsFailed([request.request_id], str(e)))
            elif isinstance(msg, AbortRequests):
                engine.abort_request(msg.request_ids)
                live.difference_update(msg.request_ids)
                encoder.forget(msg.request_ids)
            else:
                logger.error("engine loop got an unknown message: %r", msg)
        if parent_pid is not None and os.getppid() != parent_pid:
            logger.error("the API process is gone; the engine exits")
            return 1

        outputs: list[RequestOutput] = []
        if engine.has_unfinished_requests():
            try:
                outputs = engine.step()
                failures = 0
            except Exception as e:
                failures += 1
                logger.exception("engine step failed (%d in a row)", failures)
                failed = _failed_step_requests(engine, live)
                live.difference_update(failed)
                encoder.forget(failed)
                message = f"the engine failed while running this request: {type(e).__name__}: {e}"
                try:
                    engine.abort_request(failed)
                    _check_recoverable(engine)
                except Exception as fatal:
                    logger.exception("the engine cannot recover from the failed step")
                    out_q.put(RequestsFailed(failed, message))
                    out_q.put(
                        EngineDead(
                            f"engine state is broken after: {message} "
                            f"({type(fatal).__name__}: {fatal})"
                        )
                    )
                    return 1
                out_q.put(RequestsFailed(failed, message))
                if failures >= max_consecutive_failures:
                    out_q.put(EngineDead(f"{failures} engine steps failed in a row; last: {e}"))
                    return 1
                continue
            for out in outputs:
                if out.finished:
                    live.discard(out.request_id)
            # Requests that ended with an error of their own (a grammar with no way on).
            take_failed = getattr(engine, "take_failed", None)
            for failure in take_failed() if take_failed is not None else []:
                live.discard(failure.request_id)
                encoder.forget([failure.request_id])
                out_q.put(RequestsFailed([failure.request_id], failure.message, failure.param))

        now = time.monotonic()
        if not outputs and now - last_sent >= heartbeat_interval_s:
            # Idle too: a rank (or node) that died between steps ends the engine now, not at the
            # next request.
            try:
                _check_recoverable(engine)
            except Exception as fatal:
                logger.error("the engine cannot go on: %s", fatal)
                out_q.put(EngineDead(f"the engine cannot go on: {type(fatal).__name__}: {fatal}"))
                return 1
        if outputs or msgs or now - last_sent >= heartbeat_interval_s:
            deltas = [encoder.encode(out) for out in outputs]
            out_q.put(StepOutputs(deltas, stats_since(base_stats, engine.get_stats()), time.time()))
            last_sent = now


def run_engine_core(
    engine_args: EngineArgs,
    in_q: QueueLike,
    out_q: multiprocessing.queues.Queue[Any],
    log_level: str = "INFO",
    heartbeat_interval_s: float = 0.5,
) -> None:
    """Entry point of the engine process (spawned by ``AsyncLLM``)."""
    from tandem.engine.llm_engine import LLMEngine

    logging.basicConfig(
        level=getattr(logging, log_level.upper(), logging.INFO),
        format="%(asctime)s %(levelname)s [engine] %(name)s: %(message)s",
        force=True,  # a forked engine inherits the API process's handler
    )
    # Ctrl-C reaches the whole process group; the API process decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    pace_garbage_collector()
    parent_pid = os.getppid()
    try:
        engine = LLMEngine.from_engine_args(engine_args)
        warm_up(engine)
        faults = FaultPlan.from_env()  # test-only; None unless TANDEM_TEST_FAULTS is set
        if faults is not None:
            faults.install(engine)
        mc = engine.config.model_config
        info = EngineInfo(
            num_blocks=engine.block_manager.num_blocks,
            block_size=engine.config.cache_config.block_size,
            max_model_len=engine.max_model_len,
            vocab_size=mc.vocab_size,
            eos_token_ids=frozenset(engine.eos_token_ids),
            served_model_name=mc.served_model_name,
            generation_defaults=generation_defaults(engine.generation_config),
            pid=os.getpid(),
            input_processor=copy.copy(engine.input_processor),
        )
        info.input_processor.tokenizer = None
        base = engine.get_stats()
    except Exception as e:
        logger.exception("engine start-up failed")
        out_q.put(EngineDead(f"engine start-up failed: {type(e).__name__}: {e}"))
        sys.exit(1)
    out_q.put(EngineReady(info))
    logger.info("engine ready: %d KV blocks, max_model_len %d", info.num_blocks, info.max_model_len)
    code = 1
    try:
        code = run_engine_loop(
            engine,
            in_q,
            out_q,
            heartbeat_interval_s=heartbeat_interval_s,
            base_stats=base,
            parent_pid=parent_pid,
        )
    except Exception as e:
        logger.exception("engine loop crashed")
        out_q.put(EngineDead(f"engine loop crashed: {type(e).__name__}: {e}"))
    finally:
        try:
            engine.shutdown()
        except Exception:
            logger.exception("engine shutdown failed")
    if code == 0:
        # Told to stop: the API process no longer reads what is still buffered, so exit without
        # waiting for the queue to flush it.
        out_q.cancel_join_thread()
    else:  # an error report is flushed
        out_q.close()
        out_q.join_thread()
    exit_process(code)
