"""Capture and replay of a generation step over static buffers (CUDA graphs).

For every ``GraphKey`` (padded batch size, draft length, sampling variant) start-up captures:

- the **target segment**: input ids, positions and attention metadata (slot mapping, block
  tables, sequence lengths, query starts) → hidden states and the Eagle3 captures. It does not
  depend on the sampling variant, so the variants of one batch size share it;
- under speculation, the **draft segment** per variant: the verify layout, the verification
  result (accepted counts, emitted tokens = the step-0 gather ids), the draft hidden input, and
  for the advanced variant the sampling buffers and pre-drawn noise → next drafts and q.

Draft trees (``TreeDecoder``): the target segment reads the verify rows' tree positions and
attention words from static buffers; the draft segment is ``TreeDecoder.next_tree`` (the accepted
paths come in through a static buffer, the next trees' tokens and shapes go out as static
outputs), one segment for both sampling variants (tree drafts are never sampled).

Verification between the two runs eagerly (it reads per-request generators and stored q), and so
do prefill / mixed steps, steps past the largest bucket and steps with drafts cut short. A step
replays by copying its live tensors into the static buffers (the graph padding's rows are dummy
generation requests on reserved KV blocks, so every row is safe), replaying, and reading the
static outputs — which the next replay overwrites: everything kept past the step is cloned.

``mode="cuda"``: each segment is a ``torch.cuda.CUDAGraph`` in one shared memory pool, captured
largest batch first. ``mode="static"`` (CPU, test-only ``TANDEM_TEST_STATIC_GRAPHS=1``): the same
callables over the same static buffers run eagerly at replay, so the copy-in, the padding and the
slicing are tested without a GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor

from tandem.engine.cuda_graph import ADVANCED, GREEDY, SAMPLED, GraphKey, dummy_kv_tokens
from tandem.engine.sampler import SamplingTensors
from tandem.engine.speculative.interface import SpecMetadata, VerifyLayout
from tandem.engine.speculative.tree_decoder import TreeDecoder
from tandem.engine.step import PreparedInputs, StepInput
from tandem.kernels.attention_torch import build_attention_plan
from tandem.kernels.launch import gpu_paths
from tandem.models.attention import AttentionMetadata
from tandem.models.parallel import ParallelMapping

if TYPE_CHECKING:
    from tandem.engine.model_runner import ModelRunner


def draft_lens_of(spec: Any) -> tuple[int, ...]:
    """The draft lengths captured: 0 without speculation, a tree's node count, else K and the
    positive K values of a num_speculative_tokens schedule."""
    if spec is None:
        return (0,)
    lens = {spec.k}
    if not isinstance(spec, TreeDecoder):
        lens |= {k for _, k in spec.config.draft_len_schedule if k > 0}
    return tuple(sorted(lens))


def max_blocks_per_request(max_model_len: int, kv_lookahead: int, block_size: int) -> int:
    """Block-table width of the static buffers: a request at ``max_model_len`` plus a step's
    KV look-ahead (``SpeculativeConfig.kv_lookahead``), plus one block of slack."""
    return -(-(max_model_len + kv_lookahead) // block_size) + 1


class Segment:
    """One captured callable: ``fn`` reads and writes only static buffers."""

    def __init__(self, fn: Callable[[], Any]) -> None:
        self.fn = fn
        self.graph: torch.cuda.CUDAGraph | None = None
        self.outputs: Any = None

    def capture(self, pool: Any, use_cuda: bool) -> None:
        """Warm up (compiles kernels, creates lazy state), then on CUDA capture into ``pool``."""
        if not use_cuda:
            self.outputs = self.fn()
            return
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            self.fn()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, pool=pool):
            self.outputs = self.fn()

    def replay(self) -> Any:
        if self.graph is None:  # static mode: the same callable, eagerly
            self.outputs = self.fn()
        else:
            self.graph.replay()
        return self.outputs


@dataclass
class CapturedStep:
    key: GraphKey
    target: Segment
    draft: Segment | None  # None without speculation


class GraphRunner:
    """The captured steps of one rank and their static buffers (sized for the largest bucket;
    each key works on leading views of them)."""

    def __init__(
        self,
        runner: ModelRunner,
        batch_sizes: tuple[int, ...],
        max_model_len: int,
        mapping: ParallelMapping,
        mode: str,
    ) -> None:
        if mode not in ("cuda", "static"):
            raise ValueError(f"mode={mode!r} is invalid: 'cuda' or 'static'")
        self.runner = runner
        self.spec = runner.spec
        self.k = runner.k
        # The draft lengths a key may carry: K, and every K of a num_speculative_tokens
        # schedule (a step that verifies as many drafts as it draws replays its own graph).
        self.draft_lens = draft_lens_of(self.spec)
        # Draft trees: the target verifies tree rows (positions root + depth, a tree mask)
        # and the draft segment drafts the next tree (its shape leaves as static outputs).
        self.tree = isinstance(self.spec, TreeDecoder)
        self.topk = self.spec.config.topk if self.spec is not None else 1
        self.batch_sizes = tuple(sorted(batch_sizes))
        self.mapping = mapping
        self.use_cuda = mode == "cuda"
        self.block_size = runner.block_size
        lookahead = self.spec.config.kv_lookahead if self.spec is not None else 0
        self.max_blocks = max_blocks_per_request(max_model_len, lookahead, self.block_size)
        # A model with sliding-window layers whose KV is the window group (gpt-oss): those
        # layers read their own slots and block tables, static buffers too.
        self.windowed = bool(runner.dummy_window_block_ids)
        self.graphs: dict[GraphKey, CapturedStep] = {}
        self.pool: Any = None
        self.num_replays = 0
        self.buffers: dict[str, Tensor] = {}

    # ------------------------------------------------------------------ static buffers

    def _alloc(self) -> None:
        dev = self.runner.device
        b, k1 = max(self.batch_sizes), self.k + 1
        n = b * k1
        i64, i32 = torch.int64, torch.int32

        def z(name: str, shape: tuple[int, ...], dtype: torch.dtype) -> None:
            self.buffers[name] = torch.zeros(shape, dtype=dtype, device=dev)

        z("input_ids", (n,), i64)
        z("positions", (n,), i64)
        z("slot_mapping", (n,), i64)
        z("block_tables", (b, self.max_blocks), i32)
        z("seq_lens", (b,), i32)
        z("query_start_loc", (b + 1,), i32)
        if self.windowed:  # the window group's slots and tables (sliding-window layers)
            z("window_slot_mapping", (n,), i64)
            z("window_block_tables", (b, self.max_blocks), i32)
        if self.spec is None:
            return
        hidden = int(self.runner.model.config.hidden_size)
        draft = self.spec.draft  # None: drafts from the engine (n-gram), verification only
        z("draft_hidden", (n, hidden), draft.dtype if draft is not None else torch.float32)
        z("next_tokens", (b,), i64)
        z("rows", (b, k1), i64)
        z("drafts", (b, self.k), i64)
        z("num_drafts", (b,), i64)
        z("first_row", (b,), i64)
        z("layout_positions", (b,), i64)
        z("row_owner", (n,), i64)
        z("num_accepted", (b,), i64)
        z("tokens", (b, k1), i64)
        if self.tree:
            z("tree_positions", (n,), i64)
            z("tree_mask", (n,), i64)
            z("path", (b, self.spec.config.num_speculative_tokens), i64)
        if self.spec.vanilla:
            z("future", (b, k1), i64)
            z("row_req", (n,), i64)
            z("row_last", (n,), i64)
        if self.spec.config.use_rejection_sampling:
            z("temperature", (b,), torch.float32)
            z("top_k", (b,), i64)
            z("top_p", (b,), torch.float32)
            z("min_p", (b,), torch.float32)
            z("zeros", (b,), torch.float32)
            z("ones", (b,), torch.float32)
            self.buffers["ones"].fill_(1.0)
            self.buffers["top_p"].fill_(1.0)
            vocab = int(self.runner.vocab_size)
            z("noise", (self.k, b, vocab), torch.float32)
            self.buffers["noise"].fill_(1.0)

    def _counts(self, b: int, k: int) -> tuple[list[int], list[int]] | None:
        """Attention DP: every rank pads to the same bucket, so the per-rank row counts of a
        key are fixed (and baked into its collectives)."""
        if not self.mapping.enable_attention_dp:
            return None
        tp = self.mapping.tp_size
        return [b * (k + 1)] * tp, [b] * tp

    def _meta(self, b: int, k: int, tree: bool = False) -> AttentionMetadata:
        """The step's attention metadata over the static buffers (``b`` requests of ``k``
        drafts); ``tree``: the target's, with the tree attention words of the verify rows."""
        buf, n = self.buffers, b * (k + 1)
        max_seq_len = self.max_blocks * self.block_size
        tables, seq_lens = buf["block_tables"][:b], buf["seq_lens"][:b]
        qsl = buf["query_start_loc"][: b + 1]
        tree_mask = buf["tree_mask"][:n] if tree else None

        def group(slot_mapping: Tensor, tables: Tensor) -> AttentionMetadata:
            plan = None
            if not gpu_paths(self.runner.device):  # the CPU attention path's indices
                plan = partial(
                    build_attention_plan,
                    tables,
                    seq_lens,
                    qsl,
                    self.block_size,
                    k + 1,
                    max_seq_len,
                    num_tokens=n,
                    tree_mask=tree_mask,
                )
            return AttentionMetadata(
                slot_mapping=slot_mapping,
                block_tables=tables,
                seq_lens=seq_lens,
                query_start_loc=qsl,
                max_query_len=k + 1,
                max_seq_len=max_seq_len,
                plan=plan,
                tree_mask=tree_mask,
            )

        meta = group(buf["slot_mapping"][:n], tables)
        if self.windowed:
            meta.window = group(buf["window_slot_mapping"][:n], buf["window_block_tables"][:b])
        counts = self._counts(b, k)
        if counts is not None:
            meta.all_rank_num_tokens, meta.all_rank_num_picked = counts
        return meta

    def _sampling(self, b: int) -> SamplingTensors:
        """Every stage on (neutral values disable it per row), so one graph serves any mix of
        greedy and random rows; the results equal the eager path's, which skips unused stages."""
        buf = self.buffers
        return SamplingTensors(
            temperature=buf["temperature"][:b],
            top_k=buf["top_k"][:b],
            top_p=buf["top_p"][:b],
            min_p=buf["min_p"][:b],
            presence_penalty=buf["zeros"][:b],
            frequency_penalty=buf["zeros"][:b],
            repetition_penalty=buf["ones"][:b],
            output_token_counts=None,
            prompt_token_mask=None,
            generators=[None] * b,
            all_greedy=False,
            all_random=False,
            no_top_k=False,
            no_top_p=False,
            no_min_p=False,
            no_penalties=True,
            max_num_logprobs=0,
        )

    # ------------------------------------------------------------------ segments

    def _target_fn(self, b: int, k: int) -> Callable[[], tuple[Tensor, list[Tensor]]]:
        buf, n, runner = self.buffers, b * (k + 1), self.runner

        positions = buf["tree_positions" if self.tree else "positions"][:n]

        def target() -> tuple[Tensor, list[Tensor]]:
            return runner.model(
                buf["input_ids"][:n],
                positions,
                self._meta(b, k, tree=self.tree),
                capture_layers=runner.capture_layers,
            )

        return target

    def _layout(self, b: int, k: int, meta: AttentionMetadata) -> VerifyLayout:
        buf = self.buffers
        return VerifyLayout(
            rows=buf["rows"][:b],
            drafts=buf["drafts"][:b],
            num_drafts=buf["num_drafts"][:b],
            first_row=buf["first_row"][:b],
            positions=buf["layout_positions"][:b],
            block_tables=meta.block_tables,  # every request is sampled: the same tables
            row_owner=buf["row_owner"][: b * (k + 1)],
            max_seq_len=meta.max_seq_len,
            window_block_tables=None if meta.window is None else meta.window.block_tables,
        )

    def _tree_fn(self, b: int) -> Callable[[], tuple[Tensor, ...]]:
        """The next trees (tokens, parents, depths, words) from the step's rows and the
        accepted paths in ``path``."""
        spec, buf, n = self.spec, self.buffers, b * (self.k + 1)
        assert isinstance(spec, TreeDecoder)

        def draft() -> tuple[Tensor, ...]:
            meta = self._meta(b, self.k)
            return spec.next_tree(
                buf["input_ids"][:n],
                buf["positions"][:n],
                meta,
                buf["draft_hidden"][:n],
                buf["next_tokens"][:b],
                self._layout(b, self.k, meta),
                buf["num_accepted"][:b],
                buf["tokens"][:b],
                buf["path"][:b],
            )

        return draft

    def _draft_fn(
        self, b: int, k: int, variant: str
    ) -> Callable[[], tuple[Tensor, Tensor | None, Tensor | None]]:
        spec, buf, n = self.spec, self.buffers, b * (k + 1)
        assert spec is not None
        advanced = variant == ADVANCED

        def draft() -> tuple[Tensor, Tensor | None, Tensor | None]:
            meta = self._meta(b, k)
            layout = self._layout(b, k, meta)
            vanilla = SimpleNamespace(future=None, row_req=None, row_last=None)
            if spec.vanilla:
                vanilla = SimpleNamespace(
                    future=buf["future"][:b],
                    row_req=buf["row_req"][:n],
                    row_last=buf["row_last"][:n],
                )
            spec_meta = SpecMetadata(self.k, spec.config.use_rejection_sampling)
            spec_meta.is_all_greedy_sample = not advanced
            new_drafts, q_all = spec.draft_loop(
                vanilla,
                buf["input_ids"][:n],
                buf["positions"][:n],
                meta,
                buf["draft_hidden"][:n],
                buf["next_tokens"][:b],
                layout,
                buf["num_accepted"][:b],
                buf["tokens"][:b],
                self._sampling(b) if advanced else _NO_SAMPLING,
                spec_meta,
                buf["noise"][:, :b] if advanced else None,
                steps=None if k == self.k else k,
            )
            # The drafts' confidence (confidence_threshold) is one more output of the graph.
            return new_drafts, q_all, spec.last_confidence

        return draft

    def variants(self) -> tuple[str, ...]:
        if self.spec is None:
            return (GREEDY, SAMPLED)
        if self.spec.config.use_rejection_sampling:
            return (GREEDY, ADVANCED)
        return (GREEDY,)  # drafts are never sampled

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every (bucket, variant) with dummy generation requests on the reserved KV
        blocks, largest bucket first (smaller graphs reuse the pool). Fails loudly rather than
        leaving a bucket uncaptured."""
        runner = self.runner
        depth = self.spec.config.num_speculative_tokens if self.spec is not None else 0
        need = dummy_kv_tokens(self.k, self.topk, depth)
        have = len(runner.dummy_block_ids) * self.block_size
        if have < need:
            raise ValueError(
                f"graph capture: the dummy request has {have} reserved KV slots but writes "
                f"{need}; allocate the KV cache (num_dummy_blocks) before capturing"
            )
        self._alloc()
        if self.use_cuda:
            self.pool = torch.cuda.graph_pool_handle()
        for b in sorted(self.batch_sizes, reverse=True):
            for k in sorted(self.draft_lens, reverse=True):
                self._capture(b, k)
        if self.use_cuda:
            torch.cuda.synchronize()

    # ------------------------------------------------------------------ replay

    def _capture(self, b: int, k: int) -> None:
        """The graphs of ``b`` requests with ``k`` drafts each: the target segment, then the
        draft segment of each sampling variant (one tree segment for a draft tree)."""
        runner = self.runner
        empty = StepInput([], num_draft_steps=None if k == self.k else k)
        inp = runner.prepare(runner.pad_generation(empty, b), self._counts(b, k))
        self._copy_target(b, k, inp)
        target = Segment(self._target_fn(b, k))
        target.capture(self.pool, self.use_cuda)
        tree = None  # a tree's draft segment does not depend on the sampling variant
        if self.tree and self.spec.draft is not None:  # suffix trees come from the engine
            self._copy_layout(b, k, inp)
            tree = Segment(self._tree_fn(b))
            tree.capture(self.pool, self.use_cuda)
        for variant in self.variants():
            draft = tree
            if self.spec is not None and tree is None and self.spec.draft is not None:
                self._copy_layout(b, k, inp)
                draft = Segment(self._draft_fn(b, k, variant))
                draft.capture(self.pool, self.use_cuda)
            key = GraphKey(b, k, variant, self.topk)
            self.graphs[key] = CapturedStep(key, target, draft)

    def _copy_target(self, b: int, k: int, inp: PreparedInputs) -> None:
        buf, n, meta = self.buffers, b * (k + 1), inp.meta
        buf["input_ids"][:n].copy_(inp.input_ids)
        buf["positions"][:n].copy_(inp.positions)
        buf["slot_mapping"][:n].copy_(meta.slot_mapping)
        width = meta.block_tables.shape[1]
        buf["block_tables"][:b, :width].copy_(meta.block_tables)
        buf["block_tables"][:b, width:].zero_()  # never read past seq_lens; kept deterministic
        buf["seq_lens"][:b].copy_(meta.seq_lens)
        buf["query_start_loc"][: b + 1].copy_(meta.query_start_loc)
        if self.windowed:
            assert meta.window is not None
            buf["window_slot_mapping"][:n].copy_(meta.window.slot_mapping)
            buf["window_block_tables"][:b, :width].copy_(meta.window.block_tables)
            buf["window_block_tables"][:b, width:].zero_()
        if self.spec is None:
            return
        if self.tree:
            assert inp.target is not None
            positions, tree_meta = inp.target
            assert tree_meta.tree_mask is not None
            buf["tree_positions"][:n].copy_(positions)
            buf["tree_mask"][:n].copy_(tree_meta.tree_mask)
        assert inp.next_tokens is not None
        buf["next_tokens"][:b].copy_(inp.next_tokens)
        if self.spec.vanilla:
            assert inp.future is not None and inp.row_req is not None and inp.row_last is not None
            buf["future"][:b].copy_(inp.future)
            buf["row_req"][:n].copy_(inp.row_req)
            buf["row_last"][:n].copy_(inp.row_last)

    def _copy_layout(self, b: int, k: int, inp: PreparedInputs) -> None:
        layout, buf = inp.layout, self.buffers
        assert layout is not None
        buf["rows"][:b].copy_(layout.rows)
        buf["drafts"][:b].copy_(layout.drafts)
        buf["num_drafts"][:b].copy_(layout.num_drafts)
        buf["first_row"][:b].copy_(layout.first_row)
        buf["layout_positions"][:b].copy_(layout.positions)
        buf["row_owner"][: b * (k + 1)].copy_(layout.row_owner)

    def bind(self, key: GraphKey, inp: PreparedInputs) -> GraphReplay | None:
        """This step's replay (its target inputs copied in), or None when the prepared batch
        does not have the key's captured shape (the step then runs eagerly)."""
        captured = self.graphs.get(key)
        if captured is None:
            return None
        b, k = key.batch_size, key.draft_len
        n = b * (k + 1)
        meta = inp.meta
        counts = self._counts(b, k)
        fits = (
            len(inp.sampled) == b
            and meta.seq_lens.shape[0] == b
            and inp.input_ids.shape[0] == n
            and meta.max_query_len == k + 1
            and meta.block_tables.shape[1] <= self.max_blocks
            and (meta.window is not None) == self.windowed
            and (not self.tree or inp.target is not None)  # the tree's verify rows
            and (counts is None or (meta.all_rank_num_tokens, meta.all_rank_num_picked) == counts)
        )
        if not fits:
            return None
        self._copy_target(b, k, inp)
        return GraphReplay(self, captured)


