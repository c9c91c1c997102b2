"""Building blocks shared by the model families: norms, rotary embeddings and parallel linears.

Every parameter that comes from a checkpoint carries a ``weight_loader(param, loaded, shard_id)``
that copies this rank's slice of the tensor; ``loaded`` is a torch tensor or a lazy safetensors
slice, so a rank reads only the bytes it keeps.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_decode
from tandem.kernels.fp8 import fp8_linear
from tandem.models.parallel import ParallelMapping, all_gather_last_dim, all_reduce, divide
from tandem.models.quantization import DequantizedWeight, dequantize_fp8_blockwise

# ----------------------------------------------------------------------------- weight loading


def loaded_shape(loaded: Any) -> tuple[int, ...]:
    """Shape of a tensor or of a lazy safetensors slice."""
    if isinstance(loaded, torch.Tensor):
        return tuple(loaded.shape)
    return tuple(loaded.get_shape())


def narrow_loaded(loaded: Any, dim: int, start: int, size: int) -> torch.Tensor:
    """Read ``[start, start + size)`` along ``dim`` (0 or 1) from a tensor or lazy slice."""
    if dim == 0:
        return loaded[start : start + size]
    return loaded[:, start : start + size]


def read_loaded(loaded: Any) -> torch.Tensor:
    return loaded if isinstance(loaded, torch.Tensor) else loaded[:]


def copy_checked(param: torch.Tensor, value: torch.Tensor, what: str = "tensor") -> None:
    if tuple(param.shape) != tuple(value.shape):
        raise ValueError(
            f"shape mismatch for {what}: checkpoint has {tuple(value.shape)}, "
            f"the model expects {tuple(param.shape)}"
        )
    param.data.copy_(value.to(param.dtype))


def default_weight_loader(param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
    copy_checked(param, read_loaded(loaded))


def set_loader(param: nn.Parameter, loader: Any) -> nn.Parameter:
    param.weight_loader = loader  # type: ignore[attr-defined]
    return param


def make_fp8(module: nn.Module, name: str, block: tuple[int, int]) -> None:
    """Replace ``module.<name>`` ([..., N, K], same device and loader) with an empty
    float8_e4m3fn parameter and add its block scales ``<name>_scale_inv`` [..., ceil(N / bn),
    ceil(K / bk)] (a buffer the loader fills from the checkpoint)."""
    old = getattr(module, name)
    *lead, n, k = old.shape
    fp8 = torch.empty(*lead, n, k, dtype=torch.float8_e4m3fn, device=old.device)
    setattr(module, name, set_loader(nn.Parameter(fp8, requires_grad=False), module.weight_loader))
    grid = (*lead, -(-n // block[0]), -(-k // block[1]))
    module.register_buffer(
        f"{name}_scale_inv", torch.zeros(grid, device=old.device), persistent=False
    )


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


def rope_parameters(config: Any) -> dict[str, Any]:
    """The config's rope settings as one dict (transformers 4.x and 5.x spellings)."""
    params = dict(getattr(config, "rope_parameters", None) or {})
    scaling = getattr(config, "rope_scaling", None)
    if scaling and not params.get("rope_type"):
        params.update(scaling)
    if "rope_theta" not in params:
        params["rope_theta"] = getattr(config, "rope_theta", 10000.0)
    params.setdefault("rope_type", params.pop("type", None) or "default")
    return params


