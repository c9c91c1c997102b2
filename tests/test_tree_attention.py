"""Tree attention in paged attention (draft-tree verification): the reference against dense
masked attention built from the ancestor mask, the chain mask against causal attention, and the
PyTorch path and the Triton kernel (interpreter) against the reference.

Interpreter set-up as in test_paged_attention.py: the in-process kernel tests skip when triton
was imported before the interpreter could be switched on, and run in a fresh process instead.
"""

from __future__ import annotations

import os

import pytest
import torch
from test_paged_attention import HEADS, Batch, assert_close, dtype_id, make_batch

from triton_utils import run_in_fresh_interpreter

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"  # before triton / kernels are imported

from tandem.engine.speculative.tree import ancestor_mask, tree_attention_words  # noqa: E402
from tandem.kernels.attention_torch import build_attention_plan, paged_attention_reference
from tandem.kernels.launch import HAS_TRITON, triton_interpreter_enabled
from tandem.kernels.paged_attention import paged_attention

INTERPRETER = triton_interpreter_enabled()
needs_interpreter = pytest.mark.skipif(
    not INTERPRETER,
    reason="Triton interpreter not active in this process; see test_tree_in_fresh_interpreter",
)

# Per sequence: ("tree", context, nodes) verifies root + nodes rows; ("causal", context, rows)
# is an ordinary decode / prefill / chain row set in the same batch.
SCENARIOS = {
    "trees": [("tree", 9, 5), ("tree", 0, 3), ("tree", 17, 7)],
    "mixed": [("causal", 5, 6), ("tree", 12, 6), ("causal", 9, 1), ("tree", 3, 4)],
    "wide": [("tree", 6, 12), ("causal", 20, 1)],
}


def random_parents(n: int, gen: torch.Generator) -> torch.Tensor:
    """A random tree in topological order: node i's parent is the root (-1) or a node < i."""
    return torch.tensor([int(torch.randint(-1, i, (1,), generator=gen)) for i in range(n)])


