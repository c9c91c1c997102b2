"""Eagle3 draft head: ``fc`` (3 H_target → H) over captured target layers, a Llama-style
midlayer whose attention reads ``cat[input_layernorm(embed), hidden_norm(h)]`` (2H), optionally
more decoder layers on H (each with its own KV cache), ``norm`` and an LM head over a reduced
draft vocabulary mapped back with ``target_id = draft_id + d2t[draft_id]``. Which of these a
checkpoint has, and how it names them, is its ``Eagle3Layout`` (``models/eagle3_layout``)."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from functools import partial
from typing import Any

import torch
from torch import nn

from tandem.kernels import cpu_decode
from tandem.models.attention import AttentionMetadata
from tandem.models.draft import DraftHead, post_attention
from tandem.models.eagle3_layout import Eagle3Layout, split_layer_key
from tandem.models.layers import ParallelLMHead, ReplicatedLinear, RMSNorm, VocabParallelEmbedding
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
    """The first draft layer: attention over ``cat[embed path, hidden path]`` (2H)."""

    supports_pick_rows = True
    fast_path: Eagle3FastPath | None = None  # set by ``Eagle3Draft.enable_cpu_fast_path``

    def __init__(
        self, config: Any, mapping: ParallelMapping, layout: Eagle3Layout | None = None
    ) -> None:
        """``layout``: default the plain one (every norm) of ``config``."""
        super().__init__()
        layout = layout or Eagle3Layout.from_config(config)
        h = config.hidden_size
        eps = config.rms_norm_eps
        # A layout without one of the two input norms leaves that path as it is.
        self.input_layernorm = RMSNorm(h, eps) if layout.embed_norm else None
        self.hidden_norm = RMSNorm(h, eps) if layout.hidden_norm else None
        self.norm_before_residual = layout.norm_before_residual
        self.self_attn = LlamaAttention(
            config, mapping, layout.qkv_bias, layout.qk_norm, input_size=2 * h
        )
        self.post_attention_layernorm = RMSNorm(h, eps)
        self.mlp = LlamaMLP(h, layout.intermediate_size or config.intermediate_size, mapping)

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
        x, normed = self._attention_input(embeds, hidden)
        # norm_before_residual (speculators): the residual is the normed hidden state.
        residual = normed if self.norm_before_residual else hidden
        return post_attention(self, self.self_attn(positions, x, meta), residual, meta, pick_rows)

    def _attention_input(
        self, embeds: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(cat[embed path, hidden path] [T, 2H], the hidden path)."""
        normed = hidden if self.hidden_norm is None else self.hidden_norm(hidden)
        if self.input_layernorm is not None:
            embeds = self.input_layernorm(embeds)
        return torch.cat([embeds, normed], dim=-1), normed

    def write_kv(
        self,
        positions: torch.Tensor,
        embeds: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
    ) -> None:
        """Only the draft KV of every row (``DraftHead.write_kv``)."""
        self.self_attn.write_kv(positions, self._attention_input(embeds, hidden)[0], meta)


class Eagle3DecoderLayer(nn.Module):
    """A later draft layer of a multi-layer head: a plain pre-norm decoder layer on the first
    layer's output stream [T, H], with its own attention (and KV cache)."""

    supports_pick_rows = True

    def __init__(self, config: Any, mapping: ParallelMapping, layout: Eagle3Layout) -> None:
        super().__init__()
        h = config.hidden_size
        self.input_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.self_attn = LlamaAttention(config, mapping, layout.qkv_bias, layout.qk_norm)
        self.post_attention_layernorm = RMSNorm(h, config.rms_norm_eps)
        self.mlp = LlamaMLP(h, layout.intermediate_size or config.intermediate_size, mapping)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        pick_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        x = self.self_attn(positions, self.input_layernorm(hidden), meta)
        return post_attention(self, x, hidden, meta, pick_rows)


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
            self.rope.cos_sin,
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
        confidence: torch.Tensor | None = None,
        min_confidence: float = 0.0,
    ) -> tuple[torch.Tensor, torch.Tensor | None] | None:
        """Greedy draft steps 1 .. ``steps`` in one extension call (``cpu_decode.eagle3_chain``:
        the drafts, and with ``confidence`` their running products of draft probabilities,
        stopping once every row's is under ``min_confidence``), or None where it does not apply
        (the LM head or the embedding sharded or not packed, too many rows, a cache in another
        dtype)."""
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
            self.rope.cos_sin,
            draft.norm.weight,
            lm_head,
            draft.d2t,
            steps,
            (*self.shape, k_cache.shape[1], self.intermediate),
            self.eps,
            self.scale,
            confidence,
            min_confidence,
        )