def _llama3_inv_freq(inv_freq: torch.Tensor, p: dict[str, Any]) -> torch.Tensor:
    factor = float(p["factor"])
    low, high = float(p["low_freq_factor"]), float(p["high_freq_factor"])
    old_len = float(p["original_max_position_embeddings"])
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > old_len / low, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < old_len / high) & ~(wavelen > old_len / low)
    return torch.where(medium, smoothed, scaled)


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN's magnitude correction for a context extended ``scale`` times."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn_inv_freq(
    inv_freq: torch.Tensor, rotary_dim: int, p: dict[str, Any], max_position: int
) -> tuple[torch.Tensor, float]:
    """YaRN: interpolated low frequencies, extrapolated high ones, a linear ramp between the
    correction dims of ``beta_fast`` / ``beta_slow`` rotations; returns (inv_freq, the factor
    cos/sin are scaled by)."""
    old_len = float(p["original_max_position_embeddings"])
    factor = float(p.get("factor") or max_position / old_len)
    base = float(p.get("rope_theta", 10000.0))
    attention_factor = p.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all_dim = p.get("mscale"), p.get("mscale_all_dim")
        if mscale and mscale_all_dim:
            attention_factor = yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all_dim)
        else:
            attention_factor = yarn_mscale(factor)

    def correction_dim(rotations: float) -> float:
        return rotary_dim * math.log(old_len / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low = correction_dim(float(p.get("beta_fast") or 32))
    high = correction_dim(float(p.get("beta_slow") or 1))
    if p.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, rotary_dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(rotary_dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolate = 1 - ramp
    inv_freq = inv_freq / factor * (1 - extrapolate) + inv_freq * extrapolate
    return inv_freq, float(attention_factor)


_ROPE_CACHE: dict[tuple, RotaryEmbedding] = {}


def get_rope(
    rotary_dim: int, max_position: int, params: dict[str, Any], interleaved: bool = False
) -> RotaryEmbedding:
    """One rotary module (and cos/sin cache) per distinct setting, shared by all layers."""
    key = (
        rotary_dim,
        max_position,
        repr(sorted(params.items())),
        torch.get_default_dtype(),
        interleaved,
    )
    device = torch.empty(0).device
    rope = _ROPE_CACHE.get(key)
    if rope is None or rope.cos_sin.device != device:
        rope = _ROPE_CACHE[key] = RotaryEmbedding(rotary_dim, max_position, params, interleaved)
    return rope


def cover_positions(model: nn.Module, num_positions: int) -> None:
    """Size every rotary table of ``model`` for positions ``[0, num_positions)``: what the
    engine serves (``max_model_len`` plus a step's KV look-ahead), whatever the config says."""
    for m in model.modules():
        if isinstance(m, RotaryEmbedding):
            m.cover(num_positions)


class RotaryEmbedding(nn.Module):
    """Neox-style rotary embedding with a precomputed fp32 cos/sin cache."""

    def __init__(
        self, rotary_dim: int, max_position: int, params: dict[str, Any], interleaved: bool = False
    ) -> None:
        super().__init__()
        self.rotary_dim = rotary_dim
        self.interleaved = interleaved
        base = float(params.get("rope_theta", 10000.0))
        inv_freq = 1.0 / (
            base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim)
        )
        rope_type = params.get("rope_type", "default")
        self.attention_scaling = 1.0
        if rope_type == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, params)
        elif rope_type == "linear":
            inv_freq = inv_freq / float(params["factor"])
        elif rope_type == "yarn":
            inv_freq, self.attention_scaling = _yarn_inv_freq(
                inv_freq, rotary_dim, params, max_position
            )
        elif rope_type != "default":
            raise ValueError(
                f"rope_type {rope_type!r} is not supported; supported: default, linear, llama3, "
                "yarn"
            )
        self.inv_freq = inv_freq  # [rot/2] fp32; ``cover`` extends the table from it
        # Margin: speculative draft steps look up to 2K positions past the last real token.
        # The serving length may pass the config's (a draft head's config often says less than
        # its target serves): the worker calls ``cover_positions`` with what it serves.
        self.register_buffer("cos_sin", self._table(max_position + 64), persistent=False)

    def _table(self, num_positions: int) -> torch.Tensor:
        t = torch.arange(num_positions, dtype=torch.float32)
        freqs = torch.outer(t, self.inv_freq.to(t.device))  # [num_positions, rot/2]
        cos = freqs.cos() * self.attention_scaling
        sin = freqs.sin() * self.attention_scaling
        return torch.cat([cos, sin], dim=-1)

    def cover(self, num_positions: int) -> None:
        """Extend the cos/sin table to at least ``num_positions`` rows (the rotation of each
        position stays what it was: only the table's length depends on the serving length)."""
        if self.cos_sin.shape[0] < num_positions:
            self.cos_sin = self._table(num_positions).to(self.cos_sin.device)

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, Hq, D], k: [T, Hk, D]; rotates the first ``rotary_dim`` dims."""
        cos, sin = self.cos_sin[positions].chunk(2, dim=-1)  # [T, rot/2] each
        return self._apply(q, cos, sin), self._apply(k, cos, sin)

    def rotate(self, positions: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Every head of x [T, N, D] rotated (e.g. q and k heads side by side, as the fused qkv
        projection lays them out): one table lookup and a few whole-tensor ops instead of the
        per-half ops of ``forward``, with the same rounding. Returns a new [T, N, D] tensor."""
        if self.interleaved or self.rotary_dim != x.shape[-1]:
            cos, sin = self.cos_sin[positions].chunk(2, dim=-1)
            return self._apply(x, cos, sin)
        t, n, d = x.shape
        half = d // 2
        cs = self.cos_sin[positions].view(t, 1, 2, 1, half)  # [T, 1, (cos, sin), 1, D/2]
        cos, sin = cs[:, :, 0], cs[:, :, 1]
        halves = x.view(t, n, 2, half)  # (x1, x2) of every head
        if halves.dtype != torch.float32:
            halves = halves.float()
        out = halves * cos  # (x1 cos, x2 cos)
        swapped = halves.flip(2).mul_(sin)  # (x2 sin, x1 sin)
        out[:, :, 0].sub_(swapped[:, :, 0])  # x1 cos - x2 sin
        out[:, :, 1].add_(swapped[:, :, 1])  # x2 cos + x1 sin
        return out.view(t, n, d).to(x.dtype)

    def _apply(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        dtype = x.dtype
        rot = rot.float()
        cos, sin = cos.unsqueeze(-2), sin.unsqueeze(-2)
        if self.interleaved:
            x1, x2 = rot[..., 0::2], rot[..., 1::2]
            out = torch.stack([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).flatten(-2)
        else:
            x1, x2 = rot.chunk(2, dim=-1)
            out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)
        out = out.to(dtype)
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)


