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

Three implementations: `paged_attention_reference` (per-sequence loop, the test oracle),
`_paged_attention_torch` (vectorized CPU path, one SDPA call) and a Triton kernel (CUDA, or CPU
through the Triton interpreter). `paged_attention` dispatches between the last two.
"""

from __future__ import annotations

import contextlib
import math
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

try:
    import triton
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # triton is Linux-only; the PyTorch paths still work
    HAS_TRITON = False

# Test-only: CPU tensors take the GPU code paths (Triton kernels through the interpreter, no CPU
# attention plan), so a CPU run sees the ops a GPU step runs (engine/capture_check.py). Read once,
# at import; never set it in production.
GPU_PATHS_ENV = "TANDEM_TEST_GPU_PATHS"
FORCE_GPU_PATHS = os.environ.get(GPU_PATHS_ENV, "").strip() == "1"


def gpu_paths(where: Tensor | torch.device) -> bool:
    """Whether work on ``where`` (a tensor or a device) takes the GPU code paths: CUDA, or
    anything under ``TANDEM_TEST_GPU_PATHS=1``."""
    device = where.device if isinstance(where, Tensor) else where
    return device.type == "cuda" or FORCE_GPU_PATHS


__all__ = [
    "AttentionPlan",
    "build_attention_plan",
    "paged_attention",
    "paged_attention_reference",
    "triton_interpreter_enabled",
    "write_kv_cache",
]


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
) -> None:
    """Store k, v [num_tokens, num_kv_heads, head_dim] at flat slots `slot_mapping` [num_tokens].

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
    if use_triton:
        if not HAS_TRITON:
            raise RuntimeError("use_triton=True but triton is not installed")
        _write_kv_cache_triton(k, v, k_flat, v_flat, slot_mapping)
        return
    if plan is not None and plan.write_slots is not None:
        slots, rows = plan.write_slots, plan.write_rows
        if rows is not None:
            k, v = k.index_select(0, rows), v.index_select(0, rows)
    else:
        valid = slot_mapping >= 0
        slots = slot_mapping[valid].long()
        k, v = k[valid], v[valid]
    k_flat.index_copy_(0, slots, k if k.dtype == k_flat.dtype else k.to(k_flat.dtype))
    v_flat.index_copy_(0, slots, v if v.dtype == v_flat.dtype else v.to(v_flat.dtype))


# --------------------------------------------------------------------------------------------
# Reference (test oracle)
# --------------------------------------------------------------------------------------------


def paged_attention_reference(
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
    tree_mask: Tensor | None = None,
) -> Tensor:
    """Plain per-sequence loop; obviously correct and slow. Same contract as `paged_attention`."""
    del max_query_len, max_seq_len  # derived per sequence here
    block_size = k_cache.shape[1]
    num_heads, num_kv_heads = q.shape[1], k_cache.shape[2]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    qsl = query_start_loc.tolist()
    for i, seq_len in enumerate(seq_lens.tolist()):
        start, end = qsl[i], qsl[i + 1]
        ql = end - start
        if ql == 0:
            continue
        pos = torch.arange(seq_len, device=q.device)
        slots = block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = k_cache.flatten(0, 1)[slots].float()  # [L, Hkv, D]
        v = v_cache.flatten(0, 1)[slots].float()
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]; head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        qi = q[start:end].float()  # [ql, H, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale  # [H, ql, L]
        q_pos = torch.arange(seq_len - ql, seq_len, device=q.device)
        causal = pos[None, :] <= q_pos[:, None]  # [ql, L]
        if tree_mask is not None:
            ctx = seq_len - ql
            for j, word in enumerate(tree_mask[start:end].tolist()):
                if word != 0:
                    rows = [i for i in range(min(j + 1, 64)) if (word >> i) & 1]
                    causal[j, ctx:] = False
                    causal[j, [ctx + i for i in rows]] = True
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


