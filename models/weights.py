"""Routing checkpoint tensors to parameters: fused q/k/v and gate/up, buffers, completeness."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from torch import nn

# checkpoint name fragment → (our fused parameter fragment, shard id)
STACKED_PARAMS = (
    ("q_proj", "qkv_proj", "q"),
    ("k_proj", "qkv_proj", "k"),
    ("v_proj", "qkv_proj", "v"),
    ("gate_proj", "gate_up_proj", 0),
    ("up_proj", "gate_up_proj", 1),
)


def load_named_weights(
    module: nn.Module, weights: Iterable[tuple[str, Any]], rename: Any
) -> set[str]:
    """Load (checkpoint name, tensor) pairs through ``rename(name) -> list[our name] | None``.

    Stacked q/k/v and gate/up projections are routed to their fused parameters. Returns the
    filled parameter keys (``name#shard`` for fused ones)."""
    params = dict(module.named_parameters())
    buffers = dict(module.named_buffers())
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        targets = rename(ckpt_name)
        if targets is None:
            continue
        for target in targets:
            name, shard = target, None
            for ckpt, ours, sid in STACKED_PARAMS:
                if f".{ckpt}." in target:
                    name, shard = target.replace(ckpt, ours), sid
                    break
            if name in buffers:
                value = tensor if hasattr(tensor, "shape") else tensor[:]
                if tuple(value.shape) != tuple(buffers[name].shape):
                    raise ValueError(
                        f"{ckpt_name}: shape mismatch: checkpoint has {tuple(value.shape)}, "
                        f"the model expects {tuple(buffers[name].shape)}"
                    )
                buffers[name].copy_(value.to(buffers[name].dtype))
                loaded.add(name)
                continue
            if name not in params:
                raise ValueError(f"unexpected tensor in checkpoint: {ckpt_name}")
            param = params[name]
            try:
                param.weight_loader(param, tensor, shard)
            except ValueError as e:
                raise ValueError(f"{ckpt_name}: {e}") from None
            loaded.add(name if shard is None else f"{name}#{shard}")
    return loaded


def expected_keys(module: nn.Module, skip: set[str] = frozenset()) -> set[str]:
    out: set[str] = set()
    for name, _ in module.named_parameters():
        if name in skip:
            continue
        if "qkv_proj" in name:
            out.update(f"{name}#{s}" for s in ("q", "k", "v"))
        elif "gate_up_proj" in name:
            out.update(f"{name}#{s}" for s in (0, 1))
        else:
            out.add(name)
    return out
