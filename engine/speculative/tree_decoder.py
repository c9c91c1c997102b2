"""The speculative half of a step with draft trees (``speculative_config.topk > 1``, issue #35).

Per request and step: the scheduler's drafts are the previous step's tree nodes (``N`` =
num_draft_tokens of them, in tree order, or a prefix of them when it had less room); the
target verifies them as ``N + 1`` rows (root first) in one forward with RoPE positions
``root + depth`` and a tree attention mask; acceptance walks the tree (``tree_accept``); the
accepted path's target KV is moved into chain order (``compaction_slots``), so the sequence
continues as if a chain had been verified. Then the draft:

- step 0 runs on every row of the step as the chain's does, with each tree request's accepted
  path permuted into chain order (rows, hidden states and input tokens), so it writes the draft
  KV of the accepted tokens at their final positions;
- depth 1 takes the top-k tokens after the gathered row; each later depth runs the draft over
  the frontier nodes of every depth so far (``topk`` per depth, at KV scratch positions after the
  new root, RoPE position root + depth - 1) with a tree attention mask, and takes each frontier
  node's top-k children; ``build_tree`` keeps the best ``N`` nodes. With row pick, step 0's
  post-attention part runs on the rows the trees grow from and each frontier pass's on the
  ``topk`` rows expanded next.

Children are the deterministic top-k (under structured output: the top-k the grammar allows
after the node's path, ``DraftMasker.node_masks``), so acceptance uses the point-mass rule
(``q=None``), lossless at any temperature. The tree's shape (parents, depths, attention words)
stays here, per request, on the device; its tokens and parents travel to the scheduler (the
parents for the grammar masks of the nodes' verified rows). ``next_tree`` is what a CUDA graph
captures (engine/graph_runner.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.engine.sampler import (
    SamplingTensors,
    adjusted_logits,
    ban_stop_tokens,
    probs_for_rows,
)
from tandem.engine.speculative.decoder import SpecDecoder
from tandem.engine.speculative.draft_grammar import DraftMasker
from tandem.engine.speculative.interface import (
    ROW_PICK_RESOLVER,
    DraftRowPick,
    SpecMetadata,
    VerifyLayout,
)
from tandem.engine.speculative.sampling import (
    exponential_noise,
    sample_rows,
    uniform_noise,
    widen_columns,
    with_path_counts,
)
from tandem.engine.speculative.tree import (
    DraftTree,
    ancestor_mask,
    build_tree,
    compaction_slots,
    copy_kv_slots,
    expand_level,
    root_frontier,
    select_frontier,
    tree_attention_words,
)
from tandem.engine.speculative.tree_accept import (
    TreeAcceptance,
    accept_tree_greedy,
    accept_tree_sampling,
)
from tandem.kernels import cpu_decode
from tandem.kernels.attention_torch import build_attention_plan
from tandem.kernels.launch import gpu_paths
from tandem.kernels.spec_decode import build_draft_step0_inputs
from tandem.models.attention import AttentionMetadata
from tandem.models.parallel import ParallelMapping

__all__ = ["TreeDecoder", "TreeLayout", "layer_caches"]


@dataclass
class TreeLayout(VerifyLayout):
    """The verify layout plus the batch's tree (N = num_draft_tokens nodes; a request that
    verifies fewer, or none, has padding nodes of token -1)."""

    tree: DraftTree


def layer_caches(attn: nn.Module) -> tuple[Tensor, ...]:
    """The cache tensors bound to an attention layer (K and V, or one latent tensor)."""
    latent = getattr(attn, "latent_cache", None)
    if latent is not None:
        return (latent,)
    return (attn.k_cache, attn.v_cache)


def _scatter_rows(base: Tensor, rows: Tensor, values: Tensor, keep: Tensor) -> Tensor:
    """``base`` [T] with base[rows[keep]] = values[keep], without a host read (the entries not
    kept go to a spare slot past the end)."""
    t = base.shape[0]
    ext = torch.cat([base, base.new_zeros(1)])
    idx = torch.where(keep, rows, t).reshape(-1)
    ext.scatter_(0, idx, values.reshape(-1).to(ext.dtype))
    return ext[:t]


class StopBan(NamedTuple):
    """``min_tokens`` in a tree's drafting: each request's stop tokens [B, V] are banned from
    the nodes less than ``left`` [B] deep below the new root (depth 1: the root's children)."""

    tokens: Tensor
    left: Tensor


class TreeDecoder(SpecDecoder):
    """``SpecDecoder`` for draft trees (Eagle3, MTP-Eagle: one draft layer reused per depth).
    ``k`` is num_draft_tokens: the drafts a request carries into the next step (the verify
    rows are k + 1)."""

    def __init__(
        self,
        draft: nn.Module,
        config: Any,
        mapping: ParallelMapping,
        block_size: int,
        target_layers: list[nn.Module],
        resolver: DraftRowPick = ROW_PICK_RESOLVER,
    ) -> None:
        super().__init__(draft, config, mapping, block_size, resolver)
        if self.vanilla or not config.is_tree:
            raise ValueError(
                "TreeDecoder serves Eagle3 and MTP-Eagle with speculative_config.topk > 1"
            )
        vocab = int(draft.draft_vocab_size)
        if config.topk > vocab:  # torch.topk would fail inside the first tree step
            raise ValueError(
                f"speculative_config.topk={config.topk} is larger than the draft head's "
                f"vocabulary ({vocab} tokens): each node's children are distinct draft tokens; "
                f"use topk <= {vocab}"
            )
        self.depth = config.num_speculative_tokens
        self.topk = config.topk
        self.k = config.num_draft_tokens
        self.fast_chain = False
        self.target_layers = target_layers
        # request id → its next tree's (parents [N], depths [N], words [N + 1]) on the device.
        self.shapes: dict[str, tuple[Tensor, Tensor, Tensor]] = {}
        self._path: Tensor | None = None  # [B, D] this step's accepted path (verify → propose)
        self.last_parents = torch.empty(0, self.k, dtype=torch.int64)  # the last trees' parents

    def forget(self, request_ids: list[str]) -> None:
        super().forget(request_ids)
        for rid in request_ids:
            self.shapes.pop(rid, None)

    def export_request(self, request_id: str) -> dict[str, Any]:
        state = super().export_request(request_id)
        shape = self.shapes.get(request_id)
        if shape is not None:  # the next tree's parents, depths and words
            state["tree_shape"] = [t.cpu() for t in shape]
        return state

    def import_request(self, request_id: str, state: dict[str, Any], device: Any) -> None:
        super().import_request(request_id, state, device)
        if "tree_shape" in state:
            parents, depths, words = (t.to(device) for t in state["tree_shape"])
            self.shapes[request_id] = (parents, depths, words)

    # ------------------------------------------------------------------ the step's rows

    def prepare_tree(self, inp: Any, requests: list[Any]) -> None:
        """Turn ``inp.layout`` into a ``TreeLayout`` and give the target forward its tree
        positions and attention words (``inp.target``). Host work is per request; the rows are
        filled on the device."""
        layout = inp.layout
        sampled = [r for r in requests if r.sample]
        n, d = self.k, self.depth
        dev = layout.rows.device
        parents_t, depths_t, words_t = self.tree_shapes(sampled, dev)
        m = layout.num_drafts  # [B] nodes carried (the tree, or a prefix of it)
        limit = [d if r.max_draft_depth is None else r.max_draft_depth for r in sampled]
        limit_t = torch.tensor(limit, dtype=torch.int64).to(dev, non_blocking=True)
        j = torch.arange(n, device=dev)
        # Nodes past the carried ones or deeper than the room left are padding: never accepted.
        verified = (j < m[:, None]) & (depths_t <= limit_t[:, None])
        tokens = torch.where(verified, layout.drafts, -1)
        tree = DraftTree(
            tokens=tokens,
            parents=parents_t,
            depths=depths_t,
            scores=torch.zeros(tokens.shape, device=dev),
            ancestors=ancestor_mask(parents_t, d),
            max_depth=d,
        )
        fields = dataclasses.fields(VerifyLayout)
        inp.layout = TreeLayout(**{f.name: getattr(layout, f.name) for f in fields}, tree=tree)
        if not any(r.num_drafts for r in sampled):
            return  # nothing to verify as a tree: the target runs causally
        first = layout.first_row[:, None]
        node_rows = first + 1 + j  # [B, N] the row of node i
        positions = _scatter_rows(
            inp.positions, node_rows, layout.positions[:, None] + depths_t, verified
        )
        j1 = torch.arange(n + 1, device=dev)
        keep = (j1 <= m[:, None]) & (m[:, None] > 0)
        tree_mask = _scatter_rows(
            torch.zeros_like(inp.positions), first + j1, words_t, keep
        )  # [T]; 0: causal rows (prefill chunks, requests without drafts)
        meta = inp.meta
        plan = meta.plan
        if isinstance(plan, partial):
            plan = partial(plan.func, *plan.args, **{**plan.keywords, "tree_mask": tree_mask})
        window = meta.window  # the window group's rows are the same rows (models/attention.py)
        if window is not None:
            window_plan = window.plan
            if isinstance(window_plan, partial):
                keywords = {**window_plan.keywords, "tree_mask": tree_mask}
                window_plan = partial(window_plan.func, *window_plan.args, **keywords)
            window = dataclasses.replace(window, tree_mask=tree_mask, plan=window_plan)
        inp.target = (
            positions,
            dataclasses.replace(meta, tree_mask=tree_mask, plan=plan, window=window),
        )

    def tree_shapes(
        self, sampled: list[Any], device: torch.device
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Each sampled request's tree shape: parents, depths [B, N] and attention words
        [B, N + 1] of the tree drafted for it (a chain where none was: a chain is a tree)."""
        chain = None
        parents, depths, words = [], [], []
        for r in sampled:
            shape = self.shapes.get(r.request_id)
            if shape is None:
                chain = chain or _chain_shape(self.k, device)
                shape = chain
            parents.append(shape[0])
            depths.append(shape[1])
            words.append(shape[2])
        return torch.stack(parents), torch.stack(depths), torch.stack(words)

    # ------------------------------------------------------------------ verification

    def verify(
        self,
        logits: Tensor,
        layout: VerifyLayout,
        st: SamplingTensors,
        meta: SpecMetadata,
        request_ids: list[str],
    ) -> tuple[Tensor, Tensor]:
        """logits: [B, C, V] for the first C <= N + 1 verify rows → (num_accepted [B], tokens
        [B, N + 1]: the accepted path's tokens, then the correction / bonus token).

        Side effects, in the step's order: the accepted path's target KV moves into chain
        positions, and when logprobs are asked for, ``logits``' columns are reordered in place
        to the accepted path (column j: the distribution that emitted token j)."""
        if not isinstance(layout, TreeLayout):
            raise TypeError("TreeDecoder.verify needs the TreeLayout of prepare_tree")
        tree = layout.tree
        b, k1 = layout.rows.shape
        n = tree.num_nodes
        depths = F.pad(tree.depths, (1, 0))[:, : logits.shape[1]]  # column 0: the root
        wide = widen_columns(ban_stop_tokens(logits, st, depths), k1)
        v = wide.shape[-1]
        if meta.all_greedy and not st.adjusts_logits:
            acc = accept_tree_greedy(tree, cpu_decode.argmax(wide))
        elif meta.all_greedy:
            # Penalties: the position after a node counts the tokens on its path as output.
            flat = with_path_counts(st, k1, tree.tokens, tree.ancestors)
            ids = cpu_decode.argmax(adjusted_logits(wide.reshape(b * k1, v), flat))
            acc = accept_tree_greedy(tree, ids.view(b, k1))
        else:
            flat = with_path_counts(st, k1, tree.tokens, tree.ancestors)
            p = probs_for_rows(wide.reshape(b * k1, v), flat).view(b, k1, v)
            if not meta.use_rejection_sampling:
                # Strict acceptance: a child is accepted iff it is the token the target drew.
                sampled = sample_rows(p.view(b * k1, v), flat.generators).view(b, k1)
                acc = accept_tree_greedy(tree, sampled)
            else:
                gens = st.generators
                uniform = uniform_noise(b, n, gens, logits.device)
                noise = exponential_noise((b, v), gens, logits.device)
                acc = accept_tree_sampling(tree, p, uniform, noise)
        self.compact(layout, acc)
        self._path = acc.path
        if st.max_num_logprobs > 0:
            _path_columns_(logits, acc)
        tokens = F.pad(acc.tokens, (0, k1 - acc.tokens.shape[1]))
        return acc.num_accepted, tokens

    def compact(self, layout: VerifyLayout, acc: TreeAcceptance) -> None:
        """Move the accepted nodes' target KV to the positions a chain would have used (in
        each layer's KV group: the window group's layers through its tables)."""
        moves = {}
        for name, tables in (("full", layout.block_tables), ("window", layout.window_block_tables)):
            if tables is not None:
                moves[name] = compaction_slots(
                    tables, layout.positions, acc.path, acc.num_accepted, self.block_size
                )
        for attn in self.target_layers:
            src, dst = moves["window" if getattr(attn, "window_group", False) else "full"]
            for cache in layer_caches(attn):
                copy_kv_slots(cache, src, dst)

    # ------------------------------------------------------------------ drafting

    @property
    def path(self) -> Tensor:
        """[B, D] this step's accepted paths (``verify`` sets it; drafting reads it)."""
        if self._path is None:
            raise RuntimeError("TreeDecoder drafts after verify (no accepted path yet)")
        return self._path

    def _chain_order(
        self, layout: VerifyLayout, num_accepted: Tensor, rows: int, path: Tensor
    ) -> Tensor:
        """[rows] source row of every row once the accepted paths (``path`` [B, D]) are in
        chain order (row first + j takes the row of the depth-j accepted node; other rows
        stay)."""
        d = path.shape[1]
        j = torch.arange(1, d + 1, device=path.device)
        first = layout.first_row[:, None]
        identity = torch.arange(rows, device=path.device)
        return _scatter_rows(
            identity, first + j, first + 1 + path.clamp_min(0), j <= num_accepted[:, None]
        )

    def defers_step_kv(self, meta: AttentionMetadata) -> bool:
        return False  # its paused steps write their draft KV at once

    def write_step_kv(
        self,
        inp: Any,
        draft_hidden: Tensor,
        layout: VerifyLayout,
        num_accepted: Tensor,
        tokens: Tensor,
    ) -> None:
        """A step that proposes no drafts: draft step 0 over the rows in chain order."""
        rows = (inp.input_ids, inp.meta, draft_hidden, inp.next_tokens, layout)
        step_tokens, hidden, _ = self._step0_inputs(*rows, num_accepted, tokens, self.path)
        self.draft.write_kv(0, inp.positions, step_tokens, hidden, inp.meta)

    def _step0_inputs(
        self,
        input_ids: Tensor,
        target_meta: AttentionMetadata,
        draft_hidden: Tensor,
        next_tokens: Tensor,
        layout: VerifyLayout,
        num_accepted: Tensor,
        tokens: Tensor,
        path: Tensor,
    ) -> tuple[Tensor, Tensor, Tensor]:
        """Draft step 0's input tokens and hidden states with the accepted paths in chain order,
        and the rows the trees grow from (gather ids [B])."""
        order = self._chain_order(layout, num_accepted, input_ids.shape[0], path)
        last_rows = target_meta.query_start_loc[1:].long() - 1
        step_tokens, gather_ids = build_draft_step0_inputs(
            layout.first_row, num_accepted, tokens, input_ids[order], last_rows, next_tokens
        )
        return step_tokens, draft_hidden[order], gather_ids

    def propose(
        self,
        inp: Any,
        input_ids: Tensor,
        positions: Tensor,
        target_meta: AttentionMetadata,
        draft_hidden: Tensor,
        next_tokens: Tensor,
        layout: VerifyLayout,
        num_accepted: Tensor,
        tokens: Tensor,
        st: SamplingTensors,
        meta: SpecMetadata,
        request_ids: list[str],
        draft_mask: DraftMasker | None = None,
        steps: int | None = None,
    ) -> Tensor:
        """``steps``: None (a tree's shape is fixed; the configuration refuses schedules).
        Draft every sampled request's next tree; returns its tokens [B, N] (target
        vocabulary, tree order) and keeps its shape for the next step's verification.
        ``draft_mask`` (structured output): each node's children are the top-k tokens its
        grammar allows after the node's path."""
        rows = (input_ids, positions, target_meta, draft_hidden, next_tokens, layout)
        ban = None
        if st.stop_ban is not None and st.stop_ban_left is not None:
            ban = StopBan(st.stop_ban, st.stop_ban_left - num_accepted - 1)
        tree = self.next_tree(*rows, num_accepted, tokens, self.path, draft_mask, ban)
        self.keep_shapes(request_ids, *tree[1:])
        return tree[0]

    def keep_shapes(
        self, request_ids: list[str], parents: Tensor, depths: Tensor, words: Tensor
    ) -> None:
        """Each request's next tree shape, for its verification: parents and depths [B, N],
        attention words [B, N + 1]."""
        self.forget(request_ids)
        for i, rid in enumerate(request_ids):
            self.shapes[rid] = (parents[i], depths[i], words[i])
        self.last_parents = parents

    def next_tree(
        self,
        input_ids: Tensor,
        positions: Tensor,
        target_meta: AttentionMetadata,
        draft_hidden: Tensor,
        next_tokens: Tensor,
        layout: VerifyLayout,
        num_accepted: Tensor,
        tokens: Tensor,
        path: Tensor,
        masker: DraftMasker | None = None,
        ban: StopBan | None = None,
    ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The next trees from this step's rows: (tokens, parents, depths [B, N], attention
        words [B, N + 1]). Device work only, no host reads and no state kept: what a CUDA graph
        captures (``path``: this step's accepted paths, a static buffer there). ``masker``
        (eager steps with constrained requests only): grammar masks, read on the host.
        ``ban`` (eager steps only): ``min_tokens``' stop tokens kept out of the shallow nodes."""
        rows = (input_ids, target_meta, draft_hidden, next_tokens, layout)
        step_tokens, hidden, gather_ids = self._step0_inputs(*rows, num_accepted, tokens, path)
        # Row pick: step 0's post-attention part only on the rows the tree grows from.
        if self.picks_rows():
            hidden = self.draft(
                0, positions, step_tokens, hidden, target_meta, pick_rows=gather_ids
            )
        else:
            hidden = self.draft(0, positions, step_tokens, hidden, target_meta)[gather_ids]
        root_pos = layout.positions + num_accepted + 1  # [B] the new root's position
        picked = target_meta.all_rank_num_picked  # attention DP: every rank's sampled rows
        tree = self.draft_tree(hidden, root_pos, layout, picked, masker, ban)
        words = tree_attention_words(tree.ancestors)
        return tree.tokens, tree.parents, tree.depths, words

    def picks_rows(self) -> bool:
        """Whether draft passes run their post-attention part only on the rows read next (row
        pick; ``TLLM_SPEC_DISABLE_DRAFT_ROW_PICK=1`` or ``disable_draft_row_pick`` turn it
        off)."""
        return self.resolver.resolve(
            self.draft.layers[0],
            self.mapping,
            num_draft_layers=getattr(self.draft, "num_layers", 1),
            disabled=self.config.disable_draft_row_pick,
        )

    def draft_tree(
        self,
        hidden: Tensor,
        root_pos: Tensor,
        layout: VerifyLayout,
        all_rank_num_picked: list[int] | None = None,
        masker: DraftMasker | None = None,
        ban: StopBan | None = None,
    ) -> DraftTree:
        """The tree below each new root: hidden [B, H] is draft step 0's output at the row of
        the last accepted token (whose input token is the root's). ``all_rank_num_picked``:
        every rank's request count under attention DP (the draft MLP gathers every rank's
        frontier rows). ``masker``: children masked by the grammar after each node's path."""
        k = self.topk
        b, h = hidden.shape
        mask = None if masker is None else masker(0, [])  # feeds the emitted tokens
        children = partial(self._children, ban=ban)
        level = expand_level(*root_frontier(b, hidden.device), *children(hidden, b, 1, mask, 1))
        paths: list[list[list[int]]] = [[[]] for _ in range(b)]  # host: frontier node paths
        levels = [level]
        rows: list[tuple[Tensor, Tensor, Tensor, Tensor]] = []  # per depth: tok, hid, word, pos
        bits = torch.arange(k, device=hidden.device)
        out = hidden[:, None]  # [B, F, H] the previous frontier's outputs (F = 1: the root)
        words = torch.zeros(b, 1, dtype=torch.int64, device=hidden.device)
        for depth in range(1, self.depth):
            ids, scores = select_frontier(level, k)  # [B, k] into the level's candidates
            parent = ids // k if depth > 1 else torch.zeros_like(ids)
            tok = level.tokens.gather(1, ids)
            mask = None
            if masker is not None:  # host read: the new frontier's paths
                par, toks = parent.tolist(), tok.tolist()
                paths = [[paths[i][par[i][f]] + [toks[i][f]] for f in range(k)] for i in range(b)]
                mask = masker.node_masks(paths)
            hid = out.gather(1, parent[..., None].expand(b, k, h))
            words = words.gather(1, parent) | (1 << ((depth - 1) * k + bits))
            pos = (root_pos + depth - 1)[:, None].expand(b, k)
            rows.append((tok, hid, words, pos))
            tok_all, hid_all, word_all, pos_all = (
                torch.cat(x, dim=1) for x in zip(*rows, strict=True)
            )
            out = self.frontier_forward(
                layout, root_pos, tok_all, hid_all, word_all, pos_all, all_rank_num_picked
            )
            kids = children(out.reshape(b * k, h), b, k, mask, depth + 1)
            level = expand_level(ids, scores, *kids)
            levels.append(level)
        return build_tree(levels, self.k)

    def frontier_forward(
        self,
        layout: VerifyLayout,
        root_pos: Tensor,
        tokens: Tensor,
        hidden: Tensor,
        words: Tensor,
        positions: Tensor,
        all_rank_num_picked: list[int] | None = None,
    ) -> Tensor:
        """One draft pass over the frontier nodes of every depth so far, R = depth * topk rows
        per request (tokens, words, positions [B, R], hidden [B, R, H]: each node's input
        hidden state is its parent's output); returns the outputs of the last topk rows (this
        depth's frontier), [B, topk, H]. Every row writes its KV; with row pick only those
        topk rows run the post-attention part."""
        b, r, h = hidden.shape
        k = self.topk
        meta = self._frontier_meta(layout, root_pos, r, words.reshape(-1))
        if all_rank_num_picked is not None:
            meta.all_rank_num_tokens = [n * r for n in all_rank_num_picked]
            meta.all_rank_num_picked = [n * k for n in all_rank_num_picked]
        args = (0, positions.reshape(-1), tokens.reshape(-1), hidden.reshape(b * r, h), meta)
        if not self.picks_rows():
            return self.draft(*args).view(b, r, h)[:, -k:]
        last = torch.arange(r - k, r, device=hidden.device)
        pick = (torch.arange(b, device=hidden.device)[:, None] * r + last).reshape(-1)
        return self.draft(*args, pick_rows=pick).view(b, k, h)

    def _children(
        self,
        hidden: Tensor,
        b: int,
        f: int,
        mask: Tensor | None = None,
        depth: int = 1,
        ban: StopBan | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Top-k children (at ``depth``) of ``b * f`` nodes: (tokens, log-probabilities) [B, F,
        topk], best first, tokens in the target vocabulary. ``mask`` [B * F, W]: a grammar
        bitmask over the target vocabulary (a node it leaves no draft token keeps its unmasked
        logits)."""
        logits = self.draft.compute_logits(0, hidden).float()
        if mask is not None:
            logits = self.mask_draft_logits(logits, mask)
        if ban is not None:
            rows = (depth - 1 < ban.left).repeat_interleave(f)
            logits = self.ban_draft_stops(logits, ban.tokens, rows)
        logprobs, ids = logits.log_softmax(dim=-1).topk(self.topk, dim=-1)
        tokens = self.draft.to_target_ids(ids)
        return tokens.view(b, f, self.topk), logprobs.view(b, f, self.topk)

    def _frontier_meta(
        self, layout: VerifyLayout, root_pos: Tensor, rows: int, tree_mask: Tensor
    ) -> AttentionMetadata:
        """``rows`` frontier rows per request at KV scratch positions root_pos + r (past them
        the next step's verify rows overwrite them); the prefix is everything before the new
        root, and each row sees its ancestors through its tree word."""
        b = root_pos.shape[0]
        bs = self.block_size
        tables = layout.block_tables
        kv_pos = root_pos[:, None] + torch.arange(rows, device=root_pos.device)  # [B, R]
        block = tables.long().gather(1, (kv_pos // bs).clamp(max=tables.shape[1] - 1))
        slots = (block * bs + kv_pos % bs).reshape(-1)
        seq_lens = (root_pos + rows).to(torch.int32)
        qsl = torch.arange(b + 1, dtype=torch.int32, device=root_pos.device) * rows
        max_s = layout.max_seq_len + self.depth * (self.topk + 1)  # host bound
        plan = None
        if not gpu_paths(root_pos):
            plan = partial(
                build_attention_plan,
                tables,
                seq_lens,
                qsl,
                bs,
                rows,
                max_s,
                num_tokens=b * rows,
                tree_mask=tree_mask,
            )
        return AttentionMetadata(
            slot_mapping=slots,
            block_tables=tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            max_query_len=rows,
            max_seq_len=max_s,
            plan=plan,
            tree_mask=tree_mask,
        )


def _chain_shape(n: int, device: torch.device) -> tuple[Tensor, Tensor, Tensor]:
    """(parents [N], depths [N], attention words [N + 1]) of a chain of n nodes (row i sees
    rows 0..i)."""
    parents = torch.arange(-1, n - 1, device=device)
    words = tree_attention_words(ancestor_mask(parents[None], n))[0]
    return parents, torch.arange(1, n + 1, device=device), words


def _path_columns_(logits: Tensor, acc: TreeAcceptance) -> None:
    """Reorder logits [B, C, V] in place so column j is the row that emitted token j: the root
    for j = 0, else the depth-j accepted node's (j <= num_accepted; other columns stay)."""
    b, c, v = logits.shape
    path = acc.path
    col = torch.arange(c, device=logits.device).expand(b, c)
    depth_idx = (col - 1).clamp(0, path.shape[1] - 1)
    node = path.gather(1, depth_idx)
    src = torch.where((col >= 1) & (col <= acc.num_accepted[:, None]), node + 1, col)
    logits.copy_(logits.gather(1, src[..., None].expand(b, c, v)))
