"""The Llama family: Llama 2/3.x, Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k norm), SmolLM2."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch import nn

from models.attention import AttentionMetadata, PagedAttention
from models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    get_rope,
    rope_parameters,
    silu_and_mul,
)
from models.parallel import ParallelMapping, adp_all_gather_rows, adp_reduce_own_rows
from models.weights import expected_keys, load_named_weights


def head_dim_of(config: Any) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


class LlamaAttention(nn.Module):
    def __init__(
        self,
        config: Any,
        mapping: ParallelMapping,
        qkv_bias: bool,
        qk_norm: bool,
        input_size: int | None = None,
    ) -> None:
        super().__init__()
        mapping = mapping.attn_mapping  # replicated under attention DP
        head_dim = head_dim_of(config)
        num_kv = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        self.qkv_proj = QKVParallelLinear(
            input_size or config.hidden_size,
            head_dim,
            config.num_attention_heads,
            num_kv,
            qkv_bias,
            mapping,
        )
        self.num_heads = self.qkv_proj.num_heads
        self.num_kv_heads = self.qkv_proj.num_kv_heads
        self.head_dim = head_dim
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * head_dim,
            config.hidden_size,
            bool(getattr(config, "o_proj_bias", False)),
            mapping,
        )
        self.rotary_emb = get_rope(
            head_dim, config.max_position_embeddings, rope_parameters(config)
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        qkv = self.qkv_proj(hidden)  # [T, (H + 2 Hkv) * D]
        h, hkv, d = self.num_heads, self.num_kv_heads, self.head_dim
        v = qkv[:, (h + hkv) * d :].view(-1, hkv, d)
        if self.q_norm is None:
            # q and k heads are adjacent in each row: rotate them in one go.
            qk = self.rotary_emb.rotate(positions, qkv[:, : (h + hkv) * d].view(-1, h + hkv, d))
            q, k = qk[:, :h], qk[:, h:]
        else:
            q = self.q_norm(qkv[:, : h * d].view(-1, h, d))
            k = self.k_norm(qkv[:, h * d : (h + hkv) * d].view(-1, hkv, d))
            q, k = self.rotary_emb(positions, q, k)
        return self.o_proj(self.attn(q, k, v, meta))


class LlamaMLP(nn.Module):
    """Tensor-parallel MLP. Under attention DP the weights stay sharded over the group and the
    MLP runs on every rank's rows (all-gathered by ``all_rank_num_tokens``, reduced back)."""

    def __init__(self, hidden_size: int, intermediate_size: int, mapping: ParallelMapping) -> None:
        super().__init__()
        self.mapping = mapping
        self.adp = mapping.uses_adp_collectives
        self.gate_up_proj = MergedColumnParallelLinear(
            hidden_size, [intermediate_size, intermediate_size], False, mapping
        )
        self.down_proj = RowParallelLinear(
            intermediate_size, hidden_size, False, mapping, reduce=not self.adp
        )

    def forward(
        self, x: torch.Tensor, all_rank_num_tokens: list[int] | None = None
    ) -> torch.Tensor:
        if not self.adp:
            return self.down_proj(silu_and_mul(self.gate_up_proj(x)))
        if all_rank_num_tokens is None:
            raise RuntimeError("attention DP: the MLP needs all_rank_num_tokens")
        rows = adp_all_gather_rows(x, all_rank_num_tokens, self.mapping)  # [tp * max, H]
        out = self.down_proj(silu_and_mul(self.gate_up_proj(rows)))  # partial sums
        return adp_reduce_own_rows(out, all_rank_num_tokens, self.mapping)


class LlamaDecoderLayer(nn.Module):
    def __init__(
        self, config: Any, mapping: ParallelMapping, qkv_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(config, mapping, qkv_bias, qk_norm)
        self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, mapping)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        meta: AttentionMetadata,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, meta)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden, meta.all_rank_num_tokens), residual


class LlamaModel(nn.Module):
    def __init__(
        self, config: Any, mapping: ParallelMapping, qkv_bias: bool, qk_norm: bool
    ) -> None:
        super().__init__()
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, mapping.attn_mapping
        )
        self.layers = nn.ModuleList(
            LlamaDecoderLayer(config, mapping, qkv_bias, qk_norm)
            for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """Returns the final normed hidden states [T, H] and, for each index in
        ``capture_layers``, the residual stream (hidden + residual) after that layer."""
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, meta)
            if i in capture_layers:
                captured[i] = hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return hidden, [captured[i] for i in capture_layers]


class LlamaForCausalLM(nn.Module):
    """Causal LM over the paged cache. ``forward`` gives hidden states; logits are computed
    separately on the rows that are sampled (``compute_logits``)."""

    qkv_bias = False
    qk_norm = False

    def __init__(self, config: Any, mapping: ParallelMapping | None = None) -> None:
        super().__init__()
        mapping = mapping or ParallelMapping()
        self.config = config
        self.mapping = mapping
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        self.model = LlamaModel(config, mapping, qkv_bias, self.qk_norm)
        # Replicated under attention DP (each rank computes its own requests' logits).
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, mapping.attn_mapping)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        return self.model(input_ids, positions, meta, capture_layers)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.lm_head.compute_logits(hidden)

    def attention_layers(self) -> list[PagedAttention]:
        return [layer.self_attn.attn for layer in self.model.layers]

    def checkpoint_names(self, name: str) -> list[str] | None:
        """Which of our parameters a checkpoint tensor fills; None = not ours to load."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("model.layers."):
            index = int(name.split(".")[2])
            if index >= self.config.num_hidden_layers:  # MTP layers belong to the draft
                return None
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return [name]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Load (name, tensor-or-slice) pairs; returns the parameter keys that were filled."""
        return load_named_weights(self, weights, self.checkpoint_names)

    def expected_weights(self) -> set[str]:
        """What ``load_weights`` must have filled for the model to be complete."""
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        return expected_keys(self, skip)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