# --------------------------------------------------------------------------------------------
# Vectorized PyTorch path (CPU hot loop)
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AttentionPlan:
    """Index tensors shared by every attention layer of one step (build once, reuse per layer).

    slots:    [num_seqs * max_seq_len] int64 flat cache slots (0 beyond each sequence's length).
    mask:     [num_seqs, 1, max_query_len, max_seq_len] bool, True = attend (causal + length);
              None when every key is visible to every query (one query token per sequence and
              every sequence exactly max_seq_len long, e.g. batch-1 decode), or when ``causal``.
    pad_idx:  [num_tokens] int64 row of each query token in the padded [num_seqs * max_query_len]
              layout, or None when the batch is pure decode with one token per sequence.
    write_slots, write_rows: the KV-write slots of the rows with a valid slot, and those rows
              (None: every row); only when the plan was built with the step's slot mapping.
    causal:   every sequence's queries are all of its positions (a prefill with nothing cached):
              the mask is plain causal, which SDPA runs without it (CPU only: deciding reads
              the sequence lengths).
    tree:     the mask includes a tree mask (``paged_attention``'s ``tree_mask``).
    """

    slots: Tensor
    mask: Tensor | None
    pad_idx: Tensor | None
    num_tokens: int
    num_seqs: int
    max_query_len: int
    max_seq_len: int
    block_size: int
    write_slots: Tensor | None = None
    write_rows: Tensor | None = None
    causal: bool = False
    tree: bool = False


