"""Test-only fault injection for the engine process.

``TANDEM_TEST_FAULTS`` is read by the engine process only (``run_engine_core``), never by the
HTTP layer, and nothing a client sends can set it; it exists so that tests can make a real
server's engine fail. Never set it in production. It lists faults as ``ACTION@STEP`` items,
comma-separated, e.g. ``raise@3,hang@9``:

- ``raise@N``: step N raises ``InjectedFault``; the loop fails that step's requests and goes on.
- ``fatal@N``: step N raises and the executor's health check fails from then on, as after a lost
  rank: the engine reports itself dead and its process exits non-zero.
- ``hang@N``: step N never returns, as a stuck kernel or collective would; the API process's
  heartbeat check must notice.

Steps count executor calls that run at least one request, from 1, after warm-up.
"""

from __future__ import annotations

import logging
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

logger = logging.getLogger(__name__)

ENV_VAR = "TANDEM_TEST_FAULTS"
ACTIONS = ("raise", "fatal", "hang")


class InjectedFault(RuntimeError):
    """The failure a test asked for."""


@dataclass
class FaultPlan:
    faults: dict[int, str]  # step number -> action
    steps: int = 0  # steps run so far
    broken: bool = False  # a fatal fault fired: health checks fail from now on
    _parent_pid: int = field(default_factory=os.getppid)

    @classmethod
    def parse(cls, text: str) -> FaultPlan:
        faults: dict[int, str] = {}
        for item in filter(None, (part.strip() for part in text.split(","))):
            action, _, step = item.partition("@")
            if action not in ACTIONS or not step.isdigit() or int(step) < 1:
                raise ValueError(
                    f"{ENV_VAR}: bad item {item!r}; expected ACTION@STEP with ACTION one of "
                    f"{ACTIONS} and STEP >= 1, e.g. 'raise@3,hang@9'"
                )
            faults[int(step)] = action
        return cls(faults)

    @classmethod
    def from_env(cls, environ: Mapping[str, str] = os.environ) -> FaultPlan | None:
        text = environ.get(ENV_VAR, "").strip()
        return cls.parse(text) if text else None

    def before_step(self) -> None:
        self.steps += 1
        action = self.faults.get(self.steps)
        if action is None:
            return
        logger.warning("%s: injecting %r at step %d", ENV_VAR, action, self.steps)
        if action == "hang":
            while os.getppid() == self._parent_pid:  # never outlive the API process
                time.sleep(0.5)
            os._exit(1)
        if action == "fatal":
            self.broken = True
        raise InjectedFault(f"injected fault ({action}) at step {self.steps}")

    def check_health(self) -> None:
        if self.broken:
            raise InjectedFault("injected: the engine state is lost")

    def install(self, engine: Any) -> None:
        """Wrap ``engine.executor``'s ``execute`` and ``check_health`` (this instance only)."""
        executor = engine.executor
        execute, check_health = executor.execute, executor.check_health

        def faulty_execute(step: Any) -> Any:
            parts = getattr(step, "steps", [step])  # attention DP: one StepInput per rank
            if any(part.requests for part in parts):
                self.before_step()
            return execute(step)

        def faulty_check_health() -> None:
            self.check_health()
            check_health()

        executor.execute = faulty_execute
        executor.check_health = faulty_check_health
        logger.warning("%s is set: TEST-ONLY fault injection is active: %s", ENV_VAR, self.faults)
