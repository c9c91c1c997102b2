"""``ReplicatedLLM``: data-parallel replicas of one model behind one API process.

``--data-parallel-size N`` (``-dp N``) starts N ``AsyncLLM``s, each with its own engine process
and its own tensor-parallel ranks (on CUDA, its own ``tensor_parallel_size`` devices through
``CUDA_VISIBLE_DEVICES``). ``ReplicatedLLM`` has the interface the server uses of ``AsyncLLM``,
so the server does not care how many there are.

Dispatch: every API request (its whole group of prompts x n samples) goes to one replica. The
client remembers, in a bounded LRU map, which replica last got each prompt prefix: the chained
SHA-256 hashes of the prompt's first full KV blocks (``block_hash``, as the prefix cache hashes
them). A request goes to the replica that holds its longest remembered prefix, unless that
replica has more than ``affinity_slack`` requests in flight beyond the least-loaded one; else
(and when nothing matches) to the least-loaded replica, ties broken by fewer requests sent so
far. Remembering is a guess about the engines' caches (they evict on their own), so a wrong
guess costs a recomputed prefix, never a wrong answer.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
from collections import OrderedDict
from collections.abc import Callable, Sequence
from typing import Any

import torch

from tandem.engine.async_llm import AsyncLLM
from tandem.engine.block_manager import block_hash
from tandem.engine.client import (
    EngineClient,
    EngineDeadError,
    EngineNotReadyError,
    Prompt,
    RequestGroup,
    RequestStatsSink,
)
from tandem.engine.config import EngineArgs, EngineConfig
from tandem.engine.engine_core import EngineInfo
from tandem.engine.outputs import EngineStats
from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.tokenizer import load_tokenizer

logger = logging.getLogger(__name__)

# Prefix blocks hashed per prompt for dispatch (a longer shared prefix is no stronger a hint).
ROUTING_BLOCKS = 64
# Remembered prefix hashes (32 bytes each): older ones are forgotten first.
MAX_PREFIX_ENTRIES = 1 << 16
# In-flight requests a replica may have beyond the least-loaded one and still get a request
# whose prefix it holds.
AFFINITY_SLACK = 8


def prefix_hashes(token_ids: Sequence[int], block_size: int, max_blocks: int) -> list[bytes]:
    """Chained hashes of the first full blocks of ``token_ids`` (at most ``max_blocks``):
    entry i identifies the prefix of (i + 1) blocks."""
    out: list[bytes] = []
    parent: bytes | None = None
    for i in range(min(len(token_ids) // block_size, max_blocks)):
        parent = block_hash(parent, token_ids[i * block_size : (i + 1) * block_size])
        out.append(parent)
    return out


def replica_devices(num_replicas: int, ranks: int) -> list[str]:
    """Each replica's ``CUDA_VISIBLE_DEVICES``: consecutive groups of ``ranks`` devices among
    those visible here (ValueError when there are not enough)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None and visible.strip():
        ids = [d.strip() for d in visible.split(",") if d.strip()]
    else:
        ids = [str(i) for i in range(torch.cuda.device_count())]
    need = num_replicas * ranks
    if len(ids) < need:
        raise ValueError(
            f"data_parallel_size={num_replicas} replicas of {ranks} rank(s) each need {need} "
            f"CUDA devices, {len(ids)} are visible"
        )
    return [",".join(ids[i * ranks : (i + 1) * ranks]) for i in range(num_replicas)]