def build_attention_plan(
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    block_size: int,
    max_query_len: int,
    max_seq_len: int,
    *,
    num_tokens: int | None = None,
    full_keys: bool = False,
    slot_mapping: Tensor | None = None,
    tree_mask: Tensor | None = None,
) -> AttentionPlan:
    """Precompute gather slots, padding indices and the attention mask for one batch.

    Pass `num_tokens` (the query row count, a host int) to avoid the one host read of
    `query_start_loc[-1]`. `full_keys`: the caller knows every sequence has exactly
    `max_seq_len` KV positions, so with one query token per sequence no mask is needed.
    `slot_mapping` (host-side tensor): the step's KV-write slots, filtered here once for every
    layer's `write_kv_cache`. `tree_mask` [num_tokens] int64: the rows' tree words (see the
    module docstring), folded into the mask.
    """
    if num_tokens is None:
        num_tokens = int(query_start_loc[-1])
    device = block_tables.device
    num_seqs = seq_lens.shape[0]
    seq_lens = seq_lens.long()
    qsl = query_start_loc.long()
    pos = torch.arange(max_seq_len, device=device)  # [S]
    block_idx = (pos // block_size).clamp_(max=block_tables.shape[1] - 1)
    slots = block_tables[:, block_idx].long() * block_size + pos % block_size  # [B, S]
    decode = max_query_len == 1 and num_tokens == num_seqs
    key_valid = None  # full_keys: every gathered position is a real key
    if not full_keys:
        key_valid = pos[None, :] < seq_lens[:, None]  # [B, S]
        # Unused block-table entries are arbitrary: never gather through them.
        slots = torch.where(key_valid, slots, torch.zeros_like(slots))
    # Flat: index_select on [num_slots, Hkv, D] is several times faster than [B, S] indexing.
    slots = slots.view(-1)
    tree = tree_mask is not None
    causal = (
        device.type == "cpu"
        and not tree
        and not decode
        and max_query_len == max_seq_len
        and num_tokens == int(seq_lens.sum())  # query lengths <= sequence lengths: all equal
    )
    pad_idx = None
    if not decode:
        tok = torch.arange(num_tokens, device=device)
        seq_id = torch.searchsorted(qsl[1:], tok, right=True)  # [T]
        pad_idx = seq_id * max_query_len + (tok - qsl[seq_id])
    mask = None
    if not (decode and full_keys and not tree) and not causal:
        query_lens = qsl[1:] - qsl[:-1]  # [B]
        j = torch.arange(max_query_len, device=device)
        ctx_lens = seq_lens - query_lens  # [B] KV positions before each sequence's queries
        q_pos = ctx_lens[:, None] + j[None, :]  # [B, Q]
        # Padded query rows (j >= ql) get q_pos >= seq_len, so they still see every valid key
        # and never form an all-masked (NaN) row; they are dropped when unpadding anyway.
        mask = pos[None, None, :] <= q_pos[:, :, None]  # [B, Q, S]
        if tree_mask is not None:
            words = tree_mask.long()
            if pad_idx is not None:  # padded rows get word 0: causal
                words = words.new_zeros(num_seqs * max_query_len).index_copy_(0, pad_idx, words)
            words = words.view(num_seqs, max_query_len, 1)
            rel = pos[None, :] - ctx_lens[:, None]  # [B, S] position among the query rows
            bit = (words >> rel.clamp(0, 63)[:, None, :]) & 1  # [B, Q, S]
            in_tree = (rel < 64)[:, None, :] & (bit != 0) & mask
            tree_visible = (rel < 0)[:, None, :] | in_tree
            mask = torch.where(words != 0, tree_visible, mask)
        if key_valid is not None:
            mask = mask & key_valid[:, None, :]
        mask = mask[:, None]
    write_slots = write_rows = None
    if slot_mapping is not None:
        valid = slot_mapping >= 0
        if bool(valid.all()):  # a host tensor: no device to sync with
            write_slots = slot_mapping.long()
        else:
            write_rows = valid.nonzero().squeeze(1)
            write_slots = slot_mapping[write_rows].long()
    return AttentionPlan(
        slots=slots,
        mask=mask,
        pad_idx=pad_idx,
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        max_query_len=max_query_len,
        max_seq_len=max_seq_len,
        block_size=block_size,
        write_slots=write_slots,
        write_rows=write_rows,
        causal=causal,
        tree=tree,
    )


def _paged_attention_torch(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, plan: AttentionPlan, scale: float
) -> Tensor:
    """Gather K/V into padded [B, S] form and run one SDPA call (fp32 accumulation inside).

    GQA without repeating K/V: the G query heads sharing a kv head are folded into the query
    length, q [B, Hkv, Q * G, D] against k/v [B, Hkv, S, D]. For decode (Q == 1) this is a view.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    B, Q, S = plan.num_seqs, plan.max_query_len, plan.max_seq_len
    k = k_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.slots)
    v = v_cache.view(-1, num_kv_heads, head_dim).index_select(0, plan.slots)
    k = k.view(B, S, num_kv_heads, head_dim).transpose(1, 2)  # [B, Hkv, S, D]
    v = v.view(B, S, num_kv_heads, head_dim).transpose(1, 2)
    if plan.causal and plan.pad_idx is not None:
        # Plain causal (padded query rows j >= a sequence's length see padding keys; they are
        # dropped): SDPA's own causal path skips the masked blocks and shares kv heads itself.
        q_pad = q.new_zeros(B * Q, num_heads, head_dim)
        q_pad.index_copy_(0, plan.pad_idx, q)
        q_bhqd = q_pad.view(B, Q, num_heads, head_dim).transpose(1, 2)
        out = F.scaled_dot_product_attention(
            q_bhqd, k, v, is_causal=True, scale=scale, enable_gqa=group > 1
        )
        out = out.transpose(1, 2).reshape(B * Q, num_heads, head_dim)
        return out.index_select(0, plan.pad_idx)
    if plan.pad_idx is None:  # one query token per sequence
        q_fold = q.reshape(B, num_kv_heads, group, head_dim)  # a view unless q is odd-strided
        mask = plan.mask  # [B, 1, 1, S] broadcasts over the G folded rows
    else:
        q_pad = q.new_zeros(B * Q, num_heads, head_dim)
        q_pad.index_copy_(0, plan.pad_idx, q)
        q_pad = q_pad.view(B, Q, num_kv_heads, group, head_dim).transpose(1, 2)
        q_fold = q_pad.reshape(B, num_kv_heads, Q * group, head_dim)  # rows ordered (Q, G)
        mask = plan.mask
        if group > 1 and mask is not None:
            mask = mask[:, :, :, None, :].expand(B, 1, Q, group, S).reshape(B, 1, Q * group, S)
    out = F.scaled_dot_product_attention(q_fold, k, v, attn_mask=mask, scale=scale)
    if plan.pad_idx is None:
        return out.reshape(num_tokens, num_heads, head_dim)
    out = out.view(B, num_kv_heads, Q, group, head_dim).transpose(1, 2)  # [B, Q, Hkv, G, D]
    return out.reshape(B * Q, num_heads, head_dim).index_select(0, plan.pad_idx)


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
) -> Tensor:
    """Causal attention of q [num_tokens, num_heads, head_dim] over the paged KV cache.

    seq_lens [num_seqs] counts KV positions including this step's query tokens (already written
    to the cache); query_start_loc [num_seqs + 1] holds cumulative query counts. Returns
    [num_tokens, num_heads, head_dim] in q's dtype. `use_triton=None` picks Triton on CUDA and
    the PyTorch path elsewhere; `use_triton=True` on CPU runs the kernel in the Triton
    interpreter (tests). `plan` (PyTorch path only) lets all layers of a step share indices.
    `tree_mask` [num_tokens] int64 (see the module docstring): tree attention for the rows with
    a nonzero word; a `plan` must have been built with it.
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
        return _paged_attention_triton(
            q,
            k_cache,
            v_cache,
            block_tables,
            seq_lens,
            query_start_loc,
            scale,
            max_query_len,
            tree_mask,
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
    return _paged_attention_torch(q, k_cache, v_cache, plan, scale)


# --------------------------------------------------------------------------------------------
# Triton (CUDA; CPU through the interpreter)
# --------------------------------------------------------------------------------------------


def triton_interpreter_enabled() -> bool:
    """True if Triton kernels can run on CPU tensors here (through the Triton interpreter).

    That needs TRITON_INTERPRET=1 in the environment before `triton` is first imported: the
    interpreter replaces triton.language's own jit functions at import time.
    """
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


# Where every Triton launch of the kernel modules goes while set (``launch_hook``): the AOT
# tool records launches instead of running them, the capture check marks them as device work.
_launch_hook: Callable[..., None] | None = None


@contextlib.contextmanager
def launch_hook(hook: Callable[..., None]) -> Iterator[None]:
    """Route every ``_launch`` (paged attention, MoE, speculative decoding kernels) to
    ``hook(kernel, grid, device, *args, **options)`` inside the block; ``run_launch`` runs one."""
    global _launch_hook
    saved, _launch_hook = _launch_hook, hook
    try:
        yield
    finally:
        _launch_hook = saved


def _launch(
    kernel: object, grid: tuple[int, ...], device: torch.device, *args: object, **options: int
) -> None:
    """Launch on CUDA, or in the Triton interpreter for CPU tensors. ``options``: num_warps,
    num_stages (Triton's defaults otherwise)."""
    if _launch_hook is not None:
        _launch_hook(kernel, grid, device, *args, **options)
        return
    run_launch(kernel, grid, device, *args, **options)


def run_launch(
    kernel: object, grid: tuple[int, ...], device: torch.device, *args: object, **options: int
) -> None:
    """The launch itself (what ``_launch`` does without a hook)."""
    if device.type != "cuda" and not triton_interpreter_enabled():
        raise RuntimeError(
            "Triton kernels run on CPU only in the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (or use use_triton=False)"
        )
    kernel[grid](*args, **options)  # type: ignore[index]


def _next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())


