"""DeepSeek-V3 (Hugging Face ``DeepseekV3ForCausalLM`` folders): MLA attention over a paged latent
cache (models/mla.py), dense MLPs in the first ``first_k_dense_replace`` layers and MoE after
them (models/moe.py), and MTP draft layers read from ``model.layers.{num_hidden_layers}``.

Parallelism: MLA heads are split over the TP ranks (replicated under attention DP); routed
experts are split over the TP group (expert parallelism), the shared experts and dense MLPs are
TP-sharded; under attention DP the MLPs and MoEs run on every rank's rows.

Each attention layer caches ``kv_lora_rank + qk_rope_head_dim`` numbers per token
(``LatentPagedAttention.kv_cache_spec``), against ``num_heads × (qk_head_dim + v_head_dim)``
for decompressed K and V.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import Any

from torch import nn

from tandem.models.draft import DraftHead
from tandem.models.layers import RMSNorm, VocabParallelEmbedding
from tandem.models.llama import LlamaDecoderLayer, LlamaForCausalLM, LlamaMLP, LlamaModel
from tandem.models.mla import LatentPagedAttention, MLAAttention
from tandem.models.moe import DeepseekV3MoE, RoutedExperts
from tandem.models.mtp import MTPDraft, MTPLayer
from tandem.models.parallel import ParallelMapping
from tandem.models.weights import expected_keys, load_param

_EXPERT = re.compile(r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")
_FUSED_EXPERTS = re.compile(r"^(.*\.experts)\.(gate_up_proj|down_proj)$")
_GATE_UP = {"gate_proj": 0, "up_proj": 1}


def make_mlp(config: Any, mapping: ParallelMapping, layer_index: int) -> nn.Module:
    """Dense before ``first_k_dense_replace``, MoE from there on."""
    first_moe = int(getattr(config, "first_k_dense_replace", 0) or 0)
    if getattr(config, "n_routed_experts", None) and layer_index >= first_moe:
        return DeepseekV3MoE(config, mapping)
    return LlamaMLP(config.hidden_size, config.intermediate_size, mapping)


def load_deepseek_weights(
    module: nn.Module, weights: Iterable[tuple[str, Any]], rename: Any
) -> set[str]:
    """Load (checkpoint name, tensor) pairs through ``rename(name) -> list[our name] | None``.

    Per-expert tensors go to this rank's stacked experts (other ranks' experts are skipped),
    gate/up projections to the fused ``gate_up_proj``. Returns the filled keys (``name#shard``
    for stacked parameters), the same ones ``deepseek_expected_keys`` lists."""
    params = dict(module.named_parameters())
    experts = {n: m for n, m in module.named_modules() if isinstance(m, RoutedExperts)}
    loaded: set[str] = set()
    for ckpt_name, tensor in weights:
        for target in rename(ckpt_name) or ():
            # (our parameter, its shard, the keys it fills) for each place the tensor goes
            places: list[tuple[str, Any, list[str]]]
            if m := _EXPERT.match(target):
                prefix, owner = m.group(1), experts.get(m.group(1))
                if owner is None:
                    raise ValueError(f"unexpected tensor in checkpoint: {ckpt_name}")
                # Every local slot holding the expert (none: another rank's; redundant copies).
                places = [
                    _expert_place(prefix, slot, m.group(3))
                    for slot in owner.slots_of(int(m.group(2)))
                ]
            elif m := _FUSED_EXPERTS.match(target):
                name = f"{m.group(1)}.{'w13' if m.group(2) == 'gate_up_proj' else 'w2'}"
                filled = [
                    k
                    for k in _stacked_keys(m.group(1), experts.get(m.group(1)))
                    if k.startswith(name + "#")
                ]
                places = [(name, "all", filled)]
            else:
                name, shard = target, None
                for ckpt, sid in _GATE_UP.items():
                    if f".{ckpt}." in target:
                        name, shard = target.replace(ckpt, "gate_up_proj"), sid
                places = [(name, shard, [name if shard is None else f"{name}#{shard}"])]
            for name, shard, filled in places:
                load_param(params, name, tensor, shard, ckpt_name)
                loaded.update(filled)
    return loaded


def _expert_place(prefix: str, slot: int, proj: str) -> tuple[str, Any, list[str]]:
    """One expert's projection in local slot ``slot``: (parameter, shard, filled key)."""
    if proj == "down_proj":
        return f"{prefix}.w2", slot, [f"{prefix}.w2#{slot}"]
    part = _GATE_UP[proj]
    return f"{prefix}.w13", (slot, part), [f"{prefix}.w13#{slot}.{part}"]


