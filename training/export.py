"""Write a trained draft head in the public checkpoint layout (fused q/k/v and gate/up split
back into their ``*_proj`` tensors), and initialise one for training."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

SAVE_DTYPE = torch.bfloat16  # heads ship in bf16; the loader casts to the serving dtype


def unfused_state(module: nn.Module) -> dict[str, torch.Tensor]:
    """Parameter name → tensor, with ``qkv_proj`` / ``gate_up_proj`` split (TP = 1 layout)."""
    out: dict[str, torch.Tensor] = {}
    for name, p in module.named_parameters():
        w = p.detach()
        if ".qkv_proj." in name:
            attn = module.get_submodule(name.rsplit(".qkv_proj.", 1)[0] + ".qkv_proj")
            d = attn.head_dim
            sizes = [attn.num_heads * d, attn.num_kv_heads * d, attn.num_kv_heads * d]
            for part, value in zip(("q", "k", "v"), w.split(sizes), strict=True):
                out[name.replace(".qkv_proj.", f".{part}_proj.")] = value
        elif ".gate_up_proj." in name:
            gate, up = w.chunk(2)
            out[name.replace(".gate_up_proj.", ".gate_proj.")] = gate
            out[name.replace(".gate_up_proj.", ".up_proj.")] = up
        else:
            out[name] = w
    return out


def save_head(
    folder: str | os.PathLike, tensors: dict[str, torch.Tensor], config: dict[str, Any]
) -> None:
    """``config.json`` + ``model.safetensors`` (floating tensors in bf16), written atomically."""
    from safetensors.torch import save_file

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    state = {
        k: (v.to(SAVE_DTYPE) if v.is_floating_point() else v).contiguous().cpu()
        for k, v in tensors.items()
    }
    tmp = folder / "model.safetensors.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    (folder / "model.safetensors").chmod(0o644)  # safetensors writes owner-only files
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def init_linear_(weight: torch.Tensor, generator: torch.Generator, std: float = 0.02) -> None:
    with torch.no_grad():
        weight.copy_(torch.randn(weight.shape, generator=generator, device="cpu") * std)
