"""Paged attention over a block-structured KV cache.

Cache layout (the contract the model code relies on):
    k_cache, v_cache: [num_blocks, block_size, num_kv_heads, head_dim]
    slot(p) = block_table[p // block_size] * block_size + p % block_size

A batch concatenates the query tokens of its sequences (decode rows, prefill chunks and
speculative K+1 verify rows may be mixed). Query token j of a sequence with KV length L and query
length ql sits at position L - ql + j and attends to KV positions 0..L - ql + j (causal).

Tree attention (draft-tree verification, engine/speculative/tree.py): an optional ``tree_mask``
[num_tokens] int64 gives one word per query row. A row whose word is 0 is causal as above. A row
j with a nonzero word sees every KV position before its sequence's first query row (the prefix,
0..L - ql - 1) and, among the sequence's query rows 0..j, row i iff bit i of the word is set
(rows past 63 are never seen through a word). A tree request's query rows are the root then the
nodes in topological order, so a node's word holds the root, its ancestors and itself.

Three implementations: `paged_attention_reference` (per-sequence loop, the test oracle) and the
vectorized CPU path (one SDPA call) in ``kernels/attention_torch.py``, and a Triton kernel (CUDA,
or CPU through the Triton interpreter) in ``kernels/attention_triton.py``. `paged_attention`
and `write_kv_cache`, here, dispatch between the last two.
"""

from __future__ import annotations

import torch
from torch import Tensor

from tandem.kernels.attention_torch import (
    FP8_KV_DTYPE,
    AttentionPlan,
    build_attention_plan,
    paged_attention_sinks_torch,
    paged_attention_torch,
)
from tandem.kernels.attention_triton import paged_attention_triton, write_kv_cache_triton
from tandem.kernels.launch import HAS_TRITON, gpu_paths

__all__ = ["FP8_KV_DTYPE", "paged_attention", "write_kv_cache"]


# --------------------------------------------------------------------------------------------
# KV cache writes
# --------------------------------------------------------------------------------------------


