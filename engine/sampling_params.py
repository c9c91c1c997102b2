"""Per-request sampling parameters, validated on construction."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.structured_output import StructuredSpec

MAX_LOGPROBS = 20
# The smallest normal float32 (the sampler computes in float32; a smaller penalty becomes 0,
# and 0 times a grammar's masked -inf is NaN).
MIN_REPETITION_PENALTY = 1.1754943508222875e-38
# OpenAI's range for a logit_bias value.
MAX_LOGIT_BIAS = 100.0


@dataclass
class SamplingParams:
    """How to sample one request. ``temperature == 0`` is greedy (argmax)."""

    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    seed: int | None = None
    max_tokens: int | None = 16
    min_tokens: int = 0
    stop: list[str] | str | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    # Token id -> value added to its logit before the penalties (OpenAI's logit_bias).
    logit_bias: dict[int, float] | None = None
    logprobs: int | None = None
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # False: no output text (token ids only; the text stays "" and nothing is decoded), as
    # vLLM's; stop strings need the text, so they are refused without it.
    detokenize: bool = True
    # Constrained generation (JSON schema, regex, ...): see engine/structured_output.py.
    structured: StructuredSpec | None = None
    # Disaggregated serving: {"do_remote_decode": true} on a prefill instance (hand the request
    # over after its first token), or the prefill instance's answer on a decode instance.
    kv_transfer: dict[str, Any] | None = None
    stop_strings: list[str] = field(init=False, default_factory=list)

    def __post_init__(self) -> None:
        def bad(name: str, value: object, allowed: str) -> ValueError:
            return ValueError(f"{name}={value!r} is invalid: {allowed}")

        if not isinstance(self.n, int) or self.n < 1:
            raise bad("n", self.n, "must be an integer >= 1")
        if self.temperature < 0:
            raise bad("temperature", self.temperature, "must be >= 0")
        if not 0 < self.top_p <= 1:
            raise bad("top_p", self.top_p, "must be in (0, 1]")
        if not isinstance(self.top_k, int) or not -1 <= self.top_k <= 2**31 - 1:
            raise bad("top_k", self.top_k, "must be -1 or 0 (disabled) or a positive integer")
        if not 0 <= self.min_p < 1:
            raise bad("min_p", self.min_p, "must be in [0, 1)")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise bad("max_tokens", self.max_tokens, "must be at least 1")
        if self.min_tokens < 0 or (
            self.max_tokens is not None and self.min_tokens > self.max_tokens
        ):
            raise bad("min_tokens", self.min_tokens, "must be in [0, max_tokens]")
        if not -2 <= self.presence_penalty <= 2:
            raise bad("presence_penalty", self.presence_penalty, "must be in [-2, 2]")
        if not -2 <= self.frequency_penalty <= 2:
            raise bad("frequency_penalty", self.frequency_penalty, "must be in [-2, 2]")
        if not MIN_REPETITION_PENALTY <= self.repetition_penalty <= 10:
            raise bad(
                "repetition_penalty",
                self.repetition_penalty,
                "must be in (0, 10] and at least 1.2e-38 (the sampler's float32 holds no "
                "smaller positive number: it would be 0)",
            )
        self.logit_bias = _check_logit_bias(self.logit_bias, bad)
        if self.logprobs is not None and not 0 <= self.logprobs <= MAX_LOGPROBS:
            raise bad("logprobs", self.logprobs, f"must be in [0, {MAX_LOGPROBS}]")
        if self.seed is not None and not isinstance(self.seed, int):
            raise bad("seed", self.seed, "must be an integer")
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if any(not isinstance(s, str) or not s for s in stop):
            raise bad("stop", self.stop, "stop strings must be non-empty strings")
        if stop and not self.detokenize:
            raise bad("stop", self.stop, "stop strings need detokenize=True (they match text)")
        self.stop_strings = stop
        ids = list(self.stop_token_ids or [])
        if any(not isinstance(t, int) or t < 0 for t in ids):
            raise bad("stop_token_ids", self.stop_token_ids, "must be non-negative integers")
        self.stop_token_ids = ids
        if self.structured is not None and not isinstance(self.structured, StructuredSpec):
            raise bad("structured", self.structured, "must be a StructuredSpec or None")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def uses_penalties(self) -> bool:
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def child(self, index: int) -> SamplingParams:
        """Parameters of sample ``index`` of an ``n > 1`` request (distinct seeds)."""
        import dataclasses

        seed = None if self.seed is None else self.seed + index
        kw = {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.init}
        kw.update(n=1, seed=seed)
        return SamplingParams(**kw)


def _check_logit_bias(bias: object, bad: Any) -> dict[int, float] | None:
    """``logit_bias`` as {token id: value} (None when empty); ids are checked against the
    vocabulary where it is known (the input processor)."""
    if not bias:
        return None
    if not isinstance(bias, dict):
        raise bad("logit_bias", bias, "must map token ids to numbers")
    out: dict[int, float] = {}
    for token, value in bias.items():
        if isinstance(token, bool) or not isinstance(token, int) or token < 0:
            raise bad("logit_bias", bias, f"key {token!r} is not a token id")
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
        ):
            raise bad("logit_bias", bias, f"the value of token {token} is not a number")
        if not -MAX_LOGIT_BIAS <= value <= MAX_LOGIT_BIAS:
            raise bad(
                "logit_bias", bias, f"values must be in [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
            )
        out[token] = float(value)
    return out
