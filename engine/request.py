"""Request state owned by the scheduler (the engine's view of one sequence)."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field

from tandem.engine.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self in (
            RequestStatus.FINISHED_STOPPED,
            RequestStatus.FINISHED_LENGTH,
            RequestStatus.FINISHED_ABORTED,
        )


@dataclass
class TokenLogprobs:
    """Log-probability of the chosen token and the top-N alternatives (model distribution)."""

    token_id: int
    logprob: float
    top_token_ids: list[int]
    top_logprobs: list[float]


@dataclass
class SpecStats:
    """Speculative-decoding counts. ``num_drafts`` counts verification steps with drafts;
    tokens per step = (accepted + steps) / steps includes the bonus token; the draft acceptance
    rate = accepted / draft tokens. Never mixed up."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_pos: list[int] = field(default_factory=list)

    def record(self, num_drafts: int, num_accepted: int, depth: int | None = None) -> None:
        """One verification step: ``num_drafts`` draft tokens verified (a chain's drafts or a
        tree's nodes), ``num_accepted`` of them accepted; ``accepted_per_pos[d]`` counts steps
        that accepted a token at draft depth d + 1 (a tree's ``depth`` bounds the positions)."""
        if num_drafts == 0:
            return
        self.num_drafts += 1
        self.num_draft_tokens += num_drafts
        self.num_accepted_tokens += num_accepted
        positions = num_drafts if depth is None else min(num_drafts, depth)
        if len(self.accepted_per_pos) < positions:
            self.accepted_per_pos += [0] * (positions - len(self.accepted_per_pos))
        for i in range(num_accepted):
            self.accepted_per_pos[i] += 1

    def merge(self, other: SpecStats) -> None:
        self.num_drafts += other.num_drafts
        self.num_draft_tokens += other.num_draft_tokens
        self.num_accepted_tokens += other.num_accepted_tokens
        n = max(len(self.accepted_per_pos), len(other.accepted_per_pos))
        self.accepted_per_pos += [0] * (n - len(self.accepted_per_pos))
        for i, c in enumerate(other.accepted_per_pos):
            self.accepted_per_pos[i] += c

    @property
    def mean_tokens_per_step(self) -> float:
        return (
            (self.num_accepted_tokens + self.num_drafts) / self.num_drafts
            if self.num_drafts
            else 0.0
        )

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_draft_tokens_per_step(self) -> float:
        """Draft tokens verified per step: K for a chain, the verified tree's size for trees."""
        return self.num_draft_tokens / self.num_drafts if self.num_drafts else 0.0


@dataclass(
    eq=False
)  # one request is equal only to itself: the scheduler's lists compare by identity
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    eos_token_ids: frozenset[int]
    max_tokens: int  # resolved: never past max_model_len
    prompt: str | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    # Sliding-window layers' blocks, one per entry of block_ids (engine/block_manager.py);
    # WINDOW_NULL_BLOCK for those that left the window. Empty: the model has no such layers.
    window_block_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprobs] = field(default_factory=list)
    stop_reason: int | str | None = None
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    num_preemptions: int = 0
    spec_token_ids: list[int] = field(default_factory=list)  # drafts to verify next step
    spec_parents: list[int] = field(default_factory=list)  # draft trees: each draft's parent
    spec_max_depth: int = 0  # draft trees: the deepest of those nodes worth verifying
    # Masked drafting: output tokens already sent to the ranks (they keep their own copy).
    output_tokens_shipped: int = 0
    spec_stats: SpecStats | None = None

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.finished

    @property
    def finish_reason(self) -> str | None:
        if self.status in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH):
            return self.status.value
        if self.status == RequestStatus.FINISHED_ABORTED:
            return "abort"
        return None

    def append_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
