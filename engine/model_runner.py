"""Turns one scheduled step into tensors, runs the forward and samples (or verifies and drafts).

The runner is rank-local: it owns the model, the draft head, the KV cache tensors and the
per-request random generators, and it receives plain, picklable step descriptions
(``StepInput``) so that the same code serves one in-process rank or N rank processes.
"""

from __future__ import annotations

import dataclasses
import io
from typing import Any

import torch
from torch import nn

from tandem.engine.cuda_graph import (
    CUDAGraphRunner,
    GraphKey,
    GraphPlan,
    sampling_variant,
    step_can_graph,
)
from tandem.engine.request import TokenLogprobs
from tandem.engine.sampler import (
    GREEDY_EPS,
    RowSamplingInfo,
    SamplingTensors,
    apply_token_bitmask,
    compute_logprobs,
    sample,
)
from tandem.engine.speculative.decoder import SpecDecoder
from tandem.engine.speculative.draft_grammar import DraftGrammars
from tandem.engine.speculative.interface import SpecMetadata
from tandem.engine.speculative.sampling import widen_columns
from tandem.engine.speculative.tree_decoder import TreeDecoder
from tandem.engine.step import (
    ADP_DUMMY_REQUEST_ID,
    DUMMY_PARAMS,
    DPStepInput,
    PreparedInputs,
    RequestStep,
    StepGraphs,
    StepInput,
    StepOutput,
    StepReplay,
    adp_pad_steps,
    drop_dummy,
    is_dummy,
    num_dummy_blocks,
)
from tandem.engine.step_io import host_rows, prepare_step
from tandem.kernels.paged_attention import FP8_KV_DTYPE
from tandem.models.parallel import all_ranks_true


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        block_size: int,
        seed: int,
        spec: SpecDecoder | None = None,
        capture_layers: tuple[int, ...] = (),
        dp_rank: int = 0,
    ) -> None:
        self.model = model
        self.dp_rank = dp_rank
        self.dummy_block_ids: list[int] = []  # attention DP: the reserved blocks (last ones)
        self.dummy_window_block_ids: list[int] = []  # the same in the window group
        self.graphs: CUDAGraphRunner | None = None  # set by the worker
        self.graph_runner: StepGraphs | None = None  # captured graphs (worker; CUDA)
        self.device = device
        self.block_size = block_size
        self.vocab_size = int(model.config.vocab_size)
        self.spec = spec
        self.capture_layers = capture_layers
        self.k = spec.k if spec is not None else 0
        # Kept across steps: the group greedy flag is cleared and re-derived every step.
        self.spec_meta = (
            SpecMetadata(spec.k, spec.config.use_rejection_sampling) if spec is not None else None
        )
        self.generators: dict[str, torch.Generator] = {}
        # Masked drafting of constrained requests (set by the worker under speculation).
        self.grammars: DraftGrammars | None = None
        self.kv_caches: list[tuple[torch.Tensor, ...]] = []
        torch.manual_seed(seed)

    # ---------------------------------------------------------------- KV cache

    def cache_layers(self, dtype: torch.dtype) -> list[tuple[Any, torch.dtype]]:
        """Every attention layer with the dtype of its KV cache: ``dtype`` for the target's, the
        head's own for a draft's (an Eagle3 head may run in another dtype); an FP8 cache
        (``FP8_KV_DTYPE``) for every layer."""
        layers = [(a, dtype) for a in self.model.attention_layers()]
        draft = self.spec.draft if self.spec is not None else None
        if draft is not None:
            draft_dtype = dtype if dtype == FP8_KV_DTYPE else draft.dtype
            layers += [(a, draft_dtype) for a in draft.attention_layers()]
        return layers

    def kv_window(self) -> int | None:
        """The largest window of the target's sliding-window layers, whose KV is the window
        group's (engine/block_manager.py); None when it has none. A draft's layers keep their
        whole KV."""
        windows = [getattr(a, "window", None) for a in self.model.attention_layers()]
        return max((w for w in windows if w is not None), default=None)

    def in_window_group(self, attn: Any) -> bool:
        return getattr(attn, "window", None) is not None and any(
            attn is a for a in self.model.attention_layers()
        )

    def kv_bytes_per_block(self, dtype: torch.dtype, window_group: bool = False) -> int:
        """Bytes of one block over every cache layer (``window_group``: the window group's
        layers only)."""
        return sum(
            a.kv_cache_spec().bytes_per_block(self.block_size, layer_dtype)
            for a, layer_dtype in self.cache_layers(dtype)
            if not window_group or self.in_window_group(a)
        )

    def allocate_kv_cache(
        self, num_blocks: int, dtype: torch.dtype, window_num_blocks: int = 0
    ) -> None:
        """The cache tensors each attention layer asks for (``kv_cache_spec``: K and V, or one
        latent tensor), target layers then draft layers; the window group's layers get
        ``window_num_blocks`` blocks."""
        self.kv_caches = []
        for attn, layer_dtype in self.cache_layers(dtype):
            spec = attn.kv_cache_spec()
            windowed = window_num_blocks > 0 and self.in_window_group(attn)
            blocks = window_num_blocks if windowed else num_blocks
            shape = (blocks, self.block_size, *spec.token_shape)
            caches = tuple(
                torch.zeros(shape, dtype=layer_dtype, device=self.device)
                for _ in range(spec.num_tensors)
            )
            attn.bind_kv_cache(caches)
            attn.window_group = windowed
            self.kv_caches.append(caches)
        n = num_dummy_blocks(self.block_size, self.spec.config.kv_lookahead if self.spec else 0)
        self.dummy_block_ids = list(range(num_blocks - n, num_blocks))
        self.dummy_window_block_ids = (
            list(range(window_num_blocks - n, window_num_blocks)) if window_num_blocks else []
        )

    # ---------------------------------------------------------------- inputs

    def dummy_step(self, index: int = 0, draft_len: int | None = None) -> RequestStep:
        """A greedy generation request (one token plus ``draft_len``, None: K, zero drafts) on
        the reserved blocks."""
        k = self.k if draft_len is None else draft_len
        return RequestStep(
            request_id=f"{ADP_DUMMY_REQUEST_ID}{index}",
            token_ids=[0] * (1 + k),
            start=0,
            block_ids=list(self.dummy_block_ids),
            window_block_ids=list(self.dummy_window_block_ids),
            sample=True,
            params=DUMMY_PARAMS,
            num_drafts=k,
        )

    def graph_draft_len(self, step: StepInput) -> int:
        """The draft length of a step's graph key: the drafts it draws (K, or a schedule's K);
        only a step whose requests verify as many drafts can replay."""
        return self.k if step.num_draft_steps is None else step.num_draft_steps

    def prepare(
        self, step: StepInput, adp_counts: tuple[list[int], list[int]] | None = None
    ) -> PreparedInputs:
        spec = self.spec
        vanilla = spec is not None and spec.vanilla
        inp = prepare_step(step, self.device, self.block_size, self.k, spec is not None, vanilla)
        if adp_counts is not None:
            inp.meta.all_rank_num_tokens, inp.meta.all_rank_num_picked = adp_counts
        if isinstance(spec, TreeDecoder) and inp.sampled:
            spec.prepare_tree(inp, step.requests)
        return inp

    def _generator(self, r: RequestStep) -> torch.Generator | None:
        assert r.params is not None
        if r.params.seed is None or r.params.greedy:
            return None
        gen = self.generators.get(r.request_id)
        if gen is None:
            gen = torch.Generator(device=self.device)
            gen.manual_seed(r.params.seed)
            self.generators[r.request_id] = gen
        return gen

    # ---------------------------------------------------------------- hand-over

    def handover_state(self, request_id: str) -> bytes:
        """What a request's next steps read here besides its KV: the draft probabilities its
        drafts were sampled from (rejection sampling) and its random generator; serialized for
        a decode instance (engine/kv_transfer.py)."""
        state: dict[str, Any] = {}
        if self.spec is not None:
            state["spec"] = self.spec.export_request(request_id)
        gen = self.generators.get(request_id)
        if gen is not None:
            state["generator"] = gen.get_state()
        if not state.get("spec") and "generator" not in state:
            return b""
        buf = io.BytesIO()
        torch.save(state, buf)
        return buf.getvalue()

    def adopt_state(self, request_id: str, blob: bytes) -> None:
        """``handover_state``'s blob, for the same request here."""
        if not blob:
            return
        state = torch.load(io.BytesIO(blob), weights_only=True)
        if self.spec is not None and state.get("spec"):
            self.spec.import_request(request_id, state["spec"], self.device)
        if "generator" in state:
            gen = torch.Generator(device=self.device)
            gen.set_state(state["generator"])
            self.generators[request_id] = gen

    def sampling_tensors(self, sampled: list[RequestStep]) -> SamplingTensors:
        rows = []
        for r in sampled:
            p = r.params
            assert p is not None
            rows.append(
                RowSamplingInfo(
                    temperature=p.temperature,
                    top_k=p.top_k,
                    top_p=p.top_p,
                    min_p=p.min_p,
                    presence_penalty=p.presence_penalty,
                    frequency_penalty=p.frequency_penalty,
                    repetition_penalty=p.repetition_penalty,
                    prompt_token_ids=r.prompt_token_ids,
                    output_token_ids=r.output_token_ids,
                    generator=self._generator(r),
                    num_logprobs=0 if p.logprobs is None else max(1, p.logprobs),
                    min_tokens_left=r.min_tokens_left,
                    stop_token_ids=r.stop_token_ids,
                    logit_bias=p.logit_bias,
                )
            )
        return SamplingTensors.from_params(rows, self.vocab_size, self.device)

    # ---------------------------------------------------------------- step

    @torch.inference_mode()
    def execute_dp(self, dp_step: DPStepInput) -> StepOutput:
        """Attention DP: run this rank's entry, padded with the dummy request where needed; the
        per-rank counts come from every rank's (padded) entry."""
        k = self.graph_draft_len(dp_step.steps[self.dp_rank])
        steps = adp_pad_steps(dp_step.steps, self.dummy_step(-1, k))
        own = steps[self.dp_rank]
        if not own.requests:  # no rank has work: no collective at all
            return self.execute(own)
        advanced, plan = self.plan_graph(own.requests, k)
        masked = self.grammars is not None and any(
            r.token_bitmask is not None for s in steps for r in s.requests
        )
        if not own.propose_drafts or masked:
            # Paused speculation, or masked drafting somewhere (host reads inside the draft
            # loop): every rank runs eagerly (every rank knows every entry, so all agree).
            plan = GraphPlan(None, 0)
        if plan.key is not None:  # every rank pads to the same bucket (all know every entry)
            steps = [self.pad_generation(s, plan.key.batch_size - len(s.requests)) for s in steps]
        counts = [sum(len(r.token_ids) for r in s.requests) for s in steps]
        picked = [sum(r.sample for r in s.requests) for s in steps]
        out = self.execute(steps[self.dp_rank], (counts, picked), scanned=True, key=plan.key)
        if self.spec is not None:
            self.spec.forget([rid for rid in self.spec.draft_q if is_dummy(rid)])
        out = drop_dummy(out)
        out.rank_paths = [(advanced, plan.key)]
        return out

    def plan_graph(
        self, requests: list[RequestStep], draft_len: int | None = None
    ) -> tuple[bool, GraphPlan]:
        """The step's sampling path first (group-synced), then the graph key and padding:
        (advanced draft sampling, plan). ``draft_len``: the step's (None: K)."""
        k = self.k if draft_len is None else draft_len
        sampled = [r for r in requests if r.sample]
        # The sampler's own test (``SamplingTensors.all_greedy``), so the rescan agrees.
        local_greedy = all(
            r.params is not None and r.params.temperature < GREEDY_EPS for r in sampled
        )
        advanced = False
        if self.spec is not None:
            assert self.spec_meta is not None
            self.scan_sampling_path(self.spec_meta, local_greedy)
            advanced = self.spec_meta.wants_advanced_draft_sampling
        variant = sampling_variant(self.k, advanced, local_greedy)
        assert self.graphs is not None
        can = step_can_graph(requests, k) and self._captured_draft_len(k)
        return advanced, self.graphs.plan(can, len(requests), variant, k)

    @torch.inference_mode()
    def execute_plain(self, step: StepInput) -> StepOutput:
        """A step without attention DP. With captured graphs, a generation-only step is planned
        first (sampling path, key, padding with dummy requests) and replayed."""
        if (
            self.graph_runner is None
            or self.graphs is None
            or not step.requests
            or not step.propose_drafts  # paused speculation runs eagerly
        ):
            return self.execute(step)
        _, plan = self.plan_graph(step.requests, self.graph_draft_len(step))
        if plan.key is None:
            return self.execute(step, scanned=True)
        out = self.execute(self.pad_generation(step, plan.num_padding), scanned=True, key=plan.key)
        if self.spec is not None:
            self.spec.forget([rid for rid in self.spec.draft_q if is_dummy(rid)])
        return drop_dummy(out)

    def pad_generation(self, step: StepInput, n: int) -> StepInput:
        """``step`` plus ``n`` dummy generation requests (graph padding; reserved blocks)."""
        if n <= 0:
            return step
        k = self.graph_draft_len(step)
        dummies = [self.dummy_step(len(step.requests) + i, k) for i in range(n)]
        return dataclasses.replace(step, requests=[*step.requests, *dummies])

    @torch.inference_mode()
    def execute(
        self,
        step: StepInput,
        adp_counts: tuple[list[int], list[int]] | None = None,
        scanned: bool = False,
        key: GraphKey | None = None,
    ) -> StepOutput:
        """``scanned``: the sampling path was already scanned (and group-synced) this step.
        ``key``: the step's graph (planned and padded by the caller); replayed if captured."""
        for rid in step.finished_request_ids:
            self.generators.pop(rid, None)
        if self.spec is not None:
            self.spec.forget(step.finished_request_ids)
        if self.grammars is not None:
            self.grammars.forget(step.finished_request_ids)
            self.grammars.prefetch(step.grammars)
            self.grammars.receive(step.requests)
        if not step.requests:
            return StepOutput([], [], [])
        if self.spec is not None and self.spec.deferred:  # paused steps' draft KV first
            self.spec.flush_step_kv([r.request_id for r in step.requests], step.propose_drafts)
        inp = self.prepare(step, adp_counts)
        replay = None
        if key is not None and self.graph_runner is not None:
            replay = self.graph_runner.bind(key, inp)
        if replay is not None:
            hidden, captured = replay.forward()
        else:
            positions, meta = inp.target or (inp.positions, inp.meta)  # draft trees: theirs
            hidden, captured = self.model(
                inp.input_ids, positions, meta, capture_layers=self.capture_layers
            )
        if self.spec is not None:
            return self._execute_spec(
                inp, hidden, captured, scanned, replay, step.propose_drafts, step.num_draft_steps
            )
        if not inp.sampled:
            return StepOutput([], [], [])
        return self._sample_last_rows(inp, hidden)[0]

    def _sample_last_rows(
        self, inp: PreparedInputs, hidden: torch.Tensor
    ) -> tuple[StepOutput, torch.Tensor]:
        """Plain decoding's sampling: each sampled request's last row → (its output, the ids
        [B] on the device)."""
        # sample() widens to float32 itself where it needs to (not for plain greedy rows).
        logits = self.model.compute_logits(hidden[inp.logits_indices])
        if any(r.token_bitmask is not None for r in inp.sampled):  # structured output
            logits = apply_token_bitmask(logits, self._bitmask(inp.sampled, 1))
        out = sample(logits, self.sampling_tensors(inp.sampled))
        if out.logprobs is None:
            (ids_rows,) = host_rows(out.token_ids)  # the step's one host sync
        else:
            ids_rows, chosen_rows, top_ids, top_lp = host_rows(
                out.token_ids, out.logprobs, out.topk_ids, out.topk_logprobs
            )
            chosen = [row[0] for row in chosen_rows]
        token_ids = [row[0] for row in ids_rows]
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(token_ids)
        if out.logprobs is not None:
            for i, r in enumerate(inp.sampled):
                n = r.params.logprobs
                if n is not None:
                    logprobs[i] = [
                        TokenLogprobs(token_ids[i], chosen[i], top_ids[i][:n], top_lp[i][:n])
                    ]
        request_ids = [r.request_id for r in inp.sampled]
        return StepOutput(request_ids, [[t] for t in token_ids], logprobs), out.token_ids

    def _bitmask(self, sampled: list[RequestStep], cols: int) -> torch.Tensor:
        """[B * cols, W] int32 bitmask of the sampled logits' rows (``cols`` 1 without
        speculation): request i's row j is its grammar's mask for verified position j; all ones
        for unconstrained requests and past a request's drafts (those columns repeat a row whose
        token is never used).

        Exactness (speculative sampling with the target masked): drafts come from the draft
        distribution q (masked by the grammar too where the draft loop could mask it, see
        engine/speculative/draft_grammar.py; unmasked elsewhere: the proof needs only that the
        q verified is the q drawn from); verification takes the masked, renormalised
        target p' (p' = 0 where the grammar forbids), accepts draft d with min(1, p'(d) / q(d))
        and on rejection samples norm(max(0, p' - q)). For any q, x is emitted with
        probability q(x) min(1, p'(x) / q(x)) + (1 - sum_y min(q(y), p'(y))) norm(max(0, p' -
        q))(x) = min(q(x), p'(x)) + max(0, p'(x) - q(x)) = p'(x): exactly constrained
        sampling, and a forbidden draft (p'(d) = 0) is always rejected and never emitted. The
        residual must come from p' (masked), which it does since p' is what is verified.
        Greedy: the masked argmax at every position, equal to constrained greedy decoding.
        """
        width = max(r.token_bitmask.shape[-1] for r in sampled if r.token_bitmask is not None)
        rows = torch.full((len(sampled), cols, width), -1, dtype=torch.int32)
        for i, r in enumerate(sampled):
            m = r.token_bitmask
            if m is None:
                continue
            m = m.view(-1, m.shape[-1])[:cols]
            rows[i, : m.shape[0], : m.shape[1]] = m
        return rows.view(len(sampled) * cols, width).to(self.device, non_blocking=True)

    def _captured_draft_len(self, k: int) -> bool:
        """Whether graphs exist for ``k`` drafts (every planned length, without captured graphs:
        the padding logic runs the same)."""
        runner = self.graph_runner
        return runner is None or k in runner.draft_lens

    def scan_sampling_path(self, meta: SpecMetadata, local_all_greedy: bool) -> None:
        """The step's sampling path, before anything (the CUDA-graph key included) reads it:
        clear last step's group value, pre-scan locally, and under ADP + LM-head TP + rejection
        sampling AND the flags over the TP group (the greedy and advanced draft paths run
        different collectives, so every rank must take the same one)."""
        spec = self.spec
        assert spec is not None
        meta.reset_group_flag()
        meta.is_all_greedy_sample = local_all_greedy
        if spec.lm_head_tp and meta.use_rejection_sampling:
            meta.group_all_greedy_sample = all_ranks_true(
                local_all_greedy, spec.mapping, self.device
            )

    def _execute_spec(
        self,
        inp: PreparedInputs,
        hidden: torch.Tensor,
        captured: list[torch.Tensor],
        scanned: bool = False,
        replay: StepReplay | None = None,
        propose_drafts: bool = True,
        num_draft_steps: int | None = None,
    ) -> StepOutput:
        spec = self.spec
        assert spec is not None
        # A paused step keeps its draft-KV rows for later (``stash_step_kv``): no draft input.
        defer = not propose_drafts and bool(inp.sampled) and spec.defers_step_kv(inp.meta)
        draft_hidden = hidden
        if captured and not defer:
            draft_hidden = spec.draft.combine_hidden(captured)
        if not inp.sampled:
            # Chunks that stop mid-prompt: step 0 still writes the draft KV of every row.
            assert inp.next_tokens is not None
            step_tokens = torch.roll(inp.input_ids, -1)
            step_tokens[inp.meta.query_start_loc[1:].long() - 1] = inp.next_tokens
            spec.write_prompt_kv(inp, step_tokens, draft_hidden)
            return StepOutput([], [], [])
        layout = inp.layout
        assert layout is not None and inp.next_tokens is not None
        b, k1 = layout.rows.shape
        # Logits only for the columns some request's drafts reach: the rest repeat a row
        # (no drafts at all in a paused step: one row per request, not K + 1).
        cols = 1 + max(r.num_drafts for r in inp.sampled)
        if defer and cols == 1:
            # Paused, with nothing to verify: plain decoding's sampling (each request's one
            # row), its draft-KV rows kept.
            out, ids = self._sample_last_rows(inp, hidden)
            request_ids = out.request_ids
            tokens = ids.view(b, 1).expand(b, k1)
            num_accepted = torch.zeros(b, dtype=torch.long, device=ids.device)
            args = (layout, num_accepted, tokens, request_ids)
            spec.stash_step_kv(inp, captured or [hidden], bool(captured), *args)
            spec.forget(request_ids)
            return dataclasses.replace(
                out, num_drafts=[0] * b, draft_token_ids=[[] for _ in range(b)]
            )
        st = self.sampling_tensors(inp.sampled)
        meta = self.spec_meta
        assert meta is not None
        if scanned:  # a rescan: the group value (if any) still decides
            meta.is_all_greedy_sample = st.all_greedy
        else:
            self.scan_sampling_path(meta, st.all_greedy)
        rows = layout.rows[:, :cols].reshape(-1)
        logits = self.model.compute_logits(hidden[rows]).float().view(b, cols, -1)
        if any(r.token_bitmask is not None for r in inp.sampled):
            # Structured output: every verified position's target logits are masked with the
            # grammar's state after the drafts before it (see ``_bitmask``).
            masks = self._bitmask(inp.sampled, cols)
            logits = apply_token_bitmask(logits.view(b * cols, -1), masks).view(b, cols, -1)
        request_ids = [r.request_id for r in inp.sampled]
        num_accepted, tokens = spec.verify(logits, layout, st, meta, request_ids)
        if not propose_drafts:
            if defer:
                features = captured or [hidden]
                args = (layout, num_accepted, tokens, request_ids)
                spec.stash_step_kv(inp, features, bool(captured), *args)
            else:
                spec.write_step_kv(inp, draft_hidden, layout, num_accepted, tokens)
            new_drafts = tokens.new_empty((b, 0))
            spec.forget(request_ids)
        else:
            args = (inp, inp.input_ids, inp.positions, inp.meta, draft_hidden, inp.next_tokens)
            args += (layout, num_accepted, tokens, st, meta, request_ids)
            masker = None
            if self.grammars is not None:
                masker = self.grammars.masker(inp.sampled, num_accepted, tokens)
            if masker is None:
                # A min_tokens ban, a bias or a penalty is eager work too (the captured draft
                # loop has none).
                eager = replay is None or st.stop_ban is not None or st.adjusts_logits
                eager = eager or spec.draft is None  # drafts from the engine: nothing to run
                if eager:
                    new_drafts = spec.propose(*args, steps=num_draft_steps)
                else:
                    new_drafts = replay.propose(*args)
            else:
                # Masked drafting (structured output): the hook reads tensors on the host, so
                # the draft loop runs eagerly even after a replayed target forward.
                try:
                    new_drafts = spec.propose(*args, draft_mask=masker, steps=num_draft_steps)
                finally:
                    masker.close()
        n_new = new_drafts.shape[1]
        with_parents = isinstance(spec, TreeDecoder) and n_new > 0
        if with_parents:
            # Draft trees: the nodes' parents travel with their tokens (constrained requests'
            # grammar masks follow each node's path).
            new_drafts = torch.cat([new_drafts, spec.last_parents.to(new_drafts.dtype)], dim=1)
        confident = n_new > 0 and propose_drafts and spec.last_confidence is not None
        if confident:
            # confidence_threshold: each request's count of drafts to verify travels with them.
            kept = spec.confident_drafts()
            new_drafts = torch.cat([new_drafts, kept[:, None].to(new_drafts.dtype)], dim=1)
        lp = None
        if st.max_num_logprobs > 0:
            full = widen_columns(logits, k1).reshape(b * k1, -1)
            lp = compute_logprobs(full, tokens.view(-1), st.max_num_logprobs)
        # The step's one host sync.
        if lp is None:
            acc_rows, toks, drafts = host_rows(num_accepted, tokens, new_drafts)
        else:
            acc_rows, toks, drafts, chosen, top_ids_flat, top_lp_flat = host_rows(
                num_accepted, tokens, new_drafts, lp[0].view(b, k1), lp[1].view(b, k1, -1),
                lp[2].view(b, k1, -1),
            )  # fmt: skip
            n_top = lp[1].shape[-1]
            top_ids = [[r[j * n_top : (j + 1) * n_top] for j in range(k1)] for r in top_ids_flat]
            top_lp = [[r[j * n_top : (j + 1) * n_top] for j in range(k1)] for r in top_lp_flat]
        acc = [row[0] for row in acc_rows]
        logprobs: list[list[TokenLogprobs] | None] = [None] * b
        if lp is not None:
            for i, r in enumerate(inp.sampled):
                n = r.params.logprobs
                if n is not None:
                    logprobs[i] = [
                        TokenLogprobs(toks[i][j], chosen[i][j], top_ids[i][j][:n], top_lp[i][j][:n])
                        for j in range(acc[i] + 1)
                    ]
        return StepOutput(
            request_ids,
            [toks[i][: acc[i] + 1] for i in range(b)],
            logprobs,
            num_drafts=[r.num_drafts for r in inp.sampled],
            draft_token_ids=[row[: row[n_new] if confident else n_new] for row in drafts],
            draft_parents=[row[n_new:] for row in drafts] if with_parents else [],
        )
