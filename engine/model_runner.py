"""Turns one scheduled step into tensors, runs the forward and samples (or verifies and drafts).

The runner is rank-local: it owns the model, the draft head, the KV cache tensors and the
per-request random generators, and it receives plain, picklable step descriptions
(``StepInput``) so that the same code serves one in-process rank or N rank processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.request import TokenLogprobs
from engine.sampler import RowSamplingInfo, SamplingTensors, compute_logprobs, sample
from engine.sampling_params import SamplingParams
from engine.speculative.decoder import SpecDecoder, VerifyLayout
from engine.speculative.interface import SpecMetadata
from kernels.paged_attention import build_attention_plan
from models.attention import AttentionMetadata


@dataclass
class RequestStep:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # tokens fed this step (their KV gets written); drafts come last
    start: int  # position of token_ids[0]
    block_ids: list[int]
    sample: bool  # the step reaches the end of the request's tokens: its last rows are sampled
    params: SamplingParams | None = None  # set when sample
    prompt_token_ids: list[int] = field(default_factory=list)  # only when penalties are used
    output_token_ids: list[int] = field(default_factory=list)
    num_drafts: int = 0  # the last num_drafts entries of token_ids are drafts to verify
    next_token: int = 0  # speculation: the prompt token after a chunk that stops mid-prompt


@dataclass
class StepInput:
    requests: list[RequestStep]
    finished_request_ids: list[str] = field(default_factory=list)


@dataclass
class StepOutput:
    request_ids: list[str]  # the sampled requests, in step order
    token_ids: list[list[int]]  # emitted tokens per request (1 without speculation)
    logprobs: list[list[TokenLogprobs] | None]
    num_drafts: list[int] = field(default_factory=list)  # drafts verified per request
    draft_token_ids: list[list[int]] = field(default_factory=list)  # proposals for next step


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last row of each sampled request
    sampled: list[RequestStep]
    layout: VerifyLayout | None = None
    next_tokens: torch.Tensor | None = None


class ModelRunner:
    def __init__(
        self,
        model: nn.Module,
        device: torch.device,
        block_size: int,
        seed: int,
        spec: SpecDecoder | None = None,
        capture_layers: tuple[int, ...] = (),
    ) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = int(model.config.vocab_size)
        self.spec = spec
        self.capture_layers = capture_layers
        self.k = spec.k if spec is not None else 0
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        torch.manual_seed(seed)

    # ---------------------------------------------------------------- KV cache

    def attention_layers(self) -> list[Any]:
        layers = list(self.model.attention_layers())
        if self.spec is not None:
            layers += self.spec.draft.attention_layers()
        return layers

    def kv_bytes_per_block(self, dtype: torch.dtype) -> int:
        elem = torch.empty(0, dtype=dtype).element_size()
        return sum(
            2 * self.block_size * a.num_kv_heads * a.head_dim * elem
            for a in self.attention_layers()
        )

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        """One K and one V tensor per attention layer (target, then draft layers)."""
        self.kv_caches = []
        for attn in self.attention_layers():
            shape = (num_blocks, self.block_size, attn.num_kv_heads, attn.head_dim)
            k = torch.zeros(shape, dtype=dtype, device=self.device)
            v = torch.zeros(shape, dtype=dtype, device=self.device)
            attn.k_cache, attn.v_cache = k, v
            self.kv_caches.append((k, v))

    # ---------------------------------------------------------------- inputs

    def prepare(self, step: StepInput) -> PreparedInputs:
        bs = self.block_size
        ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        seq_lens: list[int] = []
        qsl = [0]
        logits_indices: list[int] = []
        sampled: list[RequestStep] = []
        next_tokens: list[int] = []
        max_blocks = max(len(r.block_ids) for r in step.requests)
        tables: list[list[int]] = []
        for r in step.requests:
            n = len(r.token_ids)
            ids.extend(r.token_ids)
            pos = range(r.start, r.start + n)
            positions.extend(pos)
            blocks = r.block_ids
            slots.extend(blocks[p // bs] * bs + p % bs for p in pos)
            seq_lens.append(r.start + n)
            qsl.append(qsl[-1] + n)
            tables.append(blocks + [0] * (max_blocks - len(blocks)))
            next_tokens.append(r.next_token)
            if r.sample:
                logits_indices.append(qsl[-1] - 1)
                sampled.append(r)

        dev = self.device

        def t(x: list[Any], dtype: torch.dtype) -> torch.Tensor:
            return torch.tensor(x, dtype=dtype).to(dev, non_blocking=True)

        block_tables = t(tables, torch.int32)
        seq_lens_t = t(seq_lens, torch.int32)
        qsl_t = t(qsl, torch.int32)
        max_q = max(qsl[i + 1] - qsl[i] for i in range(len(seq_lens)))
        max_s = max(seq_lens)
        plan = None
        if dev.type == "cpu":
            plan = build_attention_plan(
                block_tables, seq_lens_t, qsl_t, bs, max_q, max_s, num_tokens=len(ids)
            )
        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            block_tables=block_tables,
            seq_lens=seq_lens_t,
            query_start_loc=qsl_t,
            max_query_len=max_q,
            max_seq_len=max_s,
            plan=plan,
        )
        inp = PreparedInputs(
            t(ids, torch.int64),
            t(positions, torch.int64),
            meta,
            t(logits_indices, torch.int64),
            sampled,
        )
        if self.spec is not None:
            inp.next_tokens = t(next_tokens, torch.int64)
            if sampled:
                inp.layout = self._verify_layout(step, sampled, tables, max_s, t)
        return inp

    def _verify_layout(
        self,
        step: StepInput,
        sampled: list[RequestStep],
        tables: list[list[int]],
        max_s: int,
        t: Any,
    ) -> VerifyLayout:
        k = self.k
        rows, drafts, num_drafts, first_rows, first_pos, sampled_tables = [], [], [], [], [], []
        owner: list[int] = []
        offset = 0
        for i, r in enumerate(step.requests):
            n = len(r.token_ids)
            owner += [len(rows) if r.sample else -1] * n
            if r.sample:
                first = offset + n - 1 - r.num_drafts
                rows.append([first + min(j, r.num_drafts) for j in range(k + 1)])
                d = r.token_ids[n - r.num_drafts :] if r.num_drafts else []
                drafts.append(d + [0] * (k - len(d)))
                num_drafts.append(r.num_drafts)
                first_rows.append(first)
                first_pos.append(r.start + n - 1 - r.num_drafts)
                sampled_tables.append(tables[i])
            offset += n
        return VerifyLayout(
            rows=t(rows, torch.int64),
            drafts=t(drafts, torch.int64),
            num_drafts=t(num_drafts, torch.int64),
            first_row=t(first_rows, torch.int64),
            positions=t(first_pos, torch.int64),
            block_tables=t(sampled_tables, torch.int32),
            row_owner=t(owner, torch.int64),
            max_seq_len=max_s + k,
        )

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
                )
            )
        return SamplingTensors.from_params(rows, self.vocab_size, self.device)

    # ---------------------------------------------------------------- step

    @torch.inference_mode()
    def execute(self, step: StepInput) -> StepOutput:
        for rid in step.finished_request_ids:
            self.generators.pop(rid, None)
        if self.spec is not None:
            self.spec.forget(step.finished_request_ids)
        if not step.requests:
            return StepOutput([], [], [])
        inp = self.prepare(step)
        hidden, captured = self.model(
            inp.input_ids, inp.positions, inp.meta, capture_layers=self.capture_layers
        )
        if self.spec is not None:
            return self._execute_spec(inp, hidden, captured)
        if not inp.sampled:
            return StepOutput([], [], [])
        logits = self.model.compute_logits(hidden[inp.logits_indices]).float()
        out = sample(logits, self.sampling_tensors(inp.sampled))
        token_ids = out.token_ids.tolist()  # the step's one host sync
        logprobs: list[list[TokenLogprobs] | None] = [None] * len(token_ids)
        if out.logprobs is not None:
            chosen = out.logprobs.tolist()
            top_ids = out.topk_ids.tolist()
            top_lp = out.topk_logprobs.tolist()
            for i, r in enumerate(inp.sampled):
                n = r.params.logprobs
                if n is not None:
                    logprobs[i] = [
                        TokenLogprobs(token_ids[i], chosen[i], top_ids[i][:n], top_lp[i][:n])
                    ]
        return StepOutput([r.request_id for r in inp.sampled], [[t] for t in token_ids], logprobs)

    def _execute_spec(
        self, inp: PreparedInputs, hidden: torch.Tensor, captured: list[torch.Tensor]
    ) -> StepOutput:
        spec = self.spec
        assert spec is not None
        draft_hidden = spec.draft.combine_hidden(captured) if captured else hidden
        if not inp.sampled:
            # Chunks that stop mid-prompt: step 0 still writes the draft KV of every row.
            assert inp.next_tokens is not None
            step_tokens = torch.roll(inp.input_ids, -1)
            step_tokens[inp.meta.query_start_loc[1:].long() - 1] = inp.next_tokens
            spec.draft(0, inp.positions, step_tokens, draft_hidden, inp.meta)
            return StepOutput([], [], [])
        layout = inp.layout
        assert layout is not None and inp.next_tokens is not None
        st = self.sampling_tensors(inp.sampled)
        meta = SpecMetadata(spec.k, spec.config.use_rejection_sampling)
        meta.is_all_greedy_sample = st.all_greedy
        b, k1 = layout.rows.shape
        logits = self.model.compute_logits(hidden[layout.rows.view(-1)]).float().view(b, k1, -1)
        request_ids = [r.request_id for r in inp.sampled]
        num_accepted, tokens = spec.verify(logits, layout, st, meta, request_ids)
        new_drafts = spec.propose(
            inp.input_ids,
            inp.positions,
            inp.meta,
            draft_hidden,
            inp.next_tokens,
            layout,
            num_accepted,
            tokens,
            st,
            meta,
            request_ids,
        )
        lp = None
        if st.max_num_logprobs > 0:
            lp = compute_logprobs(logits.view(b * k1, -1), tokens.view(-1), st.max_num_logprobs)
        # The step's one host sync.
        acc = num_accepted.tolist()
        toks = tokens.tolist()
        drafts = new_drafts.tolist()
        logprobs: list[list[TokenLogprobs] | None] = [None] * b
        if lp is not None:
            chosen = lp[0].view(b, k1).tolist()
            top_ids = lp[1].view(b, k1, -1).tolist()
            top_lp = lp[2].view(b, k1, -1).tolist()
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
            draft_token_ids=drafts,
        )
