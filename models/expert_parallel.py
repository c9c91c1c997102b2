"""Expert parallelism: where each MoE layer's experts live, and how rows reach them.

**Placement.** A MoE layer of ``E`` logical experts holds ``E + R`` physical experts (``R``:
``num_redundant_experts``), ``(E + R) / ep`` on each of the ``ep`` ranks, rank ``r`` holding
physical slots ``r * n .. r * n + n - 1``. ``ExpertPlacement.slot_logical[p]`` is the logical
expert in slot ``p``; every logical expert has at least one slot. At start, slot ``p < E`` holds
expert ``p`` and the ``R`` extra slots copies of experts ``0 .. R - 1``. The router chooses
logical experts; ``to_physical`` turns each (row, choice) pair into one of its expert's slots,
spreading the pairs of a replicated expert round-robin over its copies.

**Load balancing (EPLB).** Each layer counts the pairs routed to every logical expert (on the
device, no sync), kept per engine step for the last ``eplb_window_size`` steps; every
``eplb_step_interval`` steps the ranks sum the window's counts (one all-reduce per layer), compute a new placement from the measured per-expert loads (``balanced_placement``: the
extra slots go one at a time to the expert with the highest load per copy, then copies are
packed heaviest first onto the least-loaded rank with a free slot), and move the expert weights
that change rank with one ``all_to_all_single`` per weight tensor. Every rank computes the same
placement from the same sums, so no placement is sent. The swap happens between engine steps,
so a step never sees two placements.

**Dispatch.** Under attention DP each rank holds its own rows. ``AllToAllDispatcher`` sends a
row only to the ranks holding at least one of its chosen slots (once per rank, with all its
choices: a rank ignores the choices it does not hold), the ranks run their experts on the rows
they received, and the partial outputs travel back and are summed per row. Variable splits
(the row counts exchanged first) in eager steps; static splits (every rank sends ``max`` rows
to every rank, padded, choices not held masked to -1) where the sizes must not depend on data,
under CUDA-graph capture. A backend is an ``ExpertDispatcher``: another one (DeepEP's kernels)
fits by implementing ``dispatch`` and ``combine``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

import torch
import torch.distributed as dist
from torch import Tensor

__all__ = [
    "AllToAllDispatcher",
    "next_placement",
    "DispatchHandle",
    "ExpertDispatcher",
    "ExpertPlacement",
    "balanced_placement",
    "placement_imbalance",
]


# ---------------------------------------------------------------------------------- placement


def balanced_placement(loads: list[float], num_slots: int, num_ranks: int) -> list[int]:
    """The logical expert of every physical slot (rank-major) for per-expert ``loads``.

    Replicate: each of the ``num_slots - len(loads)`` extra slots goes to the expert with the
    highest load per copy (ties: the lower id). Pack: copies, heaviest (load / copies) first,
    each to the rank with the least load so far among those with a free slot (ties: the lower
    rank). Deterministic: every rank computes the same placement from the same loads."""
    num_experts = len(loads)
    if num_slots < num_experts or num_slots % num_ranks:
        raise ValueError(
            f"{num_slots} physical experts cannot hold {num_experts} experts on {num_ranks} ranks"
        )
    copies = [1] * num_experts
    for _ in range(num_slots - num_experts):
        best = max(range(num_experts), key=lambda e: (loads[e] / copies[e], -e))
        copies[best] += 1
    items = sorted(
        ((loads[e] / copies[e], e) for e in range(num_experts) for _ in range(copies[e])),
        key=lambda item: (-item[0], item[1]),
    )
    per_rank = num_slots // num_ranks
    rank_load = [0.0] * num_ranks
    rank_experts: list[list[int]] = [[] for _ in range(num_ranks)]
    for load, e in items:
        free = [r for r in range(num_ranks) if len(rank_experts[r]) < per_rank]
        r = min(free, key=lambda r: (rank_load[r], r))
        rank_experts[r].append(e)
        rank_load[r] += load
    return [e for experts in rank_experts for e in sorted(experts)]


def next_placement(
    loads: list[float], current: list[int], num_ranks: int
) -> tuple[list[int], float, float]:
    """(placement, imbalance under ``current``, under the placement) for ``loads``: the
    balanced placement where it lowers the imbalance, else ``current`` (greedy packing is not
    optimal: a placement that balances better stays, and no weight moves)."""
    new = balanced_placement(loads, len(current), num_ranks)
    before = placement_imbalance(loads, current, num_ranks)
    after = placement_imbalance(loads, new, num_ranks)
    if after >= before:
        return list(current), before, before
    return new, before, after


def placement_imbalance(loads: list[float], slot_logical: list[int], num_ranks: int) -> float:
    """max / mean of the per-rank load a placement gives ``loads`` (a replicated expert's load
    split evenly over its copies); 1.0 is perfect balance, 1.0 with no load at all."""
    copies = [0] * len(loads)
    for e in slot_logical:
        copies[e] += 1
    per_rank = len(slot_logical) // num_ranks
    rank_load = [
        sum(loads[e] / copies[e] for e in slot_logical[r * per_rank : (r + 1) * per_rank])
        for r in range(num_ranks)
    ]
    mean = sum(rank_load) / num_ranks
    return max(rank_load) / mean if mean > 0 else 1.0


class ExpertPlacement:
    """One MoE layer's physical experts over ``num_ranks`` ranks (see the module docstring) and
    the device tables ``to_physical`` reads. Balanced (EPLB): ``step_loads`` counts the pairs
    routed to each logical expert in this engine step, ``end_step`` files it in a ring of the
    last ``window`` steps' counts, ``loads`` sums the ring (counts by logical expert stay valid
    across placements)."""

    def __init__(
        self,
        num_experts: int,
        num_redundant: int,
        num_ranks: int,
        balanced: bool = False,
        window: int = 1,
    ) -> None:
        num_slots = num_experts + num_redundant
        if num_redundant < 0 or num_slots % num_ranks:
            raise ValueError(
                f"{num_experts} experts + num_redundant_experts={num_redundant} is not divisible "
                f"by the expert-parallel size {num_ranks}"
            )
        if num_redundant > num_experts * (num_ranks - 1):
            raise ValueError(
                f"num_redundant_experts={num_redundant}: more copies than ranks to hold them "
                f"({num_experts} experts on {num_ranks} ranks)"
            )
        if num_redundant and not balanced:
            raise ValueError("num_redundant_experts needs EPLB (enable_eplb)")
        self.num_experts, self.num_ranks = num_experts, num_ranks
        self.slots_per_rank = num_slots // num_ranks
        # balanced (EPLB): choices go through the copy tables and are counted; else a choice is
        # its slot. Tables of a fixed shape, rewritten in place (CUDA graphs read them).
        self.balanced = balanced
        width = num_redundant + 1
        n = num_experts if balanced else 0
        self.step_loads = torch.zeros(n, dtype=torch.int64)
        self.window_loads = torch.zeros(window if balanced else 0, n, dtype=torch.int64)
        self.window_pos = 0
        self.copies = torch.zeros(num_experts if balanced else 0, width, dtype=torch.int64)
        self.num_copies = torch.ones(num_experts if balanced else 0, dtype=torch.int64)
        self.set([e % num_experts for e in range(num_slots)])

    @property
    def num_slots(self) -> int:
        return len(self.slot_logical)

    def set(self, slot_logical: list[int]) -> None:
        self.slot_logical = list(slot_logical)
        if not self.balanced:
            return
        copies = [
            [p for p, e in enumerate(slot_logical) if e == x] for x in range(self.num_experts)
        ]
        width = self.copies.shape[1]
        table = [c + [c[0]] * (width - len(c)) for c in copies]
        self.copies.copy_(torch.tensor(table, dtype=torch.int64))  # [E, width]
        self.num_copies.copy_(torch.tensor([len(c) for c in copies]))

    def to_physical(self, ids: Tensor, counted: slice) -> Tensor:
        """Logical choices [T, k] → physical slots [T, k], the rows ``counted`` counted in
        ``step_loads``. The choice depends only on ``ids`` (ranks that see the same rows choose
        the same copies)."""
        if not self.balanced:
            return ids
        seen = ids[counted].reshape(-1)
        self.step_loads.index_add_(  # in place: CUDA graphs count into it
            0, seen, torch.ones(seen.numel(), dtype=torch.int64, device=ids.device)
        )
        pair = torch.arange(ids.numel(), device=ids.device).view_as(ids)
        return self.copies[ids, pair % self.num_copies[ids]]

    def end_step(self) -> None:
        self.window_loads[self.window_pos].copy_(self.step_loads)
        self.step_loads.zero_()
        self.window_pos = (self.window_pos + 1) % self.window_loads.shape[0]

    def loads(self) -> Tensor:
        """Pairs routed to each logical expert over the window (this rank's rows) [E]."""
        return self.window_loads.sum(0)


def move_expert_weights(
    tensors: list[Tensor],
    old: list[int],
    new: list[int],
    rank: int,
    num_ranks: int,
    group: Any,
) -> list[Tensor]:
    """Rank ``rank``'s local expert tensors (each [slots_per_rank, ...]) for the placement
    ``new``, given the current one ``old``: a slot whose expert this rank already holds copies it
    locally; the others come from the lowest rank holding the expert (its first such slot), one
    ``all_to_all_single`` per tensor (bytes, so any dtype travels)."""
    per_rank = len(old) // num_ranks

    def source(e: int) -> tuple[int, int]:
        p = old.index(e)
        return p // per_rank, p % per_rank

    mine = range(rank * per_rank, (rank + 1) * per_rank)
    # What each rank asks of each other rank, in its slot order: (its local slot, source slot).
    asks: list[list[list[tuple[int, int]]]] = [
        [[] for _ in range(num_ranks)] for _ in range(num_ranks)
    ]
    for r in range(num_ranks):
        held = set(old[r * per_rank : (r + 1) * per_rank])
        for s in range(per_rank):
            e = new[r * per_rank + s]
            if e in held:
                continue
            src_rank, src_slot = source(e)
            asks[r][src_rank].append((s, src_slot))
    out = []
    for t in tensors:
        fresh = torch.empty_like(t)
        for s, p in enumerate(mine):
            e = new[p]
            local = [q for q in mine if old[q] == e]
            if local:
                fresh[s] = t[local[0] - rank * per_rank]
        if num_ranks > 1:
            rows = t[0].numel() * t.element_size()
            send_slots = [src for r in range(num_ranks) for _, src in asks[r][rank]]
            send = t[send_slots].contiguous().view(torch.uint8).reshape(-1)
            in_splits = [len(asks[r][rank]) * rows for r in range(num_ranks)]
            out_splits = [len(asks[rank][r]) * rows for r in range(num_ranks)]
            recv = torch.empty(sum(out_splits), dtype=torch.uint8, device=t.device)
            dist.all_to_all_single(recv, send.contiguous(), out_splits, in_splits, group=group)
            got = recv.view(-1, rows)
            dst = [s for r in range(num_ranks) for s, _ in asks[rank][r]]
            for i, s in enumerate(dst):
                fresh[s].view(-1).view(torch.uint8).copy_(got[i])
        out.append(fresh)
    return out


# ----------------------------------------------------------------------------------- dispatch


@dataclass
class DispatchHandle:
    """What ``combine`` needs to return a dispatch's outputs to their rows."""

    num_rows: int
    send_rows: Tensor | None  # variable splits: the sent rows in send order
    in_splits: list[int] | None
    out_splits: list[int] | None


class ExpertDispatcher(Protocol):
    """Sends each row to the ranks holding its chosen slots and brings the outputs back."""

    def dispatch(
        self, x: Tensor, weights: Tensor, ids: Tensor, max_rows: int
    ) -> tuple[Tensor, Tensor, Tensor, DispatchHandle]:
        """This rank's rows → the rows it received (with their choices' weights and slots)."""
        ...

    def combine(self, y: Tensor, handle: DispatchHandle) -> Tensor:
        """The received rows' partial outputs → this rank's rows' sums [num_rows, H]."""
        ...


# Observed by tests: per dispatch, (rows received, their slots) on this rank.
DispatchHook = Callable[[Tensor], None]


class AllToAllDispatcher:
    """``ExpertDispatcher`` on ``torch.distributed.all_to_all_single`` (NCCL, gloo)."""

    def __init__(
        self, rank: int, num_ranks: int, slots_per_rank: int, group: Any, static: bool = False
    ) -> None:
        self.rank, self.num_ranks = rank, num_ranks
        self.slots_per_rank = slots_per_rank
        self.group = group
        self.static = static  # always static splits (else only under CUDA-graph capture)
        self.hook: DispatchHook | None = None
        self.bytes_sent = 0  # what this rank handed to all_to_all (rows, choices, outputs)

    def _static(self, x: Tensor) -> bool:
        return self.static or (x.is_cuda and torch.cuda.is_current_stream_capturing())

    def dispatch(
        self, x: Tensor, weights: Tensor, ids: Tensor, max_rows: int
    ) -> tuple[Tensor, Tensor, Tensor, DispatchHandle]:
        n, ranks = x.shape[0], self.num_ranks
        dest = ids // self.slots_per_rank  # [n, k]
        if self._static(x):
            pad = max_rows
            xs = torch.zeros(pad, *x.shape[1:], dtype=x.dtype, device=x.device)
            xs[:n] = x
            ws = weights.new_zeros(pad, weights.shape[1])
            ws[:n] = weights
            idp = ids.new_full((pad, ids.shape[1]), -1)
            idp[:n] = ids
            dp = dest.new_full((pad, ids.shape[1]), -1)
            dp[:n] = dest
            r = torch.arange(ranks, device=x.device)[:, None, None]
            send_ids = torch.where(dp[None] == r, idp[None], -1)  # [ranks, pad, k]
            send_x = xs[None].expand(ranks, *xs.shape).contiguous()
            send_w = ws[None].expand(ranks, *ws.shape).contiguous()
            recv_x, recv_w, recv_ids = (
                self._exchange(t.reshape(ranks * pad, *t.shape[2:]), None, None)
                for t in (send_x, send_w, send_ids)
            )
            handle = DispatchHandle(n, None, None, None)
        else:
            hit = torch.zeros(n, ranks, dtype=torch.bool, device=x.device)
            hit.scatter_(1, dest, True)
            pairs = hit.t().nonzero()  # (rank, row), rank-major
            send_rows = pairs[:, 1]
            in_splits = torch.bincount(pairs[:, 0], minlength=ranks)
            out_counts = torch.empty_like(in_splits)
            if ranks > 1:
                dist.all_to_all_single(out_counts, in_splits, group=self.group)
            else:
                out_counts.copy_(in_splits)
            ins, outs = in_splits.tolist(), out_counts.tolist()
            meta = torch.cat([weights.float(), ids.float()], dim=1)[send_rows]
            recv_x = self._exchange(x[send_rows], outs, ins)
            recv_meta = self._exchange(meta, outs, ins)
            k = ids.shape[1]
            recv_w, recv_ids = recv_meta[:, :k], recv_meta[:, k:].long()
            handle = DispatchHandle(n, send_rows, ins, outs)
        if self.hook is not None:
            self.hook(recv_ids)
        return recv_x, recv_w, recv_ids, handle

    def combine(self, y: Tensor, handle: DispatchHandle) -> Tensor:
        if handle.send_rows is None:  # static: [ranks, pad, H] back, summed over ranks
            back = self._exchange(y, None, None)
            pad = back.shape[0] // self.num_ranks
            total = back.view(self.num_ranks, pad, y.shape[1]).float().sum(0)
            return total[: handle.num_rows].to(y.dtype)
        back = self._exchange(y, handle.in_splits, handle.out_splits)
        out = torch.zeros(handle.num_rows, y.shape[1], dtype=torch.float32, device=y.device)
        out.index_add_(0, handle.send_rows, back.float())
        return out.to(y.dtype)

    def _exchange(
        self, t: Tensor, out_splits: list[int] | None, in_splits: list[int] | None
    ) -> Tensor:
        if self.num_ranks == 1:
            return t
        self.bytes_sent += t.numel() * t.element_size()
        rows = sum(out_splits) if out_splits is not None else t.shape[0]
        out = torch.empty(rows, *t.shape[1:], dtype=t.dtype, device=t.device)
        dist.all_to_all_single(out, t.contiguous(), out_splits, in_splits, group=self.group)
        return out
