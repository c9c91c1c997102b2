"""What the engine returns to callers (offline API and server)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from tandem.engine.request import SpecStats, TokenLogprobs
from tandem.engine.structured_output import Histogram


@dataclass
class CompletionOutput:
    index: int
    token_ids: list[int]
    text: str
    finish_reason: str | None = None  # "stop" | "length" | "abort" | None while running
    stop_reason: int | str | None = None  # the stop string or stop token that ended it
    logprobs: list[TokenLogprobs] | None = None


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    num_cached_tokens: int = 0
    metrics: dict[str, float] = field(default_factory=dict)
    spec_stats: SpecStats | None = None  # speculative decoding counts, when speculating
    kv_transfer_params: dict[str, Any] | None = None  # a prefill instance's hand-over


@dataclass(frozen=True)
class RequestFailure:
    """A request that ended with an error: ``param`` names the request field at fault (its
    grammar: ``response_format``, ``structured_outputs``, ``tool_choice``...), the client's to
    fix; None for a fault of the server's."""

    request_id: str
    message: str
    param: str | None = None


@dataclass
class EngineStats:
    num_running: int
    num_waiting: int
    num_kv_blocks: int
    num_used_kv_blocks: int
    kv_cache_usage: float
    num_preemptions: int
    prompt_tokens: int
    generation_tokens: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    spec_num_drafts: int = 0  # verification steps that had drafts (dummies never count)
    spec_num_draft_tokens: int = 0
    spec_num_accepted_tokens: int = 0
    spec_accepted_per_pos: list[int] = field(default_factory=list)
    spec_method: str = ""  # the speculative_config's method ("": no speculation)
    # Engine steps by the number of drafts they proposed per request (the K a schedule gave the
    # step's batch size; 0: paused), whatever the room left cut.
    spec_steps_by_draft_len: dict[int, int] = field(default_factory=dict)
    # The same two counts for grammar-constrained requests only (their acceptance rate).
    spec_constrained_draft_tokens: int = 0
    spec_constrained_accepted_tokens: int = 0
    # Structured output, cumulative histograms (seconds): grammar compile time per grammar,
    # bitmask time per step that had constrained requests.
    grammar_compile_time: Histogram | None = None
    grammar_mask_time: Histogram | None = None
    # Expert load balancing (--enable-eplb): rounds done; at the last, max / mean load per rank
    # under the old placement and the new one.
    eplb_rebalances: int = 0
    eplb_imbalance_before: float = 0.0
    eplb_imbalance_after: float = 0.0


# ------------------------------------------------------------------ the engine process's queue


@dataclass
class OutputDelta:
    """What one step added to a request's output: the form ``RequestOutput`` takes on the queue
    from the engine process. Tokens, text and logprobs replace the cumulative ones from the
    given offsets on (in practice the old length: they only grow); the prompt comes once, in the
    request's first delta. Sending cumulative outputs would resend every token of a long
    generation at every step, quadratic in its length."""

    request_id: str
    finished: bool
    token_start: int
    new_token_ids: list[int]
    text_start: int
    new_text: str
    logprobs_start: int
    new_logprobs: list[TokenLogprobs] | None
    finish_reason: str | None
    stop_reason: int | str | None
    num_cached_tokens: int
    metrics: dict[str, float]
    spec_stats: SpecStats | None
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None  # the first delta only
    kv_transfer_params: dict[str, Any] | None = None


@dataclass
class _Sent:
    num_tokens: int
    text: str
    num_logprobs: int


class OutputEncoder:
    """Engine side: turns each request's cumulative ``RequestOutput`` into an ``OutputDelta``
    against what was sent for it before."""

    def __init__(self) -> None:
        self._sent: dict[str, _Sent] = {}

    def encode(self, out: RequestOutput) -> OutputDelta:
        (c,) = out.outputs  # one completion per engine request; groups are the API's business
        sent = self._sent.get(out.request_id)
        first = sent is None
        if sent is None:
            sent = _Sent(0, "", 0)
        token_start = sent.num_tokens if len(c.token_ids) >= sent.num_tokens else 0
        text_start = len(sent.text) if c.text.startswith(sent.text) else 0
        logprobs = c.logprobs or []
        lp_start = sent.num_logprobs if len(logprobs) >= sent.num_logprobs else 0
        if out.finished:
            self._sent.pop(out.request_id, None)
        else:
            self._sent[out.request_id] = _Sent(len(c.token_ids), c.text, len(logprobs))
        return OutputDelta(
            request_id=out.request_id,
            finished=out.finished,
            token_start=token_start,
            new_token_ids=c.token_ids[token_start:],
            text_start=text_start,
            new_text=c.text[text_start:],
            logprobs_start=lp_start,
            new_logprobs=None if c.logprobs is None else c.logprobs[lp_start:],
            finish_reason=c.finish_reason,
            stop_reason=c.stop_reason,
            num_cached_tokens=out.num_cached_tokens,
            metrics=out.metrics,
            spec_stats=out.spec_stats,
            prompt=out.prompt if first else None,
            prompt_token_ids=out.prompt_token_ids if first else None,
            kv_transfer_params=out.kv_transfer_params,
        )

    def forget(self, request_ids: list[str]) -> None:
        """Requests that end without a finished output (aborted, failed)."""
        for rid in request_ids:
            self._sent.pop(rid, None)


@dataclass
class OutputAssembly:
    """API side: one request's cumulative output, rebuilt from its deltas."""

    prompt: str | None = None
    prompt_token_ids: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)
    text: str = ""
    logprobs: list[TokenLogprobs] | None = None

    def apply(self, delta: OutputDelta) -> RequestOutput:
        if delta.prompt_token_ids is not None:
            self.prompt, self.prompt_token_ids = delta.prompt, delta.prompt_token_ids
        self.token_ids[delta.token_start :] = delta.new_token_ids
        self.text = self.text[: delta.text_start] + delta.new_text
        if delta.new_logprobs is not None:
            if self.logprobs is None:
                self.logprobs = []
            self.logprobs[delta.logprobs_start :] = delta.new_logprobs
        completion = CompletionOutput(
            index=0,
            token_ids=list(self.token_ids),  # a snapshot: consumers may read it a step later
            text=self.text,
            finish_reason=delta.finish_reason,
            stop_reason=delta.stop_reason,
            logprobs=None if self.logprobs is None else list(self.logprobs),
        )
        return RequestOutput(
            request_id=delta.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[completion],
            finished=delta.finished,
            num_cached_tokens=delta.num_cached_tokens,
            metrics=delta.metrics,
            spec_stats=delta.spec_stats,
            kv_transfer_params=delta.kv_transfer_params,
        )
