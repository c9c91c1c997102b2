"""DeepSeek-V3 mixture of experts: sigmoid router with grouped top-k, routed experts split across
the TP group (expert parallelism), shared experts split like a dense MLP.

Each rank holds ``(n_routed_experts + R) / tp`` whole physical experts (``R``: redundant copies,
models/expert_parallel.py; 0 unless EPLB is on) and the TP shard of the shared experts, computes
both for every token it is given, and one all-reduce sums the partial outputs. Under attention DP
the MoE runs on every rank's rows: they are all-gathered (sized by ``all_rank_num_tokens``), and
each rank keeps its own rows of the summed output; with expert parallelism on
(``ParallelMapping.ep_dispatch``) a row goes only to the ranks holding its chosen experts
(all-to-all dispatch and combine) and the shared experts are replicated, run on own rows.

Checkpoint layout: ``mlp.gate.weight`` [E, H] and ``mlp.gate.e_score_correction_bias`` [E]
(both kept in fp32), ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (or the fused
``mlp.experts.gate_up_proj`` [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I]),
``mlp.shared_experts.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from tandem.kernels.moe import grouped_topk, moe_experts
from tandem.models.expert_parallel import (
    AllToAllDispatcher,
    ExpertPlacement,
    move_expert_weights,
    next_placement,
)
from tandem.models.layers import MergedColumnParallelLinear, RowParallelLinear, silu_and_mul
from tandem.models.parallel import (
    ParallelMapping,
    adp_all_gather_rows,
    adp_reduce_own_rows,
    all_reduce,
    divide,
)
from tandem.models.quantization import DequantizedWeight, dequantize_fp8_blockwise
from tandem.models.weights import (
    copy_checked,
    default_weight_loader,
    loaded_shape,
    make_fp8,
    read_loaded,
    set_loader,
)


class MoEGate(nn.Module):
    """Router: fp32 logits, then ``grouped_topk`` → (weights [T, k] fp32, ids [T, k])."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        e, h = config.n_routed_experts, config.hidden_size
        self.top_k = config.num_experts_per_tok
        self.n_group = config.n_group or 1
        self.topk_group = config.topk_group or 1
        self.norm_topk_prob = bool(config.norm_topk_prob)
        self.routed_scaling_factor = float(config.routed_scaling_factor)
        self.weight = set_loader(
            nn.Parameter(torch.zeros(e, h, dtype=torch.float32), requires_grad=False),
            default_weight_loader,
        )
        self.e_score_correction_bias = set_loader(
            nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False),
            default_weight_loader,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight)  # [T, E]
        return grouped_topk(
            logits,
            self.e_score_correction_bias,
            self.top_k,
            self.n_group,
            self.topk_group,
            self.norm_topk_prob,
            self.routed_scaling_factor,
        )


