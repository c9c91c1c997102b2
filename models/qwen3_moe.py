"""Qwen3-MoE (Hugging Face ``Qwen3MoeForCausalLM`` folders: Qwen3-30B-A3B, Qwen3-235B-A22B,
Qwen3-Coder-30B-A3B / 480B-A35B): Qwen3's attention (GQA, per-head q/k RMSNorm, no biases unless
``attention_bias``) and, in every layer where ``(i + 1) % decoder_sparse_step == 0`` and ``i`` is
not in ``mlp_only_layers``, a mixture of ``num_experts`` experts with no shared experts: the
router's softmax over fp32 logits, the ``num_experts_per_tok`` best, renormalized to sum to 1
when ``norm_topk_prob`` (``kernels.moe.softmax_topk``); the other layers run a dense MLP of
``intermediate_size``.

Parallelism is DeepSeek-V3's (models/moe.py): attention heads split over the TP ranks
(replicated under attention DP), experts placed whole, ``num_experts / tp`` per rank, every
rank computing its experts for every row of the step and one all-reduce (under attention DP the
rows of every rank are gathered first). Expert weights load from the released per-expert layout
(``mlp.experts.{e}.{gate,up,down}_proj.weight``) or the fused one (``mlp.experts.gate_up_proj``
/ ``down_proj``), and from FP8 block-quantized releases through the same loader.

The router runs in float32 (transformers computes its logits in the model's dtype: in bf16 a
token whose top-k scores nearly tie may pick another expert there).
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.moe import softmax_topk
from tandem.models.deepseek_v3 import DeepseekV3Model, deepseek_expected_keys
from tandem.models.glm4_moe import load_glm4_moe_weights
from tandem.models.layers import RMSNorm
from tandem.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP
from tandem.models.moe import DeepseekV3MoE
from tandem.models.parallel import ParallelMapping
from tandem.models.weights import default_weight_loader, set_loader


class SoftmaxTopKGate(nn.Module):
    """Router: fp32 logits ``x @ weight.T``, then ``softmax_topk`` → (weights [T, k] fp32,
    ids [T, k])."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.top_k = int(config.num_experts_per_tok)
        self.norm_topk_prob = bool(getattr(config, "norm_topk_prob", False))
        self.weight = set_loader(
            nn.Parameter(
                torch.zeros(config.num_experts, config.hidden_size, dtype=torch.float32),
                requires_grad=False,
            ),
            default_weight_loader,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return softmax_topk(F.linear(x.float(), self.weight), self.top_k, self.norm_topk_prob)


class Qwen3MoeSparseMoe(DeepseekV3MoE):
    """``num_experts`` routed experts split whole over the TP group, no shared experts (the
    forward, collectives included, is DeepSeek-V3's)."""

    def __init__(self, config: Any, mapping: ParallelMapping) -> None:
        super().__init__(config, mapping, SoftmaxTopKGate(config), "num_experts")


def is_sparse_layer(config: Any, layer_index: int) -> bool:
    """Whether layer ``layer_index`` runs the experts (transformers' rule)."""
    step = int(getattr(config, "decoder_sparse_step", 1) or 1)
    only_mlp = set(getattr(config, "mlp_only_layers", None) or [])
    experts = int(getattr(config, "num_experts", 0) or 0)
    return layer_index not in only_mlp and experts > 0 and (layer_index + 1) % step == 0


class Qwen3MoeDecoderLayer(LlamaDecoderLayer):
    """The Llama pre-norm block with Qwen3 attention and the MoE or a dense MLP."""

    def __init__(self, config: Any, mapping: ParallelMapping, layer_index: int) -> None:
        nn.Module.__init__(self)
        bias = bool(getattr(config, "attention_bias", False))
        self.self_attn = LlamaAttention(config, mapping, bias, True)
        if is_sparse_layer(config, layer_index):
            self.mlp: nn.Module = Qwen3MoeSparseMoe(config, mapping)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, mapping)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class Qwen3MoeModel(DeepseekV3Model):
    """Embedding, Qwen3-MoE blocks, final norm; the forward is the Llama model's (Eagle3 heads
    capture its layers like a Llama target's)."""

    layer_cls = Qwen3MoeDecoderLayer  # type: ignore[assignment]


class Qwen3MoeForCausalLM(LlamaForCausalLM):
    """Causal LM over the paged cache with the Llama family's interface; expert weights load
    like DeepSeek-V3's, q/k/v into the fused projection."""

    def build_model(self, config: Any, mapping: ParallelMapping) -> nn.Module:
        return Qwen3MoeModel(config, mapping)

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return load_glm4_moe_weights(self, self.take_kv_scales(weights), self.checkpoint_names)

    def expected_weights(self) -> set[str]:
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        return deepseek_expected_keys(self, skip)
