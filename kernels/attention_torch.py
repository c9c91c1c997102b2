"""Paged attention in PyTorch: the per-sequence reference (the test oracle of every
implementation) and the vectorized CPU path, whose per-step index tensors an ``AttentionPlan``
holds (built once a step, read by every layer). The contract is ``kernels/paged_attention.py``'s.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

# An FP8 KV cache (--kv-cache-dtype fp8): e4m3 values, each layer's K and V with a per-tensor
# scale (value = stored x scale). CPU index kernels lack float8: its bytes are moved as uint8.
FP8_KV_DTYPE = torch.float8_e4m3fn


def gather_kv(flat: Tensor, slots: Tensor, dtype: torch.dtype, scale: float = 1.0) -> Tensor:
    """Rows ``slots`` of a flat cache [num_slots, ...] in ``dtype``; an FP8 cache's values
    dequantized (times its per-tensor ``scale``)."""
    if flat.dtype != FP8_KV_DTYPE:
        rows = flat.index_select(0, slots)
        return rows if rows.dtype == dtype else rows.to(dtype)
    rows = flat.view(torch.uint8).index_select(0, slots).view(FP8_KV_DTYPE).to(dtype)
    return rows * scale if scale != 1.0 else rows


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
    sinks: Tensor | None = None,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """Plain per-sequence loop; obviously correct and slow. Same contract as `paged_attention`.

    ``sinks`` [H]: one learned logit per query head that joins the softmax's denominator and
    attends to nothing (gpt-oss). ``window``: a query at position p sees keys at p - window + 1
    .. p only (sliding-window layers); a tree row's p is its root's position plus its depth."""
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
        k = gather_kv(k_cache.flatten(0, 1), slots, torch.float32, k_scale)  # [L, Hkv, D]
        v = gather_kv(v_cache.flatten(0, 1), slots, torch.float32, v_scale)
        k = k.repeat_interleave(group, dim=1)  # [L, H, D]; head h reads kv head h // group
        v = v.repeat_interleave(group, dim=1)
        qi = q[start:end].float()  # [ql, H, D]
        scores = torch.einsum("qhd,khd->hqk", qi, k) * scale  # [H, ql, L]
        q_pos = torch.arange(seq_len - ql, seq_len, device=q.device)
        causal = pos[None, :] <= q_pos[:, None]  # [ql, L]
        # A tree row's position is its root's plus its depth (its word's bits: its ancestors
        # and itself, the root included), as a query and as a key (the window's test).
        ctx = seq_len - ql
        key_pos = pos.clone()
        if tree_mask is not None:
            for j, word in enumerate(tree_mask[start:end].tolist()):
                if word != 0:
                    rows = [i for i in range(min(j + 1, 64)) if (word >> i) & 1]
                    causal[j, ctx:] = False
                    causal[j, [ctx + i for i in rows]] = True
                    key_pos[ctx + j] = ctx + len(rows) - 1
        if window is not None:
            causal &= key_pos[None, :] > key_pos[ctx:, None] - window
        scores = scores.masked_fill(~causal, float("-inf"))
        if sinks is not None:
            sink = sinks.float()[:, None, None].expand(-1, ql, 1)  # [H, ql, 1]
            probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
        else:
            probs = torch.softmax(scores, dim=-1)
        out[start:end] = torch.einsum("hqk,khd->qhd", probs, v).to(q.dtype)
    return out


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


def paged_attention_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: AttentionPlan,
    scale: float,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """Gather K/V into padded [B, S] form and run one SDPA call (fp32 accumulation inside).

    GQA without repeating K/V: the G query heads sharing a kv head are folded into the query
    length, q [B, Hkv, Q * G, D] against k/v [B, Hkv, S, D]. For decode (Q == 1) this is a view.
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    B, Q, S = plan.num_seqs, plan.max_query_len, plan.max_seq_len
    k = gather_kv(k_cache.view(-1, num_kv_heads, head_dim), plan.slots, q.dtype, k_scale)
    v = gather_kv(v_cache.view(-1, num_kv_heads, head_dim), plan.slots, q.dtype, v_scale)
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


