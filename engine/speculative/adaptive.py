"""Per-request draft length from the request's own acceptance (``"adaptive": true``).

A request drafts one more token than its last verification accepted (all accepted: one more,
up to the step's K), so a request whose drafts keep being right drafts deep and one whose drafts
keep failing drafts one. A request whose last ``STOP_AFTER`` verifications with drafts accepted
nothing stops drafting for ``PAUSE_STEPS`` steps (its verify rows cost the target compute for
nothing), then probes again with one draft. The rule only chooses how many of the proposed
drafts are verified: what is emitted is decided by verification, so output is unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

STOP_AFTER = 2  # verifications in a row that accepted nothing
PAUSE_STEPS = 8  # steps a stopped request decodes without drafts before it probes again


@dataclass
class AdaptiveDepth:
    """One request's state: the drafts to verify next (``depth``), the run of verifications
    that accepted nothing, and the steps left in a pause."""

    depth: int
    misses: int = 0
    paused: int = 0

    def update(self, verified: int, accepted: int, k: int) -> int:
        """After a step that verified ``verified`` drafts and accepted ``accepted``: the drafts
        the request verifies next step (at most ``k``, the step's K)."""
        if self.paused > 0:
            self.paused -= 1
            self.depth = 1 if self.paused == 0 else 0
        elif verified > 0:
            self.misses = self.misses + 1 if accepted == 0 else 0
            if self.misses >= STOP_AFTER:
                self.misses, self.paused, self.depth = 0, PAUSE_STEPS, 0
            else:
                self.depth = accepted + 1
        return min(self.depth, k)
