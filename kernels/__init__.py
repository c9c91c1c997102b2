"""Triton kernels, each with a plain-PyTorch reference and one dispatch function."""

from kernels.paged_attention import (
    AttentionPlan,
    build_attention_plan,
    paged_attention,
    paged_attention_reference,
    triton_interpreter_enabled,
    write_kv_cache,
)

__all__ = [
    "AttentionPlan",
    "build_attention_plan",
    "paged_attention",
    "paged_attention_reference",
    "triton_interpreter_enabled",
    "write_kv_cache",
]
