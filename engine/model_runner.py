"""Turns one scheduled step into tensors, runs the forward and samples.

The runner is rank-local: it owns the model, the KV cache tensors and the per-request random
generators, and it receives plain, picklable step descriptions (``StepInput``) so that the same
code serves one in-process rank or N rank processes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from engine.request import TokenLogprobs
from engine.sampler import RowSamplingInfo, SamplingTensors, sample
from engine.sampling_params import SamplingParams
from kernels.paged_attention import build_attention_plan
from models.attention import AttentionMetadata


@dataclass
class RequestStep:
    """One request's share of a step."""

    request_id: str
    token_ids: list[int]  # tokens fed this step (their KV gets written)
    start: int  # position of token_ids[0]
    block_ids: list[int]
    sample: bool  # the last row's logits are sampled
    params: SamplingParams | None = None  # set when sample
    prompt_token_ids: list[int] = field(default_factory=list)  # only when penalties are used
    output_token_ids: list[int] = field(default_factory=list)


@dataclass
class StepInput:
    requests: list[RequestStep]
    finished_request_ids: list[str] = field(default_factory=list)


@dataclass
class StepOutput:
    request_ids: list[str]  # the sampled requests, in step order
    token_ids: list[int]
    logprobs: list[TokenLogprobs | None]


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # rows whose logits are sampled
    sampled: list[RequestStep]


class ModelRunner:
    def __init__(self, model: nn.Module, device: torch.device, block_size: int, seed: int) -> None:
        self.model = model
        self.device = device
        self.block_size = block_size
        self.vocab_size = int(model.config.vocab_size)
        self.generators: dict[str, torch.Generator] = {}
        self.kv_caches: list[tuple[torch.Tensor, torch.Tensor]] = []
        torch.manual_seed(seed)

    # ---------------------------------------------------------------- KV cache

    def kv_bytes_per_block(self, dtype: torch.dtype) -> int:
        layers = self.model.attention_layers()
        elem = torch.empty(0, dtype=dtype).element_size()
        return sum(2 * self.block_size * a.num_kv_heads * a.head_dim * elem for a in layers)

    def allocate_kv_cache(self, num_blocks: int, dtype: torch.dtype) -> None:
        self.kv_caches = []
        for attn in self.model.attention_layers():
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
            plan = build_attention_plan(block_tables, seq_lens_t, qsl_t, bs, max_q, max_s)
        meta = AttentionMetadata(
            slot_mapping=t(slots, torch.int64),
            block_tables=block_tables,
            seq_lens=seq_lens_t,
            query_start_loc=qsl_t,
            max_query_len=max_q,
            max_seq_len=max_s,
            plan=plan,
        )
        return PreparedInputs(
            t(ids, torch.int64),
            t(positions, torch.int64),
            meta,
            t(logits_indices, torch.int64),
            sampled,
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
        if not step.requests:
            return StepOutput([], [], [])
        inp = self.prepare(step)
        hidden, _ = self.model(inp.input_ids, inp.positions, inp.meta)
        if not inp.sampled:
            return StepOutput([], [], [])
        logits = self.model.compute_logits(hidden[inp.logits_indices]).float()
        out = sample(logits, self.sampling_tensors(inp.sampled))
        token_ids = out.token_ids.tolist()  # the step's one host sync
        logprobs: list[TokenLogprobs | None] = [None] * len(token_ids)
        if out.logprobs is not None:
            chosen = out.logprobs.tolist()
            top_ids = out.topk_ids.tolist()
            top_lp = out.topk_logprobs.tolist()
            for i, r in enumerate(inp.sampled):
                n = r.params.logprobs
                if n is not None:
                    logprobs[i] = TokenLogprobs(
                        token_ids[i], chosen[i], top_ids[i][:n], top_lp[i][:n]
                    )
        return StepOutput([r.request_id for r in inp.sampled], token_ids, logprobs)
