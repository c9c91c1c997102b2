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

The engine also shortens the step's draft loop to the deepest draft any of its requests may
verify (any length on CPUs; where graphs run, rounded up to a K they were captured for), so
drafts nobody verifies are not drawn. The rule only chooses how many drafts are drawn and verified: what is emitted is decided
by verification, so output is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

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