class GraphReplay:
    """One step's replay: ``forward`` stands in for the target forward, ``propose`` for
    ``SpecDecoder.propose`` (same signatures and results)."""

    def __init__(self, graphs: GraphRunner, captured: CapturedStep) -> None:
        self.graphs = graphs
        self.captured = captured

    def forward(self) -> tuple[Tensor, list[Tensor]]:
        self.graphs.num_replays += 1
        return self.captured.target.replay()

    def propose(
        self,
        inp: PreparedInputs,
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
    ) -> Tensor:
        g, key = self.graphs, self.captured.key
        spec, buf = g.spec, g.buffers
        assert spec is not None and self.captured.draft is not None
        advanced = meta.wants_advanced_draft_sampling
        if advanced != (key.variant == ADVANCED):
            # The key must be built from the final sampling path: replaying the other variant
            # would read buffers this step never filled.
            raise RuntimeError(
                f"graph {key} replayed for a step whose draft sampling is "
                f"{'advanced' if advanced else 'greedy'}: the sampling variant must be decided "
                "before the graph key"
            )
        b, k = key.batch_size, key.draft_len
        n = b * (k + 1)
        g._copy_layout(b, k, inp)
        buf["draft_hidden"][:n].copy_(draft_hidden)
        buf["num_accepted"][:b].copy_(num_accepted)
        buf["tokens"][:b].copy_(tokens)
        if isinstance(spec, TreeDecoder):  # the next trees; their shapes stay with the decoder
            buf["path"][:b].copy_(spec.path)
            tree_tokens, parents, depths, words = self.captured.draft.replay()
            spec.keep_shapes(request_ids, parents.clone(), depths.clone(), words.clone())
            return tree_tokens.clone()
        if advanced:
            if st.adjusts_logits:  # the model runner drafts these steps eagerly
                raise RuntimeError("a captured draft loop has no logit bias or penalties")
            buf["temperature"][:b].copy_(st.temperature)
            buf["top_k"][:b].copy_(st.top_k)
            buf["top_p"][:b].copy_(st.top_p)
            buf["min_p"][:b].copy_(st.min_p)
            noise = spec.draw_draft_noise(b, st, num_accepted.device, k)
            buf["noise"][:k, :b].copy_(noise)
        new_drafts, q_all, conf = self.captured.draft.replay()
        spec.keep_q(request_ids, None if q_all is None else q_all.clone())
        spec.last_confidence = None if conf is None else conf.clone()
        return new_drafts.clone()


# The greedy draft loop never reads sampling tensors.
_NO_SAMPLING: Any = None
