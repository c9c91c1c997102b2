"""Per-request draft length from the request's own acceptance (``"adaptive": true``).

Each request keeps a running estimate of its drafts' acceptance per position (accepted drafts
over draft positions reached, both decayed by ``DECAY`` a verification, so the estimate follows
the text as it changes). Draft position j pays when the chance of reaching and accepting it,
``rate ** j``, is worth what one more draft position costs the step: ``cost``, a share of a plain
decode step (``POSITION_COST``: measured on a 2-core CPU with the built-in model at batch 1, an
Eagle3 step with K = 3 costs 1.38x a plain step and one that verifies fewer of the same drafts
nearly as much, so most of the cost is fixed and a draft position adds about 0.05 of a plain
step; an n-gram's position adds only its verify row). The request verifies the deepest such
position, at least one and at most the step's K. A request whose estimate falls below ``cost``
(not even the first position pays) stops drafting for ``PAUSE_STEPS`` steps, then probes again
with one draft.
Simulated on chains that accept each position with a fixed probability (0.1 to 0.8, a position
costing 0.15), this gave as many tokens per unit of step cost as a fixed K of 3, or more.

With ``"cost_aware": true`` the engine also measures its decode steps (``StepCosts``): per
batch size (rounded up to a power of two), the seconds a step with drafts and a step without
cost per request (each from its start to the next step's: the outputs and detokenizing that a
token costs besides the forward count too), and the tokens a request emits per verification of
its drafts; it runs a step without drafts wherever plain decoding measured more tokens per
second, probing the other choice for ``PROBE_STEPS`` steps every ``PROBE_EVERY`` steps of a
batch size. Measured tokens, not ``rate ** j``: the per-position estimate above ranks positions
well but misjudges a whole step's yield when acceptance comes in runs (the shipped Eagle3 head:
an estimate of 0.3-0.4 a position, 1.84 tokens a step). So where speculation does not pay (a
compute-bound step, drafts that miss) it costs only the probes.

With ``"confidence_threshold": c`` (EAGLE-2's idea on a chain) the draft loop also keeps each
draft's running product of the head's own probabilities, and a request verifies only the drafts
whose product is at least c: a sure head drafts deep, an unsure one verifies few rows (on a CPU
the loop stops once no request's product reaches c). The rate rule above then only pauses a
request whose drafts stopped paying; the loop runs up to K.

The engine also shortens the step's draft loop to the deepest draft any of its requests may
verify (any length on CPUs; where graphs run, rounded up to a K they were captured for), so
drafts nobody verifies are not drawn. The rule only chooses how many drafts are drawn and verified: what is emitted is decided
by verification, so output is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PAUSE_STEPS = 8  # steps a stopped request decodes without drafts before it probes again
DECAY = 0.9  # weight of the past in the running acceptance, per verification
PRIOR_RATE = 0.6  # the acceptance per position assumed before the first verification
PRIOR_WEIGHT = 1.0  # ... worth this many draft positions
# A draft position's cost as a share of a plain decode step: drafted by a head (its draft
# forward and its verify row) or by the engine (n-gram lookup: the verify row only).
POSITION_COST = {"model": 0.05, "engine": 0.02}


def best_depth(rate: float, cost: float, k: int) -> int:
    """The deepest position j <= ``k`` whose chance ``rate ** j`` is at least ``cost`` (at least
    1 where ``k`` >= 1: a request probes even when its drafts rarely pay)."""
    depth = 1
    while depth < k and rate ** (depth + 1) >= cost:
        depth += 1
    return min(depth, k)


@dataclass
class AdaptiveDepth:
    """One request's state: the drafts to verify next (``depth``), its running acceptance per
    position (``accepted`` / ``reached``, decayed) and the steps left in a pause."""

    depth: int
    cost: float = POSITION_COST["model"]
    max_depth: int = 0  # the configured K (0: ``depth`` at creation)
    # confidence_threshold: the head's confidence cuts each step's drafts, so the request
    # drafts up to K whenever it does not pause.
    by_confidence: bool = False
    accepted: float = PRIOR_RATE * PRIOR_WEIGHT
    reached: float = PRIOR_WEIGHT
    paused: int = 0

    def __post_init__(self) -> None:
        self.max_depth = self.max_depth or self.depth

    @property
    def rate(self) -> float:
        return self.accepted / self.reached

    def update(self, verified: int, accepted: int, k: int) -> int:
        """After a step that verified ``verified`` drafts and accepted ``accepted``: the drafts
        the request verifies next step (at most ``k``, the step's K)."""
        if self.paused > 0:
            self.paused -= 1
            self.depth = 1 if self.paused == 0 else 0
        elif verified > 0:
            # A chain is verified up to its first rejection: the positions reached are the
            # accepted ones and the rejected one after them (none after a fully accepted chain).
            reached = accepted + (1 if accepted < verified else 0)
            self.accepted = DECAY * self.accepted + accepted
            self.reached = DECAY * self.reached + reached
            if self.rate < self.cost:  # not even the first position pays
                self.paused, self.depth = PAUSE_STEPS, 0
            elif self.by_confidence:
                self.depth = self.max_depth
            else:
                self.depth = best_depth(self.rate, self.cost, self.max_depth)
        return min(self.depth, k)


def loop_depth(states: list[AdaptiveDepth | None], k_step: int, captured: tuple[int, ...]) -> int:
    """The draft steps a step runs for ``states`` (its requests'; None: a request without one
    yet, which may verify K): one past the deepest any of them verifies now (each may go one
    deeper after this step's verification), rounded up to a ``captured`` length, at most
    ``k_step``; 0 when every request pauses."""
    deepest = max((s.depth + 1 if s is not None else k_step for s in states), default=0)
    if deepest == 0 or all(s is not None and s.paused > 1 for s in states):
        return 0
    up = min((k for k in captured if k >= deepest), default=max(captured, default=k_step))
    return min(up, k_step)


PROBE_EVERY = 64  # steps of a batch size between probes of the choice not taken
PROBE_STEPS = 4  # a probe's steps: the first changes what is verified, the others are timed
MEMORY = 16.0  # timed steps the running estimates remember (sums decayed by 1 - 1 / MEMORY)
YIELD_MEMORY = 256.0  # verifications the tokens-per-verification estimate remembers
MIN_TIMED = 3  # timed steps of each choice before the rule compares them
MAX_JUMP = 3.0  # a timing counts for at most this many times the estimate (a stall, a GC)
MARGIN = 1.05  # the choice changes only for this much more tokens per second


def batch_bucket(batch_size: int) -> int:
    """Batch sizes share timings up to the next power of two (1, 2, 4, 8, ...)."""
    return 1 << max(0, batch_size - 1).bit_length()


@dataclass
class StepCosts:
    """The ``"cost_aware"`` choice between a step's drafts and none (module docstring): the
    seconds a request of a decode step costs, by (batch bucket, drafts: 1 or 0), and the tokens
    a request emits per verification of its drafts, as decayed running means. A drafted step's
    yield is ``1 + accepted`` of its verifications (whatever the draft length the per-request
    rule gave them, counted over every verification, so it is steady long before the timings
    are); a plain step's is one token. A step is timed only when it and the step before it were
    decode steps of the same bucket and choice (the first step after a change verifies the old
    choice's drafts and pays the paused steps' draft KV). The choice changes only for
    ``MARGIN`` more tokens per second, so near a tie it does not flip on noise."""

    # [seconds, steps] decayed, and the steps timed
    sums: dict[tuple[int, int], list[float]] = field(default_factory=dict)
    tokens: list[float] = field(default_factory=lambda: [0.0, 0.0])  # [tokens, verifications]
    choice: dict[int, int] = field(default_factory=dict)  # bucket -> 0 (plain) or 1 (drafts)
    since_probe: dict[int, int] = field(default_factory=dict)
    probe: tuple[int, int, int] | None = None  # (bucket, draft length, steps left)
    last: tuple[int, int] | None = None  # the previous step's (bucket, drafts)

    def seconds(self, key: tuple[int, int]) -> float | None:
        """Seconds a request of a step at ``key`` (None: not timed)."""
        s = self.sums.get(key)
        return None if s is None else s[0] / s[1]

    def tokens_per_verification(self) -> float | None:
        t = self.tokens
        return None if t[1] == 0 else t[0] / t[1]

    def _timed(self, key: tuple[int, int]) -> bool:
        s = self.sums.get(key)
        return s is not None and s[2] >= MIN_TIMED

    def choose(self, batch_size: int, k: int) -> int:
        """The step's draft length: ``k`` (its drafts) or 0 (none)."""
        bucket = batch_bucket(batch_size)
        if self.probe is not None and self.probe[0] == bucket:
            _, choice, left = self.probe
            self.probe = (bucket, choice, left - 1) if left > 1 else None
            return min(choice, k)
        yield_ = self.tokens_per_verification()
        if not self._timed((bucket, 1)) or yield_ is None:
            return k  # timed (and verified) as it runs
        if not self._timed((bucket, 0)):
            return self._start_probe(bucket, 0)
        spec_seconds, plain_seconds = self.seconds((bucket, 1)), self.seconds((bucket, 0))
        assert spec_seconds is not None and plain_seconds is not None
        spec, plain = yield_ / spec_seconds, 1.0 / plain_seconds
        drafts = self.choice.get(bucket, 1)
        if drafts and plain > MARGIN * spec:
            drafts = 0
        elif not drafts and spec > MARGIN * plain:
            drafts = 1
        self.choice[bucket] = drafts
        n = self.since_probe.get(bucket, 0) + 1
        self.since_probe[bucket] = n
        if n >= PROBE_EVERY:
            return self._start_probe(bucket, 0 if drafts else k)
        return k if drafts else 0

    def _start_probe(self, bucket: int, choice: int) -> int:
        self.since_probe[bucket] = 0
        if PROBE_STEPS > 1:
            self.probe = (bucket, choice, PROBE_STEPS - 1)
        return choice

    def verified(self, accepted: int) -> None:
        """A request verified its drafts and accepted ``accepted`` of them."""
        keep = 1.0 - 1.0 / YIELD_MEMORY
        self.tokens[0] = keep * self.tokens[0] + 1.0 + accepted
        self.tokens[1] = keep * self.tokens[1] + 1.0

    def record(self, batch_size: int, k: int, seconds: float, decode: bool) -> None:
        """A step of ``batch_size`` requests with a draft loop of ``k`` took ``seconds``;
        ``decode``: every request decoded (no prompt rows)."""
        key = (batch_bucket(batch_size), 1 if k else 0)
        steady, self.last = decode and self.last == key, key if decode else None
        if not steady:
            return
        per_request = seconds / batch_size
        s = self.sums.get(key)
        if s is None:
            self.sums[key] = [per_request, 1.0, 1.0]
            return
        per_request = min(per_request, MAX_JUMP * s[0] / s[1])
        keep = 1.0 - 1.0 / MEMORY
        s[0], s[1], s[2] = keep * s[0] + per_request, keep * s[1] + 1.0, s[2] + 1.0