class Eagle3Draft(DraftHead):
    def __init__(
        self,
        config: Any,
        target_config: Any,
        mapping: ParallelMapping,
        layout: Eagle3Layout | None = None,
    ) -> None:
        """``layout``: how the checkpoint is laid out (default: ``config.eagle3_layout``, set by
        ``read_eagle3_config``, else the plain one-midlayer layout)."""
        super().__init__()
        self.config = config
        layout = (
            layout or getattr(config, "eagle3_layout", None) or Eagle3Layout.from_config(config)
        )
        self.layout = layout
        h = int(config.hidden_size)
        target_h = int(target_config.hidden_size)
        declared = getattr(config, "target_hidden_size", None)
        if declared is not None and int(declared) != target_h:
            raise ValueError(
                f"the Eagle3 draft's target_hidden_size ({declared}) does not match the "
                f"target's hidden_size ({target_h})"
            )
        if h != target_h and not layout.own_embedding:
            raise ValueError(
                f"the Eagle3 draft's hidden_size ({h}) differs from the target's ({target_h}) "
                "and the checkpoint carries no embed_tokens.weight of its own: a head of "
                "another width needs its own embedding (fc takes 3 x target_hidden_size)"
            )
        if int(config.vocab_size) != int(target_config.vocab_size):
            raise ValueError(
                f"the Eagle3 draft's vocab_size ({config.vocab_size}) does not match the "
                f"target's ({target_config.vocab_size})"
            )
        self.draft_vocab_size = int(getattr(config, "draft_vocab_size", None) or config.vocab_size)
        self.fc = ReplicatedLinear(3 * target_h, h, False)
        self.midlayer = Eagle3MidLayer(config, mapping, layout)
        self.later_layers = nn.ModuleList(
            Eagle3DecoderLayer(config, mapping, layout) for _ in range(layout.num_layers - 1)
        )
        self.norm = RMSNorm(h, config.rms_norm_eps) if layout.final_norm else None
        self.lm_head = ParallelLMHead(self.draft_vocab_size, h, mapping.attn_mapping)
        self.register_buffer("d2t", torch.zeros(self.draft_vocab_size, dtype=torch.int64))
        if layout.own_embedding:
            # Registered (a draft parameter); ``embed_tokens`` points at it (``bind_target``).
            self.own_embed_tokens = VocabParallelEmbedding(
                int(config.vocab_size), h, mapping.attn_mapping
            )
        self.num_layers = layout.num_layers

    def bind_target(self, target: nn.Module) -> None:
        """The head's own embedding, else the target's (shared, not registered: it is not a
        draft parameter)."""
        own = self._modules.get("own_embed_tokens")
        object.__setattr__(self, "embed_tokens", target.model.embed_tokens if own is None else own)

    def finish_loading(
        self, target: nn.Module, loaded: set[str], folder: str | os.PathLike
    ) -> None:
        """After ``load_weights``: share the target's embedding when the head's is a copy of it;
        give the LM head the checkpoint lacks; check ``d2t``.

        A head without ``lm_head.weight`` reads the target's LM head, whatever its config's
        ``tie_word_embeddings`` says (as vLLM does): Eagle3 training code gives the head an
        LM head of its own, never tied to its embedding, and the flag is copied from the
        target's config. Only a head of another width, whose own embedding is the one matrix
        that fits, takes that embedding when it says tied. Both need the target's vocabulary."""
        own = self._modules.get("own_embed_tokens")
        theirs = target.model.embed_tokens
        values = not self.d2t.is_meta  # meta tensors (shape checks) hold none to compare
        if (
            values
            and own is not None
            and own.weight.shape == theirs.weight.shape
            and torch.equal(own.weight, theirs.weight.to(own.weight.dtype))
        ):
            del self.own_embed_tokens  # the same rows: one copy in memory
            self.bind_target(target)
        vocab = int(target.config.vocab_size)
        if "lm_head.weight" not in loaded:
            narrow = self.lm_head.weight.shape[1] != target.lm_head.weight.shape[1]
            tied = self.layout.tie_word_embeddings and narrow and own is not None
            what = "the head's embedding (tie_word_embeddings)" if tied else "the target's"
            if self.draft_vocab_size != vocab:
                raise ValueError(
                    f"draft checkpoint {folder} has no lm_head.weight and its draft vocabulary "
                    f"({self.draft_vocab_size}) differs from the target's ({vocab}), so it "
                    f"cannot use {what}"
                )
            borrowed = self.embed_tokens.weight if tied else target.lm_head.weight
            if borrowed.shape[1] != self.lm_head.weight.shape[1]:
                raise ValueError(
                    f"draft checkpoint {folder} has no lm_head.weight and its hidden_size "
                    f"({self.lm_head.weight.shape[1]}) is not {what} ({borrowed.shape[1]})"
                )
            if borrowed.dtype != self.dtype:  # a copy in the draft's dtype
                borrowed = nn.Parameter(borrowed.detach().to(self.dtype), requires_grad=False)
            self.lm_head.weight = borrowed
            loaded.add("lm_head.weight")
        ids = torch.arange(self.draft_vocab_size, device=self.d2t.device) + self.d2t
        if values and not 0 <= int(ids.min()) <= int(ids.max()) < vocab:
            raise ValueError(
                f"draft checkpoint {folder}: its d2t maps draft ids to target ids in "
                f"[{int(ids.min())}, {int(ids.max())}], outside the vocabulary [0, {vocab}): "
                "d2t holds offsets (target id - draft id)"
            )

    @property
    def layers(self) -> list[nn.Module]:
        return [self.midlayer, *self.later_layers]

    def forward(
        self,
        layer_index: int,
        positions: torch.Tensor,
        token_ids: torch.Tensor,
        hidden: torch.Tensor,
        meta: AttentionMetadata,
        pick_rows: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One draft step through every layer: the midlayer, then the later layers on its
        output stream. Returns the last layer's pre-norm output."""
        if not self.later_layers:
            return super().forward(layer_index, positions, token_ids, hidden, meta, pick_rows)
        if pick_rows is not None:  # ``draft_layer_picks_rows`` declines multi-layer heads
            raise RuntimeError("a multi-layer Eagle3 head runs its layers on every row")
        out = super().forward(layer_index, positions, token_ids, hidden, meta)
        for layer in self.later_layers:
            out = layer(positions, out, meta)
        return out

    def writes_kv_alone(self, layer_index: int = 0) -> bool:
        """A later layer's KV reads the midlayer's output: with later layers the whole step
        runs."""
        return not self.later_layers and super().writes_kv_alone(layer_index)

    def enable_cpu_fast_path(self) -> str | None:
        """Give the midlayer the CPU fast path when it qualifies (the caller has loaded the
        extension); returns why not (None: enabled)."""
        reason = self.layout.fast_path_unsupported()
        if reason is not None:
            return reason
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
        return self.lm_head.compute_logits(self.final_norm(layer_index, hidden))

    def final_norm(self, layer_index: int, hidden: torch.Tensor) -> torch.Tensor:
        return hidden if self.norm is None else self.norm(hidden)

    @property
    def lm_head_weight(self) -> torch.Tensor:
        return self.lm_head.weight

    def to_target_ids(self, draft_ids: torch.Tensor) -> torch.Tensor:
        return draft_ids + self.d2t[draft_ids]

    @property
    def greedy_chain(
        self,
    ) -> Callable[..., tuple[torch.Tensor, torch.Tensor | None] | None] | None:
        """Greedy draft steps 1 .. n after step 0 in one CPU fast-path call
        (``Eagle3FastPath.chain`` bound to this head), None without the fast path."""
        fast = self.midlayer.fast_path
        return None if fast is None else partial(fast.chain, self)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Checkpoint names of every layout: ``midlayer.*`` / ``midlayer.{i}.*`` /
        ``layers.{i}.*`` (layer 0 is ``midlayer``, layer i the later layer i - 1), an optional
        ``model.`` prefix, the head's own ``embed_tokens``; ``t2d`` is not needed."""

        def rename(name: str) -> list[str] | None:
            name = name.removeprefix("model.")
            if name == "t2d" or "rotary_emb" in name:
                return None
            if name == "embed_tokens.weight":
                return ["own_embed_tokens.weight"] if self.layout.own_embedding else None
            key = split_layer_key(name)
            if key is not None:
                _, i, rest = key
                return [f"midlayer.{rest}" if i == 0 else f"later_layers.{i - 1}.{rest}"]
            return [name]

        return load_named_weights(self, weights, rename)

    def expected_weights(self) -> set[str]:
        """``d2t`` only for a reduced draft vocabulary (else zeros: the identity)."""
        reduced = self.draft_vocab_size != int(self.config.vocab_size)
        return expected_keys(self) | ({"d2t"} if reduced else set())
