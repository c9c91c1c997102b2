"""FP8 checkpoints: the ``quantization_config`` they carry and a lazy view that reads an FP8
weight as its dequantized values.

Format (DeepSeek-V3/R1, ``quant_method: fp8``): a quantized linear stores ``X.weight``
(float8_e4m3fn, [N, K], or [E, N, K] for fused experts) and ``X.weight_scale_inv`` (float32,
[ceil(N / bn), ceil(K / bk)]) with ``[bn, bk] = weight_block_size``; the real weight is each
block times its scale (the name notwithstanding), and edge blocks are partial. Per-tensor
exports store a scalar ``X.weight_scale`` instead (``weight_block_size`` absent). Which modules
are quantized is whatever carries a scale.

Every weight loader reads its rank's slice through ``DequantizedWeight``, which reads only that
slice's FP8 bytes and the scale blocks covering it, so TP shards need not be block aligned.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

logger = logging.getLogger(__name__)

FP8_DTYPE = torch.float8_e4m3fn
FP8_MAX = 448.0  # largest finite float8_e4m3fn
_FP8_STORED = ("F8_E4M3",)
SCALE_SUFFIXES = ("weight_scale_inv", "weight_scale")
_SKIPPED_SUFFIXES = ("input_scale", "activation_scale")


@dataclass(frozen=True)
class Fp8Scheme:
    """``quantization_config`` of an FP8 checkpoint. ``block``: (bn, bk), None = per tensor."""

    block: tuple[int, int] | None
    modules_to_not_convert: tuple[str, ...] = ()

    def expects_quantized(self, weight_name: str) -> bool:
        module = weight_name.rsplit(".", 1)[0]
        return not any(
            module == m or module.startswith(m + ".") or module.endswith("." + m)
            for m in self.modules_to_not_convert
        )


def fp8_scheme(config: Any) -> Fp8Scheme | None:
    """The checkpoint's FP8 scheme, None when it is not quantized; a ``ValueError`` naming the
    field for what we do not serve."""
    qc = getattr(config, "quantization_config", None)
    if not qc:
        return None
    if not isinstance(qc, dict):
        qc = qc.to_dict() if hasattr(qc, "to_dict") else dict(vars(qc))
    method = qc.get("quant_method")
    if method == "mxfp4" and getattr(config, "model_type", None) == "gpt_oss":
        return None  # gpt-oss's MXFP4 experts: models/gpt_oss.py reads them; the rest is plain
    if method != "fp8":
        raise ValueError(
            f"quantization_config.quant_method={method!r} is not supported; supported: 'fp8' "
            "(block-wise float8_e4m3fn weights as DeepSeek-V3/R1 ship them, or per-tensor)"
        )
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ValueError(f"quantization_config.fmt={fmt!r} is not supported; supported: 'e4m3'")
    scheme = qc.get("activation_scheme", "dynamic")
    if scheme != "dynamic":
        raise ValueError(
            f"quantization_config.activation_scheme={scheme!r} is not supported; supported: "
            "'dynamic' (activations are quantized per token at run time)"
        )
    block = qc.get("weight_block_size")
    if block is not None:
        if len(block) != 2 or not all(isinstance(b, int) and b > 0 for b in block):
            raise ValueError(
                f"quantization_config.weight_block_size={block!r}: expected two positive "
                "integers [rows, columns]"
            )
        block = (int(block[0]), int(block[1]))
    skip = tuple(qc.get("modules_to_not_convert") or ())
    return Fp8Scheme(block, skip)


def _normalize_index(index: Any, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    """[start, stop) per dimension for the indexing the weight loaders use: slices with step 1
    (``x[:]``, ``x[a:b]``, ``x[:, a:b]``, ...)."""
    parts = index if isinstance(index, tuple) else (index,)
    if len(parts) > len(shape):
        raise IndexError(f"too many indices for a tensor of shape {shape}")
    ranges = []
    for dim, size in enumerate(shape):
        part = parts[dim] if dim < len(parts) else slice(None)
        if not isinstance(part, slice) or part.step not in (None, 1):
            raise IndexError(f"an FP8 weight is read by unit-step slices only, not {part!r}")
        start, stop, _ = part.indices(size)
        ranges.append((start, max(start, stop)))
    return ranges


def expand_block_scales(
    scale: torch.Tensor, rows: tuple[int, int], cols: tuple[int, int], block: tuple[int, int]
) -> torch.Tensor:
    """The per-element scales of rows [r0, r1) x columns [c0, c1) from a block grid
    ``scale`` [..., ceil(N / bn), ceil(K / bk)]."""
    (r0, r1), (c0, c1), (bn, bk) = rows, cols, block
    grid = scale[..., r0 // bn : -(-r1 // bn), c0 // bk : -(-c1 // bk)]
    full = grid.repeat_interleave(bn, dim=-2).repeat_interleave(bk, dim=-1)
    return full[..., r0 % bn : r0 % bn + r1 - r0, c0 % bk : c0 % bk + c1 - c0]


class DequantizedWeight:
    """An FP8 checkpoint weight read as float32 ``q * scale``, lazily: indexing it (as a lazy
    safetensors slice is indexed) reads only the covered FP8 bytes and scale blocks."""

    def __init__(
        self,
        name: str,
        data: Any,
        scale: torch.Tensor,
        block: tuple[int, int] | None,
        scale_name: str | None = None,
    ) -> None:
        """``scale_name``: the scale tensor as the checkpoint names it (for errors)."""
        self.name = name
        self.scale_name = scale_name or f"{name}_scale_inv"
        self.data = data  # a torch tensor or a lazy safetensors slice of float8_e4m3fn
        self.scale = scale.float()
        self.block = block
        self.shape = tuple(data.shape if isinstance(data, torch.Tensor) else data.get_shape())
        self._check_scale()

    def _check_scale(self) -> None:
        if self.block is None:
            if self.scale.numel() != 1:
                raise ValueError(
                    f"{self.name}: a per-tensor FP8 weight needs one scale, the checkpoint has "
                    f"{tuple(self.scale.shape)} (a block grid needs weight_block_size in "
                    "quantization_config)"
                )
            return
        if len(self.shape) < 2:
            raise ValueError(f"{self.name}: a block-quantized FP8 weight must be 2-D or 3-D")
        bn, bk = self.block
        n, k = self.shape[-2:]
        grid = (*self.shape[:-2], math.ceil(n / bn), math.ceil(k / bk))
        if tuple(self.scale.shape) != grid:
            expected = (
                f"quantization_config.weight_block_size {list(self.block)} expects "
                f"{self.name}_scale_inv of shape {grid}, a grid of the weight {self.shape}"
            )
            if self.scale.numel() == 1:
                raise ValueError(
                    f"{self.scale_name}: a per-tensor scale (shape {tuple(self.scale.shape)}), "
                    f"but {expected}; a per-tensor checkpoint has no weight_block_size"
                )
            raise ValueError(
                f"{self.scale_name}: shape {tuple(self.scale.shape)} does not match the "
                f"weight {self.shape} in blocks of {list(self.block)}; {expected}"
            )

    def get_shape(self) -> list[int]:
        return list(self.shape)

    def __getitem__(self, index: Any) -> torch.Tensor:
        ranges = _normalize_index(index, self.shape)
        q = self.data[tuple(slice(a, b) for a, b in ranges)].to(torch.float32)
        if self.block is None:
            return q * self.scale.reshape(())
        lead = tuple(slice(a, b) for a, b in ranges[:-2])
        return q * expand_block_scales(self.scale[lead], ranges[-2], ranges[-1], self.block)

    def raw(
        self, dim: int | None, start: int = 0, size: int = 0
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The stored FP8 values and their scale blocks for ``[start, start + size)`` along
        ``dim`` of the last two (None: all; dim 0 of a 3-D tensor: experts), for a layer that
        keeps FP8 weights; the slice must start on a block boundary."""
        if dim is None:
            return self.data[:], self.scale
        if self.block is None:
            raise ValueError(f"{self.name}: per-tensor FP8 weights are not kept as FP8")
        nd = len(self.shape)
        if nd == 3 and dim == 0:
            return self.data[start : start + size], self.scale[start : start + size]
        axis = dim + nd - 2  # a row or column of the last two dims
        unit = self.block[axis - (nd - 2)]
        if start % unit:
            raise ValueError(f"{self.name}: slice at {start} does not start on an FP8 block")
        index = [slice(None)] * nd
        index[axis] = slice(start, start + size)
        scale_index = [slice(None)] * nd
        scale_index[axis] = slice(start // unit, -(-(start + size) // unit))
        return self.data[tuple(index)], self.scale[tuple(scale_index)]


def fp8_compute_unavailable(device: torch.device) -> str | None:
    """Why weights cannot stay FP8 on ``device`` (None: they can): FP8 GEMMs need the GPU
    paths, Triton and FP8 tensor cores (compute capability 8.9)."""
    from tandem.kernels.fp8 import FP8_MIN_CAPABILITY
    from tandem.kernels.launch import FORCE_GPU_PATHS, HAS_TRITON, gpu_paths

    if not gpu_paths(device):
        return "a CPU computes with dequantized weights"
    if not HAS_TRITON:
        return "Triton is not installed"
    if device.type == "cuda" and not FORCE_GPU_PATHS:
        cap = torch.cuda.get_device_capability(device)
        if cap < FP8_MIN_CAPABILITY:
            return f"this GPU (sm_{cap[0]}{cap[1]}) has no FP8 tensor cores (sm_89 and newer)"
    return None


def keep_fp8_weights(model: torch.nn.Module, block: tuple[int, int]) -> int:
    """Make every layer of ``model`` that can (``fp8_fits``: its TP shards start on whole
    blocks; ``fp8_allowed``) store its weight as FP8 with its block scales, before loading. A
    layer whose checkpoint weight then turns out not to be FP8 goes back to its dtype. Returns
    how many layers were switched."""
    n = 0
    for m in model.modules():
        if getattr(m, "fp8_allowed", False) and m.fp8_fits(block):
            m.to_fp8(block)
            n += 1
    return n


def _stored_fp8(tensor: Any) -> bool:
    if isinstance(tensor, torch.Tensor):
        return tensor.dtype == FP8_DTYPE
    return tensor.get_dtype() in _FP8_STORED


def read_scales(files: list[Path]) -> dict[str, torch.Tensor]:
    """Every FP8 scale tensor of a checkpoint (a few bytes per 16K weights), by name."""
    scales: dict[str, torch.Tensor] = {}
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name.endswith(SCALE_SUFFIXES):
                    scales[name] = fh.get_tensor(name)
    return scales


def dequantize_fp8(
    weights: Iterable[tuple[str, Any]],
    scheme: Fp8Scheme | None,
    scales: dict[str, torch.Tensor],
    where: str,
) -> Iterator[tuple[str, Any]]:
    """(name, tensor) pairs with every FP8 weight replaced by its ``DequantizedWeight`` and the
    scales themselves left out. A float8 tensor without a scale, a scale on a module the
    config says is not converted, or float8 tensors in a checkpoint whose config names no FP8
    scheme are ``ValueError``s."""
    skipped_activation_scales = 0
    for name, tensor in weights:
        if name.endswith(SCALE_SUFFIXES):
            continue
        if name.endswith(_SKIPPED_SUFFIXES):
            skipped_activation_scales += 1
            continue
        if not _stored_fp8(tensor):
            yield name, tensor
            continue
        if scheme is None:
            raise ValueError(
                f"{where}: {name} is stored in float8 but config.json has no "
                "quantization_config naming an FP8 scheme"
            )
        if not scheme.expects_quantized(name):
            raise ValueError(
                f"{where}: {name} is stored in float8 but quantization_config."
                "modules_to_not_convert lists its module"
            )
        scale_name = next((name + s for s in ("_scale_inv", "_scale") if name + s in scales), "")
        if not scale_name:
            raise ValueError(
                f"{where}: {name} is stored in float8 without a scale ({name}_scale_inv or "
                f"{name}_scale)"
            )
        yield name, DequantizedWeight(name, tensor, scales[scale_name], scheme.block, scale_name)
    if skipped_activation_scales:
        logger.info(
            "%s: %d static activation scales not used (activations are quantized dynamically)",
            where,
            skipped_activation_scales,
        )


def quantize_fp8_blockwise(
    weight: torch.Tensor, block: tuple[int, int], power_of_two: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """``weight`` [..., N, K] → (float8_e4m3fn [..., N, K], scale_inv float32 [..., ceil(N/bn),
    ceil(K/bk)]) with ``weight ≈ q * scale_inv`` per block (amax / 448 per block;
    ``power_of_two`` rounds each scale up to a power of two, so dequantized values are exact in
    bfloat16 too)."""
    bn, bk = block
    *lead, n, k = weight.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(*lead, gn * bn, gk * bk, dtype=torch.float32, device=weight.device)
    padded[..., :n, :k] = weight.float()
    blocks = padded.reshape(*lead, gn, bn, gk, bk)
    amax = blocks.abs().amax(dim=(-3, -1)).clamp_min(1e-12)  # [..., gn, gk]
    scale = amax / FP8_MAX
    if power_of_two:
        scale = torch.exp2(torch.ceil(torch.log2(scale)))
    q = (blocks / scale[..., :, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.reshape(*lead, gn * bn, gk * bk)[..., :n, :k].contiguous()
    return q, scale.contiguous()


def dequantize_fp8_blockwise(
    q: torch.Tensor, scale: torch.Tensor, block: tuple[int, int], dtype: torch.dtype
) -> torch.Tensor:
    """The inverse of ``quantize_fp8_blockwise``: ``q * scale`` per block, in ``dtype``."""
    n, k = q.shape[-2:]
    return (q.float() * expand_block_scales(scale, (0, n), (0, k), block)).to(dtype)