class RoutedExperts(nn.Module):
    """This rank's physical experts (slots) ``first_expert .. first_expert + num_local - 1``,
    stacked: ``w13`` [num_local, 2I, H] (gate rows, then up rows) and ``w2`` [num_local, H, I].
    ``slot_experts``: the logical (checkpoint) expert in each local slot; default slot i holds
    expert ``first_expert + i``."""

    def __init__(
        self,
        num_local: int,
        first_expert: int,
        hidden: int,
        inter: int,
        slot_experts: list[int] | None = None,
    ) -> None:
        super().__init__()
        self.num_local = num_local
        self.first_expert = first_expert
        self.inter = inter
        self.slot_experts = (
            list(range(first_expert, first_expert + num_local))
            if slot_experts is None
            else list(slot_experts)
        )
        self.w13 = set_loader(
            nn.Parameter(torch.empty(num_local, 2 * inter, hidden), requires_grad=False),
            self.weight_loader,
        )
        self.w2 = set_loader(
            nn.Parameter(torch.empty(num_local, hidden, inter), requires_grad=False),
            self.weight_loader,
        )

    fp8_allowed = True
    fp8_block: tuple[int, int] | None = None  # set by ``to_fp8``: weights stored as FP8

    def fp8_fits(self, block: tuple[int, int]) -> bool:
        return self.inter % block[0] == 0  # the up rows of w13 start on a block

    def to_fp8(self, block: tuple[int, int]) -> None:
        """Store ``w13`` / ``w2`` as float8_e4m3fn with their block scales (``w13_scale_inv``
        [E, 2I/bn, ceil(H/bk)], ``w2_scale_inv`` [E, ceil(H/bn), ceil(I/bk)])."""
        self.dense_dtype = self.w13.dtype
        make_fp8(self, "w13", block)
        make_fp8(self, "w2", block)
        self.fp8_block = block

    def _fp8_to_dense(self) -> None:
        assert self.fp8_block is not None
        for name in ("w13", "w2"):
            q, scale = getattr(self, name).data, getattr(self, f"{name}_scale_inv")
            dense = torch.stack(
                [dequantize_fp8_blockwise(q[e], scale[e], self.fp8_block, self.dense_dtype)
                 for e in range(q.shape[0])]
            )  # fmt: skip
            setattr(
                self, name, set_loader(nn.Parameter(dense, requires_grad=False), self.weight_loader)
            )
            delattr(self, f"{name}_scale_inv")
        self.fp8_block = None

    def slots_of(self, expert: int) -> list[int]:
        """The local slots holding logical ``expert`` (none: another rank's)."""
        return [s for s, e in enumerate(self.slot_experts) if e == expert]

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """``shard_id``: (local slot, 0 = gate | 1 = up) for w13, the local slot for w2, or
        "all" for a fused [E, ...] tensor of every expert (this rank reads its slots' experts)."""
        name = "w13" if param is self.w13 else "w2"
        if self.fp8_block is not None:
            if not (isinstance(loaded, DequantizedWeight) and loaded.block == self.fp8_block):
                self._fp8_to_dense()
                param = getattr(self, name)
        fp8 = self.fp8_block is not None
        if shard_id == "all":
            shape = loaded_shape(loaded)
            if shape[1:] != tuple(param.shape[1:]):
                raise ValueError(f"shape mismatch: checkpoint has {shape}")
            first, n = self.first_expert, self.num_local
            if self.slot_experts != list(range(first, first + n)):  # one slot at a time
                for slot, e in enumerate(self.slot_experts):
                    if fp8:
                        q, scale = loaded.raw(0, e, 1)
                        copy_checked(param.data[slot : slot + 1], q)
                        copy_checked(
                            getattr(self, f"{name}_scale_inv")[slot : slot + 1], scale, "scales"
                        )
                    else:
                        copy_checked(param.data[slot : slot + 1], loaded[e : e + 1])
                return
            if fp8:
                q, scale = loaded.raw(0, first, n)
                copy_checked(param, q)
                copy_checked(getattr(self, f"{name}_scale_inv"), scale, "scales")
                return
            copy_checked(param, loaded[first : first + n])
            return
        if name == "w13":
            local, part = shard_id
            rows = slice(part * self.inter, (part + 1) * self.inter)
        else:
            local, rows = shard_id, slice(None)
        if fp8:
            q, scale = loaded.raw(None)
            copy_checked(param.data[local, rows], q)
            bn = self.fp8_block[0]
            scale_rows = (
                slice(None) if rows == slice(None) else slice(rows.start // bn, rows.stop // bn)
            )
            copy_checked(getattr(self, f"{name}_scale_inv")[local, scale_rows], scale, "scales")
            return
        copy_checked(param.data[local, rows], read_loaded(loaded))

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.fp8_block is not None:
            return moe_experts(
                x, self.w13, self.w2, weights, ids, self.first_expert,
                fp8_scales=(self.w13_scale_inv, self.w2_scale_inv, self.fp8_block),
            )  # fmt: skip
        return moe_experts(x, self.w13, self.w2, weights, ids, self.first_expert)


class PartialMLP(nn.Module):
    """A TP-sharded gated MLP that returns this rank's partial sum (the caller reduces)."""

    def __init__(self, hidden: int, inter: int, mapping: ParallelMapping) -> None:
        super().__init__()
        self.gate_up_proj = MergedColumnParallelLinear(hidden, [inter, inter], False, mapping)
        self.down_proj = RowParallelLinear(inter, hidden, False, mapping, reduce=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x)))


