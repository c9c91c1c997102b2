"""Paged attention: CPU PyTorch path and Triton kernel (interpreter) against the reference loop.

The Triton interpreter must be switched on before `triton` is first imported. On a CPU machine
this module does that (importing torch does not import triton). If another test module imported
triton earlier in this pytest process, or on a CUDA machine (where interpreting every kernel in
the process would be wrong), the in-process interpreter tests skip and
`test_triton_in_fresh_interpreter` re-runs them in a subprocess with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from typing import Any

import pytest
import torch

from triton_utils import run_in_fresh_interpreter

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton / kernels are imported

from tandem.kernels.attention_torch import (
    build_attention_plan,
    paged_attention_reference,
    paged_attention_torch,
)
from tandem.kernels.launch import HAS_TRITON, triton_interpreter_enabled
from tandem.kernels.paged_attention import paged_attention, write_kv_cache

INTERPRETER = triton_interpreter_enabled()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason="Triton interpreter not active in this process; see test_triton_in_fresh_interpreter",
)

# (context_len, query_len) per sequence; seq_len = context_len + query_len.
SCENARIOS = {
    "prefill": [(0, 7), (0, 12), (0, 1)],
    "chunked_prefill": [(5, 6), (16, 9), (3, 16)],
    "decode": [(9, 1), (0, 1), (30, 1), (16, 1)],
    "verify": [(8, 4), (13, 4), (2, 4)],  # speculative K + 1 = 4 rows per sequence
    "mixed": [(0, 7), (5, 6), (9, 1), (13, 4), (30, 1)],
}
HEADS = {"gqa": (8, 2), "mqa": (4, 1), "mha": (4, 4), "mla": (16, 1)}  # mla: all heads, one row
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}


def dtype_id(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass
class Batch:
    q: torch.Tensor
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    block_tables: torch.Tensor
    seq_lens: torch.Tensor
    query_start_loc: torch.Tensor
    scale: float
    max_query_len: int
    max_seq_len: int

    def args(self) -> tuple:
        return (
            self.q,
            self.k_cache,
            self.v_cache,
            self.block_tables,
            self.seq_lens,
            self.query_start_loc,
            self.scale,
            self.max_query_len,
            self.max_seq_len,
        )


def make_batch(
    specs: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> Batch:
    """Random cache filled everywhere (so stray reads show), shuffled non-contiguous blocks,
    garbage (negative or out-of-range) block-table entries past each sequence's blocks."""
    gen = torch.Generator().manual_seed(seed)
    seq_lens = [c + q for c, q in specs]
    blocks_per_seq = [max(1, math.ceil(s / block_size)) for s in seq_lens]
    max_blocks = max(blocks_per_seq) + 1  # one unused column at least
    num_blocks = sum(blocks_per_seq) + 3
    perm = torch.randperm(num_blocks, generator=gen)
    block_tables = torch.randint(
        -(2**20), 2**20, (len(specs), max_blocks), generator=gen, dtype=torch.int32
    )
    used = 0
    for i, n in enumerate(blocks_per_seq):
        block_tables[i, :n] = perm[used : used + n].to(torch.int32)
        used += n
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    num_tokens = sum(q for _, q in specs)
    q = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    qsl = [0]
    for _, ql in specs:
        qsl.append(qsl[-1] + ql)
    return Batch(
        q=q,
        k_cache=k_cache,
        v_cache=v_cache,
        block_tables=block_tables,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        query_start_loc=torch.tensor(qsl, dtype=torch.int32),
        scale=head_dim**-0.5,
        max_query_len=max(q for _, q in specs),
        max_seq_len=max(seq_lens),
    )


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype) -> None:
    assert out.shape == ref.shape and out.dtype == ref.dtype
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


# ---------------------------------------------------------------------------------------------
# The oracle itself
# ---------------------------------------------------------------------------------------------


def test_reference_matches_dense_causal_attention():
    # One sequence in contiguous blocks == plain causal SDPA over the dense K/V.
    b = make_batch([(0, 10)], 4, 2, 16, block_size=4)
    slots = b.block_tables[0, torch.arange(10) // 4].long() * 4 + torch.arange(10) % 4
    k = b.k_cache.flatten(0, 1)[slots].repeat_interleave(2, dim=1)  # [10, 4, 16]
    v = b.v_cache.flatten(0, 1)[slots].repeat_interleave(2, dim=1)
    dense = torch.nn.functional.scaled_dot_product_attention(
        b.q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), is_causal=True
    ).transpose(0, 1)
    torch.testing.assert_close(paged_attention_reference(*b.args()), dense, atol=1e-5, rtol=1e-5)


