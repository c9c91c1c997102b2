"""What one engine step is made of, shared by the engine, the ranks, the model runner and the
captured graphs: the picklable step description (``StepInput`` of ``RequestStep``s; one per rank
under attention DP), its result (``StepOutput``), the tensors a prepared step holds
(``PreparedInputs``) and what the runner needs of captured graphs (``StepGraphs``, ``StepReplay``).
``graph_runner`` drives ``model_runner``; neither imports the other for these types.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Protocol

import torch

from tandem.engine.cuda_graph import GraphKey
from tandem.engine.request import TokenLogprobs
from tandem.engine.sampler import SamplingTensors
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.speculative.interface import SpecMetadata, VerifyLayout
from tandem.engine.structured_output import StructuredSpec
from tandem.models.attention import AttentionMetadata
from tandem.models.moe import EplbStats


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
    # Output tokens from index output_offset on (None: none sent): all of them for penalties;
    # for a constrained request's masked drafting, those the ranks have not had yet (each rank
    # keeps its copy, and its matcher follows it).
    output_token_ids: list[int] = field(default_factory=list)
    output_offset: int | None = None
    num_drafts: int = 0  # the last num_drafts entries of token_ids are drafts to verify
    next_token: int = 0  # speculation: the prompt token after a chunk that stops mid-prompt
    # Vanilla MTP: the prompt tokens after next_token (layer k of the draft reads k + 1 ahead).
    future_tokens: list[int] = field(default_factory=list)
    # Structured output: the tokens the grammar allows next, [ceil(V / 32)] int32 bits (None:
    # unconstrained). Set only when sample. Speculative decoding: [num_drafts + 1, ceil(V / 32)],
    # row j for verified position j (the grammar after the first j drafts).
    token_bitmask: torch.Tensor | None = None
    # Draft trees: verify only the nodes at most this deep (the tokens left before max_tokens or
    # max_model_len); None: every node.
    max_draft_depth: int | None = None
    # Draft trees the engine proposes (method "suffix"): each draft's parent (its index among
    # the drafts, -1: the root), parents first; [] otherwise.
    draft_parents: list[int] = field(default_factory=list)
    # The window group's blocks (engine/block_manager.py), one per entry of block_ids; empty
    # when the model has no sliding-window layers.
    window_block_ids: list[int] = field(default_factory=list)
    # min_tokens: the next min_tokens_left tokens (verified positions and drafts) may not be
    # one of stop_token_ids (EOS unless ignore_eos, and the request's stop_token_ids).
    min_tokens_left: int = 0
    stop_token_ids: tuple[int, ...] = ()


@dataclass
class StepInput:
    requests: list[RequestStep]
    finished_request_ids: list[str] = field(default_factory=list)
    # Speculation: False when the step is too large to speculate for (``disable_by_batch_size``):
    # it verifies the drafts it carries and proposes none (the draft layers still write KV).
    propose_drafts: bool = True
    # Draft steps this step runs (``num_speculative_tokens`` schedule; None: K).
    num_draft_steps: int | None = None
    # Masked drafting: the grammars of constrained requests that arrived since the last step,
    # for the ranks to compile off the step (the engine schedules them once it compiled its own).
    grammars: list[StructuredSpec] = field(default_factory=list)
    # Disaggregated serving (engine/kv_transfer.py): hand-overs to offer (request id, transfer
    # id, blocks), pulls to start (request id, the prefill instance's rank addresses, the one
    # to pull from: -1 this rank's index, transfer id, blocks) on the ranks this entry is for;
    # and on every rank, the offers and pulls the engine waits on with the rank that holds each
    # (-1: every rank, tensor parallelism).
    kv_offers: list[tuple[str, int, list[int]]] = field(default_factory=list)
    kv_pulls: list[tuple[str, list[str], int, int, list[int]]] = field(default_factory=list)
    kv_pending: list[tuple[int, int]] = field(default_factory=list)
    kv_pulling: list[tuple[str, int]] = field(default_factory=list)


OTHER_RANK_FAILED = "another rank's pull failed"


@dataclass
class StepOutput:
    request_ids: list[str]  # the sampled requests, in step order
    token_ids: list[list[int]]  # emitted tokens per request (1 without speculation)
    logprobs: list[list[TokenLogprobs] | None]
    num_drafts: list[int] = field(default_factory=list)  # drafts verified per request
    draft_token_ids: list[list[int]] = field(default_factory=list)  # proposals for next step
    # Draft trees: each proposal's parents (index of its parent node, -1: the root), for the
    # grammar masks of constrained requests' tree nodes.
    draft_parents: list[list[int]] = field(default_factory=list)
    # Attention DP: per rank (rank order once merged), whether the draft loop sampled
    # (advanced) and the step's graph key (None: eager).
    rank_paths: list[tuple[bool, GraphKey | None]] = field(default_factory=list)
    eplb: EplbStats | None = None  # expert load balancing so far (every rank has the same)
    # Disaggregated serving: offers every rank has ended (their blocks may be freed), and pulls
    # every rank has ended (request id, None or the error).
    kv_released: list[int] = field(default_factory=list)
    kv_pulled: list[tuple[str, str | None]] = field(default_factory=list)


@dataclass
class DPStepInput:
    """Attention DP: every rank's ``StepInput`` (index = rank). Every rank receives all of them,
    so the per-rank row counts the MLP collectives need are host data known everywhere."""

    steps: list[StepInput]


# Dummy greedy generation requests on reserved KV blocks keep an idle rank (or one without a
# sampled request) in step with the others' collectives, and pad batches to a graph bucket.
# Never reported, never counted in statistics.
ADP_DUMMY_REQUEST_ID = "__adp_dummy__"
DUMMY_PARAMS = SamplingParams(temperature=0.0, max_tokens=1)


def num_dummy_blocks(block_size: int, kv_lookahead: int) -> int:
    """KV blocks reserved for the dummy request: its token plus a step's KV look-ahead
    (``SpeculativeConfig.kv_lookahead``: 2K for a chain, more for a tree; 0 without
    speculation), and one slot of slack."""
    return -(-(kv_lookahead + 2) // block_size)


def adp_pad_steps(steps: list[StepInput], dummy: RequestStep) -> list[StepInput]:
    """When any rank has work, every rank without a sampled request gets ``dummy``, so every rank
    runs the target forward, the verify and the whole draft loop (same collectives)."""
    if not any(s.requests for s in steps):
        return steps
    return [
        s
        if any(r.sample for r in s.requests)
        else dataclasses.replace(s, requests=[*s.requests, dummy])
        for s in steps
    ]


def is_dummy(request_id: str) -> bool:
    return request_id.startswith(ADP_DUMMY_REQUEST_ID)


def drop_dummy(out: StepOutput) -> StepOutput:
    keep = [i for i, rid in enumerate(out.request_ids) if not is_dummy(rid)]
    if len(keep) == len(out.request_ids):
        return out
    return StepOutput(
        [out.request_ids[i] for i in keep],
        [out.token_ids[i] for i in keep],
        [out.logprobs[i] for i in keep],
        [out.num_drafts[i] for i in keep] if out.num_drafts else [],
        [out.draft_token_ids[i] for i in keep] if out.draft_token_ids else [],
        [out.draft_parents[i] for i in keep] if out.draft_parents else [],
        out.rank_paths,
        out.eplb,
    )


def merge_outputs(outputs: list[StepOutput]) -> StepOutput:
    """Every rank's output, in rank order (attention DP)."""
    merged = StepOutput([], [], [])
    for o in outputs:
        merged.request_ids += o.request_ids
        merged.token_ids += o.token_ids
        merged.logprobs += o.logprobs
        merged.num_drafts += o.num_drafts
        merged.draft_token_ids += o.draft_token_ids
        merged.draft_parents += o.draft_parents
        merged.rank_paths += o.rank_paths
        merged.eplb = merged.eplb or o.eplb
    # Every rank reports the same ended transfers; a failed pull's reason is its holder's.
    merged.kv_released = outputs[0].kv_released if outputs else []
    pulled: dict[str, str | None] = {}
    for o in outputs:
        for rid, error in o.kv_pulled:
            if rid not in pulled or pulled[rid] == OTHER_RANK_FAILED:
                pulled[rid] = error
    merged.kv_pulled = list(pulled.items())
    return merged


