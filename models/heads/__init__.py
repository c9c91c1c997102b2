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
# The default config pauses speculation at this many running requests: the shipped heads make
# a K = 3 step pay at one stream but not when a CPU step is already compute-bound.
DEFAULT_DISABLE_BY_BATCH_SIZE = 4


def builtin_head_path(method: str) -> str:
    """Folder of the shipped ``method`` head for the built-in model."""
    if method not in BUILTIN_HEADS:
        raise ValueError(f"no shipped {method!r} head; shipped: {sorted(BUILTIN_HEADS)}")
    return str(HEADS_DIR / BUILTIN_HEADS[method])


def builtin_speculative_config(spec: dict[str, Any] | None) -> dict[str, Any]:
    """The built-in model's speculative config. With none given: the shipped ``DEFAULT_METHOD``
    head, K = 3, paused while ``DEFAULT_DISABLE_BY_BATCH_SIZE`` or more requests run. A config of
    a shipped method without a ``model`` gets that method's shipped head (K = 3 unless given);
    other keys are the caller's (no implicit pause)."""
    if spec is None:
        spec = {"method": DEFAULT_METHOD, "disable_by_batch_size": DEFAULT_DISABLE_BY_BATCH_SIZE}
    method = spec.get("method")
    if method in BUILTIN_HEADS and not spec.get("model"):
        return {
            "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS,
            **spec,
            "model": builtin_head_path(method),
        }
    return spec