class ReplicatedLLM:
    """N engine replicas with ``AsyncLLM``'s interface (see the module docstring for dispatch).

    The replicas count as one server: it is ready when every replica is, and healthy only while
    every replica is (one dead replica makes ``is_healthy`` False and ``dead_reason`` name it,
    and ``on_dead`` is called once), as a client of one server would expect; the server then
    exits and is restarted whole."""

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
        affinity_slack: int = AFFINITY_SLACK,
        max_prefix_entries: int = MAX_PREFIX_ENTRIES,
    ) -> None:
        self.config: EngineConfig = engine_args.create_engine_config()
        pc = self.config.parallel_config
        n = pc.num_replicas
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            raise ValueError(
                f"data_parallel_size={n} under an external launcher (RANK/WORLD_SIZE set, e.g. "
                "torchrun) is not supported: let tandem start the replicas' ranks"
            )
        envs: list[dict[str, str]] = [{} for _ in range(n)]
        if self.config.device.type == "cuda":
            for env, devices in zip(envs, replica_devices(n, pc.ranks_per_node), strict=True):
                env["CUDA_VISIBLE_DEVICES"] = devices
        self.tokenizer = load_tokenizer(self.config.model_config.tokenizer)
        self.on_dead = on_dead
        self.affinity_slack = affinity_slack
        self.max_prefix_entries = max_prefix_entries
        one = dataclasses.replace(engine_args, data_parallel_size=1)
        self.replicas = [
            AsyncLLM(
                one,
                ready_timeout_s=ready_timeout_s,
                heartbeat_timeout_s=heartbeat_timeout_s,
                heartbeat_interval_s=heartbeat_interval_s,
                stats_sink=stats_sink,
                on_dead=lambda reason, i=i: self._replica_died(i, reason),
                log_level=log_level,
                tokenizer=self.tokenizer,
                env=envs[i],
                process_name=f"tandem-engine-{i}",
            )
            for i in range(n)
        ]
        self.info: EngineInfo | None = None
        self._dead_reported = False
        self._sent = [0] * n  # requests dispatched to each replica, for tie-breaks
        self._prefix_owner: OrderedDict[bytes, int] = OrderedDict()  # prefix hash -> replica

    # -------------------------------------------------------------- lifecycle

    @property
    def num_replicas(self) -> int:
        return len(self.replicas)

    @property
    def max_model_len(self) -> int:
        # What every replica serves (under --max-model-len auto each fits its own KV cache).
        return min(r.max_model_len for r in self.replicas)

    @property
    def is_ready(self) -> bool:
        return all(r.is_ready for r in self.replicas)

    @property
    def is_healthy(self) -> bool:
        return all(r.is_healthy for r in self.replicas)

    @property
    def dead_reason(self) -> str | None:
        for i, r in enumerate(self.replicas):
            if r.dead_reason is not None:
                return f"replica {i}: {r.dead_reason}"
        return None

    @property
    def num_in_flight(self) -> int:
        return sum(r.num_in_flight for r in self.replicas)

    @property
    def replica_stats(self) -> list[EngineStats | None]:
        return [r.stats for r in self.replicas]

    def launch(self) -> None:
        """Spawn every replica's engine process (returns at once; ``start`` waits)."""
        for r in self.replicas:
            r.launch()

    async def start(self) -> EngineInfo:
        """Wait until every replica has warmed up; raises naming the first that failed."""
        results = await asyncio.gather(*(r.start() for r in self.replicas), return_exceptions=True)
        for i, result in enumerate(results):
            if isinstance(result, BaseException):
                raise EngineDeadError(f"replica {i}: {result}") from result
        info = results[0]
        assert isinstance(info, EngineInfo)
        self.info = info
        return info

    def shutdown(self, timeout_s: float = 10.0) -> None:
        """Stop every replica (each politely first, then by force)."""
        for r in self.replicas:
            r.shutdown(timeout_s)

    def _replica_died(self, index: int, reason: str) -> None:
        if self._dead_reported or self.on_dead is None:
            return
        self._dead_reported = True
        self.on_dead(f"replica {index}: {reason}")

    # -------------------------------------------------------------- requests

    def add_requests(self, items: Sequence[tuple[str, Prompt, SamplingParams]]) -> RequestGroup:
        """Validate the group, then submit it whole to the replica ``choose`` picks."""
        reason = self.dead_reason
        if reason is not None:
            raise EngineDeadError(f"the engine is not running: {reason}")
        if not self.is_ready:
            raise EngineNotReadyError("the engine is still starting; retry shortly")
        requests = self.replicas[0].process(items)
        return self.replicas[self.choose(requests)].submit(requests)

    def check_grammar(self, params: SamplingParams) -> None:
        """``AsyncLLM.check_grammar`` (replica 0 validates every group)."""
        self.replicas[0].check_grammar(params)

    def choose(self, requests: Sequence[Request]) -> int:
        """The replica for one group, remembering its prefixes there (module docstring)."""
        loads = [r.num_in_flight for r in self.replicas]
        fits = [
            load + len(requests) <= r.max_in_flight
            for load, r in zip(loads, self.replicas, strict=True)
        ]
        least = min(range(self.num_replicas), key=lambda i: (not fits[i], loads[i], self._sent[i]))
        info = self.replicas[0].info
        block_size = info.block_size if info is not None else 16
        chains = [prefix_hashes(r.prompt_token_ids, block_size, ROUTING_BLOCKS) for r in requests]
        owner, depth = None, 0
        for chain in chains:  # the longest remembered prefix of any prompt in the group
            for d in range(len(chain), depth, -1):
                hit = self._prefix_owner.get(chain[d - 1])
                if hit is not None:
                    owner, depth = hit, d
                    break
        choice = least
        if owner is not None and fits[owner] and loads[owner] - loads[least] <= self.affinity_slack:
            choice = owner
        for chain in chains:
            for h in chain:
                self._prefix_owner[h] = choice
                self._prefix_owner.move_to_end(h)
        while len(self._prefix_owner) > self.max_prefix_entries:
            self._prefix_owner.popitem(last=False)
        self._sent[choice] += len(requests)
        return choice

    def abort(self, request_ids: str | list[str]) -> None:
        """Abort these requests on whichever replica runs them."""
        for r in self.replicas:
            r.abort(request_ids)  # each ignores ids it does not track

    def abort_all(self, reason: str) -> int:
        """Abort every request in flight on every replica; returns how many."""
        return sum(r.abort_all(reason) for r in self.replicas)


def make_engine_client(engine_args: EngineArgs, **kwargs: Any) -> EngineClient:
    """``ReplicatedLLM`` when ``engine_args`` asks for data-parallel replicas, else ``AsyncLLM``
    (also for ``-dp N`` with attention DP: there it means ADP within one engine)."""
    replicas = engine_args.data_parallel_size
    if replicas > 1 and not engine_args.enable_attention_dp:
        return ReplicatedLLM(engine_args, **kwargs)
    return AsyncLLM(engine_args, **kwargs)
