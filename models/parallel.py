"""Parallel mapping and the collectives that parallel layers use.

The mapping is filled in by the engine (one per rank) and read by layers at construction time.
With ``tp_size == 1`` every collective is the identity, so single-rank code pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelMapping:
    """Where this rank sits: tensor-parallel rank and size, attention-DP switch."""

    tp_size: int = 1
    tp_rank: int = 0
    enable_attention_dp: bool = False
    enable_lm_head_tp_in_adp: bool = False
    group: object | None = None  # torch.distributed ProcessGroup for tensors; None = WORLD

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(
                f"invalid parallel mapping: tp_rank={self.tp_rank} tp_size={self.tp_size}"
            )

    @property
    def is_first_rank(self) -> bool:
        return self.tp_rank == 0

    @property
    def attn_tp_size(self) -> int:
        """Ranks that split attention heads: 1 under attention DP (each rank owns its requests)."""
        return 1 if self.enable_attention_dp else self.tp_size

    @property
    def attn_tp_rank(self) -> int:
        return 0 if self.enable_attention_dp else self.tp_rank


def divide(n: int, d: int, what: str) -> int:
    if n % d != 0:
        raise ValueError(f"{what}={n} is not divisible by the tensor-parallel size {d}")
    return n // d


def all_reduce(x: torch.Tensor, mapping: ParallelMapping) -> torch.Tensor:
    if mapping.tp_size == 1:
        return x
    dist.all_reduce(x, group=mapping.group)
    return x


def all_gather_last_dim(x: torch.Tensor, mapping: ParallelMapping) -> torch.Tensor:
    """Concatenate each rank's shard along the last dimension (rank order)."""
    if mapping.tp_size == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(mapping.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=mapping.group)
    return torch.cat(parts, dim=-1)