def test_reference_decode_row_sees_whole_context():
    # A decode row attends to every cached position: changing any one of them changes it.
    b = make_batch([(11, 1)], 2, 2, 16, block_size=4)
    before = paged_attention_reference(*b.args())
    blk = b.block_tables[0, 0].item()
    b.v_cache[blk, 0] += 10.0  # position 0
    after = paged_attention_reference(*b.args())
    assert not torch.allclose(before, after)


@pytest.mark.parametrize("window", [None, 4], ids=["full", "window4"])
def test_reference_sinks_and_window_match_transformers_gpt_oss_attention(window):
    """gpt-oss's attention (transformers' eager function: sinks as an extra softmax column,
    the window as an additive mask) over a chunk with context: the same outputs."""
    from types import SimpleNamespace

    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward

    ctx, ql, heads, kv_heads = 6, 5, 4, 2
    b = make_batch([(ctx, ql)], heads, kv_heads, 16, block_size=4)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(5))
    n = ctx + ql
    slots = b.block_tables[0, torch.arange(n) // 4].long() * 4 + torch.arange(n) % 4
    k = b.k_cache.flatten(0, 1)[slots].transpose(0, 1)[None]  # [1, Hkv, L, D]
    v = b.v_cache.flatten(0, 1)[slots].transpose(0, 1)[None]
    q_pos, k_pos = torch.arange(ctx, n)[:, None], torch.arange(n)[None, :]
    seen = k_pos <= q_pos
    if window is not None:
        seen &= k_pos > q_pos - window
    mask = torch.zeros(ql, n).masked_fill(~seen, float("-inf"))[None, None]
    module = SimpleNamespace(sinks=sinks, num_key_value_groups=heads // kv_heads, training=False)
    want, _ = eager_attention_forward(module, b.q.transpose(0, 1)[None], k, v, mask, b.scale)
    got = paged_attention_reference(*b.args(), sinks=sinks, window=window)
    torch.testing.assert_close(got, want[0], atol=1e-5, rtol=1e-5)
    plain = paged_attention_reference(*b.args())
    assert not torch.allclose(got, plain, atol=1e-3)  # the sinks (and window) matter here


def test_reference_tree_rows_with_window_equal_their_paths_attended_causally():
    """Draft trees on gpt-oss's layers: a tree row at depth d is at its root's position + d,
    and sees the context in its window and its ancestors; the same as the causal reference
    (checked against transformers above) over the context followed by that row's path, and
    the batched PyTorch path the same as the reference."""
    from tandem.engine.speculative.tree import ancestor_mask, tree_attention_words

    ctx, n, heads, kv_heads, window = 12, 7, 4, 2, 5
    b = make_batch([(ctx, n + 1)], heads, kv_heads, 16, block_size=4, seed=3)
    parents = torch.tensor([-1, 0, 0, 1, -1, 3, 5])  # depths 1..4 and siblings
    anc = ancestor_mask(parents[None], n)
    words = tree_attention_words(anc)[0]
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(7))
    got = paged_attention_reference(*b.args(), tree_mask=words, sinks=sinks, window=window)
    batched = paged_attention(*b.args(), tree_mask=words, sinks=sinks, window=window)
    torch.testing.assert_close(batched, got, atol=1e-5, rtol=1e-5)  # the PyTorch path
    pos = torch.arange(ctx + n + 1)
    slots = b.block_tables[0, pos // 4].long() * 4 + pos % 4
    keys, values = b.k_cache.flatten(0, 1)[slots], b.v_cache.flatten(0, 1)[slots]
    depths = set()
    for row in range(n + 1):
        path = [i for i in range(n + 1) if (int(words[row]) >> i) & 1]
        idx = torch.tensor(list(range(ctx)) + [ctx + i for i in path])
        one = paged_attention_reference(
            b.q[row : row + 1],
            keys[idx][:, None],  # one key per block: block i holds key i
            values[idx][:, None],
            torch.arange(len(idx), dtype=torch.int32)[None],
            torch.tensor([len(idx)], dtype=torch.int32),
            torch.tensor([0, 1], dtype=torch.int32),
            b.scale,
            1,
            len(idx),
            sinks=sinks,
            window=window,
        )
        torch.testing.assert_close(got[row], one[0], atol=1e-5, rtol=1e-5)
        depths.add(len(path))
    assert max(depths) > window  # a row deep enough that its window leaves the root behind


# ---------------------------------------------------------------------------------------------
# CPU PyTorch path
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("head_dim", [16, 48])
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", list(HEADS))
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_torch_path_matches_reference(scenario, heads, block_size, head_dim, dtype):
    num_heads, num_kv_heads = HEADS[heads]
    seed = list(SCENARIOS).index(scenario) * 1000 + list(HEADS).index(heads) * 100 + head_dim
    b = make_batch(SCENARIOS[scenario], num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    out = paged_attention(*b.args())
    assert_close(out, paged_attention_reference(*b.args()), dtype)


@pytest.mark.parametrize(
    ("sinks", "window"), [(True, None), (False, 5), (True, 5)], ids=["sinks", "window", "both"]
)
@pytest.mark.parametrize("heads", ["gqa", "mha"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_torch_path_sinks_and_window_match_reference(scenario, heads, sinks, window):
    """gpt-oss's layers batched on the PyTorch path (``paged_attention_sinks_torch``, with the
    step's shared plan) against the one-sequence-at-a-time reference."""
    num_heads, num_kv_heads = HEADS[heads]
    b = make_batch(SCENARIOS[scenario], num_heads, num_kv_heads, 16, 4, torch.float32, 8)
    sink = torch.randn(num_heads, generator=torch.Generator().manual_seed(9)) if sinks else None
    kw = {"sinks": sink, "window": window}
    plan = build_attention_plan(b.block_tables, b.seq_lens, b.query_start_loc, 4,
                                b.max_query_len, b.max_seq_len)  # fmt: skip
    for out in (paged_attention(*b.args(), **kw), paged_attention(*b.args(), plan=plan, **kw)):
        assert_close(out, paged_attention_reference(*b.args(), **kw), torch.float32)


def test_torch_path_is_causal_within_chunk():
    # Query row j of a chunk must not see positions after it: perturbing the last position
    # changes only the last row.
    b = make_batch([(5, 6)], 4, 2, 16, block_size=4)
    before = paged_attention(*b.args())
    last = 10
    blk = b.block_tables[0, last // 4].item()
    b.v_cache[blk, last % 4] += 10.0
    after = paged_attention(*b.args())
    torch.testing.assert_close(after[:5], before[:5], atol=0, rtol=0)
    assert not torch.allclose(after[5], before[5])


def test_torch_path_sequence_without_query_rows():
    # Padding sequences (no query rows, even no KV) must not disturb the others or make NaN.
    specs = [(6, 3), (5, 0), (0, 0), (9, 1)]
    b = make_batch(specs, 8, 2, 16, block_size=4)
    out = paged_attention(*b.args())
    assert_close(out, paged_attention_reference(*b.args()), torch.float32)


@pytest.mark.parametrize("scenario", ["decode", "mixed"])
def test_torch_path_accepts_q_sliced_from_fused_qkv(scenario):
    # Models slice q out of a fused qkv projection: rows are strided, head_dim is contiguous.
    b = make_batch(SCENARIOS[scenario], 8, 2, 16, block_size=4)
    qkv = torch.cat([b.q.flatten(1), torch.randn(b.q.shape[0], 2 * 2 * 16)], dim=1)
    q = qkv[:, : 8 * 16].view(b.q.shape)
    assert not q.is_contiguous()
    out = paged_attention(q, *b.args()[1:])
    assert_close(out, paged_attention_reference(*b.args()), torch.float32)


def test_plan_is_reused_across_layers():
    b = make_batch(SCENARIOS["mixed"], 8, 2, 48, block_size=4)
    plan = build_attention_plan(
        b.block_tables, b.seq_lens, b.query_start_loc, 4, b.max_query_len, b.max_seq_len
    )
    assert plan.num_tokens == b.q.shape[0]
    for layer in range(3):  # other layers: same metadata, different q and caches
        gen = torch.Generator().manual_seed(100 + layer)
        q = torch.randn(b.q.shape, generator=gen)
        k_cache = torch.randn(b.k_cache.shape, generator=gen)
        v_cache = torch.randn(b.v_cache.shape, generator=gen)
        args = (q, k_cache, v_cache, *b.args()[3:])
        with_plan = paged_attention(*args, plan=plan)
        without = paged_attention(*args)
        assert torch.equal(with_plan, without)
        assert_close(with_plan, paged_attention_reference(*args), torch.float32)


def test_plan_for_other_batch_is_rejected():
    b = make_batch(SCENARIOS["decode"], 4, 2, 16, block_size=4)
    other = make_batch(SCENARIOS["verify"], 4, 2, 16, block_size=4)
    plan = build_attention_plan(
        other.block_tables,
        other.seq_lens,
        other.query_start_loc,
        4,
        other.max_query_len,
        other.max_seq_len,
    )
    with pytest.raises(ValueError, match="plan was built for"):
        paged_attention(*b.args(), plan=plan)


def test_head_count_not_multiple_of_kv_heads_is_rejected():
    b = make_batch([(3, 2)], 6, 4, 16, block_size=4)
    with pytest.raises(ValueError, match="multiple of num_kv_heads"):
        paged_attention(*b.args())


def test_auto_dispatch_on_cpu_uses_torch_path():
    b = make_batch(SCENARIOS["mixed"], 8, 2, 16, block_size=4)
    plan = build_attention_plan(
        b.block_tables, b.seq_lens, b.query_start_loc, 4, b.max_query_len, b.max_seq_len
    )
    expected = paged_attention_torch(b.q, b.k_cache, b.v_cache, plan, b.scale)
    assert torch.equal(paged_attention(*b.args()), expected)


# ---------------------------------------------------------------------------------------------
# write_kv_cache
# ---------------------------------------------------------------------------------------------


def _check_write(use_triton: bool, dtype: torch.dtype) -> None:
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 2, 48
    gen = torch.Generator().manual_seed(7)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen).to(dtype)
    k_before, v_before = k_cache.clone(), v_cache.clone()
    slots = torch.tensor([5, -1, 0, 23, -1, 12, 13], dtype=torch.int64)
    k = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    v = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)

    write_kv_cache(k, v, k_cache, v_cache, slots, use_triton=use_triton)

    k_expected, v_expected = k_before.flatten(0, 1), v_before.flatten(0, 1)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            k_expected[slot], v_expected[slot] = k[i], v[i]
    assert torch.equal(k_cache.flatten(0, 1), k_expected)
    assert torch.equal(v_cache.flatten(0, 1), v_expected)
    # Slot 23 is the last slot of block 5, position 3: the layout contract.
    assert torch.equal(k_cache[5, 3], k[3])


@pytest.mark.parametrize(
    ("scenario", "kind"),
    [("mixed", "plain"), ("verify", "tree"), ("mixed", "sinks-window"), ("decode", "plain")],
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_an_fp8_cache_reads_as_its_dequantized_values(scenario, kind, dtype):
    """--kv-cache-dtype fp8 on the PyTorch paths (plain, tree, sinks and window) and in the
    reference: a cache of e4m3 values with scales attends as the dequantized cache does."""
    from tandem.kernels.paged_attention import FP8_KV_DTYPE

    b = make_batch(SCENARIOS[scenario], 8, 2, 16, block_size=4, dtype=dtype, seed=8)
    k_scale, v_scale = 0.25, 3.0
    k8 = (b.k_cache.float() / k_scale).to(FP8_KV_DTYPE)
    v8 = (b.v_cache.float() / v_scale).to(FP8_KV_DTYPE)
    kw: dict = {}
    if kind == "tree":  # each sequence's four rows: a root and three children
        words = torch.tensor([1, 3, 5, 9] * 3, dtype=torch.int64)
        kw["tree_mask"] = words
    if kind == "sinks-window":
        kw["sinks"] = torch.randn(8, generator=torch.Generator().manual_seed(2))
        kw["window"] = 5
    fp8 = (b.q, k8, v8, *b.args()[3:])
    deq = (b.q, (k8.float() * k_scale).to(dtype), (v8.float() * v_scale).to(dtype), *b.args()[3:])
    scales = {"k_scale": k_scale, "v_scale": v_scale}
    ref = paged_attention_reference(*deq, **kw)
    assert_close(paged_attention_reference(*fp8, **kw, **scales), ref, torch.float32)
    assert_close(paged_attention(*fp8, **kw, **scales), ref, dtype)
    assert not torch.allclose(paged_attention_reference(*fp8, **kw), ref, atol=1e-2)  # scales


def test_an_fp8_cache_stores_values_over_their_scale():
    from tandem.kernels.paged_attention import FP8_KV_DTYPE

    gen = torch.Generator().manual_seed(3)
    k_cache = torch.zeros(4, 4, 2, 16, dtype=FP8_KV_DTYPE)
    v_cache = torch.zeros(4, 4, 2, 16, dtype=FP8_KV_DTYPE)
    slots = torch.tensor([5, -1, 0, 15])
    k, v = torch.randn(4, 2, 16, generator=gen), torch.randn(4, 2, 16, generator=gen)
    write_kv_cache(k, v, k_cache, v_cache, slots, k_scale=0.5, v_scale=4.0)
    for i, slot in enumerate(slots.tolist()):
        if slot >= 0:
            stored_k = k_cache.flatten(0, 1)[slot].float()
            assert torch.equal(stored_k, (k[i] / 0.5).to(FP8_KV_DTYPE).float())
            assert torch.equal(
                v_cache.flatten(0, 1)[slot].float(), (v[i] / 4).to(FP8_KV_DTYPE).float()
            )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_write_kv_cache_torch(dtype):
    _check_write(use_triton=False, dtype=dtype)


@pytest.mark.parametrize("slots", [[5, -1, 0, 23, -1, 12, 13], [5, 0, 23, 12]], ids=["pad", "all"])
def test_write_kv_cache_with_plan_slots(slots):
    # A plan built with the step's slot mapping filters it once; every layer's write through
    # the plan stores exactly what the per-call filter stores.
    gen = torch.Generator().manual_seed(3)
    shape = (6, 4, 2, 16)
    caches = [torch.randn(shape, generator=gen) for _ in range(2)]
    mapping = torch.tensor(slots, dtype=torch.int64)
    k = torch.randn(len(slots), 2, 16, generator=gen)
    v = torch.randn(len(slots), 2, 16, generator=gen)
    n = len(slots)
    plan = build_attention_plan(
        torch.zeros(n, 1, dtype=torch.int32),
        torch.ones(n, dtype=torch.int32),
        torch.arange(n + 1, dtype=torch.int32),
        4,
        1,
        1,
        slot_mapping=mapping,
    )
    assert (plan.write_rows is None) == (min(slots) >= 0)
    expected = [c.clone() for c in caches]
    write_kv_cache(k, v, *expected, mapping)
    write_kv_cache(k, v, *caches, mapping, plan=plan)
    assert torch.equal(caches[0], expected[0]) and torch.equal(caches[1], expected[1])


def test_full_keys_decode_plan_drops_the_mask():
    # One query token per sequence, every sequence max_seq_len long: nothing to mask.
    b = make_batch([(15, 1), (15, 1), (15, 1)], 8, 2, 16, block_size=4)
    args = b.block_tables, b.seq_lens, b.query_start_loc, 4, 1, b.max_seq_len
    plan = build_attention_plan(*args, full_keys=True)
    assert plan.mask is None and plan.pad_idx is None
    assert torch.equal(plan.slots, build_attention_plan(*args).slots)
    assert_close(
        paged_attention(*b.args(), plan=plan), paged_attention_reference(*b.args()), torch.float32
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_fresh_prefill_plan_is_plain_causal(dtype):
    """Prompts with nothing cached: no mask, SDPA's causal path (GQA shared by SDPA); a prefix
    in the cache, or a decode row, keeps the mask."""
    cases = {"prefill": True, "chunked_prefill": False, "mixed": False, "decode": False}
    for scenario, causal in cases.items():
        b = make_batch(SCENARIOS[scenario], 8, 2, 16, block_size=4, dtype=dtype)
        plan = build_attention_plan(
            b.block_tables, b.seq_lens, b.query_start_loc, 4, b.max_query_len, b.max_seq_len
        )
        assert plan.causal is causal and (plan.mask is None) is causal, scenario
        assert_close(
            paged_attention(*b.args(), plan=plan), paged_attention_reference(*b.args()), dtype
        )


def test_write_then_attend_round_trip():
    # Writing a chunk's K/V through slot mapping and attending gives the reference answer.
    b = make_batch([(5, 3), (0, 4)], 4, 2, 16, block_size=4)
    slots = []
    for i, (ctx, ql) in enumerate([(5, 3), (0, 4)]):
        for p in range(ctx, ctx + ql):
            slots.append(b.block_tables[i, p // 4].item() * 4 + p % 4)
    k_new = torch.randn(len(slots), 2, 16)
    v_new = torch.randn(len(slots), 2, 16)
    write_kv_cache(k_new, v_new, b.k_cache, b.v_cache, torch.tensor(slots))
    assert torch.equal(b.k_cache.flatten(0, 1)[slots], k_new)
    assert_close(paged_attention(*b.args()), paged_attention_reference(*b.args()), torch.float32)


# ---------------------------------------------------------------------------------------------
# Triton kernel through the interpreter
# ---------------------------------------------------------------------------------------------

TRITON_CASES = [
    # scenario, heads, block_size, head_dim, dtype
    ("prefill", "gqa", 4, 16, torch.float32),
    ("chunked_prefill", "mha", 16, 48, torch.float32),
    ("decode", "mqa", 4, 48, torch.float32),
    ("decode", "gqa", 16, 16, torch.float32),
    ("verify", "gqa", 4, 48, torch.float32),
    ("mixed", "gqa", 4, 16, torch.float32),
    ("mixed", "mqa", 16, 48, torch.float32),
    ("mixed", "mha", 4, 16, torch.float16),
    ("mixed", "gqa", 16, 48, torch.bfloat16),
    # MLA-like: 16 heads over one latent row 72 wide (3 score chunks, 3 value chunks of 32).
    ("verify", "mla", 16, 72, torch.float32),
    ("mixed", "mla", 4, 72, torch.bfloat16),
]


@needs_interpreter
@pytest.mark.parametrize(
    ("scenario", "heads", "block_size", "head_dim", "dtype"),
    TRITON_CASES,
    ids=["-".join(map(str, c[:4])) + "-" + dtype_id(c[4]) for c in TRITON_CASES],
)
def test_triton_matches_reference(scenario, heads, block_size, head_dim, dtype):
    num_heads, num_kv_heads = HEADS[heads]
    b = make_batch(SCENARIOS[scenario], num_heads, num_kv_heads, head_dim, block_size, dtype, 3)
    out = paged_attention(*b.args(), use_triton=True)
    assert_close(out, paged_attention_reference(*b.args()), dtype)


@needs_interpreter
def test_triton_sequence_without_query_rows():
    specs = [(6, 3), (5, 0), (0, 0), (9, 1)]
    b = make_batch(specs, 8, 2, 16, block_size=4)
    out = paged_attention(*b.args(), use_triton=True)
    assert_close(out, paged_attention_reference(*b.args()), torch.float32)


@needs_interpreter
def test_triton_accepts_q_sliced_from_fused_qkv():
    b = make_batch(SCENARIOS["mixed"], 8, 2, 16, block_size=4)
    qkv = torch.cat([b.q.flatten(1), torch.randn(b.q.shape[0], 2 * 2 * 16)], dim=1)
    q = qkv[:, : 8 * 16].view(b.q.shape)
    out = paged_attention(q, *b.args()[1:], use_triton=True)
    assert_close(out, paged_attention_reference(*b.args()), torch.float32)


@needs_interpreter
def test_triton_long_chunk_spans_several_query_blocks():
    # 40 query rows x GQA group 4 > one program's 16 rows: exercises the query-block grid axis.
    b = make_batch([(7, 40), (0, 1)], 8, 2, 16, block_size=16)
    out = paged_attention(*b.args(), use_triton=True)
    assert_close(out, paged_attention_reference(*b.args()), torch.float32)


@needs_interpreter
@pytest.mark.parametrize(("scenario", "window"), [("mixed", 5), ("verify", 3), ("decode", None)])
def test_triton_sinks_and_window_match_reference(scenario, window):
    """gpt-oss's layers: a sink logit per query head, and a window shorter than the contexts
    (whole KV tiles before it skipped)."""
    b = make_batch(SCENARIOS[scenario], 8, 2, 16, block_size=4, seed=4)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(6)) * 2
    out = paged_attention(*b.args(), use_triton=True, sinks=sinks, window=window)
    ref = paged_attention_reference(*b.args(), sinks=sinks, window=window)
    assert_close(out, ref, torch.float32)
    assert not torch.allclose(ref, paged_attention_reference(*b.args()), atol=1e-3)


@needs_interpreter
@pytest.mark.parametrize("sinks", [False, True], ids=["window", "window-sinks"])
def test_triton_tree_rows_with_window_match_reference(sinks):
    """Draft trees on gpt-oss's layers in the Triton kernel: a tree row at its root's position
    plus its depth (deeper than the window, so its window leaves the root behind) beside a
    sequence without a tree (its rows' words 0) in the same step."""
    from tandem.engine.speculative.tree import ancestor_mask, tree_attention_words

    n, window = 7, 3
    b = make_batch([(12, n + 1), (9, 4)], 8, 2, 16, block_size=4, seed=5)
    # Siblings first, so rows sit past their depths: an ancestor at row 3 is at depth 1 (the
    # window of its depth-4 descendant leaves it out, where row numbers would keep it in).
    parents = torch.tensor([-1, -1, -1, 2, 3, 4, 0])
    words = tree_attention_words(ancestor_mask(parents[None], n))[0]
    tree_mask = torch.cat([words, torch.zeros(4, dtype=torch.int64)])
    kw = {"window": window, "tree_mask": tree_mask}
    if sinks:
        kw["sinks"] = torch.randn(8, generator=torch.Generator().manual_seed(6)) * 2
    out = paged_attention(*b.args(), use_triton=True, **kw)
    ref = paged_attention_reference(*b.args(), **kw)
    assert_close(out, ref, torch.float32)
    chain = paged_attention_reference(*b.args(), **{**kw, "tree_mask": None})
    assert not torch.allclose(ref[: n + 1], chain[: n + 1], atol=1e-3)  # the tree matters
    assert not torch.allclose(ref, paged_attention_reference(*b.args()), atol=1e-3)


@needs_interpreter
@pytest.mark.parametrize("kind", ["plain", "tree", "sinks-window"])
def test_triton_reads_and_writes_an_fp8_cache(kind):
    """--kv-cache-dtype fp8 in the Triton kernels: the write stores e4m3 of value / scale as
    the PyTorch write does, and attention reads the cache as its dequantized values."""
    from tandem.kernels.paged_attention import FP8_KV_DTYPE

    b = make_batch(SCENARIOS["verify"], 8, 2, 16, block_size=4, seed=9)
    k_scale, v_scale = 0.25, 3.0
    k8 = (b.k_cache / k_scale).to(FP8_KV_DTYPE)
    v8 = (b.v_cache / v_scale).to(FP8_KV_DTYPE)
    kw: dict = {}
    if kind == "tree":
        kw["tree_mask"] = torch.tensor([1, 3, 5, 9] * 3, dtype=torch.int64)
    if kind == "sinks-window":
        kw["sinks"] = torch.randn(8, generator=torch.Generator().manual_seed(2))
        kw["window"] = 5
    rest = b.args()[3:]
    ref = paged_attention_reference(b.q, k8.float() * k_scale, v8.float() * v_scale, *rest, **kw)
    out = paged_attention(
        b.q, k8, v8, *rest, use_triton=True, k_scale=k_scale, v_scale=v_scale, **kw
    )
    assert_close(out, ref, torch.float32)
    slots = torch.tensor([5, -1, 0, 15])
    # Values e4m3 holds exactly once scaled: the interpreter's own float-to-e4m3 rounding
    # (not the GPU's conversion) misses a carry into the next binade now and then.
    gen = torch.Generator().manual_seed(4)
    new_k = torch.randn(4, 2, 16, generator=gen).to(FP8_KV_DTYPE).float() * 0.5
    new_v = torch.randn(4, 2, 16, generator=gen).to(FP8_KV_DTYPE).float() * 2
    caches = [(k8.clone(), v8.clone()), (k8.clone(), v8.clone())]
    for (kc, vc), use_triton in zip(caches, (True, False), strict=True):
        write_kv_cache(new_k, new_v, kc, vc, slots, use_triton=use_triton, k_scale=0.5, v_scale=2)
    assert torch.equal(caches[0][0].float(), caches[1][0].float())
    assert torch.equal(caches[0][1].float(), caches[1][1].float())


@needs_interpreter
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16], ids=dtype_id)
def test_write_kv_cache_triton(dtype):
    _check_write(use_triton=True, dtype=dtype)


@pytest.mark.skipif(INTERPRETER or not HAS_TRITON, reason="Triton tests ran in this process")
def test_triton_in_fresh_interpreter():
    passed = run_in_fresh_interpreter(__file__, "triton and not cuda")
    assert passed >= len(TRITON_CASES) + 5


# ---------------------------------------------------------------------------------------------
# CUDA (compiled Triton)
# ---------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=dtype_id)
def test_triton_cuda_matches_reference(dtype):
    if INTERPRETER:  # this process interprets Triton; check the compiled kernel in a fresh one
        selector = f"test_triton_cuda_matches_reference and {dtype_id(dtype)}"
        assert run_in_fresh_interpreter(__file__, selector, interpret=False) == 1
        return
    b = make_batch(SCENARIOS["mixed"], 8, 2, 128, 16, dtype, seed=5)
    ref = paged_attention_reference(*b.args())
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in b.args()]
    out = paged_attention(*cuda_args)
    assert_close(out.cpu(), ref, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(("heads", "scenario"), [(128, "decode"), (16, "verify"), (128, "mixed")])
def test_triton_cuda_mla_shapes_match_reference(heads: int, scenario: str) -> None:
    """DeepSeek-V3's latent attention: 128 heads (16 at TP = 8) over one 576-wide latent row
    (512 + rope 64), in bf16: the chunked tiles that fit an H100's shared memory."""
    if INTERPRETER:
        selector = f"test_triton_cuda_mla_shapes_match_reference and {heads}-{scenario}"
        assert run_in_fresh_interpreter(__file__, selector, interpret=False) == 1
        return
    b = make_batch(SCENARIOS[scenario], heads, 1, 576, 16, torch.bfloat16, seed=heads)
    ref = paged_attention_reference(*b.args())
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in b.args()]
    assert_close(paged_attention(*cuda_args).cpu(), ref, torch.bfloat16)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["plain", "tree", "sinks-window", "mla"])
def test_triton_cuda_reads_and_writes_an_fp8_cache(kind: str) -> None:
    """--kv-cache-dtype fp8 compiled for the device (sm_89+): attention over an e4m3 cache
    equals the reference on its dequantized values, and the kernel's writes equal PyTorch's
    conversion of value / scale."""
    if INTERPRETER:
        selector = f"test_triton_cuda_reads_and_writes_an_fp8_cache and {kind}"
        assert run_in_fresh_interpreter(__file__, selector, interpret=False) == 1
        return
    from tandem.kernels.fp8 import FP8_MIN_CAPABILITY
    from tandem.kernels.paged_attention import FP8_KV_DTYPE

    if torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY:
        pytest.skip("e4m3 in Triton needs sm_89 or newer")

    heads, kv_heads, dim = (16, 1, 576) if kind == "mla" else (8, 2, 128)
    scenario = "mixed" if kind == "mla" else "verify"
    b = make_batch(SCENARIOS[scenario], heads, kv_heads, dim, 16, torch.bfloat16, seed=7)
    k_scale, v_scale = (0.5, 0.5) if kind == "mla" else (0.25, 3.0)
    k8 = (b.k_cache.float() / k_scale).to(FP8_KV_DTYPE)
    v8 = (b.v_cache.float() / v_scale).to(FP8_KV_DTYPE)
    kw: dict = {}
    if kind == "tree":
        kw["tree_mask"] = torch.tensor([1, 3, 5, 9] * 3, dtype=torch.int64)
    if kind == "sinks-window":
        kw["sinks"] = torch.randn(heads, generator=torch.Generator().manual_seed(2))
        kw["window"] = 5
    rest = b.args()[3:]
    deq_k, deq_v = k8.float() * k_scale, v8.float() * v_scale
    ref = paged_attention_reference(b.q.float(), deq_k, deq_v, *rest, **kw)

    def cuda(x: Any) -> Any:
        return x.cuda() if isinstance(x, torch.Tensor) else x

    out = paged_attention(
        cuda(b.q), cuda(k8), cuda(v8), *map(cuda, rest),
        k_scale=k_scale, v_scale=v_scale, **{n: cuda(v) for n, v in kw.items()},
    )  # fmt: skip
    assert_close(out.float().cpu(), ref, torch.bfloat16)
    slots = torch.tensor([5, -1, 0, 15])
    gen = torch.Generator().manual_seed(4)
    new_k = torch.randn(4, kv_heads, dim, generator=gen) * 0.5
    new_v = torch.randn(4, kv_heads, dim, generator=gen) * 2
    kc, vc = cuda(k8.clone()), cuda(v8.clone())
    write_kv_cache(cuda(new_k), cuda(new_v), kc, vc, cuda(slots), k_scale=0.5, v_scale=2.0)
    flat_k, flat_v = kc.flatten(0, 1).cpu().float(), vc.flatten(0, 1).cpu().float()
    for row, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(flat_k[slot], (new_k[row] / 0.5).to(FP8_KV_DTYPE).float())
            assert torch.equal(flat_v[slot], (new_v[row] / 2.0).to(FP8_KV_DTYPE).float())
