"""Draft heads that ship with Tandem, trained by ``tandem train-draft`` for the built-in model
(SmolLM2-135M-Instruct). Each folder holds ``config.json``, ``model.safetensors`` (bf16) and a
``README.md`` card with its data, training run and measured acceptance."""

from __future__ import annotations

from pathlib import Path
from typing import Any

HEADS_DIR = Path(__file__).resolve().parent
BUILTIN_HEADS = {
    "eagle3": "smollm2-135m-instruct-eagle3",
    "mtp": "smollm2-135m-instruct-mtp",
}
DEFAULT_METHOD = "eagle3"
DEFAULT_NUM_SPECULATIVE_TOKENS = 3


def builtin_head_path(method: str) -> str:
    """Folder of the shipped ``method`` head for the built-in model."""
    if method not in BUILTIN_HEADS:
        raise ValueError(f"no shipped {method!r} head; shipped: {sorted(BUILTIN_HEADS)}")
    return str(HEADS_DIR / BUILTIN_HEADS[method])


def builtin_speculative_config(spec: dict[str, Any] | None) -> dict[str, Any] | None:
    """The built-in model's speculative config. A config of a shipped method without a ``model``
    gets that method's shipped head (K = 3 unless given).

    With none given the built-in model serves without speculation: the shipped heads reach 1.45 to
    1.62 tokens per step on the eval set (see their cards), and at that rate a K = 3 step gains
    little on a CPU at one stream (Eagle3, bf16: 0.96-1.26x over several machines and runs) and
    loses with four or more streams (0.45-0.73x; 0.92-0.97x with ``disable_by_batch_size`` 4).
    ``DEFAULT_METHOD`` becomes the default once a head clears 2 tokens per step."""
    if spec is None:
        return None
    method = spec.get("method")
    if method in BUILTIN_HEADS and not spec.get("model"):
        return {
            "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS,
            **spec,
            "model": builtin_head_path(method),
        }
    return spec