if HAS_TRITON:

    @triton.jit
    def _write_kv_kernel(
        k_ptr: tl.tensor, v_ptr: tl.tensor, k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor,
        slot_ptr: tl.tensor,
        stride_kt: tl.tensor, stride_kh: tl.tensor, stride_vt: tl.tensor, stride_vh: tl.tensor,
        stride_kcs: tl.tensor, stride_kch: tl.tensor, stride_vcs: tl.tensor, stride_vch: tl.tensor,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    ) -> None:  # fmt: skip
        # One program per token; a negative slot masks the whole store (padding row).
        t = tl.program_id(0).to(tl.int64)
        slot = tl.load(slot_ptr + t).to(tl.int64)
        h = tl.arange(0, BLOCK_H)
        d = tl.arange(0, BLOCK_D)
        # Compare a block, not the scalar: the interpreter rejects a scalar & block mask.
        valid = (h[:, None] * 0 + slot) >= 0
        mask = valid & (h[:, None] < NUM_KV_HEADS) & (d[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
        v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + d[None, :], mask=mask)
        k_dst = k_cache_ptr + slot * stride_kcs + h[:, None] * stride_kch + d[None, :]
        v_dst = v_cache_ptr + slot * stride_vcs + h[:, None] * stride_vch + d[None, :]
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr: tl.tensor, k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor, out_ptr: tl.tensor,
        block_tables_ptr: tl.tensor, seq_lens_ptr: tl.tensor, query_start_loc_ptr: tl.tensor,
        tree_mask_ptr: tl.tensor, scale_log2e: tl.tensor,
        stride_qt: tl.tensor, stride_qh: tl.tensor,
        stride_kb: tl.tensor, stride_ks: tl.tensor, stride_kh: tl.tensor,
        stride_vb: tl.tensor, stride_vs: tl.tensor, stride_vh: tl.tensor,
        stride_ot: tl.tensor, stride_oh: tl.tensor,
        stride_bt: tl.tensor,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_DV: tl.constexpr,
        DOT_FP32: tl.constexpr, TREE: tl.constexpr,
    ) -> None:  # fmt: skip
        # Program = (sequence, kv head x value chunk, block of BLOCK_Q query tokens). Its BLOCK_M
        # rows pack BLOCK_Q tokens x GROUP query heads that share the kv head (GQA), so decode
        # rows fill the tl.dot tile. Online softmax (flash attention) over KV tiles of BLOCK_N
        # positions. Scores sum over HEAD_DIM in chunks of BLOCK_DK; the program writes output
        # columns [c * BLOCK_DV, (c + 1) * BLOCK_DV) of its value chunk c. Wide heads (MLA's
        # latent 512 + rope 64) thus never hold a whole row in registers or shared memory.
        # TREE: rows with a nonzero tree word see the prefix and the query rows of their word
        # (tree_mask_ptr is unused otherwise).
        seq = tl.program_id(0)
        kv_head = tl.program_id(1) // NUM_DV
        dv0 = (tl.program_id(1) % NUM_DV) * BLOCK_DV
        q_block = tl.program_id(2)
        q_start = tl.load(query_start_loc_ptr + seq)
        q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
        ctx_len = tl.load(seq_lens_ptr + seq) - q_len  # KV positions before this chunk

        r = tl.arange(0, BLOCK_M)
        q_idx = q_block * BLOCK_Q + r // GROUP  # [BLOCK_M] token index within the chunk
        head = kv_head * GROUP + r % GROUP
        row_valid = (r < BLOCK_Q * GROUP) & (q_idx < q_len)
        q_pos = ctx_len + q_idx  # causal limit of each row
        tok = (q_start + q_idx).to(tl.int64)
        q_rows = q_ptr + tok * stride_qt + head * stride_qh  # [BLOCK_M] row starts
        if TREE:
            word = tl.load(tree_mask_ptr + tok, mask=row_valid, other=0)  # [BLOCK_M] int64
        dk = tl.arange(0, BLOCK_DK)
        if HEAD_DIM <= BLOCK_DK:  # one chunk: load the queries once
            q_one = tl.load(q_rows[:, None] + dk[None, :],
                            mask=row_valid[:, None] & (dk < HEAD_DIM)[None, :], other=0.0)  # fmt: skip
            if DOT_FP32:
                q_one = q_one.to(tl.float32)
        dv = dv0 + tl.arange(0, BLOCK_DV)
        dv_valid = dv < HEAD_DIM

        # Last KV position any valid row of this block sees, + 1 (0 for an empty block).
        last_q = tl.minimum(q_len, (q_block + 1) * BLOCK_Q)
        kv_end = tl.where(q_block * BLOCK_Q < q_len, ctx_len + last_q, 0)

        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], tl.float32)
        for start in range(0, kv_end, BLOCK_N):
            n = start + tl.arange(0, BLOCK_N)
            n_valid = n < kv_end
            blk = tl.load(block_tables_ptr + seq * stride_bt + n // BLOCK_SIZE,
                          mask=n_valid, other=0).to(tl.int64)  # fmt: skip
            off = n % BLOCK_SIZE
            k_rows = k_cache_ptr + blk * stride_kb + off * stride_ks + kv_head * stride_kh
            s = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for d0 in tl.static_range(0, HEAD_DIM, BLOCK_DK):
                d = d0 + dk
                d_valid = d < HEAD_DIM
                if HEAD_DIM <= BLOCK_DK:
                    q = q_one
                else:
                    q = tl.load(q_rows[:, None] + d[None, :],
                                mask=row_valid[:, None] & d_valid[None, :], other=0.0)  # fmt: skip
                k = tl.load(k_rows[:, None] + d[None, :],
                            mask=n_valid[:, None] & d_valid[None, :], other=0.0)  # fmt: skip
                if DOT_FP32:
                    s += tl.dot(q.to(tl.float32), tl.trans(k.to(tl.float32)),
                                input_precision="ieee")  # fmt: skip
                else:
                    s += tl.dot(q, tl.trans(k))
            s = s * scale_log2e  # [BLOCK_M, BLOCK_N], log2 domain
            visible = n[None, :] <= q_pos[:, None]
            if TREE:
                rel = n - ctx_len  # [BLOCK_N] index among the sequence's query rows
                shift = tl.minimum(tl.maximum(rel, 0), 63).to(tl.int64)
                bit = (word[:, None] >> shift[None, :]) & 1
                in_tree = visible & (bit != 0) & (rel < 64)[None, :]
                tree_visible = (rel < 0)[None, :] | in_tree
                visible = tl.where(word[:, None] != 0, tree_visible, visible)
            visible = visible & n_valid[None, :]
            s = tl.where(visible, s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1))
            # A row with nothing visible yet keeps m = -inf; subtract 0 instead (no NaN).
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            v_rows = v_cache_ptr + blk * stride_vb + off * stride_vs + kv_head * stride_vh
            v = tl.load(v_rows[:, None] + dv[None, :],
                        mask=n_valid[:, None] & dv_valid[None, :], other=0.0)  # fmt: skip
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dv_valid[None, :])  # fmt: skip