def paged_attention_sinks_torch(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    plan: AttentionPlan,
    scale: float,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    sinks: Tensor | None = None,
    window: int | None = None,
    tree_mask: Tensor | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> Tensor:
    """gpt-oss's layers on the PyTorch path: the plan's gathered keys and mask (causal, length,
    a tree's when it was built with ``tree_mask``) narrowed to the last ``window`` positions,
    and each head's sink logit as one more softmax column that attends to nothing; fp32
    scores. A tree row is at its root's position plus its depth, as a query and as a key (the
    window's test). Same results as ``paged_attention_reference``, batched instead of one
    sequence at a time."""
    if plan.tree != (tree_mask is not None):
        raise ValueError("the plan and tree_mask disagree on whether the step has a tree")
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    group = num_heads // num_kv_heads
    B, Q, S = plan.num_seqs, plan.max_query_len, plan.max_seq_len
    k = gather_kv(k_cache.view(-1, num_kv_heads, head_dim), plan.slots, torch.float32, k_scale)
    v = gather_kv(v_cache.view(-1, num_kv_heads, head_dim), plan.slots, torch.float32, v_scale)
    k = k.view(B, S, num_kv_heads, head_dim)
    v = v.view(B, S, num_kv_heads, head_dim)
    if plan.pad_idx is None:  # one query token per sequence
        q_pad = q.reshape(B, 1, num_heads, head_dim)
    else:
        q_pad = q.new_zeros(B * Q, num_heads, head_dim).index_copy_(0, plan.pad_idx, q)
        q_pad = q_pad.view(B, Q, num_heads, head_dim)
    rows = q_pad.shape[1]
    q_g = q_pad.view(B, rows, num_kv_heads, group, head_dim).float()
    scores = torch.einsum("bqkgd,bskd->bkqgs", q_g, k) * scale  # [B, Hkv, Q, G, S]
    lens = seq_lens.long()
    ctx = lens - (query_start_loc[1:] - query_start_loc[:-1]).long()
    q_pos = ctx[:, None] + torch.arange(rows, device=q.device)  # [B, Q]; padded rows: past the end
    pos = torch.arange(S, device=q.device)
    if plan.mask is not None:
        seen = plan.mask[:, 0, :rows]  # [B, Q, S]
    else:
        seen = (pos <= q_pos[:, :, None]) & (pos < lens[:, None, None])
    if window is not None:
        key_pos = pos.expand(B, S)
        if tree_mask is not None:
            words = tree_mask.long()
            if plan.pad_idx is not None:
                words = words.new_zeros(B * Q).index_copy_(0, plan.pad_idx, words)
            words = words.view(B, rows)
            depth = sum(((words >> i) & 1) for i in range(min(rows, 64))) - 1
            q_pos = torch.where(words != 0, ctx[:, None] + depth, q_pos)
            rel = pos - ctx[:, None]  # [B, S]: the key's row among the queries
            inside = (rel >= 0) & (rel < rows)
            key_pos = torch.where(inside, q_pos.gather(1, rel.clamp(0, rows - 1)), key_pos)
        seen = seen & (key_pos[:, None, :] > q_pos[:, :, None] - window)
    scores.masked_fill_(~seen[:, None, :, None, :], float("-inf"))
    if sinks is not None:
        sink = sinks.float().view(1, num_kv_heads, 1, group, 1).expand(B, -1, rows, -1, 1)
        probs = torch.softmax(torch.cat([scores, sink], dim=-1), dim=-1)[..., :-1]
    else:
        probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bkqgs,bskd->bqkgd", probs, v).reshape(B * rows, num_heads, head_dim)
    if plan.pad_idx is not None:
        out = out.index_select(0, plan.pad_idx)
    return out.to(q.dtype)