class DeepseekV3MoE(nn.Module):
    """Routed experts split whole over the TP group, shared experts TP-sharded. ``gate`` and
    ``experts_key`` (another family's router, and the config field counting its experts;
    Qwen3-MoE): default DeepSeek-V3's grouped top-k router over ``n_routed_experts``."""

    def __init__(
        self,
        config: Any,
        mapping: ParallelMapping,
        gate: nn.Module | None = None,
        experts_key: str = "n_routed_experts",
    ) -> None:
        super().__init__()
        self.mapping = mapping
        self.adp = mapping.uses_adp_collectives
        h, inter = config.hidden_size, config.moe_intermediate_size
        self.set_placement(int(getattr(config, experts_key)), experts_key)
        num_local, first = self.placement.slots_per_rank, self.first_slot
        self.gate = MoEGate(config) if gate is None else gate
        self.experts = RoutedExperts(
            num_local, first, h, inter, self.placement.slot_logical[first : first + num_local]
        )
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        # Dispatched rows stay on their rank: the shared experts are whole there.
        dense = mapping.attn_mapping if mapping.ep_dispatch else mapping
        self.shared_experts = PartialMLP(h, inter * shared, dense) if shared else None

    def set_placement(self, num_experts: int, what: str) -> None:
        """The physical experts over the TP group (``placement``, redundant copies included) and,
        under attention DP with expert parallelism, the all-to-all ``dispatcher``."""
        mapping = self.mapping
        redundant = mapping.num_redundant_experts
        if redundant == 0:
            divide(num_experts, mapping.tp_size, what)
        self.placement = ExpertPlacement(
            num_experts, redundant, mapping.tp_size, mapping.enable_eplb, mapping.eplb_window_size
        )
        self.first_slot = mapping.tp_rank * self.placement.slots_per_rank
        self.dispatcher = (
            AllToAllDispatcher(
                mapping.tp_rank, mapping.tp_size, self.placement.slots_per_rank, mapping.group
            )
            if mapping.ep_dispatch
            else None
        )

    def rebalance(self) -> tuple[float, float, int]:
        """EPLB, on every rank of the group at once: sum the loads of the window, place the
        experts for them (``balanced_placement``; kept as they are where that would not lower
        the window's imbalance) and move the weights that change rank.
        Returns (imbalance of the window's loads under the old placement, under the new one,
        pairs counted)."""
        p, mapping = self.placement, self.mapping
        if not isinstance(self.experts, RoutedExperts) or not p.balanced:
            raise ValueError(f"EPLB is off for {type(self.experts).__name__}")
        loads = p.loads()
        if mapping.tp_size > 1:
            dist.all_reduce(loads, group=mapping.group)
        expert_loads = [float(n) for n in loads.tolist()]
        old = p.slot_logical
        new, before, after = next_placement(expert_loads, old, p.num_ranks)
        if new != old:
            e = self.experts
            names = ["w13", "w2"] + (["w13_scale_inv", "w2_scale_inv"] if e.fp8_block else [])
            moved = move_expert_weights(
                [getattr(e, n).data for n in names],
                old,
                new,
                mapping.tp_rank,
                p.num_ranks,
                mapping.group,
            )
            for n, t in zip(names, moved, strict=True):
                getattr(e, n).data.copy_(t)  # in place: CUDA graphs read these
            first = self.first_slot
            e.slot_experts = new[first : first + p.slots_per_rank]
            p.set(new)
        return before, after, int(sum(expert_loads))

    def forward(
        self, x: torch.Tensor, all_rank_num_tokens: list[int] | None = None
    ) -> torch.Tensor:
        if self.adp and all_rank_num_tokens is None:
            raise RuntimeError("attention DP: the MoE needs all_rank_num_tokens")
        if self.dispatcher is not None:
            assert all_rank_num_tokens is not None
            weights, ids = self.gate(x)  # this rank's rows only
            ids = self.placement.to_physical(ids, slice(None))
            rx, rw, rids, handle = self.dispatcher.dispatch(
                x, weights, ids, max(all_rank_num_tokens)
            )
            out = self.dispatcher.combine(self.experts(rx, rw, rids), handle)
            if self.shared_experts is not None:
                out = out + self.shared_experts(x)
            return out
        own = slice(None)  # the rows counted for load balancing
        if self.adp:
            assert all_rank_num_tokens is not None
            x = adp_all_gather_rows(x, all_rank_num_tokens, self.mapping)  # [tp * max, H]
            start = self.mapping.tp_rank * max(all_rank_num_tokens)
            own = slice(start, start + all_rank_num_tokens[self.mapping.tp_rank])
        weights, ids = self.gate(x)
        ids = self.placement.to_physical(ids, own)  # the same choice on every rank
        out = self.experts(x, weights, ids)  # this rank's experts only
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.adp:
            return adp_reduce_own_rows(out, all_rank_num_tokens, self.mapping)
        return all_reduce(out, self.mapping)


@dataclass
class EplbStats:
    """Expert load balancing so far: rebalances done and, at the last one, the measured load's
    max / mean per rank under the placement it replaced and under the new one (mean over the MoE
    layers)."""

    rebalances: int = 0
    imbalance_before: float = 0.0
    imbalance_after: float = 0.0


class ExpertBalancer:
    """EPLB for every balanced MoE layer of a rank's modules: ``step`` after each engine step
    (every rank steps alike), a rebalance every ``interval`` steps (collectives on every
    rank)."""

    def __init__(self, modules: list[nn.Module], interval: int) -> None:
        self.layers = [
            m for module in modules for m in module.modules() if isinstance(m, DeepseekV3MoE)
        ]
        if not self.layers:
            raise ValueError("enable_eplb=True: the model has no MoE layers to balance")
        for m in self.layers:
            if not (isinstance(m.experts, RoutedExperts) and m.placement.balanced):
                raise ValueError(f"EPLB is off for {type(m.experts).__name__}")
        self.interval = interval
        self.steps = 0
        self.stats = EplbStats()

    def step(self) -> EplbStats:
        for m in self.layers:
            m.placement.end_step()
        self.steps += 1
        if self.steps % self.interval == 0:
            results = [m.rebalance() for m in self.layers]
            n = len(results)
            self.stats = EplbStats(
                self.stats.rebalances + 1,
                sum(r[0] for r in results) / n,
                sum(r[1] for r in results) / n,
            )
        return self.stats