def _write_kv_cache_triton(
    k: Tensor, v: Tensor, k_flat: Tensor, v_flat: Tensor, slot_mapping: Tensor
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _check_last_dim_contiguous(k_flat, v_flat)
    _launch(
        _write_kv_kernel, (num_tokens,), k.device,
        k, v, k_flat, v_flat, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
        num_kv_heads, head_dim, _next_pow2(num_kv_heads), _next_pow2(head_dim),
    )  # fmt: skip


def _paged_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    max_query_len: int,
    tree_mask: Tensor | None = None,
) -> Tensor:
    num_tokens, num_heads, head_dim = q.shape
    num_seqs = seq_lens.shape[0]
    num_kv_heads, block_size = k_cache.shape[2], k_cache.shape[1]
    group = num_heads // num_kv_heads
    out = torch.empty_like(q)
    if num_tokens == 0 or num_seqs == 0 or max_query_len == 0:
        return out
    q = _last_dim_contiguous(q)
    _check_last_dim_contiguous(k_cache, v_cache)
    block_tables = block_tables.to(torch.int32)
    if block_tables.stride(1) != 1:
        block_tables = block_tables.contiguous()
    tree = tree_mask is not None
    plan = attention_tiles(group, head_dim, max_query_len, q.dtype, q.is_cuda, tree=tree)
    block_q, block_m, block_n, block_dk, block_dv, num_warps = plan
    num_dv = triton.cdiv(head_dim, block_dv)
    grid = (num_seqs, num_kv_heads * num_dv, triton.cdiv(max_query_len, block_q))
    # fp32 inputs: exact (ieee) dots, no tf32. The interpreter's bf16 tl.dot is wrong
    # (triton 3.9), so interpreted runs compute every dot in fp32.
    dot_fp32 = q.dtype == torch.float32 or not q.is_cuda
    options = {"num_warps": num_warps} if q.is_cuda else {}
    seq_lens, query_start_loc = seq_lens.to(torch.int32), query_start_loc.to(torch.int32)
    _launch(
        _paged_attention_kernel, grid, q.device,
        q, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc,
        tree_mask.contiguous() if tree else seq_lens,  # unused without TREE
        scale * math.log2(math.e),
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        group, block_size, head_dim,
        block_q, block_m, block_n, block_dk, block_dv, num_dv, dot_fp32, tree, **options,
    )  # fmt: skip
    return out


