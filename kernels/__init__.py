"""Triton kernels, each with a plain-PyTorch reference and one dispatch function."""

from kernels.paged_attention import (
    AttentionPlan,
    build_attention_plan,
    paged_attention,
    paged_attention_reference,
    triton_interpreter_enabled,
    write_kv_cache,
)
from kernels.spec_decode import (
    accept_matching,
    accept_matching_reference,
    build_draft_step0_inputs,
    build_draft_step0_inputs_reference,
    rejection_sample,
    rejection_sample_reference,
)

__all__ = [
    "AttentionPlan",
    "accept_matching",
    "accept_matching_reference",
    "build_attention_plan",
    "build_draft_step0_inputs",
    "build_draft_step0_inputs_reference",
    "paged_attention",
    "paged_attention_reference",
    "rejection_sample",
    "rejection_sample_reference",
    "triton_interpreter_enabled",
    "write_kv_cache",
]
