"""The engine loop: schedule, run, process outputs — one ``step()`` at a time."""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass
from typing import Any

from tandem.engine.block_manager import BlockManager
from tandem.engine.config import EngineArgs, EngineConfig
from tandem.engine.cuda_graph import GraphKey, graph_mode
from tandem.engine.detokenizer import Detokenizer
from tandem.engine.executor import Executor, make_executor
from tandem.engine.input_processor import ContextLengthExceededError, InputProcessor
from tandem.engine.outputs import CompletionOutput, EngineStats, RequestFailure, RequestOutput
from tandem.engine.request import Request, RequestStatus, SpecStats, TokenLogprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.scheduler import ScheduledRequest, Scheduler, SchedulerOutput
from tandem.engine.speculative.adaptive import (
    POSITION_COST,
    AdaptiveDepth,
    StepCosts,
    loop_depth,
)
from tandem.engine.speculative.ngram import NgramProposer, pad_drafts
from tandem.engine.speculative.suffix import SuffixProposer, pad_tree
from tandem.engine.speculative.tree import verified_nodes
from tandem.engine.step import DPStepInput, RequestStep, StepInput, StepOutput, num_dummy_blocks
from tandem.engine.structured_output import (
    GrammarFailure,
    StepMasks,
    StructuredOutputManager,
    StructuredSpec,
)
from tandem.engine.tokenizer import load_generation_config, load_tokenizer, model_eos_token_ids
from tandem.models.moe import EplbStats

logger = logging.getLogger(__name__)

__all__ = ["LLMEngine", "ContextLengthExceededError"]


# While only transfers are in flight, the loop polls pulls this often, and held offers (whose
# only news is that their blocks may be freed) this often.
KV_POLL_S = 0.005
KV_RELEASE_POLL_S = 0.05


@dataclass
class _Pull:
    """A decode instance's pull in progress (``aborted``: free its blocks when it ends)."""

    request: Request
    rank: int
    aborted: bool = False


