"""Building blocks shared by the model families: norms, parallel linears and embeddings (rotary
embeddings: ``models/rotary.py``; the CPU fast path's packed weights: ``models/cpu_linears.py``).

Every parameter that comes from a checkpoint carries a ``weight_loader(param, loaded, shard_id)``
that copies this rank's slice of the tensor; ``loaded`` is a torch tensor or a lazy safetensors
slice, so a rank reads only the bytes it keeps.
"""

from __future__ import annotations

import math
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_decode
from tandem.kernels.fp8 import fp8_linear
from tandem.models.parallel import ParallelMapping, all_gather_last_dim, all_reduce, divide
from tandem.models.quantization import DequantizedWeight, dequantize_fp8_blockwise
from tandem.models.weights import (
    copy_checked,
    default_weight_loader,
    loaded_shape,
    make_fp8,
    narrow_loaded,
    read_loaded,
    set_loader,
)

# ----------------------------------------------------------------------------- weight loading


# ----------------------------------------------------------------------------- norms


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, optionally fused with the residual add."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = set_loader(nn.Parameter(torch.ones(hidden_size)), default_weight_loader)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        # x * rsqrt(mean(x^2) + eps) in fp32, rounded to x's dtype, then scaled by the weight
        # (the Hugging Face order). One fused call when nothing needs rounding in between.
        shape = self.weight.shape
        if x.dtype == torch.float32 and self.weight.dtype == torch.float32:
            return torch.rms_norm(x, shape, self.weight, self.eps)
        return self.weight * torch.rms_norm(x.float(), shape, None, self.eps).to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual


# ----------------------------------------------------------------------------- rotary


