"""The speculative half of one engine step: verify the drafts, then run the draft loop.

Runs inside ``ModelRunner.execute`` after the target forward, entirely on the device: the
accepted counts feed the step-0 gather ids without a host read, and the step ends with the
runner's one host sync.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from tandem.engine.sampler import (
    SamplingTensors,
    adjusted_logits,
    ban_stop_tokens,
    mask_banned,
    probs_for_rows,
    token_bitmask_allowed,
)
from tandem.engine.speculative.draft_grammar import DraftMask
from tandem.engine.speculative.interface import (
    ROW_PICK_RESOLVER,
    DraftRowPick,
    SpecMetadata,
    VerifyLayout,
)
from tandem.engine.speculative.sampling import (
    chain_ancestors,
    count_tokens,
    exponential_noise,
    repeat_rows,
    sample_rows,
    uniform_noise,
    widen_columns,
    with_path_counts,
)
from tandem.kernels import cpu_decode
from tandem.kernels.attention_torch import build_attention_plan
from tandem.kernels.launch import gpu_paths
from tandem.kernels.spec_decode import accept_matching, build_draft_step0_inputs, rejection_sample
from tandem.models.attention import AttentionMetadata
from tandem.models.parallel import ParallelMapping, adp_lm_head_tp_argmax

# Paused steps' draft KV waits for at most this many rows (``SpecDecoder.stash_step_kv``).
DEFER_MAX_ROWS = 4096


def last_writes(slots: Tensor) -> Tensor:
    """Indices of the last row written to each slot, in row order (a slot written twice keeps
    its later row, as writing the rows one step after another would)."""
    uniq, inverse = torch.unique(slots, return_inverse=True)
    rows = torch.arange(slots.shape[0], device=slots.device)
    last = torch.full_like(uniq, -1, dtype=torch.long)
    return last.scatter_reduce(0, inverse, rows, reduce="amax").sort().values


@dataclass
class DeferredRows:
    """A paused step's draft-KV rows (``SpecDecoder.stash_step_kv``)."""

    positions: Tensor
    tokens: Tensor  # each row's draft input token (the token after it)
    features: list[Tensor]  # the captured target states (Eagle3), or the target's hidden rows
    slots: Tensor


@dataclass
class SpecResult:
    num_accepted: Tensor  # [B]
    tokens: Tensor  # [B, K + 1] emitted: the first num_accepted + 1
    new_drafts: Tensor  # [B, K] target-vocabulary draft tokens for the next step
    logprobs: Tensor | None = None  # [B, K + 1] chosen-token logprobs of the emitted tokens
    topk_ids: Tensor | None = None  # [B, K + 1, N]
    topk_logprobs: Tensor | None = None


