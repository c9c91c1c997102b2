"""Speculative-decoding contracts shared by the runner, the sampler and the draft layers, and
the step's verify layout (``VerifyLayout``), which the step types carry and the decoders read.

``SpecMetadata.wants_advanced_draft_sampling`` is the one predicate that decides whether draft
tokens are sampled (rejection sampling needs q) or taken by argmax; every branch reads it, so
they cannot diverge. ``draft_layer_picks_rows`` decides whether a draft layer runs its
post-attention part only on the rows the draft loop reads.
"""

from __future__ import annotations

import inspect
import os
from dataclasses import dataclass, field
from typing import Any

from torch import Tensor, nn

from tandem.models.parallel import ParallelMapping

DISABLE_ROW_PICK_ENV = "TLLM_SPEC_DISABLE_DRAFT_ROW_PICK"


@dataclass
class SpecMetadata:
    """Per-step speculative state, rebuilt every step."""

    num_speculative_tokens: int
    use_rejection_sampling: bool
    is_all_greedy_sample: bool = True  # this rank's pre-scan
    group_all_greedy_sample: bool | None = None  # AND over the TP group (ADP + LM-head TP)

    def reset_group_flag(self) -> None:
        """Clear the previous step's group value before this step's local scan."""
        self.group_all_greedy_sample = None

    @property
    def all_greedy(self) -> bool:
        if self.group_all_greedy_sample is not None:
            return self.group_all_greedy_sample
        return self.is_all_greedy_sample

    @property
    def wants_advanced_draft_sampling(self) -> bool:
        """Sample drafts (and keep q) only when rejection sampling will read them."""
        return self.use_rejection_sampling and not self.all_greedy


def _forward_takes_pick_rows(layer: nn.Module) -> bool:
    forward = type(layer).forward
    try:
        return "pick_rows" in inspect.signature(forward).parameters
    except (TypeError, ValueError):
        return False


def row_pick_disabled_by_env() -> bool:
    return os.environ.get(DISABLE_ROW_PICK_ENV, "0").strip().lower() in ("1", "true", "yes")


def draft_layer_picks_rows(
    layer: nn.Module,
    mapping: ParallelMapping,
    *,
    num_draft_layers: int = 1,
    vanilla_mtp: bool = False,
    disabled: bool = False,
) -> bool:
    """Whether ``layer`` should run its post-attention part on the picked rows only.

    Capability (``supports_pick_rows``), the layer class's own ``forward`` taking ``pick_rows``
    (a subclass overriding ``forward`` without it falls back), instance eligibility (an Eagle3
    draft with more than one layer declines), the switches (``disabled``: the speculative
    config's ``disable_draft_row_pick``; the environment variable), and declined
    configurations (vanilla MTP under attention DP)."""
    if not getattr(type(layer), "supports_pick_rows", False):
        return False
    if not _forward_takes_pick_rows(layer):
        return False
    if num_draft_layers > 1 and not vanilla_mtp:
        return False
    if disabled or row_pick_disabled_by_env():
        return False
    if vanilla_mtp and mapping.enable_attention_dp:
        return False
    return True


class DraftRowPick:
    """Caches ``draft_layer_picks_rows`` per (layer class, eligibility) and re-evaluates when
    either changes. One resolver is shared by all workers of a process."""

    def __init__(self) -> None:
        self._key: tuple[Any, ...] | None = None
        self._value = False
        self.evaluations = 0

    def resolve(
        self,
        layer: nn.Module,
        mapping: ParallelMapping,
        *,
        num_draft_layers: int = 1,
        vanilla_mtp: bool = False,
        disabled: bool = False,
    ) -> bool:
        key = (
            type(layer),
            num_draft_layers,
            vanilla_mtp,
            mapping.enable_attention_dp,
            disabled or row_pick_disabled_by_env(),
        )
        if key != self._key:
            self._value = draft_layer_picks_rows(
                layer,
                mapping,
                num_draft_layers=num_draft_layers,
                vanilla_mtp=vanilla_mtp,
                disabled=disabled,
            )
            self._key = key
            self.evaluations += 1
        return self._value


ROW_PICK_RESOLVER = DraftRowPick()


@dataclass
class VerifyLayout:
    """Where each sampled request's verify rows sit in the step's rows."""

    rows: Tensor  # [B, K + 1] row index of verify position j (clamped past num_drafts)
    drafts: Tensor  # [B, K] draft tokens being verified (0-padded)
    num_drafts: Tensor  # [B]
    first_row: Tensor  # [B] row of the last accepted token (verify position 0)
    positions: Tensor  # [B] position of that row
    block_tables: Tensor  # [B, max_blocks] of the sampled requests
    row_owner: Tensor  # [T] index of the sampled request owning each row, -1 for other rows
    max_seq_len: int  # host bound on any sampled request's KV length after the draft loop
    # [B, max_blocks] the window group's tables (sliding-window layers), None without one.
    window_block_tables: Tensor | None = field(default=None, kw_only=True)
