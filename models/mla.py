"""Multi-head latent attention (MLA, DeepSeek-V2/V3) over a paged cache of compressed latents.

Per token the cache keeps one row of ``kv_lora_rank + qk_rope_head_dim`` numbers: the normed KV
latent ``c`` and the rotated, head-shared rope key ``k_pe`` — not per-head K and V. Attention
runs in the weight-absorbed form: with ``kv_b_proj`` split per head into ``W_uk`` (nope keys) and
``W_uv`` (values),

    q_nope · k_nope = (q_nope W_uk) · c        o = softmax(...) (c W_uv^T) = (softmax(...) c) W_uv^T

so every head attends with ``[q_nope W_uk, q_pe]`` over the cached ``[c, k_pe]`` rows as one
shared KV head (MQA of width kv_lora_rank + rope dims), and the latent output is lifted to
``v_head_dim`` per head afterwards. The cache row serves as key and value at once (the value
is its first kv_lora_rank numbers), so the paged-attention kernel and the step's shared plan are
reused as they are.

Heads are split over the attention TP ranks (q / kv_b column-parallel, o row-parallel); the
down-projections (q_a, kv_a) are replicated. The softmax scale is ``qk_head_dim ** -0.5``, times
``yarn_mscale(factor, mscale_all_dim) ** 2`` under a scaled rope that sets ``mscale_all_dim``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from tandem.kernels.paged_attention import paged_attention, write_kv_cache
from tandem.models.attention import AttentionMetadata, KVCacheSpec
from tandem.models.layers import ColumnParallelLinear, ReplicatedLinear, RMSNorm, RowParallelLinear
from tandem.models.parallel import ParallelMapping, divide
from tandem.models.rotary import get_rope, rope_parameters, yarn_mscale

LORA_NORM_EPS = 1e-6  # the q_a / kv_a layernorms use the default eps, not rms_norm_eps


def mla_softmax_scale(config: Any) -> float:
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    params = rope_parameters(config)
    mscale_all_dim = params.get("mscale_all_dim")
    if params.get("rope_type", "default") != "default" and mscale_all_dim:
        factor = params.get("factor") or (
            config.max_position_embeddings / params["original_max_position_embeddings"]
        )
        scale *= yarn_mscale(float(factor), float(mscale_all_dim)) ** 2
    return scale


class LatentPagedAttention(nn.Module):
    """Writes each token's latent row into the layer's cache, then attends over the cache with
    absorbed queries (all heads share the one latent "KV head")."""

    def __init__(self, num_heads: int, kv_lora_rank: int, rope_dim: int, scale: float) -> None:
        super().__init__()
        self.num_heads = num_heads
        self.kv_lora_rank = kv_lora_rank
        self.rope_dim = rope_dim
        self.scale = scale
        # Bound by the model runner: [num_blocks, block_size, 1, kv_lora_rank + rope_dim].
        self.latent_cache = torch.empty(0)
        # An FP8 cache's per-tensor scale (value = stored x scale; the row is key and value).
        self.kv_scale = 1.0

    def kv_cache_spec(self) -> KVCacheSpec:
        return KVCacheSpec((1, self.kv_lora_rank + self.rope_dim), 1)

    def bind_kv_cache(self, caches: tuple[torch.Tensor, ...]) -> None:
        (self.latent_cache,) = caches

    def forward(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        latent: torch.Tensor,
        k_pe: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """q_latent [T, H, C], q_pe [T, H, R], latent [T, C], k_pe [T, R] → [T, H, C]."""
        if self.latent_cache.numel() == 0:
            raise RuntimeError("KV cache is not bound to this attention layer")
        entry = torch.cat([latent, k_pe], dim=-1).unsqueeze(1)  # [T, 1, C + R]
        cache = self.latent_cache
        # The row is key and value at once: both stores write the same row to the same slot.
        scales = {"k_scale": self.kv_scale, "v_scale": self.kv_scale}
        write_kv_cache(entry, entry, cache, cache, meta.slot_mapping, **scales)
        q = torch.cat([q_latent, q_pe], dim=-1)  # [T, H, C + R]
        out = paged_attention(
            q,
            cache,
            cache,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            self.scale,
            meta.max_query_len,
            meta.max_seq_len,
            plan=meta.attention_plan(),
            tree_mask=meta.tree_mask,
            **scales,
        )
        return out[..., : self.kv_lora_rank]  # the value is the latent part of the row


class MLAAttention(nn.Module):
    """DeepSeek-V3 attention: (q_a → q_a_layernorm → q_b | q_proj), kv_a_proj_with_mqa →
    (kv_a_layernorm(latent), k_pe), rope on the ``qk_rope_head_dim`` parts, latent attention,
    o_proj. Checkpoint names are the attribute names."""

    def __init__(self, config: Any, mapping: ParallelMapping) -> None:
        super().__init__()
        mapping = mapping.attn_mapping  # replicated under attention DP
        h = config.hidden_size
        total_heads = config.num_attention_heads
        self.num_heads = divide(total_heads, mapping.tp_size, "num_attention_heads")
        self.nope_dim = config.qk_nope_head_dim
        self.rope_dim = config.qk_rope_head_dim
        self.v_dim = config.v_head_dim
        self.kv_lora_rank = config.kv_lora_rank
        self.qk_head_dim = self.nope_dim + self.rope_dim
        self.q_lora_rank = getattr(config, "q_lora_rank", None)
        bias = bool(getattr(config, "attention_bias", False))
        q_out = total_heads * self.qk_head_dim
        if self.q_lora_rank is None:
            self.q_proj = ColumnParallelLinear(h, q_out, False, mapping)
        else:
            self.q_a_proj = ReplicatedLinear(h, self.q_lora_rank, bias)
            self.q_a_layernorm = RMSNorm(self.q_lora_rank, LORA_NORM_EPS)
            self.q_b_proj = ColumnParallelLinear(self.q_lora_rank, q_out, False, mapping)
        self.kv_a_proj_with_mqa = ReplicatedLinear(h, self.kv_lora_rank + self.rope_dim, bias)
        self.kv_a_layernorm = RMSNorm(self.kv_lora_rank, LORA_NORM_EPS)
        self.kv_b_proj = ColumnParallelLinear(
            self.kv_lora_rank, total_heads * (self.nope_dim + self.v_dim), False, mapping
        )
        self.kv_b_proj.fp8_allowed = False  # read as per-head matrices (the absorbed form)
        self.o_proj = RowParallelLinear(total_heads * self.v_dim, h, bias, mapping)
        self.rotary_emb = get_rope(
            self.rope_dim,
            config.max_position_embeddings,
            rope_parameters(config),
            interleaved=bool(getattr(config, "rope_interleave", True)),
        )
        self.attn = LatentPagedAttention(
            self.num_heads, self.kv_lora_rank, self.rope_dim, mla_softmax_scale(config)
        )

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        t, heads = hidden.shape[0], self.num_heads
        if self.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        q_nope, q_pe = q.view(t, heads, self.qk_head_dim).split(
            [self.nope_dim, self.rope_dim], dim=-1
        )
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split(
            [self.kv_lora_rank, self.rope_dim], dim=-1
        )
        latent = self.kv_a_layernorm(latent)
        q_pe, k_pe = self.rotary_emb(positions, q_pe, k_pe.unsqueeze(1))
        # kv_b rows per head: nope_dim key rows, then v_dim value rows; [heads, nope + v, C].
        w_kv = self.kv_b_proj.weight.view(heads, self.nope_dim + self.v_dim, self.kv_lora_rank)
        w_uk, w_uv = w_kv.split([self.nope_dim, self.v_dim], dim=1)
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [T, heads, C]
        out = self.attn(q_latent, q_pe, latent, k_pe.squeeze(1), meta)  # [T, heads, C]
        out = torch.bmm(out.transpose(0, 1), w_uv.transpose(1, 2))  # [heads, T, v]
        return self.o_proj(out.transpose(0, 1).reshape(t, heads * self.v_dim))
