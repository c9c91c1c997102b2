"""Draft trees (issue #35) in the GPU benchmark: a tree speculative step against the chain step
and a plain decode step, per batch size (benchmarks/gpu.py runs it after the Eagle3 section).

A tree step does the work of engine/speculative/tree_decoder.py, eagerly, like the Eagle3
section's chain step (the engine also replays trees in CUDA graphs): the target verifies N + 1
rows per request (the root, then the nodes) in one forward, RoPE positions root + depth, a tree
attention mask; greedy tree acceptance on the target's argmax; then the decoder's own
``compact`` (the accepted path's target KV to chain positions) and ``next_tree`` (draft step 0
over every row, then per depth one draft pass over the frontier nodes so far, their top-k
children, ``build_tree``). The verified tree is one the random-weight head drafted (best-first,
EAGLE-2 style): the work of a step does not depend on its shape, nor on how much of it is
accepted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

from tandem.bench.gpu_setup import (
    BLOCK_SIZE,
    Setup,
    StepInputs,
    build_draft,
    capture_layers,
    free_draft,
    step_inputs,
    table,
)


@dataclass
class TreeInputs:
    """One batch's tree step. ``verify`` holds the causal view of the verify rows (chain
    positions: what draft step 0 reads); ``positions`` and ``words`` the target's tree view."""

    verify: StepInputs
    positions: Any  # [B * (N + 1)] root position + depth
    words: Any  # [B * (N + 1)] int64 tree attention words
    tree: Any  # DraftTree, N nodes per request
    layout: Any  # VerifyLayout
    next_tokens: Any  # [B]


def tree_decoder(draft: Any, model: Any, k: int, topk: int, n: int) -> Any:
    """The engine's ``TreeDecoder`` around ``draft``: depth ``k``, ``topk`` children per node,
    ``n`` verified nodes."""
    from tandem.engine.config import SpeculativeConfig
    from tandem.engine.speculative.tree_decoder import TreeDecoder
    from tandem.models.parallel import ParallelMapping

    config = SpeculativeConfig(
        method="eagle3", model="random", num_speculative_tokens=k, topk=topk, num_draft_tokens=n
    )
    return TreeDecoder(draft, config, ParallelMapping(), BLOCK_SIZE, model.attention_layers())


def tree_inputs(s: Setup, decoder: Any, b: int) -> TreeInputs:
    """``b`` requests of context ``s.args.context`` whose last accepted token (the root) sits at
    position context - 1, each verifying a tree the draft head drafts from a random state."""
    import torch

    from tandem.engine.speculative.interface import VerifyLayout
    from tandem.engine.speculative.tree import tree_attention_words

    n, ctx, dev = decoder.k, s.args.context, s.device
    verify = step_inputs(b, n + 1, ctx + n, s.args.blocks_per_seq, s.config.vocab_size, dev)
    first = torch.arange(b, device=dev) * (n + 1)
    root = torch.full((b,), ctx - 1, device=dev)
    layout = VerifyLayout(
        rows=first[:, None] + torch.arange(n + 1, device=dev),
        drafts=torch.zeros(b, n, dtype=torch.int64, device=dev),
        num_drafts=torch.full((b,), n, device=dev),
        first_row=first,
        positions=root,
        block_tables=verify.meta.block_tables,
        row_owner=torch.arange(b, device=dev).repeat_interleave(n + 1),
        max_seq_len=ctx + 2 * n,  # the model runner's bound: the step's longest + N
    )
    hidden = torch.randn(b, s.config.hidden_size, device=dev, dtype=s.dtype)
    tree = decoder.draft_tree(hidden, root + 1, layout)
    layout.drafts = tree.tokens
    depths = torch.cat([torch.zeros_like(tree.depths[:, :1]), tree.depths], dim=1)
    positions = (root[:, None] + depths).reshape(-1)
    words = tree_attention_words(tree.ancestors).reshape(-1)
    next_tokens = torch.randint(0, s.config.vocab_size, (b,), device=dev)
    return TreeInputs(verify, positions, words, tree, layout, next_tokens)


def tree_meta(meta: Any, words: Any) -> Any:
    """``meta`` with the tree attention words (and, off the GPU paths, a plan built with them,
    as ``TreeDecoder.prepare_tree`` gives the target forward)."""
    from tandem.kernels.attention_torch import build_attention_plan
    from tandem.kernels.launch import gpu_paths

    plan = None
    if not gpu_paths(words):
        plan = partial(
            build_attention_plan,
            meta.block_tables,
            meta.seq_lens,
            meta.query_start_loc,
            BLOCK_SIZE,
            meta.max_query_len,
            meta.max_seq_len,
            num_tokens=words.shape[0],
            tree_mask=words,
        )
    return dataclasses.replace(meta, tree_mask=words, plan=plan)