@dataclass
class PreparedInputs:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: AttentionMetadata
    logits_indices: torch.Tensor  # last row of each sampled request
    sampled: list[RequestStep]
    layout: VerifyLayout | None = None
    next_tokens: torch.Tensor | None = None
    future: torch.Tensor | None = None  # [S, K + 1] tokens after each request's last row
    row_req: torch.Tensor | None = None  # [T] request index of each row
    row_last: torch.Tensor | None = None  # [T] last row of the row's request
    # Draft trees: the target forward's (positions [T], metadata with the tree mask) where they
    # differ from the rows' chain positions and causal metadata (which the draft's step 0 reads).
    target: tuple[torch.Tensor, AttentionMetadata] | None = None


class StepReplay(Protocol):
    """One step's captured graphs: stand-ins for the target forward and for the draft loop
    (``SpecDecoder.propose``'s signature and results)."""

    def forward(self) -> tuple[torch.Tensor, list[torch.Tensor]]: ...

    def propose(
        self,
        inp: PreparedInputs,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        target_meta: AttentionMetadata,
        draft_hidden: torch.Tensor,
        next_tokens: torch.Tensor,
        layout: VerifyLayout,
        num_accepted: torch.Tensor,
        tokens: torch.Tensor,
        st: SamplingTensors,
        meta: SpecMetadata,
        request_ids: list[str],
    ) -> torch.Tensor: ...


class StepGraphs(Protocol):
    """The captured graphs of every key (``graph_runner.GraphRunner``)."""

    def bind(self, key: GraphKey, inp: PreparedInputs) -> StepReplay | None: ...
