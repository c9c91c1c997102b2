"""Routing checkpoint tensors to parameters: fused q/k/v and gate/up, buffers, completeness."""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable
from typing import Any

import torch
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
            load_param(params, name, tensor, shard, ckpt_name)
            loaded.add(name if shard is None else f"{name}#{shard}")
    return loaded


def load_param(
    params: dict[str, nn.Parameter], name: str, tensor: Any, shard: Any, ckpt_name: str
) -> None:
    """``tensor`` (checkpoint ``ckpt_name``) into our parameter ``name`` through its loader;
    errors name the checkpoint tensor."""
    if name not in params:
        raise ValueError(f"unexpected tensor in checkpoint: {ckpt_name}")
    param = params[name]
    try:
        param.weight_loader(param, tensor, shard)
    except ValueError as e:
        raise ValueError(f"{ckpt_name}: {e}") from None


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
    """``param.weight_loader = loader``; a module's own method is held weakly (the module holds
    the parameter: a strong method would make a cycle that keeps the module's weights alive
    past the last reference, until a full collection)."""
    if inspect.ismethod(loader):
        method = weakref.WeakMethod(loader)

        def call_method(*args: Any, **kwargs: Any) -> Any:
            return method()(*args, **kwargs)  # type: ignore[misc]

        loader = call_method
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
