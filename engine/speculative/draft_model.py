"""The draft loop of a separate draft model (method ``draft_model``, models/draft_model.py).

A draft model is a plain causal LM: its KV slot p must hold token p at position p, or its drafts
would differ from its own ``generate``. So, unlike a head's shifted step 0, step 0 runs it over
the step's rows as they are (the target's ids, positions and attention metadata): it writes the
draft KV of every row, rows of rejected drafts included (a later step overwrites them, as it
does the target's). Then one single-row step per request with the token after the last accepted
one (the correction or bonus token) at the position after it gives draft 1, and draft j + 1
comes from draft j at the next position: K drafts cost K + 1 draft forwards.

Draft semantics are the base decoder's: argmax, or under rejection sampling with non-greedy
requests a sample from q (returned [B, K, V]), drawn after penalties, bias, ``min_tokens`` stop
bans and grammar masks exactly as the target would draw the token there. Tensor work only, so
the graph runner captures ``draft_loop`` as it captures the base's.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch
from torch import Tensor

from tandem.engine.sampler import SamplingTensors
from tandem.engine.speculative.decoder import SpecDecoder
from tandem.engine.speculative.draft_grammar import DraftMask
from tandem.engine.speculative.interface import SpecMetadata, VerifyLayout
from tandem.engine.speculative.sampling import count_tokens
from tandem.models.attention import AttentionMetadata
from tandem.models.parallel import adp_lm_head_tp_argmax


class DraftModelDecoder(SpecDecoder):
    """``SpecDecoder`` (verification, stored q, draft-token semantics) with the draft model's
    unshifted draft loop and KV writes."""

    def write_prompt_kv(self, inp: Any, step_tokens: Tensor, draft_hidden: Tensor) -> None:
        """A step where no request samples: the draft KV of every row, unshifted
        (``step_tokens``, the shifted ids a head would read, are not used)."""
        self.draft(0, inp.positions, inp.input_ids, None, inp.meta)

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
        """A step that proposes no drafts: the draft KV of every row, unshifted (the next step's
        first row is the correction / bonus token; its step 0 writes it)."""
        self.draft(0, inp.positions, inp.input_ids, None, inp.meta)

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
        """``SpecDecoder.draft_loop``'s contract with ``steps`` draft steps (None: K): returns
        (drafts [B, steps], q [B, steps, V] when drafts were sampled, else None).
        ``draft_hidden`` and ``next_tokens`` are not read (no target states; step 0 is not
        shifted)."""
        steps = self.k if steps is None else steps
        draft = self.draft
        # Step 0: the draft KV of the step's rows, each token at its own position.
        draft(0, positions, input_ids, None, target_meta)
        # The token after the last accepted one (correction or bonus), at the position after.
        token = tokens.gather(1, num_accepted[:, None].long()).squeeze(1)  # [B]
        pos = layout.positions + num_accepted + 1  # [B]
        picked = target_meta.all_rank_num_picked  # attention DP: every rank's single rows
        advanced = meta.wants_advanced_draft_sampling
        drafts: list[Tensor] = []
        qs: list[Tensor] = []
        # Bias and penalties (eager steps only): draft j is drawn as the target would draw it
        # after this step's emitted tokens and drafts 0 .. j - 1, and q is that distribution.
        counts = None
        if st is not None and not st.no_penalties and st.output_token_counts is not None:
            emitted = torch.arange(tokens.shape[1], device=tokens.device) <= num_accepted[:, None]
            counts = count_tokens(st.output_token_counts, tokens, emitted)
        for j in range(steps):
            if j > 0:
                token, pos = drafts[-1], pos + 1
            row_meta = self._single_row_meta(layout, pos, picked)
            hidden = draft(0, pos, token, None, row_meta)  # [B, H]
            if self.lm_head_tp and not advanced:
                # Attention DP + LM-head TP, greedy: the head's rows sharded over the group.
                if picked is None:
                    raise RuntimeError("LM-head TP in ADP needs all_rank_num_picked")
                weight = draft.lm_head_weight
                ids = adp_lm_head_tp_argmax(hidden.to(weight.dtype), weight, picked, self.mapping)
                drafts.append(draft.to_target_ids(ids))
                continue
            logits = draft.compute_logits(0, hidden).float()  # [B, V]
            noise = None if draft_noise is None else draft_noise[j]
            mask = None if draft_mask is None else draft_mask(j, drafts)
            # Draft j is the token num_accepted + 1 + j after the step's first.
            ban = None
            if st is not None and st.stop_ban_left is not None:
                ban = num_accepted + 1 + j < st.stop_ban_left
            row_st = st if counts is None else dataclasses.replace(st, output_token_counts=counts)
            new, q = self._draft_token(logits, row_st, advanced, noise, mask, ban)
            drafts.append(new)
            if counts is not None:
                counts = count_tokens(counts, new[:, None])
            if q is not None:
                qs.append(q)
        b = tokens.shape[0]
        new_drafts = torch.stack(drafts, dim=1) if drafts else tokens.new_empty((b, 0))
        q_all = torch.stack(qs, dim=1) if advanced and qs else None  # [B, steps, V]
        return new_drafts, q_all