def make_tree_batch(
    specs: list[tuple[str, int, int]],
    heads: str,
    block_size: int,
    head_dim: int = 16,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
) -> tuple[Batch, torch.Tensor, list[torch.Tensor | None]]:
    """The batch, its tree_mask [num_tokens] and each sequence's ancestor mask (None: causal)."""
    num_heads, num_kv_heads = HEADS[heads]
    rows = [(ctx, n + 1 if kind == "tree" else n) for kind, ctx, n in specs]
    b = make_batch(rows, num_heads, num_kv_heads, head_dim, block_size, dtype, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    words, ancestors = [], []
    for kind, _, n in specs:
        if kind == "causal":
            words.append(torch.zeros(n, dtype=torch.int64))
            ancestors.append(None)
            continue
        anc = ancestor_mask(random_parents(n, gen)[None], n)
        words.append(tree_attention_words(anc)[0])
        ancestors.append(anc[0])
    return b, torch.cat(words), ancestors


def dense_tree_attention(b: Batch, specs: list, ancestors: list) -> torch.Tensor:
    """Softmax attention per sequence over its dense K/V with the visibility matrix written
    from the ancestor mask (not from the words)."""
    block_size = b.k_cache.shape[1]
    group = b.q.shape[1] // b.k_cache.shape[2]
    out = torch.empty_like(b.q)
    qsl = b.query_start_loc.tolist()
    for i, ((_, ctx, _), anc) in enumerate(zip(specs, ancestors, strict=True)):
        start, end = qsl[i], qsl[i + 1]
        ql, seq_len = end - start, ctx + end - start
        pos = torch.arange(seq_len)
        slots = b.block_tables[i, pos // block_size].long() * block_size + pos % block_size
        k = b.k_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        v = b.v_cache.flatten(0, 1)[slots].float().repeat_interleave(group, dim=1)
        see = torch.zeros(ql, seq_len, dtype=torch.bool)
        see[:, :ctx] = True
        if anc is None:
            see[:, ctx:] = torch.ones(ql, ql, dtype=torch.bool).tril()
        else:
            see[:, ctx] = True  # everyone sees the root
            see[1:, ctx + 1 :] = anc
        attn = torch.nn.functional.scaled_dot_product_attention(
            b.q[start:end].float().transpose(0, 1),
            k.transpose(0, 1),
            v.transpose(0, 1),
            attn_mask=see,
            scale=b.scale,
        )
        out[start:end] = attn.transpose(0, 1).to(b.q.dtype)
    return out


@pytest.mark.parametrize("scenario", list(SCENARIOS))
@pytest.mark.parametrize("heads", ["gqa", "mqa"])
def test_reference_matches_dense_masked_attention(scenario, heads):
    specs = SCENARIOS[scenario]
    b, words, ancestors = make_tree_batch(specs, heads, 4, seed=11)
    out = paged_attention_reference(*b.args(), tree_mask=words)
    torch.testing.assert_close(out, dense_tree_attention(b, specs, ancestors), atol=1e-5, rtol=1e-5)


def test_tree_row_ignores_non_ancestors():
    # Perturbing a node's value changes exactly the rows of that node and its descendants.
    specs = [("tree", 5, 6)]
    b, words, ancestors = make_tree_batch(specs, "gqa", 4, seed=5)
    before = paged_attention(*b.args(), tree_mask=words)
    node = 2
    pos = 5 + 1 + node
    b.v_cache[b.block_tables[0, pos // 4], pos % 4] += 10.0
    after = paged_attention(*b.args(), tree_mask=words)
    changed = ~torch.isclose(after, before).all(dim=(1, 2))
    expect = torch.cat([torch.tensor([False]), ancestors[0][:, node]])
    assert torch.equal(changed, expect)


def chain_words(specs: list[tuple[str, int, int]]) -> torch.Tensor:
    """Every row of every sequence as a tree row whose ancestors are all earlier rows."""
    return torch.cat(
        [torch.tensor([(1 << (j + 1)) - 1 for j in range(n + 1)]) for _, _, n in specs]
    )


CHAIN = [("tree", 8, 3), ("tree", 13, 3), ("tree", 0, 3)]  # K = 3 verify rows, as a tree


def test_chain_mask_equals_causal():
    b, _, _ = make_tree_batch(CHAIN, "gqa", 4, seed=2)
    words = chain_words(CHAIN)
    assert torch.equal(
        paged_attention_reference(*b.args(), tree_mask=words), paged_attention_reference(*b.args())
    )
    assert torch.equal(paged_attention(*b.args(), tree_mask=words), paged_attention(*b.args()))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
@pytest.mark.parametrize("block_size", [4, 16])
@pytest.mark.parametrize("heads", ["gqa", "mqa"])
@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_torch_path_matches_reference(scenario, heads, block_size, dtype):
    specs = SCENARIOS[scenario]
    seed = list(SCENARIOS).index(scenario) * 10 + block_size
    b, words, _ = make_tree_batch(specs, heads, block_size, 48, dtype, seed)
    ref = paged_attention_reference(*b.args(), tree_mask=words)
    assert_close(paged_attention(*b.args(), tree_mask=words), ref, dtype)
    # A plan shared by every layer carries the mask; a plan without it is refused.
    plan = build_attention_plan(
        b.block_tables, b.seq_lens, b.query_start_loc, block_size, b.max_query_len,
        b.max_seq_len, tree_mask=words,
    )  # fmt: skip
    assert plan.tree and not plan.causal
    assert_close(paged_attention(*b.args(), plan=plan, tree_mask=words), ref, dtype)
    with pytest.raises(ValueError, match="with a tree mask"):
        paged_attention(*b.args(), plan=plan)


def test_decode_only_tree_rows():
    # Trees of one node per sequence next to plain decode rows: the one-row-per-sequence path.
    specs = [("tree", 7, 0), ("causal", 4, 1), ("tree", 12, 0)]
    b, words, ancestors = make_tree_batch(specs, "gqa", 4, seed=3)
    out = paged_attention(*b.args(), tree_mask=words)
    assert_close(out, dense_tree_attention(b, specs, ancestors), torch.float32)


def arbitrary_words(specs: list[tuple[str, int, int]], seed: int) -> torch.Tensor:
    """Any nonzero words (the root's bit may be clear): each row sees itself and random earlier
    rows; the prefix stays visible whatever the bits say."""
    gen = torch.Generator().manual_seed(seed)
    words = []
    for kind, _, n in specs:
        rows = n + 1 if kind == "tree" else n
        for j in range(rows):
            bits = torch.randint(0, 2, (j,), generator=gen).tolist() + [1]
            words.append(sum(bit << i for i, bit in enumerate(bits)))
    return torch.tensor(words, dtype=torch.int64)


def test_torch_path_arbitrary_words_match_reference():
    specs = SCENARIOS["mixed"]
    b, _, _ = make_tree_batch(specs, "gqa", 4, seed=4)
    words = arbitrary_words(specs, 4)
    assert (words & 1 == 0).any()
    ref = paged_attention_reference(*b.args(), tree_mask=words)
    assert_close(paged_attention(*b.args(), tree_mask=words), ref, torch.float32)


def test_bad_tree_mask_is_rejected():
    b, words, _ = make_tree_batch(SCENARIOS["trees"], "gqa", 4)
    with pytest.raises(ValueError, match="tree_mask must be int64"):
        paged_attention(*b.args(), tree_mask=words.int())
    with pytest.raises(ValueError, match="tree_mask must be int64"):
        paged_attention(*b.args(), tree_mask=words[:-1])


# ---------------------------------------------------------------------------------------------
# Triton kernel through the interpreter
# ---------------------------------------------------------------------------------------------

TRITON_CASES = [
    # scenario, heads, block_size, dtype
    ("trees", "gqa", 4, torch.float32),
    ("trees", "mqa", 16, torch.float32),
    ("mixed", "gqa", 16, torch.float32),
    ("mixed", "mqa", 4, torch.bfloat16),
    ("wide", "gqa", 4, torch.bfloat16),
    ("wide", "mqa", 16, torch.float32),
]


@needs_interpreter
@pytest.mark.parametrize(
    ("scenario", "heads", "block_size", "dtype"),
    TRITON_CASES,
    ids=["-".join(map(str, c[:3])) + "-" + dtype_id(c[3]) for c in TRITON_CASES],
)
def test_triton_tree_matches_reference(scenario, heads, block_size, dtype):
    specs = SCENARIOS[scenario]
    b, words, _ = make_tree_batch(specs, heads, block_size, 48, dtype, seed=7)
    out = paged_attention(*b.args(), use_triton=True, tree_mask=words)
    assert_close(out, paged_attention_reference(*b.args(), tree_mask=words), dtype)


@needs_interpreter
def test_triton_arbitrary_words_match_reference():
    specs = SCENARIOS["mixed"]
    b, _, _ = make_tree_batch(specs, "gqa", 4, seed=4)
    words = arbitrary_words(specs, 4)
    out = paged_attention(*b.args(), use_triton=True, tree_mask=words)
    assert_close(out, paged_attention_reference(*b.args(), tree_mask=words), torch.float32)


@needs_interpreter
def test_triton_tree_of_64_rows():
    # 63 nodes: the last rows' words use bit 63; 64 rows span several query blocks.
    specs = [("tree", 5, 63)]
    b, words, ancestors = make_tree_batch(specs, "mqa", 16, seed=9)
    assert (words < 0).any()  # some row sees row 63
    out = paged_attention(*b.args(), use_triton=True, tree_mask=words)
    assert_close(out, dense_tree_attention(b, specs, ancestors), torch.float32)


@needs_interpreter
def test_triton_chain_mask_equals_causal():
    b, _, _ = make_tree_batch(CHAIN, "gqa", 4, seed=2)
    tree = paged_attention(*b.args(), use_triton=True, tree_mask=chain_words(CHAIN))
    assert torch.equal(tree, paged_attention(*b.args(), use_triton=True))


@pytest.mark.skipif(INTERPRETER or not HAS_TRITON, reason="Triton tests ran in this process")
def test_tree_in_fresh_interpreter():
    passed = run_in_fresh_interpreter(__file__, "triton and not cuda")
    assert passed >= len(TRITON_CASES) + 3


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=dtype_id)
def test_triton_cuda_tree_matches_reference(dtype):
    if INTERPRETER:
        selector = f"test_triton_cuda_tree_matches_reference and {dtype_id(dtype)}"
        assert run_in_fresh_interpreter(__file__, selector, interpret=False) == 1
        return
    specs = [("tree", 40, 15), ("causal", 9, 1), ("tree", 100, 63), ("causal", 3, 30)]
    b, words, _ = make_tree_batch(specs, "gqa", 16, 128, dtype, seed=5)
    ref = paged_attention_reference(*b.args(), tree_mask=words)
    cuda_args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in b.args()]
    out = paged_attention(*cuda_args, tree_mask=words.cuda())
    assert_close(out.cpu(), ref, dtype)
