"""A separate causal LM as the draft (speculative method ``draft_model``): any architecture we
serve as a target, with the target's tokenizer, loaded with its own paged KV cache beside the
target's (the same block tables), sharded like the target or replicated on every rank.

``load_draft_model`` (models/loader.py) loads it. The draft loop
(engine/speculative/draft_model.py) runs it unshifted: its KV slot p holds token
p at position p, as its own ``generate`` would; it reads no target hidden states."""

from __future__ import annotations

import os
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tandem.models.attention import AttentionMetadata, PagedAttention
from tandem.models.checkpoint import safetensors_files
from tandem.models.llama import enable_cpu_fast_path
from tandem.models.parallel import ParallelMapping


class DraftModel(nn.Module):
    """A causal LM behind the draft-head interface the runner and the decoder read (``dtype``,
    ``config``, ``attention_layers``, ``compute_logits``, ``final_norm``, ``lm_head_weight``).
    ``forward`` runs the whole model: there is one "layer", and no target hidden input."""

    num_layers = 1

    def __init__(self, model: nn.Module, dtype: torch.dtype) -> None:
        """``dtype``: the one ``model`` was built in (its activations and KV cache)."""
        super().__init__()
        self.model = model
        self.config = model.config
        self._dtype = dtype

    @property
    def dtype(self) -> torch.dtype:
        return self._dtype

    def attention_layers(self) -> list[PagedAttention]:
        return self.model.attention_layers()

    def enable_cpu_fast_path(self) -> str | None:
        """The Llama stack's CPU fast path, as a target gets it (None: enabled)."""
        return enable_cpu_fast_path(self.model)

    def combine_hidden(self, captured: list[torch.Tensor]) -> torch.Tensor:
        raise RuntimeError("a draft model reads no target hidden states (none are captured)")

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids  # the same vocabulary (checked at load)

    def final_norm(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor:
        return hidden  # ``forward`` returns the final normed hidden states

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The LM head's weight: full where the head is replicated (one rank, attention DP)."""
        return self.model.lm_head.weight

    def compute_logits(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor:
        """[T, V] logits of normed hidden states [T, H]."""
        return self.model.compute_logits(hidden)

    def forward(
        self,
        layer_index: int,
        positions: torch.Tensor,
        token_ids: torch.Tensor,
        hidden: torch.Tensor | None,
        meta: AttentionMetadata,
        pick_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """The model over ``token_ids`` at ``positions`` (writing its KV at ``meta``'s slots):
        the final normed hidden states [T, H], or of ``pick_rows`` only. ``hidden`` (the
        target's) is not read."""
        out, _ = self.model(token_ids, positions, meta)
        return out if pick_rows is None else out[pick_rows]


def draft_mapping(spec: Any, mapping: ParallelMapping) -> ParallelMapping:
    """The draft's mapping: the target's (``draft_tensor_parallel_size`` None or the target's
    size) or a single-rank one (1: the draft replicated on every rank)."""
    tp = spec.draft_tensor_parallel_size
    if tp is None or tp == mapping.tp_size:
        return mapping
    if tp != 1:
        raise ValueError(
            f"speculative_config.draft_tensor_parallel_size={tp}: the draft model runs on 1 rank "
            f"(replicated) or on the target's tensor_parallel_size ({mapping.tp_size})"
        )
    return ParallelMapping()


def checkpoint_num_params(folder: str | os.PathLike) -> int:
    """Elements stored in a checkpoint's tensors (read from the safetensors headers)."""
    n = 0
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                n += int(torch.Size(fh.get_slice(name).get_shape()).numel())
    return n
