"""The model shapes the shipped presets serve, as their Hugging Face config values (no weights):
one table for the GPU benchmark (which builds random-weight models of them) and the AOT tool
(which compiles every kernel for them)."""

from __future__ import annotations

from typing import Any

# Hugging Face config fields by model family; ``fp8_block``: released FP8 weights' block size.
MODELS: dict[str, dict[str, Any]] = {
    "smollm2-135m": dict(
        vocab_size=49152,
        hidden_size=576,
        intermediate_size=1536,
        num_attention_heads=9,
        num_key_value_heads=3,
        head_dim=64,
    ),
    "llama3.1-8b": dict(
        vocab_size=128256,
        hidden_size=4096,
        intermediate_size=14336,
        num_hidden_layers=32,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
        max_position_embeddings=131072,
        rms_norm_eps=1e-5,
        rope_parameters={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192,
        },
    ),
    "qwen3-8b": dict(
        vocab_size=151936,
        hidden_size=4096,
        intermediate_size=12288,
        num_attention_heads=32,
        num_key_value_heads=8,
        head_dim=128,
    ),
    "deepseek-v3": dict(
        vocab_size=129280,
        hidden_size=7168,
        num_attention_heads=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        n_routed_experts=256,
        num_experts_per_tok=8,
        n_group=8,
        topk_group=4,
        moe_intermediate_size=2048,
        fp8_block=(128, 128),
    ),
    # Qwen3-30B-A3B's config.json: softmax top-8 routing over 128 experts, no shared ones.
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        moe_intermediate_size=768,
    ),
    # Experts in MXFP4 as released, attention sinks, a 128-token window on every other layer.
    "gpt-oss-20b": dict(
        vocab_size=201088,
        hidden_size=2880,
        intermediate_size=2880,
        num_attention_heads=64,
        num_key_value_heads=8,
        head_dim=64,
        sliding_window=128,
        num_local_experts=32,
        experts_per_token=4,
    ),
}
# The model each shipped preset (configs/NAME.yaml) serves.
PRESET_MODEL = {
    "cpu": "smollm2-135m",
    "llama3.1-8b-eagle3": "llama3.1-8b",
    "qwen3-8b-eagle3": "qwen3-8b",
    "deepseek-v3-mtp-tp8": "deepseek-v3",
    "qwen3-30b-a3b-eagle3": "qwen3-30b-a3b",
}
# Models whose kernels are compiled ahead of time without a shipped preset (the engine does not
# serve them on GPUs yet): name -> (family, tensor-parallel size).
UNPRESET_MODELS = {"gpt-oss-20b": ("gpt-oss-20b", 1)}


def llama_config(family: str, **overrides: Any) -> Any:
    """A ``transformers`` LlamaConfig of ``family``'s shape (a Llama-family entry)."""
    from transformers import LlamaConfig

    fields = {**MODELS[family], **overrides}
    return LlamaConfig(**fields, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
