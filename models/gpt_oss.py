"""gpt-oss (Hugging Face ``GptOssForCausalLM`` folders: gpt-oss-20b, gpt-oss-120b).

The block is Llama's pre-norm block with:

- attention with biases on q/k/v and o, neox rotary with YaRN (``truncate: false``), and a
  learned **sink** logit per query head that joins each softmax's denominator and attends to
  nothing; the layers named ``sliding_attention`` in ``layer_types`` see only the last
  ``sliding_window`` positions (128 in the releases), the ``full_attention`` ones all;
- a mixture of ``num_local_experts`` experts with a biased router (``top_k`` best logits, then a
  softmax over those k) and experts with biases and a clamped SwiGLU: with gate and up read from
  the interleaved columns of ``gate_up_proj`` (even: gate, odd: up),
  ``gate = min(gate, limit)``, ``up = clamp(up, -limit, limit)``,
  ``out = (up + 1) * gate * sigmoid(alpha * gate)``.

Expert weights: the released MXFP4 tensors (``mlp.experts.gate_up_proj_blocks`` [E, 2I, H/32,
16] uint8, two E2M1 values a byte, low nibble first; ``..._scales`` [E, 2I, H/32] uint8, E8M0
exponents biased by 127) stay as released on the GPU paths (``mxfp4_resident``; the Triton
kernels of kernels/mxfp4.py dequantize them in registers, with no host read: CUDA graphs
capture the step) and are dequantized at load elsewhere; a bf16 checkpoint's ``gate_up_proj``
[E, H, 2I] / ``down_proj`` [E, I, H] load as they are (CPUs only: ``check_gpt_oss``). Experts
are placed whole, ``E / tp`` per rank, as for DeepSeek-V3 (models/moe.py), with its
collectives under TP and attention DP.

The sinks and sliding windows run in the Triton attention kernel (CUDA, and CPU tests through
the interpreter) and in ``paged_attention_reference`` on CPUs, chains and draft trees in both;
the CPU fast path skips its layers (they are not plain Llama layers). The sliding layers' KV is
the block manager's window group (engine/block_manager.py): its blocks are released as they
leave the window.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.kernels.launch import HAS_TRITON, gpu_paths
from tandem.kernels.mxfp4 import (
    MXFP4_BLOCK,
    dequantize_mxfp4,
    gpt_oss_experts_mxfp4,
    gpt_oss_experts_reference,
)
from tandem.models.attention import PagedAttention
from tandem.models.deepseek_v3 import DeepseekV3Model
from tandem.models.layers import RMSNorm, RowParallelLinear
from tandem.models.llama import LlamaAttention, LlamaDecoderLayer, LlamaForCausalLM, head_dim_of
from tandem.models.moe import DeepseekV3MoE
from tandem.models.parallel import ParallelMapping
from tandem.models.weights import (
    copy_checked,
    default_weight_loader,
    expected_keys,
    load_named_weights,
    read_loaded,
    set_loader,
)


class SinkAttention(PagedAttention):
    """Paged attention with one sink logit per query head and an optional sliding window
    (``paged_attention``'s ``sinks`` / ``window``; with draft trees too). The
    sinks are this rank's heads of ``self_attn.sinks``."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        window: int | None,
        first_head: int,
    ) -> None:
        super().__init__(num_heads, num_kv_heads, head_dim, head_dim**-0.5)
        self.window = window
        self.first_head = first_head
        self.sinks = set_loader(
            nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False),
            self.load_sinks,
        )

    def load_sinks(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        full = read_loaded(loaded)
        copy_checked(param, full[self.first_head : self.first_head + self.num_heads])


def layer_window(config: Any, layer_index: int) -> int | None:
    """The sliding window of layer ``layer_index`` (None: full attention)."""
    types = list(getattr(config, "layer_types", None) or [])
    kind = types[layer_index] if layer_index < len(types) else "full_attention"
    if kind == "sliding_attention":
        return int(config.sliding_window)
    if kind != "full_attention":
        raise ValueError(f"layer_types[{layer_index}]={kind!r} is not supported")
    return None


class GptOssAttention(LlamaAttention):
    def __init__(self, config: Any, mapping: ParallelMapping, layer_index: int) -> None:
        bias = bool(getattr(config, "attention_bias", True))
        super().__init__(config, mapping, bias, False)
        attn_mapping = mapping.attn_mapping
        self.o_proj = RowParallelLinear(
            config.num_attention_heads * self.head_dim, config.hidden_size, bias, attn_mapping
        )
        self.attn = SinkAttention(
            self.num_heads,
            self.num_kv_heads,
            head_dim_of(config),
            layer_window(config, layer_index),
            attn_mapping.tp_rank * self.num_heads,
        )


class GptOssRouter(nn.Module):
    """Biased fp32 router logits, the ``top_k`` best, a softmax over them → (weights [T, k]
    fp32, ids [T, k])."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        e, h = int(config.num_local_experts), int(config.hidden_size)
        self.top_k = int(config.num_experts_per_tok)
        self.weight = set_loader(
            nn.Parameter(torch.zeros(e, h, dtype=torch.float32), requires_grad=False),
            default_weight_loader,
        )
        self.bias = set_loader(
            nn.Parameter(torch.zeros(e, dtype=torch.float32), requires_grad=False),
            default_weight_loader,
        )

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        logits = F.linear(x.float(), self.weight, self.bias)
        top, ids = torch.topk(logits, self.top_k, dim=-1)
        return torch.softmax(top, dim=-1), ids


def is_mxfp4_checkpoint(config: Any) -> bool:
    """Whether the folder's experts are the released MXFP4 tensors (``quantization_config``)."""
    quant = getattr(config, "quantization_config", None) or {}
    if not isinstance(quant, dict):
        quant = quant.to_dict() if hasattr(quant, "to_dict") else dict(vars(quant))
    return quant.get("quant_method") == "mxfp4"


def mxfp4_resident(config: Any, device: torch.device) -> bool:
    """Whether the experts stay MXFP4 in memory (the Triton MXFP4 x activation GEMMs, which
    dequantize in registers): an MXFP4 checkpoint on the GPU paths. Elsewhere they are
    dequantized at load and computed by the reference."""
    return is_mxfp4_checkpoint(config) and gpu_paths(device) and HAS_TRITON


class GptOssExperts(nn.Module):
    """This rank's experts ``first_expert ..``: ``w13`` [n, H, 2I] (gate and up interleaved by
    column, as released) with ``w13_bias`` [n, 2I], ``w2`` [n, I, H] with ``w2_bias`` [n, H].
    ``mxfp4``: ``w13`` and ``w2`` stay as released, ``w13_blocks`` [n, 2I, H / 32, 16] and
    ``w13_scales`` [n, 2I, H / 32] uint8 (``w2_*``: [n, H, I / 32, ...]), a quarter of bf16's
    bytes, and the step's pairs run in ``gpt_oss_experts_mxfp4``'s Triton kernels (sorted by
    expert on the device: no host read, CUDA-graph safe)."""

    def __init__(
        self,
        num_local: int,
        first_expert: int,
        hidden: int,
        inter: int,
        config: Any,
        mxfp4: bool = False,
    ) -> None:
        super().__init__()
        self.num_local, self.first_expert = num_local, first_expert
        self.alpha = float(getattr(config, "swiglu_alpha", 1.702))
        self.limit = float(getattr(config, "swiglu_limit", 7.0))
        self.mxfp4 = mxfp4

        def param(*shape: int, dtype: torch.dtype | None = None) -> nn.Parameter:
            empty = torch.empty(*shape, dtype=dtype)
            return set_loader(nn.Parameter(empty, requires_grad=False), self.load)

        if mxfp4:
            if hidden % MXFP4_BLOCK or inter % MXFP4_BLOCK:
                raise ValueError(
                    f"MXFP4 experts need hidden_size ({hidden}) and intermediate_size ({inter}) "
                    f"in whole blocks of {MXFP4_BLOCK}"
                )
            u8, half = torch.uint8, MXFP4_BLOCK // 2
            self.w13_blocks = param(num_local, 2 * inter, hidden // MXFP4_BLOCK, half, dtype=u8)
            self.w13_scales = param(num_local, 2 * inter, hidden // MXFP4_BLOCK, dtype=u8)
            self.w2_blocks = param(num_local, hidden, inter // MXFP4_BLOCK, half, dtype=u8)
            self.w2_scales = param(num_local, hidden, inter // MXFP4_BLOCK, dtype=u8)
        else:
            self.w13 = param(num_local, hidden, 2 * inter)
            self.w2 = param(num_local, inter, hidden)
        self.w13_bias = param(num_local, 2 * inter)
        self.w2_bias = param(num_local, hidden)

    def load(self, param: nn.Parameter, loaded: Any, shard_id: Any = None) -> None:
        """A tensor of every expert [E, ...]: this rank reads its range."""
        full = read_loaded(loaded)
        copy_checked(param, full[self.first_expert : self.first_expert + self.num_local])

    def forward(self, x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
        if self.mxfp4:
            return gpt_oss_experts_mxfp4(
                x, self.w13_blocks, self.w13_scales, self.w13_bias, self.w2_blocks,
                self.w2_scales, self.w2_bias, weights, ids, self.first_expert, self.alpha,
                self.limit,
            )  # fmt: skip
        return gpt_oss_experts_reference(
            x, self.w13, self.w13_bias, self.w2, self.w2_bias, weights, ids, self.first_expert,
            self.alpha, self.limit,
        )  # fmt: skip


class GptOssMoE(DeepseekV3MoE):
    """The router and this rank's experts; DeepSeek-V3's forward (collectives included)."""

    def __init__(self, config: Any, mapping: ParallelMapping) -> None:
        nn.Module.__init__(self)
        self.mapping = mapping
        self.adp = mapping.uses_adp_collectives
        h, inter = int(config.hidden_size), int(config.intermediate_size)
        if mapping.enable_eplb:
            raise ValueError("EPLB: gpt-oss's experts are placed once each (not balanced yet)")
        self.set_placement(int(config.num_local_experts), "num_local_experts")
        num_local = self.placement.slots_per_rank
        self.gate = GptOssRouter(config)
        first = mapping.tp_rank * num_local
        mxfp4 = mxfp4_resident(config, torch.empty(0).device)  # built under the load's device
        self.experts = GptOssExperts(num_local, first, h, inter, config, mxfp4)
        self.shared_experts = None


class GptOssDecoderLayer(LlamaDecoderLayer):
    def __init__(self, config: Any, mapping: ParallelMapping, layer_index: int) -> None:
        nn.Module.__init__(self)
        self.self_attn = GptOssAttention(config, mapping, layer_index)
        self.mlp = GptOssMoE(config, mapping)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)


class GptOssModel(DeepseekV3Model):
    """Embedding, gpt-oss blocks, final norm; the forward is the Llama model's."""

    layer_cls = GptOssDecoderLayer  # type: ignore[assignment]


def check_gpt_oss(device: torch.device, config: Any) -> None:
    """What gpt-oss does not run on, refused at start: on GPUs its experts run in the MXFP4
    kernels, so a checkpoint whose experts are stored otherwise (bf16) serves on CPUs only."""
    if not gpu_paths(device):
        return
    if not is_mxfp4_checkpoint(config):
        raise ValueError(
            "this gpt-oss checkpoint's experts are not MXFP4 (its config has no "
            "quantization_config with quant_method 'mxfp4'): on GPUs gpt-oss's experts run in "
            "the MXFP4 kernels (serve the released MXFP4 checkpoint, or --device cpu)"
        )
    if not HAS_TRITON:
        raise ValueError("gpt-oss on GPUs runs its experts in Triton kernels: install triton")


class GptOssForCausalLM(LlamaForCausalLM):
    """Causal LM over the paged cache with the Llama family's interface; expert tensors in the
    released MXFP4 layout or in bf16."""

    def build_model(self, config: Any, mapping: ParallelMapping) -> nn.Module:
        return GptOssModel(config, mapping)

    def checkpoint_names(self, name: str) -> list[str] | None:
        names = super().checkpoint_names(name)
        if names is None:
            return None
        name = names[0]
        if name.endswith(".self_attn.sinks"):
            return [name.replace(".self_attn.sinks", ".self_attn.attn.sinks")]
        if ".mlp.router." in name:
            return [name.replace(".mlp.router.", ".mlp.gate.")]
        return [name]

    def load_weights(self, weights: Iterable[tuple[str, Any]]) -> set[str]:
        """Expert tensors (MXFP4 pairs dequantized when both halves have come) go to the
        experts; everything else through the Llama loader."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        pending: dict[str, dict[str, Any]] = {}
        dtype = self.model.embed_tokens.weight.dtype
        ours = {"gate_up_proj": "w13", "down_proj": "w2"}

        def fill(prefix: str, proj: str, suffix: str, tensor: Any) -> None:
            key = f"{prefix}.mlp.experts.{ours[proj]}{suffix}"
            if key not in params:
                raise ValueError(f"unexpected tensor in checkpoint: {prefix}.mlp.experts.{proj}")
            try:
                params[key].weight_loader(params[key], tensor)
            except ValueError as e:
                raise ValueError(f"{prefix}.mlp.experts.{proj}{suffix}: {e}") from None
            loaded.add(key)

        def others() -> Iterator[tuple[str, Any]]:
            for ckpt_name, tensor in weights:
                head, sep, tail = ckpt_name.partition(".mlp.experts.")
                if not sep or self.checkpoint_names(ckpt_name) is None:
                    yield ckpt_name, tensor
                    continue
                proj, _, part = tail.partition("_proj")
                proj += "_proj"
                if proj not in ours or part not in ("", "_bias", "_blocks", "_scales"):
                    raise ValueError(f"unexpected tensor in checkpoint: {ckpt_name}")
                if part in ("", "_bias"):
                    fill(head, proj, part, tensor)
                    continue
                if f"{head}.mlp.experts.{ours[proj]}{part}" in params:  # kept as released
                    fill(head, proj, part, tensor)
                    continue
                halves = pending.setdefault(f"{head}|{proj}", {})
                halves[part] = read_loaded(tensor)
                if len(halves) == 2:
                    del pending[f"{head}|{proj}"]
                    try:
                        dense = dequantize_mxfp4(halves["_blocks"], halves["_scales"], dtype)
                    except ValueError as e:
                        raise ValueError(f"{head}.mlp.experts.{proj}_blocks: {e}") from None
                    fill(head, proj, "", dense.transpose(1, 2))  # [E, out, in] → [E, in, out]

        loaded |= load_named_weights(self, self.take_kv_scales(others()), self.checkpoint_names)
        if pending:
            missing = sorted(k.replace("|", ".mlp.experts.") for k in pending)
            raise ValueError(
                f"MXFP4 tensors without their other half (blocks or scales): {missing}"
            )
        return loaded

    def expected_weights(self) -> set[str]:
        skip = {"lm_head.weight"} if self.tie_word_embeddings else set()
        return expected_keys(self, skip)