# ----------------------------------------------------------------------------- linears


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class LinearBase(nn.Module):
    packed_weight: torch.Tensor | None = None  # bf16 on CPU: ``pack_cpu_linears``
    # Set where the CPU fast path runs the layer: its packed copy of the weight
    # (``kernels.cpu_decode.pack``), read by the eager forward too (no oneDNN copy then).
    fast_weight: torch.Tensor | None = None
    # FP8 weights kept as FP8 (``models.quantization.keep_fp8_weights``): the block size, and
    # the ``weight_scale_inv`` buffer beside the float8 weight. ``fp8_allowed`` False: the
    # layer's weight is read directly (MLA's kv_b_proj), so it stays in the model's dtype.
    fp8_allowed: bool = True
    fp8_block: tuple[int, int] | None = None

    def __init__(self, in_features: int, out_features: int, bias: bool) -> None:
        super().__init__()
        self.weight = set_loader(
            nn.Parameter(torch.empty(out_features, in_features), requires_grad=False),
            self.weight_loader,
        )
        self.bias = (
            set_loader(
                nn.Parameter(torch.zeros(out_features), requires_grad=False), self.weight_loader
            )
            if bias
            else None
        )

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        self.copy_rows(param, loaded, None)

    # ------------------------------------------------------------------ FP8 weights

    def fp8_shard_starts(self) -> tuple[list[int], list[int]]:
        """Row and column offsets (in the checkpoint and in this rank's weight) where the
        loaders cut the weight: each must fall on a block boundary to keep it FP8."""
        return [], []

    def fp8_fits(self, block: tuple[int, int]) -> bool:
        rows, cols = self.fp8_shard_starts()
        return all(r % block[0] == 0 for r in rows) and all(c % block[1] == 0 for c in cols)

    def to_fp8(self, block: tuple[int, int]) -> None:
        self.dense_dtype = self.weight.dtype
        make_fp8(self, "weight", block)
        self.fp8_block = block

    def _fp8_to_dense(self) -> None:
        """Back to the model's dtype (a checkpoint that did not quantize this layer); what was
        loaded as FP8 already is dequantized exactly as the weight-only path does."""
        assert self.fp8_block is not None
        dense = dequantize_fp8_blockwise(
            self.weight.data, self.weight_scale_inv, self.fp8_block, self.dense_dtype
        )
        self.weight = set_loader(nn.Parameter(dense, requires_grad=False), self.weight_loader)
        del self.weight_scale_inv
        self.fp8_block = None

    def copy_rows(
        self, param: nn.Parameter, loaded: Any, dim: int | None, start: int = 0, size: int = 0,
        dst_row: int = 0,
    ) -> None:  # fmt: skip
        """Copy ``[start, start + size)`` along ``dim`` of a checkpoint tensor (None: all of
        it) into ``param`` from row ``dst_row`` on: its FP8 values and scale blocks where this
        layer keeps FP8 weights, else the (dequantized) values in the parameter's dtype."""
        if param is self.weight and self.fp8_block is not None:
            if isinstance(loaded, DequantizedWeight) and loaded.block == self.fp8_block:
                q, scale = loaded.raw(dim, start, size)
                rows = param.shape[0] if dim is None else q.shape[0]
                if dst_row % self.fp8_block[0]:
                    raise ValueError("an FP8 shard must start on a block boundary")
                copy_checked(param.data[dst_row : dst_row + rows], q)
                first = dst_row // self.fp8_block[0]
                copy_checked(self.weight_scale_inv[first : first + scale.shape[0]], scale, "scales")
                return
            self._fp8_to_dense()
            param = self.weight
        value = read_loaded(loaded) if dim is None else narrow_loaded(loaded, dim, start, size)
        if dim is None or dim == 1:
            copy_checked(param, value)
        else:
            copy_checked(param.data[dst_row : dst_row + size], value)

    def matmul(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.fp8_block is not None:
            return fp8_linear(x, self.weight, self.weight_scale_inv, self.fp8_block, bias)
        if (
            self.fast_weight is not None
            and bias is None
            and x.dim() == 2
            and x.dtype == self.weight.dtype
        ):  # (the dense weight may be gone: ``release_dense_weights_``)
            if x.shape[0] == 0:
                return x.new_empty((0, self.weight.shape[0]))
            return cpu_decode.linear(x, self.fast_weight, self.weight.shape[0])
        if self.packed_weight is not None:
            return packed_linear(x, self.packed_weight, bias)
        return F.linear(x, self.weight, bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.matmul(x, self.bias)


class ReplicatedLinear(LinearBase):
    """The same full weight on every rank."""


class ColumnParallelLinear(LinearBase):
    """Output features split across ranks; no communication in forward."""

    def __init__(
        self, in_features: int, out_features: int, bias: bool, mapping: ParallelMapping
    ) -> None:
        self.mapping = mapping
        self.tp = mapping.tp_size
        super().__init__(in_features, divide(out_features, self.tp, "output features"), bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        size = param.shape[0]
        shape = loaded_shape(loaded)
        if shape[0] != size * self.tp:
            raise ValueError(
                f"shape mismatch: checkpoint has {shape}, expected dim 0 = {size * self.tp}"
            )
        if len(shape) > 1 and shape[1] != param.shape[1]:
            raise ValueError(
                f"shape mismatch: checkpoint has {shape}, expected {tuple(param.shape)}"
            )
        self.copy_rows(param, loaded, 0, self.mapping.tp_rank * size, size)

    def fp8_shard_starts(self) -> tuple[list[int], list[int]]:
        return [self.mapping.tp_rank * self.weight.shape[0]], []


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel outputs stored as one weight (e.g. gate and up projections)."""

    def __init__(
        self, in_features: int, output_sizes: list[int], bias: bool, mapping: ParallelMapping
    ) -> None:
        self.output_sizes = output_sizes
        for size in output_sizes:  # each output is split on its own, not just their sum
            divide(size, mapping.tp_size, "output features")
        super().__init__(in_features, sum(output_sizes), bias, mapping)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        idx = int(shard_id)
        local = self.output_sizes[idx] // self.tp
        offset = sum(self.output_sizes[:idx]) // self.tp
        shape = loaded_shape(loaded)
        if shape[0] != self.output_sizes[idx] or (len(shape) > 1 and shape[1] != param.shape[1]):
            raise ValueError(
                f"shape mismatch: checkpoint has {shape}, expected "
                f"({self.output_sizes[idx]}, {param.shape[1] if param.dim() > 1 else ''})"
            )
        self.copy_rows(param, loaded, 0, self.mapping.tp_rank * local, local, offset)

    def fp8_shard_starts(self) -> tuple[list[int], list[int]]:
        rows = []
        for i, size in enumerate(self.output_sizes):
            local = size // self.tp
            rows += [sum(self.output_sizes[:i]) // self.tp, self.mapping.tp_rank * local]
        return rows, []


class QKVParallelLinear(ColumnParallelLinear):
    """Fused q/k/v projection; KV heads are replicated when there are fewer of them than ranks."""

    def __init__(
        self,
        hidden_size: int,
        head_dim: int,
        num_heads: int,
        num_kv_heads: int,
        bias: bool,
        mapping: ParallelMapping,
    ) -> None:
        tp = mapping.tp_size
        self.head_dim = head_dim
        self.num_heads = divide(num_heads, tp, "num_attention_heads")
        self.total_kv_heads = num_kv_heads
        if num_kv_heads >= tp:
            self.num_kv_heads = divide(num_kv_heads, tp, "num_key_value_heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = divide(tp, num_kv_heads, "tensor-parallel size over KV heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp
        super().__init__(hidden_size, out, bias, mapping)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        rank, d = self.mapping.tp_rank, self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        if shard_id == "q":
            total, offset, size, start = self.num_heads * self.tp * d, 0, q_size, rank * q_size
        else:
            total = self.total_kv_heads * d
            offset = q_size if shard_id == "k" else q_size + kv_size
            size, start = kv_size, (rank // self.kv_replicas) * kv_size
        shape = loaded_shape(loaded)
        if shape[0] != total or (len(shape) > 1 and shape[1] != param.shape[1]):
            raise ValueError(f"shape mismatch for {shard_id}_proj: checkpoint has {shape}")
        self.copy_rows(param, loaded, 0, start, size, offset)

    def fp8_shard_starts(self) -> tuple[list[int], list[int]]:
        rank, d = self.mapping.tp_rank, self.head_dim
        q_size, kv_size = self.num_heads * d, self.num_kv_heads * d
        kv_start = (rank // self.kv_replicas) * kv_size
        return [0, q_size, q_size + kv_size, rank * q_size, kv_start], []


class RowParallelLinear(LinearBase):
    """Input features split across ranks; the partial outputs are summed with one all-reduce."""

    def __init__(
        self,
        in_features: int,
        out_features: int,
        bias: bool,
        mapping: ParallelMapping,
        reduce: bool = True,
    ) -> None:
        self.mapping = mapping
        self.tp = mapping.tp_size
        self.reduce = reduce
        super().__init__(divide(in_features, self.tp, "input features"), out_features, bias)

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        if param.dim() == 1:  # bias: full on every rank, added once after the reduce
            copy_checked(param, read_loaded(loaded))
            return
        size = param.shape[1]
        shape = loaded_shape(loaded)
        if len(shape) != 2 or shape[1] != size * self.tp or shape[0] != param.shape[0]:
            raise ValueError(
                f"shape mismatch: checkpoint has {shape}, expected ({param.shape[0]}, {size * self.tp})"
            )
        self.copy_rows(param, loaded, 1, self.mapping.tp_rank * size, size)

    def fp8_shard_starts(self) -> tuple[list[int], list[int]]:
        return [], [self.mapping.tp_rank * self.weight.shape[1]]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = self.matmul(x, None)
        if self.reduce:
            out = all_reduce(out, self.mapping)
        return out if self.bias is None else out + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding with the vocabulary split across ranks (padded to a multiple of the TP size)."""

    def __init__(self, vocab_size: int, hidden_size: int, mapping: ParallelMapping) -> None:
        super().__init__()
        self.mapping = mapping
        self.vocab_size = vocab_size
        self.local_vocab = math.ceil(vocab_size / mapping.tp_size)
        self.start = mapping.tp_rank * self.local_vocab
        self.weight = set_loader(
            nn.Parameter(torch.zeros(self.local_vocab, hidden_size), requires_grad=False),
            self.weight_loader,
        )

    def weight_loader(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        shape = loaded_shape(loaded)
        if shape != (self.vocab_size, param.shape[1]):
            raise ValueError(
                f"shape mismatch: checkpoint has {shape}, expected ({self.vocab_size}, {param.shape[1]})"
            )
        # The last ranks may hold fewer real rows than local_vocab (or none): padding stays 0.
        size = max(0, min(self.local_vocab, self.vocab_size - self.start))
        param.data.zero_()
        if size:
            param.data[:size].copy_(narrow_loaded(loaded, 0, self.start, size).to(param.dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.mapping.tp_size == 1:
            return F.embedding(ids, self.weight)
        local = ids - self.start
        mask = (local >= 0) & (local < self.local_vocab)
        out = F.embedding(local.clamp(0, self.local_vocab - 1), self.weight)
        out = out * mask.unsqueeze(-1).to(out.dtype)
        return all_reduce(out, self.mapping)


class ParallelLMHead(VocabParallelEmbedding):
    """LM head whose rows (vocabulary) are split across ranks; logits are gathered."""

    packed_weight: torch.Tensor | None = None  # bf16 on CPU: ``pack_cpu_linears``
    # Set: logits go through ``kernels.cpu_decode.linear`` with it (no oneDNN copy then).
    fast_weight: torch.Tensor | None = None

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.local_logits(hidden)
        logits = all_gather_last_dim(logits, self.mapping)
        return logits[..., : self.vocab_size]

    def local_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary shard of the logits, [T, local_vocab]."""
        if self.fast_weight is not None and hidden.dim() == 2 and hidden.dtype == self.weight.dtype:
            if hidden.shape[0] == 0:
                return hidden.new_empty((0, self.weight.shape[0]))
            return cpu_decode.linear(hidden, self.fast_weight, self.weight.shape[0])
        if self.packed_weight is not None:
            return packed_linear(hidden, self.packed_weight, None)
        return F.linear(hidden, self.weight)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]  # silu(gate) * up