def run_tree_step(
    model: Any, draft: Any, decoder: Any, t: TreeInputs, capture: tuple[int, ...]
) -> Any:
    """Verify, accept, compact the target KV (``TreeDecoder.compact``), draft the next tree
    (``TreeDecoder.next_tree``, as a step or its CUDA graph does); returns its tokens."""
    import torch.nn.functional as F

    from tandem.engine.speculative.tree_accept import accept_tree_greedy

    v, layout = t.verify, t.layout
    b, rows = layout.rows.shape
    hidden, captured = model(v.input_ids, t.positions, tree_meta(v.meta, t.words), capture)
    acc = accept_tree_greedy(t.tree, model.compute_logits(hidden).argmax(-1).view(b, rows))
    decoder.compact(layout, acc)
    tokens = F.pad(acc.tokens, (0, rows - acc.tokens.shape[1]))
    inputs = (v.input_ids, v.positions, v.meta, draft.combine_hidden(captured), t.next_tokens)
    return decoder.next_tree(*inputs, layout, acc.num_accepted, tokens, acc.path)[0]


def plain_ms(s: Setup, model: Any, b: int) -> float:
    """A plain decode step at batch ``b`` (where the Eagle3 section did not time one)."""
    inp = step_inputs(b, 1, s.args.context, s.args.blocks_per_seq, s.config.vocab_size, s.device)

    def step() -> Any:
        hidden, _ = model(inp.input_ids, inp.positions, inp.meta)
        return model.compute_logits(hidden).argmax(-1)

    return s.timer(step)


def tree_configs(k: int, wanted: list[tuple[int, int]]) -> tuple[list[tuple[int, int]], list[str]]:
    """The (topk, num_draft_tokens) pairs ``check_tree_shape`` accepts at depth ``k``, and a
    note for each one it refuses."""
    from tandem.engine.speculative.tree import check_tree_shape

    ok, refused = [], []
    for topk, n in wanted:
        try:
            check_tree_shape(k, topk, n)
        except ValueError as e:
            refused.append(f"topk {topk} N {n}: {e}")
            continue
        ok.append((topk, n))
    return ok, refused


def tree_step(s: Setup, model: Any, k: int, chain: dict[int, tuple[float, float]]) -> None:
    """Tree steps (depth ``k``) against the chain K = ``k`` step and the plain step; ``chain``:
    the Eagle3 section's {batch: (plain ms, chain ms)}, timed here where missing."""
    configs, refused = tree_configs(k, s.args.tree_configs)
    print(f"\n== draft-tree steps, depth {k}, vs chain K={k} and plain decode (random head, eager)")
    for note in refused:
        print(f"(skipped {note})")
    if not configs:
        return
    draft = build_draft(s, model)
    decoders = {(topk, n): tree_decoder(draft, model, k, topk, n) for topk, n in configs}
    capture = capture_layers(s.config)
    header = ["batch", "config", "rows/req", "step ms", "vs plain", "vs chain", "break-even"]
    rows = []
    try:
        for b in s.args.spec_batch_sizes:
            if s.time_left() < 10:
                print(f"(time budget spent: skipping batch {b} and above)")
                break
            t_plain, t_chain = chain.get(b) or (plain_ms(s, model, b), None)
            rows.append([str(b), "plain", "1", f"{t_plain:.3f}", "1.00x", "-", "1.00"])
            if t_chain is not None:
                ratio = t_chain / t_plain
                rows.append(
                    [str(b), f"chain K={k}", str(k + 1), f"{t_chain:.3f}", f"{ratio:.2f}x",
                     "1.00x", f"{ratio:.2f}"]
                )  # fmt: skip
            for (topk, n), decoder in decoders.items():
                if s.time_left() < 10:
                    print(f"(time budget spent: skipping trees from topk {topk} N {n} at {b})")
                    break
                t = tree_inputs(s, decoder, b)
                ms = s.timer(partial(run_tree_step, model, draft, decoder, t, capture))
                vs_chain = f"{ms / t_chain:.2f}x" if t_chain is not None else "-"
                rows.append(
                    [str(b), f"topk {topk} N {n}", str(n + 1), f"{ms:.3f}",
                     f"{ms / t_plain:.2f}x", vs_chain, f"{ms / t_plain:.2f}"]
                )  # fmt: skip
    finally:
        free_draft(draft)
    print(table(header, rows))
    print(
        "break-even: the tokens per step (1 + accepted) a head must reach to beat plain "
        "decoding;\nvs chain: a tree beats the chain when its tokens per step exceed the "
        "chain's times this"
    )
