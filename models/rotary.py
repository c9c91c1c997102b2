"""Rotary position embeddings: the config's rope settings (default, linear, Llama 3, YaRN), one
cos/sin table per distinct setting shared by every layer, sized for the positions the engine
serves (``cover_positions``)."""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn


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
