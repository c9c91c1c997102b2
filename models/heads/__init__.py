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
# The default K by running requests, adaptive per request: measured on a 2-core CPU (bf16,
# `tandem bench compare`, chat prompts): against K = 3 paused from 4 requests it is as fast at
# one stream (1.37x plain vs 1.38x), faster at four (1.14x vs 0.97x) and the same at sixteen
# (0.94x vs 0.93x: both draft nothing at 8+, the column's ramps run smaller batches).
DEFAULT_SCHEDULE = {"1": 3, "4": 2, "8": 0}


def builtin_head_path(method: str) -> str:
    """Folder of the shipped ``method`` head for the built-in model."""
    if method not in BUILTIN_HEADS:
        raise ValueError(f"no shipped {method!r} head; shipped: {sorted(BUILTIN_HEADS)}")
    return str(HEADS_DIR / BUILTIN_HEADS[method])


def builtin_speculative_config(spec: dict[str, Any] | None) -> dict[str, Any]:
    """The built-in model's speculative config. With none given: the shipped ``DEFAULT_METHOD``
    head with ``DEFAULT_SCHEDULE`` and ``adaptive``. A config of
    a shipped method without a ``model`` gets that method's shipped head (K = 3 unless given);
    other keys are the caller's (no implicit pause)."""
    if spec is None:
        spec = {
            "method": DEFAULT_METHOD,
            "num_speculative_tokens": dict(DEFAULT_SCHEDULE),
            "adaptive": True,
        }
    method = spec.get("method")
    if method in BUILTIN_HEADS and not spec.get("model"):
        return {
            "num_speculative_tokens": DEFAULT_NUM_SPECULATIVE_TOKENS,
            **spec,
            "model": builtin_head_path(method),
        }
    return spec