class SpecDecoder:
    def __init__(
        self,
        draft: nn.Module,
        config: Any,
        mapping: ParallelMapping,
        block_size: int,
        resolver: DraftRowPick = ROW_PICK_RESOLVER,
    ) -> None:
        self.draft = draft
        self.config = config
        self.k = config.num_speculative_tokens
        self.mapping = mapping
        self.block_size = block_size
        self.resolver = resolver
        self.vanilla = config.method == "mtp" and config.mtp_mode == "vanilla"
        # ADP + LM-head TP: greedy drafting shards the draft LM head over the group (a collective
        # per draft step), so the greedy/advanced choice must be group-synced.
        self.lm_head_tp = mapping.uses_adp_collectives and mapping.enable_lm_head_tp_in_adp
        self.draft_q: dict[str, Tensor] = {}  # request id → [K, V] draft probabilities
        # Greedy Eagle3 draft steps after the first as one CPU fast-path call where it applies
        # (the same drafts as the step-by-step loop; tests turn it off to compare).
        self.fast_chain = True
        # "confidence_threshold" (adaptive chains): the draft loop keeps each draft's running
        # product of the head's probabilities in ``last_confidence`` ([B, steps]; None where it
        # was not computed), and the runner verifies only the drafts whose product is at least
        # the threshold (``confident_drafts``).
        self.confidence_threshold: float | None = getattr(config, "confidence_threshold", None)
        self.last_confidence: Tensor | None = None
        # Paused steps' draft KV, written later in one call (``stash_step_kv``).
        self.deferred: list[DeferredRows] = []
        self.deferred_rows = 0
        self.deferred_ids: frozenset[str] = frozenset()
        self.deferred_captured = False

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.draft_q.pop(rid, None)

    def export_request(self, request_id: str) -> dict[str, Any]:
        """What ``forget`` would drop of one request, on the host: its state for a decode
        instance (a hand-over, engine/kv_transfer.py)."""
        q = self.draft_q.get(request_id)
        return {} if q is None else {"draft_q": q.cpu()}

    def import_request(self, request_id: str, state: dict[str, Any], device: Any) -> None:
        """``export_request``'s state, for the same request here."""
        if "draft_q" in state:
            self.draft_q[request_id] = state["draft_q"].to(device)

    # ------------------------------------------------------------------ verification

    def verify(
        self,
        logits: Tensor,
        layout: VerifyLayout,
        st: SamplingTensors,
        meta: SpecMetadata,
        request_ids: list[str],
    ) -> tuple[Tensor, Tensor]:
        """logits: [B, C, V] for the first C <= K + 1 layout columns (the later columns repeat
        column C - 1: every request carries at most C - 1 drafts) → (num_accepted [B], tokens
        [B, K + 1])."""
        b, k1 = layout.rows.shape
        logits = ban_stop_tokens(logits, st)  # column j: the token j after the step's first
        if meta.all_greedy and not st.adjusts_logits:
            ids = widen_columns(cpu_decode.argmax(logits), k1)
            return accept_matching(ids, layout.drafts, layout.num_drafts)
        logits = widen_columns(logits, k1)
        v = logits.shape[-1]
        if st.no_penalties:
            flat = repeat_rows(st, k1)
        else:  # column j's penalties count the drafts before it as output
            valid, ancestors = chain_ancestors(layout.num_drafts, self.k)
            drafts = torch.where(valid, layout.drafts, -1)
            flat = with_path_counts(st, k1, drafts, ancestors)
        if meta.all_greedy:
            ids = cpu_decode.argmax(adjusted_logits(logits.reshape(b * k1, v), flat))
            return accept_matching(ids.view(b, k1), layout.drafts, layout.num_drafts)
        p = probs_for_rows(logits.reshape(b * k1, v), flat).view(b, k1, v)
        if not meta.use_rejection_sampling:
            sampled = sample_rows(p.view(b * k1, v), flat.generators).view(b, k1)
            return accept_matching(sampled, layout.drafts, layout.num_drafts)
        q = self._stored_q(request_ids, layout.drafts, v)
        gens = st.generators
        uniform = uniform_noise(b, self.k, gens, logits.device)
        noise = exponential_noise((b, k1, v), gens, logits.device)
        return rejection_sample(p, q, layout.drafts, layout.num_drafts, uniform, noise)

    def _stored_q(self, request_ids: list[str], drafts: Tensor, vocab: int) -> Tensor:
        """Per-request draft probabilities; one-hot placeholders where none are stored (fresh or
        argmax-drafted requests, or a malformed buffer). A one-hot q at draft d accepts d with
        probability p(d) and otherwise samples p without d: exactly strict acceptance, which is
        lossless whatever produced d. So a missing q fails closed."""
        q = F.one_hot(drafts, vocab).to(torch.float32)
        for i, rid in enumerate(request_ids):
            stored = self.draft_q.get(rid)  # [steps, V]: a scheduled step may draft fewer than K
            if stored is not None and stored.dim() == 2 and stored.shape[1] == vocab:
                n = min(stored.shape[0], self.k)
                q[i, :n] = stored[:n]
        return q

    # ------------------------------------------------------------------ draft loop

    def write_prompt_kv(self, inp: Any, step_tokens: Tensor, draft_hidden: Tensor) -> None:
        """A step where no request samples (chunks that stop mid-prompt): the draft layers
        still write their KV for every row, as step 0 of the draft loop would."""
        if not self.vanilla:
            self.draft.write_kv(0, inp.positions, step_tokens, draft_hidden, inp.meta)
            return
        hidden = draft_hidden
        for k in range(self.k):
            tokens = self._vanilla_tokens(k, step_tokens, inp)
            hidden = self.draft(k, inp.positions, tokens, hidden, inp.meta)

    def write_step_kv(
        self,
        inp: Any,
        draft_hidden: Tensor,
        layout: VerifyLayout,
        num_accepted: Tensor,
        tokens: Tensor,
    ) -> None:
        """A step that proposes no drafts (``disable_by_batch_size``): step 0 of the draft loop
        still writes the draft KV of every row, each row's input token being the one after it
        (the accepted tokens, then the correction / bonus token), so that a later step drafts
        from a complete draft KV cache. Not for vanilla MTP (the configuration refuses it)."""
        last_rows = inp.meta.query_start_loc[1:].long() - 1
        step_tokens, _ = build_draft_step0_inputs(
            layout.first_row, num_accepted, tokens, inp.input_ids, last_rows, inp.next_tokens
        )
        self.write_prompt_kv(inp, step_tokens, draft_hidden)

    def defers_step_kv(self, meta: AttentionMetadata) -> bool:
        """Whether a paused step's draft KV may wait (``stash_step_kv``): a head whose draft
        layer writes its KV alone, on this rank's rows only (not under attention DP)."""
        writes_alone = getattr(self.draft, "writes_kv_alone", None)
        return (
            not self.vanilla
            and meta.all_rank_num_tokens is None
            and writes_alone is not None
            and writes_alone()
        )

    def stash_step_kv(
        self,
        inp: Any,
        features: list[Tensor],
        captured: bool,
        layout: VerifyLayout,
        num_accepted: Tensor,
        tokens: Tensor,
        request_ids: list[str],
    ) -> None:
        """``write_step_kv`` deferred: the rows' positions, input tokens, draft input features
        (``captured``: the target states Eagle3's ``combine_hidden`` reads, run at the flush)
        and slots are kept, and ``flush_step_kv`` writes every kept row in one call. A paused
        step then costs a copy of its rows, and the head's matrices are read once per flush
        rather than once per step (or never, for a request that ends paused)."""
        last_rows = inp.meta.query_start_loc[1:].long() - 1
        step_tokens, _ = build_draft_step0_inputs(
            layout.first_row, num_accepted, tokens, inp.input_ids, last_rows, inp.next_tokens
        )
        self.deferred.append(
            DeferredRows(
                inp.positions.clone(),
                step_tokens,
                [f.clone() for f in features],
                inp.meta.slot_mapping.clone(),
            )
        )
        self.deferred_rows += int(inp.positions.shape[0])
        self.deferred_ids = frozenset(request_ids)
        self.deferred_captured = captured

    def flush_step_kv(self, request_ids: list[str], drafts: bool) -> None:
        """Before a step of ``request_ids``, write the kept rows before anything reads or
        reuses their slots: if the step drafts (``drafts``), if its requests are not the kept
        rows' (a request ended, was preempted or arrived: blocks may be freed and reused, or
        found in the prefix cache), or past ``DEFER_MAX_ROWS`` rows."""
        if not self.deferred:
            return
        if (
            not drafts
            and frozenset(request_ids) == self.deferred_ids
            and self.deferred_rows < DEFER_MAX_ROWS
        ):
            return
        rows, self.deferred, self.deferred_rows = self.deferred, [], 0
        slots = torch.cat([d.slots for d in rows])
        keep = last_writes(slots)
        features = [
            torch.cat([d.features[i] for d in rows])[keep] for i in range(len(rows[0].features))
        ]
        hidden = self.draft.combine_hidden(features) if self.deferred_captured else features[0]
        empty = slots.new_zeros(0, dtype=torch.int32)
        meta = AttentionMetadata(slots[keep], empty.view(0, 0), empty, empty, 0, 0)
        positions = torch.cat([d.positions for d in rows])[keep]
        tokens = torch.cat([d.tokens for d in rows])[keep]
        self.draft.write_kv(0, positions, tokens, hidden, meta)

    def _vanilla_tokens(self, k: int, step_tokens: Tensor, inp: Any) -> Tensor:
        """Layer k's input token of every row: the token k + 1 positions ahead of it, from the
        step's own rows, or past a chunk's last row from the prompt tokens that follow it."""
        if k == 0:
            return step_tokens
        t = step_tokens.shape[0]
        idx = torch.arange(t, device=step_tokens.device) + k
        tokens = step_tokens[idx.clamp(max=t - 1)]
        if inp.future is None:
            return tokens
        ahead = (idx - inp.row_last).clamp(0, self.k)
        return torch.where(idx > inp.row_last, inp.future[inp.row_req, ahead], tokens)

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
        draft_mask: DraftMask | None = None,
        steps: int | None = None,
    ) -> Tensor:
        """Run the draft steps (``steps``, None: K); returns [B, steps] draft tokens (target
        vocabulary). ``draft_mask``: see ``draft_loop``."""
        new_drafts, q_all = self.draft_loop(
            inp,
            input_ids,
            positions,
            target_meta,
            draft_hidden,
            next_tokens,
            layout,
            num_accepted,
            tokens,
            st,
            meta,
            draft_mask=draft_mask,
            steps=steps,
        )
        self.keep_q(request_ids, q_all)
        return new_drafts

    def confident_drafts(self) -> Tensor:
        """[B] per request, how many of the last draft loop's drafts to verify: those whose
        running product of draft probabilities is at least ``confidence_threshold`` (a product
        never grows, so they lead the chain; NaN counts as under)."""
        assert self.last_confidence is not None and self.confidence_threshold is not None
        return (self.last_confidence >= self.confidence_threshold).sum(dim=1)

    def keep_q(self, request_ids: list[str], q_all: Tensor | None) -> None:
        """Store each request's draft probabilities [K, V] (advanced drafting), or drop stale
        ones (argmax drafting stores none)."""
        if q_all is None:
            self.forget(request_ids)
            return
        for i, rid in enumerate(request_ids):
            self.draft_q[rid] = q_all[i]

    def draw_draft_noise(
        self, batch_size: int, st: SamplingTensors, device: torch.device, steps: int | None = None
    ) -> Tensor:
        """[steps, B, V] Exp(1) noise for advanced drafting (``steps`` None: K), drawn exactly as
        the draft steps draw it one by one (same generators, same order), so a loop fed this
        noise samples the same drafts. A captured draft loop reads it from a static buffer."""
        vocab = int(self.draft.config.vocab_size)
        shape = (batch_size, vocab)
        n = self.k if steps is None else steps
        return torch.stack([exponential_noise(shape, st.generators, device) for _ in range(n)])

    def draft_loop(
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
        st: SamplingTensors | None,
        meta: SpecMetadata,
        draft_noise: Tensor | None = None,
        draft_mask: DraftMask | None = None,
        steps: int | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """The draft steps (``steps``, None: K) as tensor work only (no host reads, no
        per-request state): returns (drafts [B, steps], q [B, steps, V] when drafts were
        sampled, else None). ``draft_noise``: [K, B, V] pre-drawn sampling noise
        (``draw_draft_noise``); None draws it step by step.

        ``draft_mask`` (structured output; engine/speculative/draft_grammar.py): called before
        each draft position j with the drafts so far, it returns the [B, W] grammar bitmask of
        position j; the draft logits are masked in the target vocabulary before the argmax or
        the sample, and the stored q is the masked one the draft was drawn from. The hook reads
        tensors on the host, so a masked loop runs eagerly and step by step (no fast chain).
        Not applied under attention DP with LM-head TP and greedy drafting (the sharded argmax
        is a collective over every rank's rows): those drafts are unmasked, and the engine cuts
        them at the first one the grammar forbids."""
        draft = self.draft
        k = self.k if steps is None else steps
        # Step 0 runs on every row: each row's input token is the one after it. Rows are shifted
        # by one; each request's last row takes ``next_tokens`` (the next prompt token for a
        # chunk that stops mid-prompt), and the row of its last accepted token takes the
        # correction / bonus token.
        last_rows = target_meta.query_start_loc[1:].long() - 1
        step_tokens, gather_ids = build_draft_step0_inputs(
            layout.first_row, num_accepted, tokens, input_ids, last_rows, next_tokens
        )  # gather_ids [B]: the rows the loop reads

        pick = self.resolver.resolve(
            draft.layers[0],
            self.mapping,
            num_draft_layers=getattr(draft, "num_layers", 1),
            vanilla_mtp=self.vanilla,
            disabled=self.config.disable_draft_row_pick,
        )
        advanced = meta.wants_advanced_draft_sampling
        drafts: list[Tensor] = []
        qs: list[Tensor] = []
        # Running products of the drafts' probabilities (confidence_threshold): the head's
        # softmax probability of its argmax (greedy) or q of the sampled draft. Not computed for
        # the sharded argmax of ADP + LM-head TP (every draft then stays).
        thr = self.confidence_threshold
        gauge = thr is not None and not (self.lm_head_tp and not advanced) and not self.vanilla
        confs: list[Tensor] = []
        # On a CPU the loop stops once no request's product reaches the threshold (a host read
        # is free there); on a GPU it runs every step (no sync in the loop), and under attention
        # DP too (each rank's rows differ, and its draft layers' collectives need every rank).
        stop_early = gauge and not advanced and draft_hidden.device.type == "cpu"
        stop_early = stop_early and not self.mapping.uses_adp_collectives
        # Bias and penalties (eager steps only): draft j is drawn as the target would draw it
        # after this step's emitted tokens and drafts 0 .. j - 1 (the output if they are
        # accepted), and q is that distribution.
        counts = None
        if st is not None and not st.no_penalties and st.output_token_counts is not None:
            emitted = torch.arange(tokens.shape[1], device=tokens.device) <= num_accepted[:, None]
            counts = count_tokens(st.output_token_counts, tokens, emitted)

        def emit(layer: int, picked_hidden: Tensor) -> None:
            nonlocal counts
            if self.lm_head_tp and not advanced:
                picked = target_meta.all_rank_num_picked
                if picked is None:
                    raise RuntimeError("LM-head TP in ADP needs all_rank_num_picked")
                weight = draft.lm_head_weight
                normed = draft.final_norm(layer, picked_hidden).to(weight.dtype)
                ids = adp_lm_head_tp_argmax(normed, weight, picked, self.mapping)
                drafts.append(draft.to_target_ids(ids))
                return
            # Advanced sampling (and no LM-head TP): the replicated head, locally.
            logits = draft.compute_logits(layer, picked_hidden).float()
            noise = None if draft_noise is None else draft_noise[len(drafts)]
            mask = None if draft_mask is None else draft_mask(len(drafts), drafts)
            # This draft is the token num_accepted + 1 + len(drafts) after the step's first.
            ban = None
            if st is not None and st.stop_ban_left is not None:  # None: a captured greedy loop
                ban = num_accepted + 1 + len(drafts) < st.stop_ban_left
            row_st = st if counts is None else dataclasses.replace(st, output_token_counts=counts)
            token, q = self._draft_token(logits, row_st, advanced, noise, mask, ban)
            drafts.append(token)
            if counts is not None:
                counts = count_tokens(counts, token[:, None])
            if q is not None:
                qs.append(q)
            if gauge:
                if q is not None:
                    p = q.gather(1, token[:, None].long())[:, 0]
                else:
                    p = torch.softmax(logits, dim=-1).amax(dim=-1)
                confs.append(p if not confs else confs[-1] * p)

        def unsure() -> bool:
            """Every request's running product is under the threshold (CPU loops only)."""
            return stop_early and bool((confs[-1] < thr).all())

        def fill(n: int) -> None:
            """The ``n`` draft steps not run: the last draft again, confidence 0."""
            for _ in range(n):
                drafts.append(drafts[-1])
                confs.append(torch.zeros_like(confs[-1]))

        if self.vanilla:
            self._propose_vanilla(
                inp,
                positions,
                step_tokens,
                draft_hidden,
                target_meta,
                layout,
                gather_ids,
                pick,
                drafts,
                emit,
            )
        else:
            if pick:
                hidden = draft(
                    0, positions, step_tokens, draft_hidden, target_meta, pick_rows=gather_ids
                )
            else:
                hidden = draft(0, positions, step_tokens, draft_hidden, target_meta)[gather_ids]
            emit(0, hidden)
            pos = layout.positions + num_accepted  # position of the picked row
            chain = None
            plain = st is None or (st.stop_ban is None and not st.adjusts_logits)
            fast = self.fast_chain and draft_mask is None and plain
            if fast and k > 1 and not advanced and not self.lm_head_tp:
                chain = getattr(draft, "greedy_chain", None)
            rest = None
            if k > 1 and unsure():
                fill(k - 1)
            elif chain is not None and target_meta.all_rank_num_picked is None:
                # Steps 1 .. k - 1 in one CPU fast-path call (None: it does not apply).
                gauged = (confs[-1], thr) if gauge else (None, 0.0)
                rest = chain(hidden, drafts[-1], pos, layout.block_tables, k - 1, *gauged)
            if rest is not None:
                drafts.extend(rest[0].unbind(1))
                if rest[1] is not None:
                    confs.extend(rest[1].unbind(1))
            for i in range(1, k if rest is None and len(drafts) < k else 1):
                pos = pos + 1
                row_meta = self._single_row_meta(layout, pos, target_meta.all_rank_num_picked)
                hidden = draft(0, pos, drafts[-1], hidden, row_meta)
                emit(0, hidden)
                if i < k - 1 and unsure():
                    fill(k - 1 - i)
                    break
        new_drafts = torch.stack(drafts, dim=1)
        q_all = torch.stack(qs, dim=1) if advanced else None  # [B, K, V]
        self.last_confidence = torch.stack(confs, dim=1) if gauge else None
        return new_drafts, q_all

    def _propose_vanilla(
        self,
        inp: Any,
        positions: Tensor,
        step_tokens: Tensor,
        draft_hidden: Tensor,
        meta: AttentionMetadata,
        layout: VerifyLayout,
        gather_ids: Tensor,
        pick: bool,
        drafts: list[Tensor],
        emit: Any,
    ) -> None:
        """K distinct MTP layers. Layer k runs on every row (each writes its own KV for every
        position, and the next layer reads all of its outputs); the token of row j at layer k is
        the one at position pos_j + k + 1: known tokens up to the picked row, then this step's
        new drafts. Only the last layer's post-attention part can be row-picked."""
        t = step_tokens.shape[0]
        rows = torch.arange(t, device=step_tokens.device)
        owner = layout.row_owner  # [T] sampled-request index of each row, -1 for others
        g = gather_ids[owner.clamp(min=0)]
        hidden = draft_hidden
        for k in range(self.k):
            tokens = self._vanilla_tokens(k, step_tokens, inp)
            if k > 0:  # past the picked row: this step's new drafts
                idx = rows + k
                made = torch.stack(drafts, dim=1)  # [B, k]
                m = (idx - g - 1).clamp(0, k - 1)
                tokens = torch.where((owner >= 0) & (idx > g), made[owner.clamp(min=0), m], tokens)
            last = k == self.k - 1
            if last and pick:
                out = self.draft(k, positions, tokens, hidden, meta, pick_rows=gather_ids)
                emit(k, out)
            else:
                hidden = self.draft(k, positions, tokens, hidden, meta)
                emit(k, hidden[gather_ids])

    def _draft_token(
        self,
        logits: Tensor,
        st: SamplingTensors,
        advanced: bool,
        noise: Tensor | None = None,
        mask: Tensor | None = None,
        ban: Tensor | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """Argmax, or a sample from q when rejection sampling will need q (``noise``: [B, V]
        pre-drawn Exp(1) noise; None draws it here). ``mask``: [B, W] grammar bitmask over the
        target vocabulary; a row it leaves no draft-vocabulary token keeps its unmasked logits
        (its draft is then cut or rejected like any forbidden one). ``ban``: [B] bool, the rows
        whose stop tokens are banned here (``min_tokens``; the stored q is the banned one)."""
        vocab = int(self.draft.config.vocab_size)
        if not advanced:
            if mask is not None:
                logits = self.mask_draft_logits(logits, mask)
            if ban is not None:
                logits = self.ban_draft_stops(logits, st.stop_ban, ban)
            if st is not None and st.adjusts_logits:  # in the target vocabulary
                return cpu_decode.argmax(adjusted_logits(self._to_target_vocab(logits), st)), None
            return self.draft.to_target_ids(cpu_decode.argmax(logits)), None
        full = self._to_target_vocab(logits)  # [B, V] target vocabulary
        if ban is not None:
            full = self.ban_draft_stops(full, st.stop_ban, ban)
        if mask is not None:
            allowed = token_bitmask_allowed(mask, vocab) & (full > float("-inf"))
            allowed |= ~allowed.any(dim=-1, keepdim=True)
            full = torch.where(allowed, full, float("-inf"))
        q = probs_for_rows(full, st)
        return sample_rows(q, st.generators, noise), q

    def ban_draft_stops(self, logits: Tensor, ban: Tensor, rows: Tensor) -> Tensor:
        """Draft logits [R, draft V or V] with each request's stop tokens (``ban`` [B, V], the
        batch's ``stop_ban``; R = B * n rows, n per request) at -inf in the rows ``rows`` [R]
        marks."""
        ban = ban.repeat_interleave(logits.shape[0] // ban.shape[0], dim=0)
        if logits.shape[-1] != ban.shape[-1]:  # the draft vocabulary
            index = self._draft_vocab_index(logits.shape[-1])
            ban = ban[:, index] if index is not None else ban
        return mask_banned(logits[:, None], ban, rows[:, None])[:, 0]

    def mask_draft_logits(self, logits: Tensor, mask: Tensor) -> Tensor:
        """Draft-vocabulary logits [R, draft V] with the tokens a grammar bitmask [R, W] (target
        vocabulary) forbids at -inf, in the draft vocabulary (no [R, V] scatter); a row it
        leaves no draft token keeps its logits (its draft is then cut or rejected)."""
        allowed = token_bitmask_allowed(mask, int(self.draft.config.vocab_size))  # [R, V]
        index = self._draft_vocab_index(logits.shape[-1])
        if index is not None:
            allowed = allowed[:, index]  # [R, draft V]
        allowed |= ~allowed.any(dim=-1, keepdim=True)
        return torch.where(allowed, logits, float("-inf"))

    def _to_target_vocab(self, logits: Tensor) -> Tensor:
        """Scatter draft-vocabulary logits to target positions ``arange(draft_V) + d2t``."""
        index = self._draft_vocab_index(logits.shape[-1])
        if index is None:
            return logits
        full = logits.new_full((logits.shape[0], int(self.draft.config.vocab_size)), float("-inf"))
        full[:, index] = logits
        return full

    def _draft_vocab_index(self, draft_vocab: int) -> Tensor | None:
        """[draft V] target id of each draft-vocabulary id, or None when they are the same."""
        d2t = getattr(self.draft, "d2t", None)
        if d2t is None or draft_vocab == int(self.draft.config.vocab_size):
            return None
        return torch.arange(draft_vocab, device=d2t.device) + d2t

    def _single_row_meta(
        self, layout: VerifyLayout, pos: Tensor, all_rank_num_rows: list[int] | None = None
    ) -> AttentionMetadata:
        """One row per sampled request; ``all_rank_num_rows``: every rank's count (attention DP)."""
        b = pos.shape[0]
        bs = self.block_size
        block = layout.block_tables.gather(
            1, (pos // bs)[:, None].clamp(max=layout.block_tables.shape[1] - 1)
        )
        slots = block.squeeze(1).long() * bs + pos % bs
        seq_lens = (pos + 1).to(torch.int32)
        qsl = torch.arange(b + 1, dtype=torch.int32, device=pos.device)
        plan = None
        if not gpu_paths(pos):  # the CPU attention path's indices
            plan = partial(
                build_attention_plan,
                layout.block_tables,
                seq_lens,
                qsl,
                bs,
                1,
                layout.max_seq_len,
                num_tokens=b,
            )
        return AttentionMetadata(
            slot_mapping=slots,
            block_tables=layout.block_tables,
            seq_lens=seq_lens,
            query_start_loc=qsl,
            max_query_len=1,
            max_seq_len=layout.max_seq_len,
            plan=plan,
            all_rank_num_tokens=all_rank_num_rows,
            all_rank_num_picked=all_rank_num_rows,
        )


class EngineDrafted:
    """For decoders whose drafts come from the engine with the step's tokens (n-gram chains,
    suffix trees): no draft layers, so no draft KV to write and nothing to propose."""

    def defers_step_kv(self, meta: AttentionMetadata) -> bool:
        return False

    def write_prompt_kv(self, inp: Any, step_tokens: Tensor, draft_hidden: Tensor) -> None:
        return None

    def write_step_kv(
        self,
        inp: Any,
        draft_hidden: Tensor,
        layout: VerifyLayout,
        num_accepted: Tensor,
        tokens: Tensor,
    ) -> None:
        return None

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
        draft_mask: DraftMask | None = None,
        steps: int | None = None,
    ) -> Tensor:
        """No drafts from the ranks: [B, 0]."""
        return tokens.new_empty((tokens.shape[0], 0))


class DraftlessDecoder(EngineDrafted, SpecDecoder):
    """The ranks' side of speculation without a draft model: verification only (n-gram drafts,
    engine/speculative/ngram.py, come with the step's tokens from the engine). No draft
    layers, no draft KV cache, no draft loop."""

    def __init__(self, config: Any, mapping: ParallelMapping, block_size: int) -> None:
        SpecDecoder.__init__(self, None, config, mapping, block_size)  # type: ignore[arg-type]
        self.lm_head_tp = False  # verification is the same on every path: nothing to sync
