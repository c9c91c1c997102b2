"""The Llama family: Llama 2/3.x, Qwen2/2.5 (q/k/v bias), Qwen3 (per-head q/k norm), SmolLM2."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch import nn

from tandem.kernels import cpu_decode
from tandem.models.attention import AttentionMetadata, PagedAttention
from tandem.models.cpu_linears import pack_weight, use_cpu_matvec_lm_heads
from tandem.models.layers import (
    MergedColumnParallelLinear,
    ParallelLMHead,
    QKVParallelLinear,
    RMSNorm,
    RowParallelLinear,
    VocabParallelEmbedding,
    silu_and_mul,
)
from tandem.models.parallel import ParallelMapping, adp_all_gather_rows, adp_reduce_own_rows
from tandem.models.rotary import RotaryEmbedding, get_rope, rope_parameters
from tandem.models.weights import expected_keys, load_named_weights


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
        rotary_dim: int | None = None,
    ) -> None:
        """``rotary_dim``: rotate only the first ``rotary_dim`` dims of each head (partial
        rotary; default the whole head)."""
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
            rotary_dim or head_dim, config.max_position_embeddings, rope_parameters(config)
        )
        self.q_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.k_norm = RMSNorm(head_dim, config.rms_norm_eps) if qk_norm else None
        self.attn = PagedAttention(self.num_heads, self.num_kv_heads, head_dim, head_dim**-0.5)

    def forward(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> torch.Tensor:
        return self.o_proj(self.attn(*self._qkv(positions, hidden), meta))

    def write_kv(
        self, positions: torch.Tensor, hidden: torch.Tensor, meta: AttentionMetadata
    ) -> None:
        """Only this step's KV, exactly as ``forward`` writes it: no attention, no ``o_proj``
        (and so no collective: a column-parallel projection is rank-local)."""
        _, k, v = self._qkv(positions, hidden)
        self.attn.write(k, v, meta)

    def _qkv(
        self, positions: torch.Tensor, hidden: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [T, H, D] and k, v [T, Hkv, D], rotated (and normed where the model has it)."""
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
        return q, k, v


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
    fast_path: CpuStackFastPath | None = None  # set by ``enable_cpu_fast_path``

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
        if self.fast_path is not None and self.fast_path.accepts(input_ids, meta):
            return self.fast_path(input_ids, positions, meta, capture_layers)
        hidden = self.embed_tokens(input_ids)
        residual: torch.Tensor | None = None
        captured: dict[int, torch.Tensor] = {}
        for i, layer in enumerate(self.layers):
            hidden, residual = layer(positions, hidden, residual, meta)
            if i in capture_layers:
                captured[i] = hidden + residual
        hidden, _ = self.norm(hidden, residual)
        return hidden, [captured[i] for i in capture_layers]


def fast_layer_unsupported(
    attn: nn.Module, mlp: nn.Module, weights: tuple[torch.Tensor, ...]
) -> str | None:
    """Why a layer's attention and MLP cannot run in ``kernels/cpu_decode`` (None: they can):
    plain Llama modules, one rank, full neox rotary, head_dim <= ``MAX_HEAD_DIM``, no q/k norms
    or biases, ``weights`` on the CPU in one supported dtype."""
    if type(attn) is not LlamaAttention or type(mlp) is not LlamaMLP:
        return "not a plain Llama decoder stack"
    if mlp.mapping.tp_size != 1 or mlp.mapping.uses_adp_collectives:
        return "tensor or attention parallelism"
    rope = attn.rotary_emb
    if type(rope) is not RotaryEmbedding or rope.interleaved:
        return "a rotary variant other than neox"
    if rope.rotary_dim != attn.head_dim or attn.head_dim % 2:
        return "partial rotary"
    if attn.head_dim > cpu_decode.MAX_HEAD_DIM:
        return f"head_dim {attn.head_dim} over {cpu_decode.MAX_HEAD_DIM}"
    if attn.q_norm is not None or attn.qkv_proj.bias is not None or attn.o_proj.bias is not None:
        return "q/k norms or projection biases"
    dtype = weights[0].dtype
    if dtype not in cpu_decode.DTYPES:
        return f"dtype {dtype}"
    if any(w.device.type != "cpu" or w.dtype != dtype for w in weights):
        return "weights off the CPU or in mixed dtypes"
    return None


