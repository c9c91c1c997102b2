"""Executors run a step on every rank and return rank 0's sampled tokens.

``UniProcExecutor`` runs the single rank in-process. Multi-rank executors keep the same
interface: the engine never knows how many ranks there are.
"""

from __future__ import annotations

from engine.config import EngineConfig
from engine.model_runner import StepInput, StepOutput
from engine.worker import Worker


class Executor:
    num_blocks: int

    def execute(self, step: StepInput) -> StepOutput:
        raise NotImplementedError

    def check_health(self) -> None:
        """Raise if a rank is gone."""

    def shutdown(self) -> None:
        pass


class UniProcExecutor(Executor):
    def __init__(self, config: EngineConfig) -> None:
        self.worker = Worker(config)
        self.num_blocks = self.worker.num_blocks

    def execute(self, step: StepInput) -> StepOutput:
        return self.worker.execute(step)


def make_executor(config: EngineConfig) -> Executor:
    if config.parallel_config.tensor_parallel_size > 1:
        raise ValueError(
            "tensor_parallel_size > 1 is not supported yet; run with tensor_parallel_size=1"
        )
    return UniProcExecutor(config)
