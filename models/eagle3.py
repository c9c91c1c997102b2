"""Eagle3 draft head: ``fc`` (3H→H) over captured target layers, one Llama-style midlayer whose
attention reads ``cat[input_layernorm(embed), hidden_norm(h)]`` (2H), ``norm`` and an LM head
over a reduced draft vocabulary mapped back with ``target_id = draft_id + d2t[draft_id]``."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from tandem.kernels import cpu_decode
from tandem.models.attention import AttentionMetadata
from tandem.models.draft import DraftHead, post_attention
from tandem.models.layers import ParallelLMHead, ReplicatedLinear, RMSNorm
from tandem.models.llama import (
    FastDraftLayer,
    LlamaAttention,
    LlamaMLP,
    fast_layer_unsupported,
    fast_step_rows,
)
from tandem.models.parallel import ParallelMapping
from tandem.models.weights import expected_keys, load_named_weights


class Eagle3MidLayer(nn.Module):
    supports_pick_rows = True
    fast_path: Eagle3FastPath | None = None  # set by ``Eagle3Draft.enable_cpu_fast_path``

    def __init__(self, config: Any, mapping: ParallelMapping) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.hidden_norm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = LlamaAttention(
            config, mapping, bool(getattr(config, "attention_bias", False)), False, input_size=2 * h
        )
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = LlamaMLP(h, config.intermediate_size, mapping)

    def forward(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        pick_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Attention on every row (it writes the draft KV of each); the rest only on
        ``pick_rows`` when given. Returns the pre-norm output, [len(pick_rows) or T, H]."""
        if self.fast_path is not None and self.fast_path.accepts(embeds, meta):
            return self.fast_path(positions, embeds, hidden, meta, pick_rows)
        residual = hidden
        x = torch.cat([self.input_layernorm(embeds), self.hidden_norm(hidden)], dim=-1)
        x = self.self_attn(positions, x, meta)
        return post_attention(self, x, residual, meta, pick_rows)


class Eagle3FastPath(FastDraftLayer):
    """The midlayer through ``kernels/cpu_decode`` for steps of at most ``MAX_ROWS`` rows (the
    eager ``Eagle3MidLayer.forward`` is its reference and runs every other step)."""

    def __init__(self, layer: Eagle3MidLayer) -> None:
        super().__init__(layer, self.layer_weights(layer), (2, 3, 5, 6))

    @staticmethod
    def layer_weights(layer: Eagle3MidLayer) -> tuple[torch.Tensor, ...]:
        """In the extension's order: input norm, hidden norm, QKV, O, post-attention norm,
        gate/up, down."""
        return (
            layer.input_layernorm.weight,
            layer.hidden_norm.weight,
            layer.self_attn.qkv_proj.weight,
            layer.self_attn.o_proj.weight,
            layer.post_attention_layernorm.weight,
            layer.mlp.gate_up_proj.weight,
            layer.mlp.down_proj.weight,
        )

    def __call__(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        pick_rows: torch.Tensor | None,
    ) -> torch.Tensor:
        caches = (self.attention.k_cache, self.attention.v_cache)
        return cpu_decode.eagle3_layer(
            embeds.contiguous(),
            hidden.to(self.dtype).contiguous(),
            [] if pick_rows is None else pick_rows.tolist(),
            fast_step_rows(positions, meta),
            self.weights,
            caches,
            self.cos_sin,
            (*self.shape, caches[0].shape[1], self.intermediate),
            self.eps,
            self.scale,
        )

    def chain(
        self,
        draft: Eagle3Draft,
        hidden: torch.Tensor,
        tokens: torch.Tensor,
        positions: torch.Tensor,
        block_tables: torch.Tensor,
        steps: int,
    ) -> torch.Tensor | None:
        """Greedy draft steps 1 .. ``steps`` in one extension call (``cpu_decode.eagle3_chain``),
        or None where it does not apply (the LM head or the embedding sharded or not packed,
        too many rows, a cache in another dtype)."""
        lm_head, embed = draft.lm_head.fast_weight, draft.embed_tokens
        k_cache = self.attention.k_cache
        if (
            lm_head is None
            or embed is None
            or getattr(embed, "mapping", None) is None
            or embed.mapping.tp_size != 1
            or not 0 < hidden.shape[0] <= cpu_decode.MAX_ROWS
            or hidden.dtype != self.dtype
            or k_cache.dtype != self.dtype
            or k_cache.dim() != 4
        ):
            return None
        return cpu_decode.eagle3_chain(
            hidden.contiguous(),
            tokens.long().contiguous(),
            positions.long().contiguous(),
            block_tables.to(torch.int32).contiguous(),
            embed.weight,
            self.weights,
            (k_cache, self.attention.v_cache),
            self.cos_sin,
            draft.norm.weight,
            lm_head,
            draft.d2t,
            steps,
            (*self.shape, k_cache.shape[1], self.intermediate),
            self.eps,
            self.scale,
        )


