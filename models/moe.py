"""DeepSeek-V3 mixture of experts: sigmoid router with grouped top-k, routed experts split across
the TP group (expert parallelism), shared experts split like a dense MLP.

Each rank holds ``n_routed_experts / tp`` whole experts and the TP shard of the shared experts,
computes both for every token it is given, and one all-reduce sums the partial outputs. Under
attention DP the MoE runs on every rank's rows: they are all-gathered (sized by
``all_rank_num_tokens``), and each rank keeps its own rows of the summed output.

Checkpoint layout: ``mlp.gate.weight`` [E, H] and ``mlp.gate.e_score_correction_bias`` [E]
(both kept in fp32), ``mlp.experts.{e}.{gate,up,down}_proj.weight`` (or the fused
``mlp.experts.gate_up_proj`` [E, 2I, H] / ``mlp.experts.down_proj`` [E, H, I]),
``mlp.shared_experts.{gate,up,down}_proj.weight``.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.moe import grouped_topk, moe_experts
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
    """This rank's experts ``first_expert .. first_expert + num_local - 1``, stacked:
    ``w13`` [num_local, 2I, H] (gate rows, then up rows) and ``w2`` [num_local, H, I]."""

    def __init__(self, num_local: int, first_expert: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.num_local = num_local
        self.first_expert = first_expert
        self.inter = inter
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

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """``shard_id``: (local expert, 0 = gate | 1 = up) for w13, the local expert for w2, or
        "all" for a fused [E, ...] tensor of every expert (this rank reads its range)."""
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
        num_local = divide(int(getattr(config, experts_key)), mapping.tp_size, experts_key)
        self.gate = MoEGate(config) if gate is None else gate
        self.experts = RoutedExperts(num_local, mapping.tp_rank * num_local, h, inter)
        shared = int(getattr(config, "n_shared_experts", 0) or 0)
        self.shared_experts = PartialMLP(h, inter * shared, mapping) if shared else None

    def forward(
        self, x: torch.Tensor, all_rank_num_tokens: list[int] | None = None
    ) -> torch.Tensor:
        if self.adp:
            if all_rank_num_tokens is None:
                raise RuntimeError("attention DP: the MoE needs all_rank_num_tokens")
            x = adp_all_gather_rows(x, all_rank_num_tokens, self.mapping)  # [tp * max, H]
        weights, ids = self.gate(x)
        out = self.experts(x, weights, ids)  # this rank's experts only
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        if self.adp:
            return adp_reduce_own_rows(out, all_rank_num_tokens, self.mapping)
        return all_reduce(out, self.mapping)
