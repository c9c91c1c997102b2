"""MTP draft layers in the DeepSeek-V3 layout: ``eh_proj(cat[enorm(embed(next_token)),
hnorm(h)])`` → decoder block → ``shared_head.norm`` → the target's LM head. Embedding and LM head
are shared with the target. The decoder block is Llama-family by default; a target family with
its own block (DeepSeek-V3: MLA + MoE) passes its attention and MLP modules in."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch
from torch import nn

from tandem.kernels import cpu_decode
from tandem.models.attention import AttentionMetadata
from tandem.models.draft import DraftHead, post_attention
from tandem.models.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, VocabParallelEmbedding
from tandem.models.llama import (
    CpuStackFastPath,
    FastDraftLayer,
    LlamaAttention,
    LlamaMLP,
    fast_layer_unsupported,
    fast_step_rows,
)
from tandem.models.parallel import ParallelMapping
from tandem.models.weights import expected_keys, load_named_weights


class SharedHead(nn.Module):
    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden_size, eps)


class MTPLayer(nn.Module):
    supports_pick_rows = True
    fast_path: MTPFastPath | None = None  # set by ``MTPDraft.enable_cpu_fast_path``

    def __init__(
        self,
        config: Any,
        mapping: ParallelMapping,
        qkv_bias: bool,
        qk_norm: bool,
        self_attn: nn.Module | None = None,
        mlp: nn.Module | None = None,
    ) -> None:
        """``self_attn(positions, x, meta)`` and ``mlp(x, all_rank_num_tokens)`` default to the
        Llama-family modules."""
        super().__init__()
        h, eps = config.hidden_size, config.rms_norm_eps
        self.enorm = RMSNorm(h, eps)
        self.hnorm = RMSNorm(h, eps)
        self.eh_proj = ReplicatedLinear(2 * h, h, False)
        self.input_layernorm = RMSNorm(h, eps)
        self.self_attn = self_attn or LlamaAttention(config, mapping, qkv_bias, qk_norm)
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = mlp or LlamaMLP(h, config.intermediate_size, mapping)
        self.shared_head = SharedHead(h, eps)

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        pick_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention on every row (it writes this layer's KV for each); residual, norm and MLP
        only on ``pick_rows`` when given. Returns the pre-norm output."""
        if self.fast_path is not None and self.fast_path.accepts(embeds, meta):
            return self.fast_path(positions, embeds, hidden, meta, pick_rows)
        residual = self._combined(embeds, hidden)
        x = self.self_attn(positions, self.input_layernorm(residual), meta)
        return post_attention(self, x, residual, meta, pick_rows)

    def _combined(self, embeds: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
        """``eh_proj`` over the normed embedding and hidden state: the layer's input [T, H]."""
        return self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))

    def write_kv(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Only this layer's KV of every row (``DraftHead.write_kv``; needs an attention with
        ``write_kv``)."""
        x = self.input_layernorm(self._combined(embeds, hidden))
        self.self_attn.write_kv(positions, x, meta)


class MTPFastPath(FastDraftLayer):
    """An MTP layer on a Llama decoder block through ``kernels/cpu_decode``: ``eh_proj`` over
    the normed inputs, then the block as a one-layer ``llama_stack`` (its output is the
    residual stream after that layer), for steps of at most ``MAX_ROWS`` rows; the eager
    ``MTPLayer.forward`` is its reference and runs every other step."""

    def __init__(self, layer: MTPLayer) -> None:
        super().__init__(layer, CpuStackFastPath.layer_weights(layer), (1, 2, 4, 5))
        # Its parts, not the layer (which holds this object: no cycle, see CpuStackFastPath).
        self.eh_proj, self.enorm, self.hnorm = layer.eh_proj, layer.enorm, layer.hnorm
        self.final_norm = layer.shared_head.norm

    def __call__(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        pick_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        caches = [self.attention.k_cache, self.attention.v_cache]
        _, out = cpu_decode.llama_stack(
            x.contiguous(),
            fast_step_rows(positions, meta),
            self.weights,
            caches,
            self.final_norm.weight.detach(),
            self.rope.cos_sin,
            (*self.shape, caches[0].shape[1], self.intermediate),
            self.eps,
            self.scale,
            [0],
        )
        return out if pick_rows is None else out[pick_rows]


class MTPDraft(DraftHead):
    """``num_layers`` MTP layers: 1 for MTP-Eagle (reused K times), K for vanilla MTP."""

    def __init__(
        self,
        config: Any,
        mapping: ParallelMapping,
        num_layers: int,
        qkv_bias: bool,
        qk_norm: bool,
        make_layer: Callable[[], nn.Module] | None = None,
    ) -> None:
        """``make_layer`` builds one MTP layer (default: over a Llama-family block)."""
        super().__init__()
        self.config = config
        self.num_layers = num_layers
        make = make_layer or (lambda: MTPLayer(config, mapping, qkv_bias, qk_norm))
        self.mtp_layers = nn.ModuleList(make() for _ in range(num_layers))
        self.lm_head: nn.Module | None = None
        self.draft_vocab_size = int(config.vocab_size)
        self.mapping = mapping
        # Set by ``use_draft_vocab``: the target's LM-head rows of a reduced draft vocabulary.
        self.draft_lm_head: ParallelLMHead | None = None
        self.d2t: torch.Tensor | None
        self.register_buffer("d2t", None)

    def bind_target(self, target: nn.Module) -> None:
        """Share the target's embedding and LM head (not registered as draft parameters)."""
        object.__setattr__(self, "embed_tokens", target.model.embed_tokens)
        object.__setattr__(self, "lm_head", target.lm_head)

    @property
    def layers(self) -> list[nn.Module]:
        return list(self.mtp_layers)

    def enable_cpu_fast_path(self) -> str | None:
        """Give every MTP layer on a plain Llama block the CPU fast path (the caller has loaded
        the extension); returns why not (None: enabled)."""
        for layer in self.mtp_layers:
            if not isinstance(layer, MTPLayer):
                return "not an MTP layer"
            weights = CpuStackFastPath.layer_weights(layer)
            reason = fast_layer_unsupported(layer.self_attn, layer.mlp, weights)
            if reason is not None:
                return reason
        for layer in self.mtp_layers:
            layer.fast_path = MTPFastPath(layer)
        return None

    def use_draft_vocab(self, d2t: torch.Tensor) -> None:
        """Propose from a reduced vocabulary (target id = draft id + ``d2t[draft id]``): a draft
        LM head of the target's rows of those tokens, so a draft pass reads len(d2t) rows of
        the LM head instead of the whole vocabulary. Verification still scores every token, so
        the output is unchanged; a token outside the vocabulary is never drafted. Call after
        ``bind_target``, on every rank (under TP the rows are gathered from the LM-head
        shards)."""
        assert self.lm_head is not None
        vocab = int(self.config.vocab_size)
        if d2t.dim() != 1 or d2t.numel() == 0:
            raise ValueError(f"the MTP draft vocabulary (d2t) must be 1-D, got {tuple(d2t.shape)}")
        d2t = d2t.to(torch.int64).cpu()
        ids = d2t + torch.arange(d2t.numel())
        if ids.min() < 0 or ids.max() >= vocab:
            raise ValueError(f"the MTP draft vocabulary (d2t) maps outside [0, {vocab})")
        if bool((ids[1:] <= ids[:-1]).any()):
            raise ValueError("the MTP draft vocabulary (d2t) must list ascending target ids")
        weight = self.lm_head.weight
        with torch.no_grad():  # every rank gets every row (an all-reduce under TP)
            rows = VocabParallelEmbedding.forward(self.lm_head, ids.to(weight.device))
        with torch.device(weight.device):
            head = ParallelLMHead(ids.numel(), weight.shape[1], self.mapping.attn_mapping)
        head.weight.data = head.weight.data.to(self.dtype)  # the head's dtype (draft_dtype)
        head.weight_loader(head.weight, rows)
        self.draft_lm_head = head
        self.register_buffer("d2t", d2t.to(weight.device))
        self.draft_vocab_size = ids.numel()

    def compute_logits(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Logits over the draft vocabulary (the target's whole vocabulary by default)."""
        head = self.draft_lm_head or self.lm_head
        assert head is not None
        normed = self.final_norm(layer_index, hidden)
        return head.compute_logits(normed.to(head.weight.dtype))  # the target's, or the head's

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids if self.d2t is None else draft_ids + self.d2t[draft_ids]

    def final_norm(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.mtp_layers[layer_index].shared_head.norm(hidden)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        head = self.draft_lm_head or self.lm_head
        assert head is not None
        return head.weight

    def load_weights(
        self, weights: Iterable[tuple[str, Any]], first_layer: int, num_ckpt_layers: int
    ) -> set[str]:
        """Checkpoint layers ``model.layers.{first_layer + i}``; layer i of ours reads checkpoint
        layer min(i, num_ckpt_layers - 1), so a one-layer checkpoint backs all K vanilla layers."""
        return load_named_weights(
            self, weights, lambda name: self.checkpoint_names(name, first_layer, num_ckpt_layers)
        )

    def checkpoint_names(
        self, name: str, first_layer: int, num_ckpt_layers: int
    ) -> list[str] | None:
        """Which of our parameters a checkpoint tensor fills; None = not ours to load."""
        if not name.startswith("model.layers."):
            return None
        parts = name.split(".")
        idx = int(parts[2]) - first_layer
        if not 0 <= idx < num_ckpt_layers:
            return None
        rest = ".".join(parts[3:])
        if rest.startswith(("embed_tokens.", "shared_head.head.")) or "rotary_emb" in rest:
            return None
        ours = [i for i in range(self.num_layers) if min(i, num_ckpt_layers - 1) == idx]
        return [f"mtp_layers.{i}.{rest}" for i in ours]

    def expected_weights(self) -> set[str]:
        return expected_keys(self)