def write_kv_cache(
    k: Tensor,
    v: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    slot_mapping: Tensor,
    *,
    use_triton: bool | None = None,
    plan: AttentionPlan | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Store k, v [num_tokens, num_kv_heads, head_dim] at flat slots `slot_mapping` [num_tokens].
    An FP8 cache (``FP8_KV_DTYPE``) stores k / ``k_scale`` and v / ``v_scale``.

    Negative slots (padding rows) are skipped. On CUDA a Triton kernel does the store without a
    host sync; on CPU a boolean filter is used (no device to sync with), or the filtered slots
    of `plan` when it was built with this `slot_mapping` (every layer of a step shares them).
    `use_triton=True` on CPU runs the kernel in the Triton interpreter (tests).
    """
    num_kv_heads, head_dim = k_cache.shape[2], k_cache.shape[3]
    k_flat = k_cache.view(-1, num_kv_heads, head_dim)  # [num_slots, Hkv, D]
    v_flat = v_cache.view(-1, num_kv_heads, head_dim)
    if use_triton is None:
        use_triton = gpu_paths(k) and HAS_TRITON
    fp8 = k_flat.dtype == FP8_KV_DTYPE
    if use_triton:
        if not HAS_TRITON:
            raise RuntimeError("use_triton=True but triton is not installed")
        write_kv_cache_triton(k, v, k_flat, v_flat, slot_mapping, k_scale, v_scale)
        return
    if plan is not None and plan.write_slots is not None:
        slots, rows = plan.write_slots, plan.write_rows
        if rows is not None:
            k, v = k.index_select(0, rows), v.index_select(0, rows)
    else:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        k, v = k[valid], v[valid]
    if fp8:  # (CPU index kernels lack float8: its bytes are copied as uint8)
        k = (k / k_scale if k_scale != 1.0 else k).to(FP8_KV_DTYPE)
        v = (v / v_scale if v_scale != 1.0 else v).to(FP8_KV_DTYPE)
        k_flat.view(torch.uint8).index_copy_(0, slots, k.view(torch.uint8))
        v_flat.view(torch.uint8).index_copy_(0, slots, v.view(torch.uint8))
        return
    k_flat.index_copy_(0, slots, k if k.dtype == k_flat.dtype else k.to(k_flat.dtype))
    v_flat.index_copy_(0, slots, v if v.dtype == v_flat.dtype else v.to(v_flat.dtype))


# --------------------------------------------------------------------------------------------
# Dispatch
# --------------------------------------------------------------------------------------------


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    max_query_len: int,
    max_seq_len: int,
    *,
    plan: AttentionPlan | None = None,
    use_triton: bool | None = None,
    tree_mask: Tensor | None = None,
    sinks: Tensor | None = None,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged KV cache.

    seq_lens [num_seqs] counts KV positions including this step's query tokens (already written
    to the cache); query_start_loc [num_seqs + 1] holds cumulative query counts. Returns
    [num_tokens, num_heads, head_dim] in q's dtype. `use_triton=None` picks Triton on CUDA and
    the PyTorch path elsewhere; `use_triton=True` on CPU runs the kernel in the Triton
    interpreter (tests). `plan` (PyTorch path only) lets all layers of a step share indices.
    `tree_mask` [num_tokens] int64 (see the module docstring): tree attention for the rows with
    a nonzero word; a `plan` must have been built with it. `sinks` [num_heads] (one logit per
    query head in the softmax's denominator) and `window` (a row at position p sees keys
    p - window + 1 .. p): gpt-oss's layers, in the Triton kernel (no `tree_mask`) or on the
    PyTorch path (`paged_attention_sinks_torch`). An FP8 cache (``FP8_KV_DTYPE``: values
    x `k_scale` / `v_scale`) is read by every path (e4m3 in Triton needs sm_89 or newer).
    """
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    if num_heads % num_kv_heads != 0:
        raise ValueError(
            f"num_heads ({num_heads}) must be a multiple of num_kv_heads ({num_kv_heads})"
        )
    if tree_mask is not None and (
        tree_mask.shape != (q.shape[0],) or tree_mask.dtype != torch.int64
    ):
        raise ValueError(
            f"tree_mask must be int64 [num_tokens] = [{q.shape[0]}], got "
            f"{tree_mask.dtype} {list(tree_mask.shape)}"
        )
    if use_triton is None:
        use_triton = gpu_paths(q) and HAS_TRITON
    if use_triton:
        if not HAS_TRITON:
            raise RuntimeError("use_triton=True but triton is not installed")
        return paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            tree_mask,
            sinks,
            window,
            k_scale,
            v_scale,
        )
    if plan is None:
        plan = build_attention_plan(
            block_tables,
            seq_lens,
            query_start_loc,
            k_cache.shape[1],
            max_query_len,
            max_seq_len,
            num_tokens=q.shape[0],
            tree_mask=tree_mask,
        )
    elif plan.tree != (tree_mask is not None):
        raise ValueError(
            "plan was built " + ("with" if plan.tree else "without") + " a tree mask, but "
            "tree_mask is " + ("None" if tree_mask is None else "given")
        )
    if plan.num_tokens != q.shape[0] or plan.block_size != k_cache.shape[1]:
        raise ValueError(
            f"plan was built for {plan.num_tokens} tokens / block_size {plan.block_size}, "
            f"got {q.shape[0]} tokens / block_size {k_cache.shape[1]}"
        )
    if sinks is not None or window is not None:
        return paged_attention_sinks_torch(
            q, k_cache, v_cache, plan, scale, seq_lens, query_start_loc, sinks, window,
            tree_mask, k_scale, v_scale,
        )  # fmt: skip
    return paged_attention_torch(q, k_cache, v_cache, plan, scale, k_scale, v_scale)
