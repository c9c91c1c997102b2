"""The CPU decode fast path's view of the linears: weights packed for its matrix products (and
the eager layers of larger steps), GGUF-style blocks (``--cpu-weights``, draft heads'
``draft_quantization``), and the
matrix-vector path of LM heads and draft linears."""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels import cpu_decode
from tandem.models.layers import (
    LinearBase,
    ParallelLMHead,
    VocabParallelEmbedding,
    packed_linear,
)

QUANT_BLOCKS = "quant_blocks"  # a weight's attribute: its (q, d, m) from ``set_blocks_``
Blocks = cpu_decode.Blocks


def set_blocks_(
    module: nn.Module, q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None
) -> None:
    """``module`` computes with Q8_0 (``m`` None) or Q4_1 blocks ``(q, d, m)`` from now on: its
    eager forward with their dequantized values (a new tensor), ``pack_weight`` packs the
    blocks themselves for the CPU fast path."""
    old = module.weight
    if tuple(q.shape) != tuple(old.shape):
        raise ValueError(f"quantized blocks {tuple(q.shape)} for a weight {tuple(old.shape)}")
    weight = nn.Parameter(cpu_decode.dequantize_blocks(q, d, m, old.dtype), requires_grad=False)
    setattr(weight, QUANT_BLOCKS, (q, d, m))
    module.weight = weight


def builtin_blocks(model: str, cpu_weights: str) -> dict[str, Blocks] | None:
    """The blocks ``quantize_blocks_`` takes for ``cpu_weights``: "q4" the built-in model's own
    (``model``: its converted folder), "q8" none (quantized from the weights)."""
    if cpu_weights != "q4":
        return None
    from tandem.models.builtin import builtin_source, gguf_blocks

    source = builtin_source(model)
    if source is None:
        raise ValueError(f"cpu_weights='q4': {model} is not the built-in model's folder")
    return gguf_blocks(source)


def quantize_blocks_(model: nn.Module, blocks: dict[str, Blocks] | None = None) -> int:
    """The CPU weights of ``model``'s bias-free 2-D linears and unsharded LM heads as blocks
    (``--cpu-weights``, a draft head's ``draft_quantization``): ``blocks`` by module name where
    given (the built-in model's GGUF values, ``models.builtin.gguf_blocks``), else Q8_0
    quantized here from the weight (rows a multiple of 32 long). Each module computes with the
    dequantized values from then on (a new tensor: a tied embedding, or a matrix shared with
    another model, keeps its own). Returns how many matrices were quantized."""
    n = 0
    for name, m in model.named_modules():
        if isinstance(m, LinearBase):
            if m.bias is not None or m.weight.dim() != 2:
                continue
        elif not isinstance(m, ParallelLMHead) or m.mapping.tp_size != 1:
            continue
        w = m.weight
        if w.device.type != "cpu" or w.shape[1] % cpu_decode.QBLOCK or hasattr(w, QUANT_BLOCKS):
            continue  # (a matrix shared with the target, an MTP head's LM head: done there)
        if blocks is not None:
            if name not in blocks:
                continue
            set_blocks_(m, *blocks[name])
        else:
            q, d = cpu_decode.quantize_q8_0(m.weight)
            set_blocks_(m, q, d, None)
        n += 1
    return n


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The CPU fast path's packed copy of ``weight``: its quantized blocks where ``set_blocks_``
    gave it some, else the weight itself."""
    blocks = getattr(weight, QUANT_BLOCKS, None)
    return cpu_decode.pack(weight) if blocks is None else cpu_decode.pack_blocks(*blocks)


def release_dense_weights_(model: nn.Module) -> int:
    """Free the dense weight of every bias-free linear and LM head of ``model`` whose products
    all read the CPU fast path's packed copy (``fast_weight``: the eager steps' products too),
    so the model is held once, not twice: each such ``weight`` becomes a meta tensor of its
    shape and dtype (a read of its values fails loudly, never computes with zeros). A weight
    an embedding shares (tied) stays. Inference only. Returns how many were freed."""
    embeddings = {
        id(m.weight)
        for m in model.modules()
        if isinstance(m, (nn.Embedding, VocabParallelEmbedding))
        and not isinstance(m, ParallelLMHead)
    }
    n = 0
    for m in model.modules():
        if not isinstance(m, (LinearBase, ParallelLMHead)) or m.fast_weight is None:
            continue
        w = m.weight
        if getattr(m, "bias", None) is not None or w.device.type != "cpu" or id(w) in embeddings:
            continue
        m.weight = nn.Parameter(torch.empty(w.shape, dtype=w.dtype, device="meta"), False)
        n += 1
    return n


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
            packed_linear(probe, packed, None).float(),
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