class LLMEngine:
    def __init__(self, config: EngineConfig, executor: Executor | None = None) -> None:
        self.config = config
        mc = config.model_config
        self.tokenizer = load_tokenizer(mc.tokenizer)
        # Sampling defaults (--generation-config): the model folder's file, another folder's, or
        # none; end-of-sequence ids always come from the model folder.
        folder = mc.generation_config
        self.generation_config = load_generation_config(folder) if folder is not None else {}
        self.eos_token_ids = model_eos_token_ids(mc, self.tokenizer)
        self.executor = executor or make_executor(config)
        # --max-model-len auto: the length rank 0's worker fitted to the agreed KV block count.
        fitted = getattr(self.executor.worker, "max_model_len", mc.max_model_len)
        config = self.config = config.with_max_model_len(fitted)
        mc = config.model_config
        cc = config.cache_config
        sc = config.speculative_config
        self.num_spec_tokens = sc.num_speculative_tokens if sc is not None else 0
        lookahead = sc.kv_lookahead if sc is not None else 0
        self.vanilla_mtp = sc is not None and sc.method == "mtp" and sc.mtp_mode == "vanilla"
        self.tree_drafts = sc is not None and sc.is_tree
        self.disable_spec_at = sc.disable_by_batch_size if sc is not None else None
        # N-gram drafting: proposed here, from each request's own tokens, after the step's
        # tokens are read (the ranks only verify).
        self.ngram = (
            NgramProposer(sc.prompt_lookup_min, sc.prompt_lookup_max)
            if sc is not None and sc.method == "ngram"
            else None
        )
        # Suffix decoding: draft trees proposed here as well, from counts over each request's
        # text and recent outputs (engine/speculative/suffix.py).
        self.suffix = (
            SuffixProposer(
                sc.num_speculative_tokens,
                sc.suffix_max_tree_nodes,
                sc.suffix_min_probability,
                sc.suffix_max_spec_factor,
                sc.suffix_max_match_length,
                sc.suffix_max_cached_requests,
            )
            if sc is not None and sc.method == "suffix"
            else None
        )
        # Captured steps have K drafts per request (GraphKey): with graphs, n-gram drafts shorter
        # than K are padded (verified like any draft; at most one more forward row each).
        self.pad_ngram = graph_mode(config.device, config.graph_config.enforce_eager) is not None
        pc = config.parallel_config
        # Attention DP: every rank owns its requests and KV cache, so one scheduler and block
        # manager per rank; the last blocks of each rank's cache are kept for the dummy request.
        self.dp_size = pc.tensor_parallel_size if pc.enable_attention_dp else 1
        num_blocks = self.executor.num_blocks
        window_num_blocks = self.executor.window_num_blocks
        # Graph padding also runs dummy requests on those blocks.
        if self.dp_size > 1 or graph_mode(config.device, config.graph_config.enforce_eager):
            num_blocks -= num_dummy_blocks(cc.block_size, lookahead)
            if window_num_blocks:
                window_num_blocks -= num_dummy_blocks(cc.block_size, lookahead)
        # A draft head's KV in a block's last slots is computed from the tokens after it: one
        # (Eagle3, MTP), or K (vanilla MTP's K layers); the block's hash covers them. N-gram
        # drafting keeps no draft KV.
        # A draft model's KV at a position depends on the tokens up to it only.
        follow = 0 if sc is None or sc.method in ("ngram", "draft_model", "suffix") else 1
        follow = self.num_spec_tokens if self.vanilla_mtp else follow
        self.block_managers = [
            BlockManager(
                num_blocks,
                cc.block_size,
                cc.enable_prefix_caching,
                follow,
                self.executor.window,
                window_num_blocks,
            )
            for _ in range(self.dp_size)
        ]
        self.schedulers = [
            Scheduler(config.scheduler_config, bm, lookahead=lookahead)
            for bm in self.block_managers
        ]
        self.block_manager = self.block_managers[0]
        self.scheduler = self.schedulers[0]
        self.rank_of: dict[str, int] = {}  # request id → the DP rank that owns it
        # Disaggregated serving (--role; engine/kv_transfer.py): the ranks move the KV; the
        # engine says what to offer and pull (StepInput.kv_*) and hears what ended.
        kc = config.kv_transfer_config
        self.kv_role = kc.role if kc is not None else "both"
        if kc is not None and self.executor.window is not None:
            raise ValueError(f"kv_role={kc.role!r}: sliding-window layers' KV is not moved yet")
        worker = self.executor.worker
        self.kv_addresses: list[str] = list(getattr(worker, "kv_addresses", []))
        kv = getattr(worker, "kv", None)
        self.kv_bytes_per_block = 0 if kv is None else kv.bytes_per_block * pc.tensor_parallel_size
        self.handovers: dict[int, tuple[Request, int]] = {}  # prefill: offers by transfer id
        self.new_offers: list[tuple[str, int, list[int]]] = []  # for the next step
        self.next_transfer_id = 1
        self.pulls: dict[str, _Pull] = {}  # decode: pulls in progress by request id
        self.new_pulls: list[tuple[str, list[str], int, list[int]]] = []  # for the next step
        self.waiting_pulls: list[Request] = []  # decode: waiting for blocks to pull into
        if self.kv_addresses:
            logger.info("prefill instance: KV transfers served at %s", ", ".join(self.kv_addresses))
        self.last_rank_paths: list[tuple[bool, GraphKey | None]] = []
        self.eplb = EplbStats()  # expert load balancing, as the ranks last reported it
        self.spec_stats = SpecStats()
        self.steps_by_draft_len: dict[int, int] = {}  # see EngineStats.spec_steps_by_draft_len
        # "adaptive": each request's draft length from its own acceptance; the draft loop's
        # length is any up to K, or where graphs run one they hold (K and the schedule's:
        # graph_runner.draft_lens_of).
        self.adaptive: dict[str, AdaptiveDepth] | None = (
            {} if sc is not None and sc.adaptive else None
        )
        # "cost_aware": steps timed, and no drafts where plain decoding measured faster. A step
        # is timed from its start to the next one's (its outputs, detokenizing, the caller's
        # loop: what a token costs besides the forward); (batch, K, decode, start).
        self.step_costs = StepCosts() if sc is not None and sc.cost_aware else None
        self.timed_step: tuple[int, int, bool, float] | None = None
        self.captured_draft_lens: tuple[int, ...] = ()
        if sc is not None and self.pad_ngram:
            ks = {sc.num_speculative_tokens} | {k for _, k in sc.draft_len_schedule if k}
            self.captured_draft_lens = tuple(sorted(ks))
        elif sc is not None:
            self.captured_draft_lens = tuple(range(1, sc.num_speculative_tokens + 1))
        self.constrained_drafts = self.constrained_accepted = 0  # grammar-constrained requests
        self.input_processor = InputProcessor(
            self.tokenizer,
            mc.vocab_size,
            mc.max_model_len,
            self.eos_token_ids,
            cc.block_size,
            num_blocks,
            lookahead=lookahead,
        )
        self.detok: dict[str, Detokenizer] = {}
        # The requests the current (or last) step scheduled; None until it has scheduled. The
        # engine process fails exactly these when a step raises.
        self.step_request_ids: list[str] | None = None
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        # Structured output: grammars compile off the loop; a request waits until its own is
        # ready. Requests that failed there (or whose grammar reached a dead end) are reported by
        # ``take_failed`` and never finish normally.
        self.structured = StructuredOutputManager(self.tokenizer, mc.vocab_size, self.eos_token_ids)
        # Offline requests are checked in this process: with the same compiler, once per grammar.
        # The callbacks hold the manager, not the engine: a cycle through the engine would keep
        # its model and KV cache alive after the last reference until a full collection.
        structured = self.structured
        self.input_processor.share_grammars(lambda: structured.compiler)
        grammars = self.executor.worker.runner.grammars
        if grammars is not None:
            # The rank in this process masks drafts with the engine's compiler (a request's
            # grammar is compiled before it is scheduled); rank processes build their own.
            grammars.use_compiler(lambda: structured.compiler)
        self.failed: list[RequestFailure] = []
        self.new_grammars: list[StructuredSpec] = []  # see _send_grammars
        self.bitmask_width = -(-max(mc.vocab_size, len(self.tokenizer)) // 32)

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> LLMEngine:
        return cls(args.create_engine_config())

    @property
    def max_model_len(self) -> int:
        return self.config.model_config.max_model_len

    # -------------------------------------------------------------- requests

    def make_request(
        self, request_id: str, prompt: str | list[int], params: SamplingParams
    ) -> Request:
        """Validate and build a request (raises ValueError with a message a user can act on)."""
        return self.input_processor.process(request_id, prompt, params)

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int] | Request,
        params: SamplingParams | None = None,
    ) -> Request:
        request = (
            prompt
            if isinstance(prompt, Request)
            else self.make_request(request_id, prompt, params or SamplingParams())
        )
        p = request.params
        rid = request.request_id
        if rid in self.rank_of or rid in self.structured.pending:
            raise ValueError(f"request id {rid!r} is already in use")
        if self._pulls_its_kv(request):
            self._check_handover(request)
        if p.detokenize:
            self.detok[rid] = Detokenizer(self.tokenizer, p.skip_special_tokens, p.stop_strings)
        if p.structured is not None:
            self.structured.submit(request)  # scheduled once its grammar is compiled
            if self.num_spec_tokens:  # the ranks compile it too, meanwhile (masked drafting)
                self.new_grammars.append(p.structured)
        else:
            self._schedule_request(request)
        return request

    def _pulls_its_kv(self, request: Request) -> bool:
        kv = request.params.kv_transfer
        return self.kv_role == "decode" and kv is not None and "transfer_id" in kv

    def _schedule_request(self, request: Request) -> None:
        if self._pulls_its_kv(request):
            self._start_pull(request)
            return
        rank = self._least_loaded_rank()
        self.schedulers[rank].add(request)
        self.rank_of[request.request_id] = rank
        self.prompt_tokens_total += request.num_prompt_tokens

    def _admit_compiled(self, wait_s: float = 0.0) -> None:
        """Schedule the requests whose grammar is compiled; fail those whose grammar failed."""
        ready, failed = self.structured.ready(wait_s)
        for request in ready:
            self._schedule_request(request)
        for request, message in failed:
            self._fail(request.request_id, message, request.params.structured.param)

    def _fail(self, request_id: str, message: str, param: str | None = None) -> None:
        """End a request with an error (``take_failed`` reports it); ``param``: the request field
        at fault (its grammar), None for a fault of the server's."""
        self.abort_request(request_id)
        self.failed.append(RequestFailure(request_id, message, param))

    def take_failed(self) -> list[RequestFailure]:
        """The requests that ended with an error since the last call."""
        failed, self.failed = self.failed, []
        return failed

    def _least_loaded_rank(self) -> int:
        """The DP rank with the fewest unfinished requests (lowest rank on ties)."""
        loads = [s.num_running + s.num_waiting for s in self.schedulers]
        return loads.index(min(loads))

    def abort_request(self, request_ids: str | list[str]) -> None:
        for rid in [request_ids] if isinstance(request_ids, str) else request_ids:
            if rid in self.pulls:  # its blocks are freed when the pull ends
                self.pulls[rid].aborted = True
                self.detok.pop(rid, None)
                self.structured.forget(rid)
                continue
            self.waiting_pulls = [r for r in self.waiting_pulls if r.request_id != rid]
            rank = self.rank_of.pop(rid, None)
            if rank is not None:
                self.schedulers[rank].abort(rid)
            self.detok.pop(rid, None)
            self.structured.forget(rid)
            if self.ngram is not None:
                self.ngram.forget(rid)
            if self.suffix is not None:
                self.suffix.forget(rid)
            if self.adaptive is not None:
                self.adaptive.pop(rid, None)

    def has_unfinished_requests(self) -> bool:
        """Requests in flight; under disaggregation also pulls in progress and hand-overs whose
        blocks are still held (the loop keeps polling them)."""
        return bool(
            self.structured.pending or self.pulls or self.waiting_pulls or self.handovers
        ) or any(s.has_unfinished() for s in self.schedulers)

    def reset_prefix_cache(self) -> None:
        """Forget every cached prompt block, on every DP rank."""
        for bm in self.block_managers:
            bm.reset_prefix_cache()

    # -------------------------------------------------------------- step

    def _step_input(
        self,
        scheduled: list[ScheduledRequest],
        finished: list[str],
        propose_drafts: bool = True,
        masks: dict[str, Any] | None = None,
    ) -> StepInput:
        steps = []
        for s in scheduled:
            r = s.request
            sample = s.samples
            bitmask = masks.get(r.request_id) if masks and sample else None
            # Masked drafting: each rank syncs its own matcher to the output tokens (matchers
            # cannot travel between processes); see engine/speculative/draft_grammar.py.
            grammar = bitmask is not None and propose_drafts and self.num_spec_tokens > 0
            pen = sample and r.params.uses_penalties
            offset, outputs = (0, r.output_token_ids) if pen else (None, [])
            if grammar and not pen:  # only what the ranks have not had yet
                offset = r.output_tokens_shipped
                outputs = r.output_token_ids[offset:]
            if grammar:
                r.output_tokens_shipped = len(r.output_token_ids)
            end = s.start + s.num_new_tokens - s.num_drafts
            tokens = r.all_token_ids[s.start : end]
            if s.num_drafts:
                tokens = tokens + r.spec_token_ids[: s.num_drafts]
            steps.append(
                RequestStep(
                    request_id=r.request_id,
                    token_ids=tokens,
                    start=s.start,
                    block_ids=list(r.block_ids),
                    window_block_ids=list(r.window_block_ids),
                    sample=sample,
                    params=r.params if sample else None,
                    prompt_token_ids=r.prompt_token_ids if pen else [],
                    output_token_ids=outputs,
                    output_offset=offset,
                    num_drafts=s.num_drafts,
                    next_token=r.all_token_ids[end] if end < r.num_tokens else 0,
                    future_tokens=(
                        r.all_token_ids[end + 1 : end + 1 + self.num_spec_tokens]
                        if self.vanilla_mtp and not sample
                        else []
                    ),
                    token_bitmask=bitmask,
                    max_draft_depth=r.spec_max_depth if s.num_drafts and self.tree_drafts else None,
                    draft_parents=r.spec_parents[: s.num_drafts] if self.suffix else [],
                    **self._min_tokens_ban(r, sample),
                )
            )
        return StepInput(steps, finished, propose_drafts)

    def step(self) -> list[RequestOutput]:
        """Run one engine step; returns an output for every request that advanced or finished."""
        self.step_request_ids = None
        step_start = time.perf_counter()
        if self.timed_step is not None and self.step_costs is not None:
            batch, k, decode, start = self.timed_step
            self.step_costs.record(batch, k, step_start - start, decode)
        self.timed_step = None
        if self.waiting_pulls:
            self._retry_waiting_pulls()
        if self.structured.pending:
            # Nothing else to run: wait a little for a grammar rather than spin.
            idle = not any(s.has_unfinished() for s in self.schedulers)
            self._admit_compiled(wait_s=0.01 if idle else 0.0)
        scheds = [s.schedule() for s in self.schedulers]
        scheduled = [s for sched in scheds for s in sched.scheduled]
        self.step_request_ids = [s.request.request_id for s in scheduled]
        masks = self._bitmasks(scheds) if self.structured.matchers else StepMasks({}, {})
        if not scheduled:
            admitted: list[RequestOutput] = []
            busy = self._kv_busy()
            if self.new_grammars or busy or any(s.finished_request_ids for s in scheds):
                empty = [StepInput([], sched.finished_request_ids) for sched in scheds]
                self._send_grammars(empty)
                self._attach_kv(empty)
                done = self.executor.execute(empty[0] if self.dp_size == 1 else DPStepInput(empty))
                admitted = self._kv_results(done)
            if busy and not admitted:  # only transfers in flight: poll, do not spin
                # A pull's admission is a request's first token; held offers only free blocks.
                time.sleep(KV_POLL_S if self.pulls else KV_RELEASE_POLL_S)
            return admitted
        # Speculation pauses while the step runs at least disable_by_batch_size requests (all
        # ranks), or drafts the schedule's K for this many: drafts cost more than they save
        # once the step is compute-bound.
        k_step = self.draft_len(len(scheduled))
        if self.adaptive is not None and self.ngram is None and k_step > 0:
            # The draft loop draws only what its requests may verify next.
            states = [self.adaptive.get(s.request.request_id) for s in scheduled]
            k_step = loop_depth(states, k_step, self.captured_draft_lens)
            if self.step_costs is not None and k_step > 0:
                k_step = self.step_costs.choose(len(scheduled), k_step)
        if self.num_spec_tokens:
            self.steps_by_draft_len[k_step] = self.steps_by_draft_len.get(k_step, 0) + 1
        propose = k_step > 0 or not self.num_spec_tokens
        inputs = [
            self._step_input(sched.scheduled, sched.finished_request_ids, propose, masks.masks)
            for sched in scheds
        ]
        for inp in inputs:
            inp.num_draft_steps = k_step if 0 < k_step < self.num_spec_tokens else None
        self._send_grammars(inputs)
        self._attach_kv(inputs)
        result = self.executor.execute(inputs[0] if self.dp_size == 1 else DPStepInput(inputs))
        admitted = self._kv_results(result)
        if self.step_costs is not None:
            decode = all(s.num_new_tokens == 1 + s.num_drafts for s in scheduled)
            self.timed_step = (len(scheduled), k_step, decode, step_start)
        # Attention DP: each rank's (advanced draft sampling, graph key) of this step.
        self.last_rank_paths = result.rank_paths
        if result.eplb is not None:
            self.eplb = result.eplb
        now = time.monotonic()
        outputs = []
        by_id = {s.request.request_id: s.request for s in scheduled}
        for i, rid in enumerate(result.request_ids):
            request = by_id[rid]
            if request.is_finished:  # aborted while the step ran
                continue
            if rid in masks.dead:  # the request's grammar has no way on
                self._fail(rid, masks.dead[rid], request.params.structured.param)
                continue
            emitted = result.token_ids[i]
            if self.num_spec_tokens:
                n_drafts = result.num_drafts[i]
                # KV rewind: rejected draft slots are simply no longer counted as computed.
                request.num_computed_tokens -= n_drafts - (len(emitted) - 1)
                if request.spec_stats is None:
                    request.spec_stats = SpecStats()
                accepted = len(emitted) - 1
                verified = n_drafts
                if self.tree_drafts and n_drafts:  # nodes deeper than the room were skipped
                    parents = request.spec_parents[:n_drafts]
                    verified = verified_nodes(parents, request.spec_max_depth)
                request.spec_stats.record(verified, accepted, self.num_spec_tokens)
                if self.step_costs is not None and n_drafts:
                    self.step_costs.verified(accepted)
                self.spec_stats.record(verified, accepted, self.num_spec_tokens)
                if self.structured.is_constrained(rid):
                    self.constrained_drafts += n_drafts
                    self.constrained_accepted += accepted
            lps = result.logprobs[i]
            status = None
            for j, token in enumerate(emitted):
                request.append_token(token)
                self.generation_tokens_total += 1
                if lps is not None:
                    request.logprobs.append(lps[j])
                status = self._check_stop(request, token)
                if status is None and self.structured.is_constrained(rid):
                    status = self._advance_grammar(request, token)
                if status is not None or request.is_finished:
                    break
            if request.is_finished:  # its grammar failed
                continue
            if request.first_token_time is None:
                request.first_token_time = now
            # Its blocks are registered now that the KV rewind and the accepted tokens are in
            # (before, a speculative step hashed draft rows' slots with too few tokens).
            self.schedulers[self.rank_of[rid]].cache_computed_blocks([request])
            if self._hands_over(request):
                # Its decode instance goes on from here (and makes the checks above again).
                if status is None and self.num_spec_tokens:
                    request.spec_token_ids = self._next_drafts(
                        request, result, i, k_step, n_drafts, accepted
                    )
                outputs.append(self._hand_over(request))
                continue
            if status is not None:
                self.schedulers[self.rank_of.pop(rid)].finish(request, status)
            elif self.num_spec_tokens:
                request.spec_token_ids = self._next_drafts(
                    request, result, i, k_step, n_drafts, accepted
                )
            outputs.append(self._make_output(request))
            if status is not None:
                self.detok.pop(rid, None)
                self.structured.forget(rid)
                if self.ngram is not None:
                    self.ngram.forget(rid)
                if self.suffix is not None:  # its output joins the cached outputs
                    self.suffix.finish(rid, request.output_token_ids)
                if self.adaptive is not None:
                    self.adaptive.pop(rid, None)
        # Prefill chunks that sampled nothing this step.
        for scheduler, sched in zip(self.schedulers, scheds, strict=True):
            scheduler.cache_computed_blocks([s.request for s in sched.scheduled])
        return admitted + outputs

    def _next_drafts(
        self, request: Request, result: Any, i: int, k_step: int, n_drafts: int, accepted: int
    ) -> list[int]:
        """The drafts a request verifies next step (its tree's parents and depth set too): the
        rank's proposals, n-gram or suffix drafts, cut to the room left and by its grammar."""
        rid = request.request_id
        room = (
            min(
                request.max_tokens - request.num_output_tokens,
                self.max_model_len - request.num_tokens,
            )
            - 1
        )
        if self.suffix is not None:
            # Suffix trees: cut to the room left; where graphs run, filled to the
            # captured node count (a filler is never accepted).
            tree = self.suffix.propose(rid, request.all_token_ids, min(room, k_step))
            drafts, request.spec_parents = tree.tokens, tree.parents
            if self.pad_ngram and room > 0 and k_step == self.num_spec_tokens:
                n = self.suffix.max_nodes
                drafts, request.spec_parents = pad_tree(tree, request.all_token_ids[-1], n)
            request.spec_max_depth = room
        elif self.tree_drafts:
            # Tree nodes are ordered by depth, not along one path: keep the whole tree
            # and let verification skip the nodes deeper than the room left (and, for a
            # constrained request, never accept a node its grammar forbids).
            drafts = result.draft_token_ids[i] if room > 0 else []
            request.spec_max_depth = room
            request.spec_parents = result.draft_parents[i] if drafts else []
        else:
            if self.ngram is not None:
                k = min(room, k_step)
                drafts = self.ngram.propose(rid, request.all_token_ids, k)
                if self.pad_ngram and k == self.num_spec_tokens:
                    drafts = pad_drafts(drafts, request.all_token_ids[-1], k)
            else:
                drafts = result.draft_token_ids[i][: max(0, min(room, k_step))]
            if self.adaptive is not None:
                depth = self.adaptive.get(rid)
                if depth is None:
                    cost = POSITION_COST["engine" if self.ngram is not None else "model"]
                    sc = self.config.speculative_config
                    by_confidence = sc.confidence_threshold is not None
                    depth = self.adaptive[rid] = AdaptiveDepth(
                        self.num_spec_tokens, cost, by_confidence=by_confidence
                    )
                drafts = drafts[: depth.update(n_drafts, accepted, k_step)]
            if drafts and self.structured.is_constrained(rid):
                drafts = self._grammar_drafts(request, drafts)
        return drafts

    # -------------------------------------------------------------- disaggregation

    def _hands_over(self, request: Request) -> bool:
        kv = request.params.kv_transfer
        return self.kv_role == "prefill" and kv is not None and bool(kv.get("do_remote_decode"))

    def _kv_busy(self) -> bool:
        return bool(self.handovers or self.pulls or self.new_offers or self.new_pulls)

    def _attach_kv(self, inputs: list[StepInput]) -> None:
        """What the ranks offer, pull and report on this step: under attention DP the rank
        holding a request does its transfer (every rank hears of all of them); under tensor
        parallelism every rank does its shard's."""
        if self.kv_role == "both":
            return
        dp = self.dp_size > 1
        for rid, tid, blocks, rank in self.new_offers:
            inputs[rank if dp else 0].kv_offers.append((rid, tid, blocks))
        for rid, addresses, source, tid, blocks, rank in self.new_pulls:
            inputs[rank if dp else 0].kv_pulls.append((rid, addresses, source, tid, blocks))
        self.new_offers, self.new_pulls = [], []
        pending = [(tid, rank if dp else -1) for tid, (_, rank) in self.handovers.items()]
        pulling = [(rid, p.rank if dp else -1) for rid, p in self.pulls.items()]
        for inp in inputs:
            inp.kv_pending, inp.kv_pulling = pending, pulling

    def _kv_results(self, result: StepOutput) -> list[RequestOutput]:
        """Free the blocks of offers every rank ended; admit (or fail) the requests whose pull
        every rank ended: their first outputs."""
        for tid in result.kv_released:
            held = self.handovers.pop(tid, None)
            if held is not None:
                request, rank = held
                self.block_managers[rank].free(request)
        admitted = []
        for rid, error in result.kv_pulled:
            pull = self.pulls.pop(rid, None)
            if pull is None:
                continue
            request = pull.request
            if error is not None or pull.aborted:
                self.block_managers[pull.rank].free(request)
                self.schedulers[pull.rank].finished_ids.append(rid)  # ranks drop its state
                self.rank_of.pop(rid, None)
                if not pull.aborted:
                    self._fail_remote(request, f"KV transfer failed: {error}")
                continue
            out = self._admit_pulled(request, pull.rank)
            if out is not None:
                admitted.append(out)
        return admitted

    def _hand_over(self, request: Request) -> RequestOutput:
        """Prefill side, after the step that sampled the request's first token (and drafts):
        its blocks and draft state are held for the decode instance (offered by the ranks with
        the next step); its output says where."""
        rid = request.request_id
        rank = self.rank_of.pop(rid)
        self.schedulers[rank].detach(request)  # the ranks forget it after offering it
        tid = self.next_transfer_id
        self.next_transfer_id += 1
        self.new_offers.append((rid, tid, list(request.block_ids), rank))
        self.handovers[tid] = (request, rank)
        lp = request.logprobs[0] if request.logprobs else None
        params = {
            "remote_addresses": self.kv_addresses,
            # Attention DP: the one rank holding it (its KV is whole there); -1: every rank
            # holds its shard (tensor parallelism).
            "remote_rank": rank if self.dp_size > 1 else -1,
            "transfer_id": tid,
            "num_blocks": len(request.block_ids),
            "num_bytes": len(request.block_ids) * self.kv_bytes_per_block,
            "num_prompt_tokens": request.num_prompt_tokens,
            "num_cached_tokens": request.num_cached_tokens,
            "first_token": request.output_token_ids[0],
            "first_logprob": None if lp is None else dataclasses.asdict(lp),
            "drafts": list(request.spec_token_ids),
            "draft_parents": list(request.spec_parents),
            "draft_max_depth": request.spec_max_depth,
        }
        for forget in (self.detok, self.adaptive or {}):
            forget.pop(rid, None)
        self.structured.forget(rid)
        for proposer in (self.ngram, self.suffix):
            if proposer is not None:
                proposer.forget(rid)
        request.status = RequestStatus.FINISHED_LENGTH
        out = self._make_output(request)
        out.kv_transfer_params = params
        return out

    def _check_handover(self, request: Request) -> None:
        """A decode instance's request: its hand-over must fit this instance (ValueError)."""
        kv = request.params.kv_transfer
        assert kv is not None
        addresses = kv.get("remote_addresses")
        ranks = self.config.parallel_config.tensor_parallel_size
        source = kv.get("remote_rank", -1)
        if int(kv.get("num_prompt_tokens", -1)) != request.num_prompt_tokens:
            raise ValueError(
                f"kv_transfer_params: the prefill instance had {kv.get('num_prompt_tokens')} "
                f"prompt tokens, this request {request.num_prompt_tokens}"
            )
        if (source == -1) != (self.dp_size == 1):
            raise ValueError(
                "kv_transfer_params: one side runs attention DP and the other does not "
                f"(remote_rank {source}, this instance {'with' if self.dp_size > 1 else 'without'}"
                " attention DP): a request's KV is whole on one rank under it, sharded without"
            )
        if self.dp_size > 1:  # the holder's whole KV: any count of ranks on either side
            if not isinstance(addresses, list) or not 0 <= int(source) < len(addresses):
                raise ValueError(f"kv_transfer_params: remote_rank {source} has no address")
        elif not isinstance(addresses, list) or len(addresses) != ranks:
            n = len(addresses) if isinstance(addresses, list) else "no"
            raise ValueError(
                f"kv_transfer_params: the prefill instance has {n} rank address(es), this decode "
                f"instance {ranks} rank(s): both sides need the same tensor-parallel size"
            )

    def _start_pull(self, request: Request) -> None:
        """Decode side: as many blocks as the prefill instance held, then the pull into them
        (with the next step), or a wait for blocks (retried every step)."""
        kv = request.params.kv_transfer
        assert kv is not None
        rid = request.request_id
        addresses = kv["remote_addresses"]
        if request not in self.waiting_pulls:
            self.prompt_tokens_total += request.num_prompt_tokens
        rank = self._least_loaded_rank()
        bm = self.block_managers[rank]
        if not bm.allocate(request, int(kv["num_blocks"]) * bm.block_size):
            if request not in self.waiting_pulls:
                self.waiting_pulls.append(request)
            return
        self.rank_of[rid] = rank
        blocks = list(request.block_ids)
        source = int(kv.get("remote_rank", -1))
        tid = int(kv["transfer_id"])
        self.new_pulls.append((rid, [str(a) for a in addresses], source, tid, blocks, rank))
        self.pulls[rid] = _Pull(request, rank)

    def _retry_waiting_pulls(self) -> None:
        waiting, self.waiting_pulls = self.waiting_pulls, []
        for request in waiting:
            self.waiting_pulls.append(request)
            self._start_pull(request)
            if request.request_id in self.pulls:
                self.waiting_pulls.remove(request)

    def _fail_remote(self, request: Request, message: str) -> None:
        self.detok.pop(request.request_id, None)
        self.structured.forget(request.request_id)
        self.failed.append(RequestFailure(request.request_id, message, None))

    def _admit_pulled(self, request: Request, rank: int) -> RequestOutput | None:
        """Decode side: the request as its prefill instance left it (prompt KV computed, first
        token sampled, drafts proposed; the ranks adopted its draft state); the checks of a
        first token run here."""
        rid = request.request_id
        kv = request.params.kv_transfer
        assert kv is not None
        now = time.monotonic()
        request.num_computed_tokens = request.num_prompt_tokens
        request.num_cached_tokens = int(kv.get("num_cached_tokens", 0))
        first = int(kv["first_token"])
        request.append_token(first)
        self.generation_tokens_total += 1
        if request.params.logprobs is not None and kv.get("first_logprob") is not None:
            request.logprobs.append(TokenLogprobs(**kv["first_logprob"]))
        scheduler = self.schedulers[rank]
        scheduler.adopt(request)
        request.first_scheduled_time = request.first_token_time = now
        status = self._check_stop(request, first)
        if status is None and self.structured.is_constrained(rid):
            status = self._advance_grammar(request, first)
        if request.is_finished:  # its grammar failed
            return None
        scheduler.cache_computed_blocks([request])
        if status is not None:
            scheduler.finish(request, status)
            self.rank_of.pop(rid, None)
            out = self._make_output(request)
            self.detok.pop(rid, None)
            self.structured.forget(rid)
            return out
        request.spec_token_ids = [int(t) for t in kv.get("drafts", [])]
        request.spec_parents = [int(t) for t in kv.get("draft_parents", [])]
        request.spec_max_depth = int(kv.get("draft_max_depth", 0))
        return self._make_output(request)

    def draft_len(self, batch_size: int) -> int:
        """Drafts a step of ``batch_size`` requests (every rank's) proposes: 0 past
        disable_by_batch_size, else the schedule's K (the fixed K without one)."""
        sc = self.config.speculative_config
        if sc is None:
            return 0
        if self.disable_spec_at is not None and batch_size >= self.disable_spec_at:
            return 0
        return sc.draft_len(batch_size)

    def _send_grammars(self, inputs: list[StepInput]) -> None:
        """Every rank gets the grammars that arrived since the last step, to compile them off
        the step (each rank's masked drafting needs its own)."""
        for inp in inputs:
            inp.grammars = self.new_grammars
        self.new_grammars = []

    def _bitmasks(self, scheds: list[SchedulerOutput]) -> StepMasks:
        """The grammar bitmask of every constrained request this step samples; those whose
        grammar allows no token (``dead``) run unmasked and fail after the step."""
        ids = [
            s.request.request_id
            for sched in scheds
            for s in sched.scheduled
            if s.samples and self.structured.is_constrained(s.request.request_id)
        ]
        if not ids:
            return StepMasks({}, {})
        if not self.num_spec_tokens:
            return self.structured.masks(ids, self.bitmask_width)
        # Speculation: one mask per verified position, the grammar's state after the request's
        # emitted tokens and its drafts before that position.
        drafts = {
            s.request.request_id: s.request.spec_token_ids[: s.num_drafts]
            for sched in scheds
            for s in sched.scheduled
            if s.request.request_id in ids
        }
        parents = None
        if self.tree_drafts:  # one mask per tree node: the state after the node's path
            parents = {
                s.request.request_id: s.request.spec_parents[: s.num_drafts]
                for sched in scheds
                for s in sched.scheduled
                if s.request.request_id in ids
            }
        return self.structured.masks(ids, self.bitmask_width, drafts, parents)

    def _grammar_drafts(self, request: Request, drafts: list[int]) -> list[int]:
        """The drafts of a constrained request worth verifying. A draft the grammar forbids is
        always rejected (the masked target gives it probability 0), so the drafts after it are
        never used: they are cut. The forbidden draft itself is cut only for greedy requests
        (the masked argmax at its position does not depend on it). Drafting is masked by the
        grammar (engine/speculative/draft_grammar.py), so a forbidden draft is rare: a row whose
        draft vocabulary the grammar leaves empty, or a loop that could not mask. A sampled
        request keeps it: such a draft is sampled from an unmasked q, and rejection sampling is
        exact only over every draft q proposes — a rejected forbidden draft's position must be
        sampled from the residual norm(max(0, p' - q)), not from p' (cutting it would sample p'
        there, over-weighting tokens q favours; the distribution test catches that)."""
        n = self.structured.valid_drafts(request.request_id, drafts)
        return drafts[: n if request.params.greedy else n + 1]

    def _advance_grammar(self, request: Request, token: int) -> RequestStatus | None:
        """Feed ``token`` to the request's matcher: a complete grammar stops it; a token the
        grammar refuses fails it."""
        result = self.structured.advance(request.request_id, token)
        if result == "stop":
            return RequestStatus.FINISHED_STOPPED
        if isinstance(result, GrammarFailure):
            param = request.params.structured.param if result.request_at_fault else None
            self._fail(request.request_id, result.message, param)
        return None

    @staticmethod
    def _min_tokens_ban(request: Request, sample: bool) -> dict[str, Any]:
        """The ``RequestStep`` fields that keep the stop tokens (EOS unless ignore_eos, and
        stop_token_ids) out of the tokens before ``min_tokens`` is reached, as vLLM masks them:
        the model cannot end early, and its drafts do not propose an end either."""
        p = request.params
        left = p.min_tokens - request.num_output_tokens
        if not sample or left <= 0:
            return {}
        stops = set(p.stop_token_ids or ())
        if not p.ignore_eos:
            stops |= request.eos_token_ids
        return {"min_tokens_left": left, "stop_token_ids": tuple(sorted(stops))} if stops else {}

    def _check_stop(self, request: Request, token: int) -> RequestStatus | None:
        p = request.params
        detok = self.detok.get(request.request_id)  # None: detokenize=False
        n_out = request.num_output_tokens
        if n_out >= p.min_tokens:
            # The token that ends the request is not in its text (as vLLM's): decoded with
            # special tokens kept (markers a parser reads), an EOS would show as its string.
            ended = request.output_token_ids[: None if p.include_stop_str_in_output else -1]
            if not p.ignore_eos and token in request.eos_token_ids:
                if detok is not None:
                    detok.update(ended, False)
                return RequestStatus.FINISHED_STOPPED
            if token in p.stop_token_ids:
                request.stop_reason = token
                if detok is not None:
                    detok.update(ended, False)
                return RequestStatus.FINISHED_STOPPED
        stop = (
            detok.update(
                request.output_token_ids, p.include_stop_str_in_output, n_out >= p.min_tokens
            )
            if detok is not None
            else None
        )
        if stop is not None:
            request.stop_reason = stop
            return RequestStatus.FINISHED_STOPPED
        if n_out >= request.max_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _make_output(self, request: Request) -> RequestOutput:
        detok = self.detok.get(request.request_id)
        finished = request.is_finished
        completion = CompletionOutput(
            index=0,
            token_ids=list(request.output_token_ids),
            text=detok.visible(finished) if detok is not None else "",
            finish_reason=request.finish_reason,
            stop_reason=request.stop_reason,
            logprobs=list(request.logprobs) if request.params.logprobs is not None else None,
        )
        metrics = {"arrival_time": request.arrival_time}
        if request.first_scheduled_time is not None:
            metrics["first_scheduled_time"] = request.first_scheduled_time
        if request.first_token_time is not None:
            metrics["first_token_time"] = request.first_token_time
        return RequestOutput(
            spec_stats=request.spec_stats,
            request_id=request.request_id,
            prompt=request.prompt,
            prompt_token_ids=request.prompt_token_ids,
            outputs=[completion],
            finished=finished,
            num_cached_tokens=request.num_cached_tokens,
            metrics=metrics,
        )

    # -------------------------------------------------------------- stats

    def get_stats(self) -> EngineStats:
        """Totals over the DP ranks (one rank without attention DP)."""
        bms, scheds = self.block_managers, self.schedulers
        total = sum(bm.num_blocks for bm in bms)
        used = sum(bm.num_used_blocks for bm in bms)
        return EngineStats(
            num_running=sum(s.num_running for s in scheds),
            num_waiting=sum(s.num_waiting for s in scheds),
            num_kv_blocks=total,
            num_used_kv_blocks=used,
            kv_cache_usage=used / total,
            num_preemptions=sum(s.num_preemptions for s in scheds),
            prompt_tokens=self.prompt_tokens_total,
            generation_tokens=self.generation_tokens_total,
            prefix_cache_queries=sum(bm.prefix_queries for bm in bms),
            prefix_cache_hits=sum(bm.prefix_hits for bm in bms),
            spec_num_drafts=self.spec_stats.num_drafts,
            spec_num_draft_tokens=self.spec_stats.num_draft_tokens,
            spec_num_accepted_tokens=self.spec_stats.num_accepted_tokens,
            spec_accepted_per_pos=list(self.spec_stats.accepted_per_pos),
            spec_method=sc.method if (sc := self.config.speculative_config) else "",
            spec_steps_by_draft_len=dict(self.steps_by_draft_len),
            spec_constrained_draft_tokens=self.constrained_drafts,
            spec_constrained_accepted_tokens=self.constrained_accepted,
            # None until a constrained request came (the snapshot travels with every step).
            grammar_compile_time=self.structured.compile_times,
            grammar_mask_time=self.structured.mask_times.copy() if self.structured.used else None,
            eplb_rebalances=self.eplb.rebalances,
            eplb_imbalance_before=self.eplb.imbalance_before,
            eplb_imbalance_after=self.eplb.imbalance_after,
        )

    def shutdown(self) -> None:
        self.structured.shutdown()
        self.executor.shutdown()