def fast_path_accepts(
    rows: int, meta: AttentionMetadata, attn: PagedAttention, dtype: torch.dtype
) -> bool:
    """Whether a step of ``rows`` rows with ``meta`` can run in ``kernels/cpu_decode``."""
    k_cache = attn.k_cache
    return (
        isinstance(meta, AttentionMetadata)
        and 0 < rows <= cpu_decode.MAX_ROWS
        and meta.all_rank_num_tokens is None
        and k_cache.dtype == dtype
        and k_cache.dim() == 4
        and bool((meta.slot_mapping >= 0).all())
    )


def fast_step_rows(positions: torch.Tensor, meta: AttentionMetadata) -> cpu_decode.StepRows:
    """The step's row layout for ``kernels/cpu_decode``."""
    return cpu_decode.step_rows(
        positions,
        meta.slot_mapping,
        meta.block_tables,
        meta.seq_lens,
        meta.query_start_loc,
        meta.max_query_len,
        meta.tree_mask,
    )


def fast_weights(weights: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    """A layer's weights as ``kernels/cpu_decode`` takes them: norms as they are, matrices
    packed (a copy: the fast path serves inference, not training)."""
    return [pack_weight(w) if w.dim() == 2 else w.detach() for w in weights]


def share_fast_weights(attn: nn.Module, mlp: nn.Module, packed: list[torch.Tensor]) -> None:
    """The eager linears of a fast-path layer read the fast path's packed matrices (``packed``
    in the extension's order: QKV, O, gate/up, down) for the steps it does not take: one
    packed copy of each weight in memory, not also oneDNN's."""
    linears = (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj)
    for linear, weight in zip(linears, packed, strict=True):
        linear.fast_weight = weight


class FastDraftLayer:
    """What a draft layer served by ``kernels/cpu_decode`` keeps: its packed weights (the eager
    linears read the same copies), dtype, attention shape and constants."""

    def __init__(
        self, layer: nn.Module, weights: tuple[torch.Tensor, ...], shared: tuple[int, ...]
    ) -> None:
        """``weights`` in the extension's order; ``shared``: the positions of QKV, O, gate/up
        and down among them."""
        attn = layer.self_attn
        self.attention = attn.attn
        self.weights = fast_weights(weights)
        share_fast_weights(attn, layer.mlp, [self.weights[i] for i in shared])
        self.dtype = self.weights[0].dtype
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.intermediate = layer.mlp.down_proj.weight.shape[1]
        self.eps = float(layer.input_layernorm.eps)
        self.scale = float(attn.attn.scale)
        self.rope = attn.rotary_emb  # its table is read per call (``cover`` may extend it)

    def accepts(self, embeds: torch.Tensor, meta: AttentionMetadata) -> bool:
        return embeds.dtype == self.dtype and fast_path_accepts(
            embeds.shape[0], meta, self.attention, self.dtype
        )


class CpuStackFastPath:
    """Runs a ``LlamaModel``'s whole decoder stack through ``kernels/cpu_decode`` for steps of
    at most ``cpu_decode.MAX_ROWS`` rows (decode and speculative verification of small
    batches); the eager layers stay the reference and run every other step (prefill chunks,
    large batches, training)."""

    def __init__(self, model: LlamaModel) -> None:
        # The embedding and the final norm, not the model: the model holds this object, and a
        # cycle would keep the weights alive past the last reference (until a full collection).
        self.embed_tokens, self.norm = model.embed_tokens, model.norm
        layer0 = model.layers[0]
        attn = layer0.self_attn
        self.dtype = model.norm.weight.dtype
        self.shape = (attn.num_heads, attn.num_kv_heads, attn.head_dim)
        self.intermediate = layer0.mlp.down_proj.weight.shape[1]
        self.eps = float(layer0.input_layernorm.eps)
        self.scale = float(attn.attn.scale)
        self.rope = attn.rotary_emb  # its table is read per call (``cover`` may extend it)
        self.weights: list[torch.Tensor] = []
        for layer in model.layers:
            weights = fast_weights(self.layer_weights(layer))
            share_fast_weights(layer.self_attn, layer.mlp, [weights[i] for i in (1, 2, 4, 5)])
            self.weights += weights
        self.attention = [layer.self_attn.attn for layer in model.layers]

    @staticmethod
    def layer_weights(layer: LlamaDecoderLayer) -> tuple[torch.Tensor, ...]:
        """In the extension's order: input norm, QKV, O, post-attention norm, gate/up, down."""
        return (
            layer.input_layernorm.weight,
            layer.self_attn.qkv_proj.weight,
            layer.self_attn.o_proj.weight,
            layer.post_attention_layernorm.weight,
            layer.mlp.gate_up_proj.weight,
            layer.mlp.down_proj.weight,
        )

    @staticmethod
    def unsupported(model: LlamaModel) -> str | None:
        """Why ``model`` cannot take the fast path (None: it can)."""
        layers = list(model.layers)
        if not layers:
            return "no layers"
        if any(type(layer) is not LlamaDecoderLayer for layer in layers):
            return "not a plain Llama decoder stack"
        for layer in layers:
            weights = CpuStackFastPath.layer_weights(layer)
            reason = fast_layer_unsupported(layer.self_attn, layer.mlp, weights)
            if reason is not None:
                return reason
        return None

    def accepts(self, input_ids: torch.Tensor, meta: AttentionMetadata) -> bool:
        return fast_path_accepts(input_ids.shape[0], meta, self.attention[0], self.dtype)

    def __call__(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        meta: AttentionMetadata,
        capture_layers: tuple[int, ...] = (),
    ) -> tuple[torch.Tensor, list[torch.Tensor]]:
        caches = [c for a in self.attention for c in (a.k_cache, a.v_cache)]
        out = cpu_decode.llama_stack(
            self.embed_tokens(input_ids).contiguous(),
            fast_step_rows(positions, meta),
            self.weights,
            caches,
            self.norm.weight.detach(),
            self.rope.cos_sin,
            (*self.shape, caches[0].shape[1], self.intermediate),
            self.eps,
            self.scale,
            list(capture_layers),
        )
        return out[0], out[1:]


def enable_cpu_fast_path(model: nn.Module) -> str | None:
    """Give ``model``'s Llama stack the CPU fast path when it qualifies and the extension
    builds; returns why not (None: enabled). Models without a ``LlamaModel`` are left alone."""
    inner = getattr(model, "model", None)
    if not isinstance(inner, LlamaModel):
        return "not a Llama-family model"
    reason = CpuStackFastPath.unsupported(inner)
    if reason is None:
        reason = cpu_decode.unavailable_reason()
    if reason is None and cpu_decode.load_extension() is None:
        reason = cpu_decode.unavailable_reason() or "the extension did not load"
    if reason is None:
        inner.fast_path = CpuStackFastPath(inner)
        use_cpu_matvec_lm_heads(model)
    return reason


# A layer's FP8 KV cache scale in a checkpoint: model.layers.N.self_attn.k_scale / v_scale.
KV_SCALE_NAME = re.compile(r"model\.layers\.(\d+)\.self_attn\.([kv])_scale")


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
        self.model = self.build_model(config, mapping)
        # Replicated under attention DP (each rank computes its own requests' logits).
        self.lm_head = ParallelLMHead(config.vocab_size, config.hidden_size, mapping.attn_mapping)
        self.tie_word_embeddings = bool(getattr(config, "tie_word_embeddings", False))
        if self.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def build_model(self, config: Any, mapping: ParallelMapping) -> nn.Module:
        """The decoder stack (embedding, blocks, final norm); a family with other blocks
        (DeepSeek-V3, GLM-4.5, Qwen3-MoE) overrides it, keeping the LM head and the rest."""
        qkv_bias = self.qkv_bias or bool(getattr(config, "attention_bias", False))
        return LlamaModel(config, mapping, qkv_bias, self.qk_norm)

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
        return load_named_weights(self, self.take_kv_scales(weights), self.checkpoint_names)

    def take_kv_scales(self, weights: Iterable[tuple[str, Any]]) -> Iterator[tuple[str, Any]]:
        """The pairs but the layers' FP8 KV scales (``model.layers.N.self_attn.k_scale`` /
        ``v_scale``, one number each, as FP8 checkpoints ship them), which are set on layer N's
        attention (an FP8 cache stores K / k_scale; other caches ignore them)."""
        for name, tensor in weights:
            found = KV_SCALE_NAME.fullmatch(name)
            if found is None:
                yield name, tensor
                continue
            index = int(found[1])
            if index >= self.config.num_hidden_layers:  # an MTP layer's: the draft's
                continue
            value = tensor if isinstance(tensor, torch.Tensor) else tensor[...]  # 0-dim too
            attn = self.model.layers[index].self_attn.attn
            setattr(attn, f"{found[2]}_scale", float(value.float().reshape(-1)[0]))

    def expected_weights(self) -> set[str]:
        """What ``load_weights`` must have filled for the model to be complete."""
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        return expected_keys(self, skip)


class Qwen2ForCausalLM(LlamaForCausalLM):
    qkv_bias = True


class Qwen3ForCausalLM(LlamaForCausalLM):
    qk_norm = True
