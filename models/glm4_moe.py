"""GLM-4.5 / GLM-4.6 (Hugging Face ``Glm4MoeForCausalLM`` folders): Llama-style attention with
q/k/v biases (``attention_bias``), optional per-head q/k norms (``use_qk_norm``) and partial
rotary, dense MLPs in the first ``first_k_dense_replace`` layers and the DeepSeek-V3 MoE after
them (sigmoid router with ``e_score_correction_bias``, grouped top-k, shared experts,
``routed_scaling_factor``), and an MTP layer at ``model.layers.{num_hidden_layers}`` in the
DeepSeek-V3 layout.

Partial rotary, as transformers' ``glm4_moe`` computes it: the first
``int(head_dim * partial_rotary_factor)`` dims of each q/k head rotate, neox style (the first half
of those dims against the second half, not interleaved pairs); the rest pass through. The factor
sits in ``rope_parameters`` (transformers 5) or at the top level of older config.json files;
transformers' default for GLM is 0.5.

Parallelism is DeepSeek-V3's: attention heads split over the TP ranks (replicated under
attention DP), routed experts split over the TP group (expert parallelism), shared experts and
dense MLPs TP-sharded.

MTP layers of released checkpoints also hold copies of the embedding and the LM head
(``embed_tokens``, ``shared_head.head``; GLM-4.6 drops them): the draft shares the target's, so
the copies are skipped when present and not required when absent.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from tandem.models.deepseek_v3 import (
    DeepseekV3DecoderLayer,
    DeepseekV3Model,
    DeepseekV3MTPDraft,
    deepseek_expected_keys,
    load_deepseek_weights,
)
from tandem.models.draft import DraftHead
from tandem.models.llama import (
    LlamaAttention,
    LlamaForCausalLM,
    head_dim_of,
)
from tandem.models.parallel import ParallelMapping
from tandem.models.rotary import rope_parameters

_QKV = re.compile(r"^(.*)\.(q|k|v)_proj\.(weight|bias)$")
DEFAULT_PARTIAL_ROTARY_FACTOR = 0.5  # transformers' Glm4MoeConfig default


def rotary_dim_of(config: Any) -> int:
    """How many leading dims of each head rotate (``head_dim * partial_rotary_factor``)."""
    head_dim = head_dim_of(config)
    factor = rope_parameters(config).get("partial_rotary_factor")
    if factor is None:
        factor = getattr(config, "partial_rotary_factor", None) or DEFAULT_PARTIAL_ROTARY_FACTOR
    rotary_dim = int(head_dim * float(factor))
    if not 0 < rotary_dim <= head_dim or rotary_dim % 2:
        raise ValueError(
            f"partial_rotary_factor={factor} with head_dim={head_dim} gives {rotary_dim} rotary "
            f"dims; it must give an even number in [2, {head_dim}]"
        )
    return rotary_dim


class Glm4MoeAttention(LlamaAttention):
    """Llama attention with GLM's flags: q/k/v biases, optional q/k norms, partial rotary."""

    def __init__(self, config: Any, mapping: ParallelMapping) -> None:
        super().__init__(
            config,
            mapping,
            bool(getattr(config, "attention_bias", False)),
            bool(getattr(config, "use_qk_norm", False)),
            rotary_dim=rotary_dim_of(config),
        )


class Glm4MoeDecoderLayer(DeepseekV3DecoderLayer):
    """The DeepSeek-V3 block (dense MLP, then the MoE) with GLM attention."""

    attention_cls = Glm4MoeAttention


class Glm4MoeModel(DeepseekV3Model):
    """Embedding, GLM blocks, final norm; the forward is the Llama model's."""

    layer_cls = Glm4MoeDecoderLayer


def load_glm4_moe_weights(
    module: nn.Module, weights: Iterable[tuple[str, Any]], rename: Any
) -> set[str]:
    """``load_deepseek_weights`` (experts, gate/up) plus the fused q/k/v projection: a q, k or v
    weight or bias goes to ``qkv_proj`` with shard id ``q`` / ``k`` / ``v``. One pass over the
    checkpoint (its lazy slices are read while their file is open)."""
    params = dict(module.named_parameters())
    loaded: set[str] = set()

    def others() -> Iterator[tuple[str, Any]]:
        for ckpt_name, tensor in weights:
            targets = rename(ckpt_name) or []
            matches = [m for t in targets if (m := _QKV.match(t))]
            if not targets or len(matches) != len(targets):
                yield ckpt_name, tensor
                continue
            for m in matches:
                name, shard = f"{m.group(1)}.qkv_proj.{m.group(3)}", m.group(2)
                if name not in params:
                    raise ValueError(f"unexpected tensor in checkpoint: {ckpt_name}")
                try:
                    params[name].weight_loader(params[name], tensor, shard)
                except ValueError as e:
                    raise ValueError(f"{ckpt_name}: {e}") from None
                loaded.add(f"{name}#{shard}")

    return load_deepseek_weights(module, others(), rename) | loaded


class Glm4MoeMTPDraft(DeepseekV3MTPDraft):
    """MTP layers whose block is GLM's (its attention and the MoE of layer
    ``num_hidden_layers``); row-picked steps run the MoE on the picked rows only."""

    attention_cls = Glm4MoeAttention
    load_fn = staticmethod(load_glm4_moe_weights)


class Glm4MoeForCausalLM(LlamaForCausalLM):
    """Causal LM over the paged cache; the Llama family's interface, forward and logits, with
    GLM blocks and DeepSeek-V3-style MoE weight loading."""

    def build_model(self, config: Any, mapping: ParallelMapping) -> nn.Module:
        return Glm4MoeModel(config, mapping)

    def build_mtp_draft(self, config: Any, mapping: ParallelMapping, num_layers: int) -> DraftHead:
        """The MTP draft for this target (``models.loader.load_draft`` asks for it)."""
        return Glm4MoeMTPDraft(config, mapping, num_layers)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return load_glm4_moe_weights(self, self.take_kv_scales(weights), self.checkpoint_names)

    def expected_weights(self) -> set[str]:
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        return deepseek_expected_keys(self, skip)