def attention_tiles(
    group: int,
    head_dim: int,
    max_query_len: int,
    dtype: torch.dtype,
    on_gpu: bool,
    *,
    tree: bool = False,
) -> tuple[int, int, int, int, int, int]:
    """(BLOCK_Q, BLOCK_M, BLOCK_N, BLOCK_DK, BLOCK_DV, num_warps) of the attention kernel.

    GPU: 64 query rows (tokens x GQA group) and 64 KV positions per tile. Heads up to 128 wide
    are one chunk (queries loaded once); wider ones (MLA's 576) go in 64-wide chunks for the
    scores and 64-wide value chunks, one per program, so no tile exceeds 128 x 64 and nothing
    spills (``python -m tandem.bench.aot`` checks every variant for sm_80 / sm_90: registers,
    spills, shared memory). Eight warps where the tiles are large. The interpreter is slow per
    element: 16-row tiles there, and 32-wide chunks, so heads wider than 32 run the chunked
    code paths in the interpreter tests. ``tree``: the tree-mask variant; its per-tile bit
    tests cost registers (the AOT check measured spills on sm_80 with the chain's KV tiles:
    88 B for SmolLM's 32-row tiles, 208 B for MLA's), so it runs half as many KV positions."""
    if not on_gpu:
        block_q = max(1, min(16 // group, max_query_len))
        block_d = min(32, max(16, _next_pow2(head_dim)))
        return block_q, max(16, _next_pow2(block_q * group)), 16, block_d, block_d, 4
    block_q = max(1, min(64 // group, max_query_len))
    block_m = max(16, _next_pow2(block_q * group))
    block_d = max(16, _next_pow2(head_dim))
    wide = block_d > 128
    block_dk = 64 if wide else block_d
    block_dv = 64 if wide else block_d
    block_n = 32 if block_m * block_dk >= 64 * 128 else 64  # big query tiles: shorter KV tiles
    if tree:
        block_n = max(16, block_n // 2)
    big = block_m >= 64 or block_dk >= 128
    del dtype  # the same tiles for bf16, fp16 and fp32 (fp32 dots are exact, see the caller)
    return block_q, block_m, block_n, block_dk, block_dv, 8 if big else 4


def _last_dim_contiguous(x: Tensor) -> Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _check_last_dim_contiguous(*caches: Tensor) -> None:
    for cache in caches:
        if cache.stride(-1) != 1:
            raise ValueError(
                f"KV cache must be contiguous in head_dim, got strides {cache.stride()}"
            )
