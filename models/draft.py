"""What every draft head shares: one decoder-style layer per draft step, the target's embedding,
and the forward signature the draft loop calls."""

from __future__ import annotations

import torch
from torch import nn

from tandem.models.attention import AttentionMetadata, PagedAttention


def post_attention(
    layer: nn.Module,
    x: torch.Tensor,
    residual: torch.Tensor,
    meta: AttentionMetadata,
    pick_rows: torch.Tensor | None,
) -> torch.Tensor:
    """A draft layer's per-token tail (residual add, post-attention norm, MLP), on ``pick_rows``
    only when given; under attention DP the MLP is sized by the matching per-rank counts."""
    if pick_rows is not None:
        x, residual = x[pick_rows], residual[pick_rows]
    x, residual = layer.post_attention_layernorm(x, residual)
    counts = meta.all_rank_num_tokens if pick_rows is None else meta.all_rank_num_picked
    return layer.mlp(x, counts) + residual


class DraftHead(nn.Module):
    """A draft head: ``layers[i]`` takes (positions, embeds, hidden, meta[, pick_rows])."""

    num_layers: int = 1
    embed_tokens: nn.Module | None = None  # the target's, bound by ``bind_target``

    @property
    def layers(self) -> list[nn.Module]:
        raise NotImplementedError

    @property
    def dtype(self) -> torch.dtype:
        """The dtype the head computes in (its layers' weights; Eagle3 may differ from the
        target's: ``speculative_config.draft_dtype``)."""
        return next(self.layers[0].parameters()).dtype

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.layers]

    def enable_cpu_fast_path(self) -> str | None:
        """Run the head's layers through ``kernels/cpu_decode`` where they qualify (the caller
        has loaded the extension); returns why not (None: enabled)."""
        return f"no CPU fast path for {type(self).__name__}"

    def combine_hidden(self, captured: list[torch.Tensor]) -> torch.Tensor:
        """The draft's hidden input from captured target states (Eagle3 only)."""
        raise NotImplementedError

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids

    def final_norm(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor:
        """The norm before the LM head (``compute_logits`` = head(final_norm(hidden)))."""
        raise NotImplementedError

    @property
    def lm_head_weight(self) -> torch.Tensor:
        """The full (replicated) draft LM-head weight, [draft_V, H]."""
        raise NotImplementedError

    def writes_kv_alone(self, layer_index: int = 0) -> bool:
        """Whether ``write_kv`` runs only the KV part of draft layer ``layer_index`` (else the
        whole layer)."""
        layer = self.layers[layer_index]
        attn = getattr(layer, "self_attn", None)
        return hasattr(layer, "write_kv") and callable(getattr(attn, "write_kv", None))

    def write_kv(
        self,
        layer_index: int,
        positions: torch.Tensor,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Draft layer ``layer_index``'s KV for every row, as ``forward`` writes it, for a step
        that reads no draft output (it drafts nothing, or its chunks sample nothing): only the
        inputs and the K/V projection run, no attention and no MLP, where the layer can and no
        other rank waits on the skipped collectives (under attention DP the MLP gathers every
        rank's rows: there the whole layer runs)."""
        layer = self.layers[layer_index]
        if meta.all_rank_num_tokens is not None or not self.writes_kv_alone(layer_index):
            self.forward(layer_index, positions, token_ids, hidden, meta)
            return
        assert self.embed_tokens is not None
        dtype = self.dtype
        layer.write_kv(positions, self.embed_tokens(token_ids).to(dtype), hidden.to(dtype), meta)

    def forward(
        self,
        layer_index: int,
        positions: torch.Tensor,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        pick_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Run draft layer ``layer_index``; layers that do not pick rows are called without
        the argument, exactly as before row picking existed."""
        assert self.embed_tokens is not None
        layer = self.layers[layer_index]
        # The target's embedding and hidden states, in the head's dtype (no-op when the same).
        dtype = self.dtype
        embeds = self.embed_tokens(token_ids).to(dtype)
        hidden = hidden.to(dtype)
        if pick_rows is None:
            return layer(positions, embeds, hidden, meta)
        return layer(positions, embeds, hidden, meta, pick_rows=pick_rows)
