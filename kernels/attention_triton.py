"""Paged attention's Triton kernels (CUDA; a CPU through the interpreter): the KV-cache write,
the attention kernel (tree words included) and the launch planning (``attention_tiles``: tile
sizes, warps and stages per query length and head size). The contract is
``kernels/paged_attention.py``'s."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from tandem.kernels.launch import HAS_TRITON, launch, next_pow2

if HAS_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _write_kv_kernel(
        k_ptr: tl.tensor, v_ptr: tl.tensor, k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor,
        slot_ptr: tl.tensor, inv_k_scale: tl.tensor, inv_v_scale: tl.tensor,
        stride_kt: tl.tensor, stride_kh: tl.tensor, stride_vt: tl.tensor, stride_vh: tl.tensor,
        stride_kcs: tl.tensor, stride_kch: tl.tensor, stride_vcs: tl.tensor, stride_vch: tl.tensor,
        NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr, KV_FP8: tl.constexpr,
    ) -> None:  # fmt: skip
        # One program per token; a negative slot masks the whole store (padding row). KV_FP8:
        # the cache holds e4m3 values of K / k_scale and V / v_scale.
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
        if KV_FP8:
            k = k.to(tl.float32) * inv_k_scale
            v = v.to(tl.float32) * inv_v_scale
        tl.store(k_dst, k.to(k_cache_ptr.dtype.element_ty), mask=mask)
        tl.store(v_dst, v.to(v_cache_ptr.dtype.element_ty), mask=mask)

    @triton.jit
    def _popcount64(x: tl.tensor) -> tl.tensor:
        # Set bits of each int64 (SWAR: pair, nibble and byte sums, then the bytes' total;
        # unsigned, so that bit 63 shifts in zeros).
        x = x.to(tl.uint64)
        x = x - ((x >> 1) & 0x5555555555555555)
        x = (x & 0x3333333333333333) + ((x >> 2) & 0x3333333333333333)
        x = (x + (x >> 4)) & 0x0F0F0F0F0F0F0F0F
        return (((x * 0x0101010101010101) >> 56) & 0x7F).to(tl.int64)

    @triton.jit
    def _paged_attention_kernel(
        q_ptr: tl.tensor, k_cache_ptr: tl.tensor, v_cache_ptr: tl.tensor, out_ptr: tl.tensor,
        block_tables_ptr: tl.tensor, seq_lens_ptr: tl.tensor, query_start_loc_ptr: tl.tensor,
        tree_mask_ptr: tl.tensor, sinks_ptr: tl.tensor, scale_log2e: tl.tensor,
        v_scale: tl.tensor,
        stride_qt: tl.tensor, stride_qh: tl.tensor,
        stride_kb: tl.tensor, stride_ks: tl.tensor, stride_kh: tl.tensor,
        stride_vb: tl.tensor, stride_vs: tl.tensor, stride_vh: tl.tensor,
        stride_ot: tl.tensor, stride_oh: tl.tensor,
        stride_bt: tl.tensor,
        GROUP: tl.constexpr, BLOCK_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr,
        BLOCK_Q: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
        BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr, NUM_DV: tl.constexpr,
        DOT_FP32: tl.constexpr, TREE: tl.constexpr, WINDOW: tl.constexpr, SINKS: tl.constexpr,
        KV_FP8: tl.constexpr,
    ) -> None:  # fmt: skip
        # Program = (sequence, kv head x value chunk, block of BLOCK_Q query tokens). Its BLOCK_M
        # rows pack BLOCK_Q tokens x GROUP query heads that share the kv head (GQA), so decode
        # rows fill the tl.dot tile. Online softmax (flash attention) over KV tiles of BLOCK_N
        # positions. Scores sum over HEAD_DIM in chunks of BLOCK_DK; the program writes output
        # columns [c * BLOCK_DV, (c + 1) * BLOCK_DV) of its value chunk c. Wide heads (MLA's
        # latent 512 + rope 64) thus never hold a whole row in registers or shared memory.
        # TREE: rows with a nonzero tree word see the prefix and the query rows of their word
        # (tree_mask_ptr is unused otherwise). WINDOW > 0: a row at position p sees keys
        # p - WINDOW + 1 .. p only (sliding-window layers); with TREE, a tree row's position is
        # its root's plus its depth (its word's bits less one: its ancestors and itself), as a
        # query and as a key. SINKS: one logit per query head (sinks_ptr, natural log) joins each
        # row's softmax denominator. KV_FP8: e4m3 keys and values, dequantized as they are
        # read (k_scale folded into scale_log2e, v_scale applied to the output).
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
            if WINDOW > 0:  # a tree row's position: its root's plus its depth
                depth = _popcount64(word) - 1
                q_win = tl.where(word != 0, ctx_len + depth, q_pos)
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
        kv_start = 0
        if WINDOW > 0:  # the first tile any row of this block still sees
            # (a tree row sits at its root's position or after: the block's lowest is ctx_len)
            lowest = ctx_len if TREE else ctx_len + q_block * BLOCK_Q
            first = tl.maximum(lowest - WINDOW + 1, 0)
            kv_start = (first // BLOCK_N) * BLOCK_N
        for start in range(kv_start, kv_end, BLOCK_N):
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
                if KV_FP8:
                    k = k.to(q_ptr.dtype.element_ty)
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
            if WINDOW > 0:
                if TREE:  # a key among the tree's rows sits at its own row's position
                    in_chunk = (rel >= 0) & (rel < q_len)
                    k_word = tl.load(tree_mask_ptr + q_start + rel, mask=in_chunk & n_valid,
                                     other=0)  # fmt: skip
                    k_pos = tl.where(in_chunk & (k_word != 0),
                                     ctx_len + _popcount64(k_word) - 1, n)  # fmt: skip
                    visible = visible & (k_pos[None, :] > q_win[:, None] - WINDOW)
                else:
                    visible = visible & (n[None, :] > q_pos[:, None] - WINDOW)
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
            if KV_FP8:
                v = v.to(q_ptr.dtype.element_ty)
            if DOT_FP32:
                acc = acc * alpha[:, None] + tl.dot(p, v.to(tl.float32), input_precision="ieee")
            else:
                acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m_i = m_new

        if SINKS:  # exp(sink) joins the denominator, in the running max's scale
            sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32)
            sink = sink * 1.4426950408889634  # log2(e): the scores are in the log2 domain
            m_safe = tl.where(m_i == float("-inf"), sink, m_i)
            l_i = l_i + tl.exp2(sink - m_safe)
        acc = acc / tl.where(l_i == 0.0, 1.0, l_i)[:, None]
        if KV_FP8:
            acc = acc * v_scale
        o_ptrs = out_ptr + tok[:, None] * stride_ot + head[:, None] * stride_oh + dv[None, :]
        tl.store(o_ptrs, acc.to(out_ptr.dtype.element_ty),
                 mask=row_valid[:, None] & dv_valid[None, :])  # fmt: skip


def write_kv_cache_triton(
    k: Tensor,
    v: Tensor,
    k_flat: Tensor,
    v_flat: Tensor,
    slot_mapping: Tensor,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    k, v = _last_dim_contiguous(k), _last_dim_contiguous(v)
    _check_last_dim_contiguous(k_flat, v_flat)
    launch(
        _write_kv_kernel, (num_tokens,), k.device,
        k, v, k_flat, v_flat, slot_mapping, 1.0 / k_scale, 1.0 / v_scale,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_flat.stride(0), k_flat.stride(1), v_flat.stride(0), v_flat.stride(1),
        num_kv_heads, head_dim, next_pow2(num_kv_heads), next_pow2(head_dim),
        k_flat.dtype == torch.float8_e4m3fn,
    )  # fmt: skip


def paged_attention_triton(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_tables: Tensor,
    seq_lens: Tensor,
    query_start_loc: Tensor,
    scale: float,
    max_query_len: int,
    tree_mask: Tensor | None = None,
    sinks: Tensor | None = None,
    window: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
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
    launch(
        _paged_attention_kernel, grid, q.device,
        q, k_cache, v_cache, out,
        block_tables, seq_lens, query_start_loc,
        tree_mask.contiguous() if tree else seq_lens,  # unused without TREE
        sinks.float().contiguous() if sinks is not None else seq_lens,  # unused without SINKS
        scale * k_scale * math.log2(math.e), v_scale,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        out.stride(0), out.stride(1),
        block_tables.stride(0),
        group, block_size, head_dim,
        block_q, block_m, block_n, block_dk, block_dv, num_dv, dot_fp32, tree,
        window or 0, sinks is not None, k_cache.dtype == torch.float8_e4m3fn, **options,
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
        block_d = min(32, max(16, next_pow2(head_dim)))
        return block_q, max(16, next_pow2(block_q * group)), 16, block_d, block_d, 4
    block_q = max(1, min(64 // group, max_query_len))
    block_m = max(16, next_pow2(block_q * group))
    block_d = max(16, next_pow2(head_dim))
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