class Eagle3Draft(DraftHead):
    def __init__(self, config: Any, target_config: Any, mapping: ParallelMapping) -> None:
        super().__init__()
        self.config = config
        h = config.hidden_size
        target_h = int(getattr(config, "target_hidden_size", None) or target_config.hidden_size)
        if h != target_config.hidden_size:
            raise ValueError(
                f"the Eagle3 draft's hidden_size ({h}) does not match the target's "
                f"({target_config.hidden_size})"
            )
        if int(config.vocab_size) != int(target_config.vocab_size):
            raise ValueError(
                f"the Eagle3 draft's vocab_size ({config.vocab_size}) does not match the "
                f"target's ({target_config.vocab_size})"
            )
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = ReplicatedLinear(3 * target_h, h, False)
        self.midlayer = Eagle3MidLayer(config, mapping)
        self.norm = RMSNorm(h, config.rms_norm_eps)
        self.lm_head = ParallelLMHead(self.draft_vocab_size, h, mapping.attn_mapping)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        self.num_layers = int(getattr(config, "num_hidden_layers", 1))

    def bind_target(self, target: nn.Module) -> None:
        """Share the target's embedding (not registered: it is not a draft parameter)."""
        object.__setattr__(self, "embed_tokens", target.model.embed_tokens)

    @property
    def layers(self) -> list[nn.Module]:
        return [self.midlayer]

    def enable_cpu_fast_path(self) -> str | None:
        """Give the midlayer the CPU fast path when it qualifies (the caller has loaded the
        extension); returns why not (None: enabled)."""
        layer = self.midlayer
        weights = Eagle3FastPath.layer_weights(layer)
        reason = fast_layer_unsupported(layer.self_attn, layer.mlp, weights)
        if reason is None:
            layer.fast_path = Eagle3FastPath(layer)
        return reason

    def combine_hidden(self, captured: list[torch.Tensor]) -> torch.Tensor:
        """fc over the concatenated captured target states: [T, 3H] → [T, H]."""
        return self.fc(torch.cat(captured, dim=-1).to(self.fc.weight.dtype))

    def compute_logits(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor:
        """Draft-vocabulary logits [n, draft_V]."""
        return self.lm_head.compute_logits(self.norm(hidden))

    def final_norm(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor:
        return self.norm(hidden)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @property
    def greedy_chain(self) -> Callable[..., torch.Tensor | None] | None:
        """Greedy draft steps 1 .. n after step 0 in one CPU fast-path call
        (``Eagle3FastPath.chain`` bound to this head), None without the fast path."""
        fast = self.midlayer.fast_path
        return None if fast is None else partial(fast.chain, self)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        def rename(name: str) -> list[str] | None:
            if name.startswith("model."):
                name = name[len("model.") :]
            if name in ("t2d", "embed_tokens.weight") or "rotary_emb" in name:
                return None
            if name.startswith("layers.0."):  # some exports name the midlayer layers.0
                name = "midlayer." + name[len("layers.0.") :]
            return [name]

        return load_named_weights(self, weights, rename)

    def expected_weights(self) -> set[str]:
        return expected_keys(self) | {"d2t"}
