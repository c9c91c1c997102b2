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
    # Expert parallelism (models/expert_parallel.py): under attention DP, rows go to the ranks
    # holding their experts (all-to-all) instead of every rank; experts are placed whole over
    # the TP group either way. ``num_redundant_experts``: extra physical copies per MoE layer.
    enable_expert_parallel: bool = False
    num_redundant_experts: int = 0
    enable_eplb: bool = False  # MoE layers count their routed loads and can be rebalanced
    eplb_window_size: int = 1  # engine steps whose loads a rebalance reads

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

    @property
    def attn_mapping(self) -> ParallelMapping:
        """The mapping attention, embedding and LM head are built with: this one without
        attention DP, a single-rank (replicated) one under it."""
        if not self.enable_attention_dp:
            return self
        return ParallelMapping(group=self.group)

    @property
    def ep_dispatch(self) -> bool:
        """MoE rows dispatched all-to-all to their experts' ranks (attention DP + EP)."""
        return self.enable_expert_parallel and self.uses_adp_collectives

    @property
    def uses_adp_collectives(self) -> bool:
        """Attention DP over more than one rank: MLPs run on every rank's tokens."""
        return self.enable_attention_dp and self.tp_size > 1


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


def adp_all_gather_rows(
    x: torch.Tensor, all_rank_num_tokens: list[int], mapping: ParallelMapping
) -> torch.Tensor:
    """Attention DP: every rank's rows, each rank's block padded to ``max(all_rank_num_tokens)``;
    [tp * max, ...]. ``all_rank_num_tokens`` is host data every rank knows, so the collective is
    sized identically everywhere (a rank with fewer rows pads)."""
    n = all_rank_num_tokens[mapping.tp_rank]
    if x.shape[0] != n:
        raise RuntimeError(
            f"rank {mapping.tp_rank} has {x.shape[0]} rows but all_rank_num_tokens says {n}"
        )
    pad = max(all_rank_num_tokens)
    if n < pad:
        x = torch.cat([x, x.new_zeros((pad - n, *x.shape[1:]))])
    parts = [torch.empty_like(x) for _ in range(mapping.tp_size)]
    dist.all_gather(parts, x.contiguous(), group=mapping.group)
    return torch.cat(parts)


def adp_reduce_own_rows(
    x: torch.Tensor, all_rank_num_tokens: list[int], mapping: ParallelMapping
) -> torch.Tensor:
    """Sum the partial outputs of ``adp_all_gather_rows``'s rows over the ranks and keep this
    rank's segment (gloo has no reduce-scatter for every dtype: all-reduce, then slice)."""
    dist.all_reduce(x, group=mapping.group)
    pad = max(all_rank_num_tokens)
    start = mapping.tp_rank * pad
    return x[start : start + all_rank_num_tokens[mapping.tp_rank]]


def adp_lm_head_tp_argmax(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    all_rank_num_rows: list[int],
    mapping: ParallelMapping,
) -> torch.Tensor:
    """LM-head TP under attention DP, greedy: argmax over the vocabulary of ``hidden @ weight.T``
    for this rank's rows, [n] int64. Hidden rows are all-gathered (padded to the max count), each
    rank computes its vocabulary shard's logits for all of them, and only (max, index) pairs are
    exchanged; ties resolve to the lowest index, like ``argmax``. ``weight`` is the full
    (replicated) head; this rank reads its shard ``[rank * ceil(V / tp), ...)``."""
    vocab = weight.shape[0]
    shard = -(-vocab // mapping.tp_size)
    start = min(vocab, mapping.tp_rank * shard)
    end = min(vocab, start + shard)
    rows = adp_all_gather_rows(hidden, all_rank_num_rows, mapping)  # [tp * max, H]
    if end > start:
        local = torch.nn.functional.linear(rows, weight[start:end]).float()  # [tp * max, shard]
        best, idx = local.max(dim=-1)
        pairs = torch.stack([best.double(), (idx + start).double()], dim=-1)
    else:  # a rank past the end of a small vocabulary holds no shard
        pairs = rows.new_zeros((rows.shape[0], 2), dtype=torch.float64)
        pairs[:, 0] = float("-inf")
    parts = [torch.empty_like(pairs) for _ in range(mapping.tp_size)]
    dist.all_gather(parts, pairs.contiguous(), group=mapping.group)
    stacked = torch.stack(parts)  # [tp, tp * max, 2]: shards in vocabulary order
    winner = stacked[..., 0].argmax(dim=0)  # first (lowest-index) shard on ties
    ids = stacked[..., 1].gather(0, winner[None]).squeeze(0).long()
    pad = max(all_rank_num_rows)
    own = mapping.tp_rank * pad
    return ids[own : own + all_rank_num_rows[mapping.tp_rank]]


def all_ranks_true(flag: bool, mapping: ParallelMapping, device: torch.device) -> bool:
    """AND of a boolean over the tensor-parallel group (one all-gather of one element)."""
    if mapping.tp_size == 1:
        return flag
    local = torch.tensor([int(flag)], dtype=torch.int32, device=device)
    parts = [torch.empty_like(local) for _ in range(mapping.tp_size)]
    dist.all_gather(parts, local, group=mapping.group)
    return bool(torch.cat(parts).min().item())