# ----------------------------------------------------------------------------- linears


def _packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None
) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


INT8_ROWS = "int8_rows"  # a weight's attribute: its (q, scale) from ``quantize_int8_``


def quantize_int8_(modules: Iterable[nn.Module]) -> int:
    """Int8 rows for the weight of every 2-D ``LinearBase`` / ``ParallelLMHead`` among
    ``modules`` (``speculative_config.draft_quantization``): each module computes with the
    dequantized values from then on (a new tensor, so a weight shared with another model keeps
    its own), and ``pack_weight`` packs the int8 rows themselves for the CPU fast path. Returns
    how many weights were quantized."""
    n = 0
    for m in modules:
        if not isinstance(m, (LinearBase, ParallelLMHead)) or m.weight.dim() != 2:
            continue
        q, scale = cpu_decode.quantize_int8(m.weight)
        weight = nn.Parameter(
            cpu_decode.dequantize_int8(q, scale, m.weight.dtype), requires_grad=False
        )
        setattr(weight, INT8_ROWS, (q, scale))
        m.weight = weight
        n += 1
    return n


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The CPU fast path's packed copy of ``weight``: its int8 rows where ``quantize_int8_``
    gave it some, else the weight itself."""
    rows = getattr(weight, INT8_ROWS, None)
    return cpu_decode.pack(weight) if rows is None else cpu_decode.pack_int8(*rows)


def _pack_for_cpu_matvec(modules: Iterable[nn.Module]) -> int:
    """Give each of ``modules`` whose weight is a CPU matrix in a fast-path dtype a packed copy
    (``fast_weight``), which its forward then reads through ``kernels.cpu_decode.linear`` (read
    once for all rows; the caller has loaded the extension). Returns how many were packed."""
    n = 0
    for m in modules:
        w = m.weight
        if w.device.type == "cpu" and w.dtype in cpu_decode.DTYPES and w.dim() == 2:
            m.fast_weight = pack_weight(w)
            n += 1
    return n


def use_cpu_matvec_lm_heads(model: nn.Module) -> int:
    """Route the logits of every unsharded CPU LM head in ``model`` through
    ``kernels.cpu_decode.linear``. Returns how many heads were switched."""
    heads = [m for m in model.modules() if isinstance(m, ParallelLMHead)]
    return _pack_for_cpu_matvec(m for m in heads if m.mapping.tp_size == 1)


def use_cpu_matvec_linears(model: nn.Module) -> int:
    """The same for every bias-free linear of ``model`` that no fast-path layer serves yet (a
    draft head's ``fc`` / ``eh_proj``, the layers of an eager MTP block)."""
    linears = [m for m in model.modules() if isinstance(m, LinearBase)]
    return _pack_for_cpu_matvec(m for m in linears if m.fast_weight is None and m.bias is None)


def pack_cpu_linears(model: nn.Module) -> int:
    """Give every bfloat16 linear and LM head of ``model`` on CPU (but those the fast path's
    packed copy already serves: ``fast_weight``) a copy of its weight in oneDNN's blocked layout, which its matrix-vector products read faster than the plain layout
    (decode is bound by reading weights). Inference only: the copy does not follow later
    in-place weight updates. Returns the number of packed weights; 0 where oneDNN bf16 is
    unavailable or disagrees with ``F.linear`` on a probe."""
    targets = [
        m
        for m in model.modules()
        if isinstance(m, (LinearBase, ParallelLMHead))
        and m.fast_weight is None  # the fast path's packed copy serves it
        and m.weight.device.type == "cpu"
        and m.weight.dtype == torch.bfloat16
        and m.weight.dim() == 2
    ]
    if not targets:
        return 0
    try:
        if not (
            torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
        ):
            return 0
        w = targets[0].weight.detach()
        probe = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(0))
        probe = probe.to(torch.bfloat16)
        packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        if not torch.allclose(
            _packed_linear(probe, packed, None).float(),
            F.linear(probe, w).float(),
            rtol=1e-2,
            atol=1e-2,
        ):
            return 0
    except (RuntimeError, AttributeError, NotImplementedError):
        return 0
    for m in targets:
        m.packed_weight = torch.ops.mkldnn._reorder_linear_weight(m.weight.detach(), 1)
    return len(targets)


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
            and x.shape[0] > 0
            and x.dtype == self.weight.dtype
        ):
            return cpu_decode.linear(x, self.fast_weight, self.weight.shape[0])
        if self.packed_weight is not None:
            return _packed_linear(x, self.packed_weight, bias)
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
        if (
            self.fast_weight is not None
            and hidden.dim() == 2
            and hidden.shape[0] > 0
            and hidden.dtype == self.weight.dtype
        ):
            return cpu_decode.linear(hidden, self.fast_weight, self.weight.shape[0])
        if self.packed_weight is not None:
            return _packed_linear(hidden, self.packed_weight, None)
        return F.linear(hidden, self.weight)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    n = x.shape[-1] // 2
    return F.silu(x[..., :n]) * x[..., n:]  # silu(gate) * up