def _stacked_keys(prefix: str, experts: RoutedExperts | None) -> list[str]:
    if experts is None:
        return []
    n = experts.num_local
    return [f"{prefix}.w13#{e}.{p}" for e in range(n) for p in (0, 1)] + [
        f"{prefix}.w2#{e}" for e in range(n)
    ]


def deepseek_expected_keys(module: nn.Module, skip: set[str] = frozenset()) -> set[str]:
    keys = {k for k in expected_keys(module, skip) if not k.endswith((".w13", ".w2"))}
    for name, m in module.named_modules():
        if isinstance(m, RoutedExperts):
            keys.update(_stacked_keys(name, m))
    return keys


class DeepseekV3DecoderLayer(LlamaDecoderLayer):
    """The Llama pre-norm block with MLA attention and, from ``first_k_dense_replace`` on, the MoE
    (the forward is the Llama block's). ``attention_cls``: a family with this block and another
    attention (GLM-4.5) overrides it."""

    attention_cls: type[nn.Module] = MLAAttention

    def __init__(self, config: Any, mapping: ParallelMapping, layer_index: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = self.attention_cls(config, mapping)
        self.mlp = make_mlp(config, mapping, layer_index)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3Model(LlamaModel):
    """Embedding, DeepSeek-V3 blocks, final norm; the forward is the Llama model's."""

    layer_cls: type[DeepseekV3DecoderLayer] = DeepseekV3DecoderLayer

    def __init__(self, config: Any, mapping: ParallelMapping) -> None:
        nn.Module.__init__(self)
        self.embed_tokens = VocabParallelEmbedding(
            config.vocab_size, config.hidden_size, mapping.attn_mapping
        )
        self.layers = nn.ModuleList(
            self.layer_cls(config, mapping, i) for i in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class DeepseekV3MTPDraft(MTPDraft):
    """MTP layers whose block is the DeepSeek-V3 one (MLA writing its own latent cache, and the
    MoE of layer ``num_hidden_layers``); row-picked steps run the MoE on the picked rows only.
    ``attention_cls`` and ``load_fn``: what a family with another attention overrides."""

    attention_cls: type[nn.Module] = MLAAttention
    load_fn = staticmethod(load_deepseek_weights)

    def __init__(self, config: Any, mapping: ParallelMapping, num_layers: int) -> None:
        def make_layer() -> nn.Module:
            return MTPLayer(
                config,
                mapping,
                False,
                False,
                self_attn=self.attention_cls(config, mapping),
                mlp=make_mlp(config, mapping, int(config.num_hidden_layers)),
            )

        super().__init__(config, mapping, num_layers, False, False, make_layer=make_layer)

    def load_weights(
        self, weights: Iterable[tuple[str, Any]], first_layer: int, num_ckpt_layers: int
    ) -> set[str]:
        return self.load_fn(
            self, weights, lambda name: self.checkpoint_names(name, first_layer, num_ckpt_layers)
        )

    def expected_weights(self) -> set[str]:
        return deepseek_expected_keys(self)


class DeepseekV3ForCausalLM(LlamaForCausalLM):
    """Causal LM over the paged latent cache; the Llama family's interface, forward and logits,
    with DeepSeek-V3 blocks and weight loading."""

    def build_model(self, config: Any, mapping: ParallelMapping) -> nn.Module:
        return DeepseekV3Model(config, mapping)

    def attention_layers(self) -> list[LatentPagedAttention]:  # type: ignore[override]
        return [layer.self_attn.attn for layer in self.model.layers]

    def build_mtp_draft(self, config: Any, mapping: ParallelMapping, num_layers: int) -> DraftHead:
        """The MTP draft for this target (``models.loader.load_draft`` asks for it)."""
        return DeepseekV3MTPDraft(config, mapping, num_layers)

    def checkpoint_names(self, name: str) -> list[str] | None:
        """Which of our parameters a checkpoint tensor fills; None = not ours to load."""
        if "rotary_emb.inv_freq" in name:
            return None
        if name.startswith("model.layers."):
            if int(name.split(".")[2]) >= self.config.num_hidden_layers:
                return None  # MTP layers belong to the draft
        if name == "lm_head.weight" and self.tie_word_embeddings:
            return None
        return [name]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        return load_deepseek_weights(self, weights, self.checkpoint_names)

    def expected_weights(self) -> set[str]:
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        return deepseek_expected_keys(self, skip)
