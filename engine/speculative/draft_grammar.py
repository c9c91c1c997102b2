"""Masked drafting under structured output: each draft position's distribution is masked by the
grammar's state after the step's emitted tokens (accepted drafts, then the correction / bonus
token) and this step's drafts before it, so drafts the grammar forbids are not proposed.

The engine process owns the matchers that decide what is emitted; they cannot travel to the
ranks, so every rank keeps a matcher of its own per constrained request (``DraftGrammars``),
compiled from the request's ``StructuredSpec`` (by the engine's ``GrammarCompiler`` in the
engine's process, by one of their own in rank processes, in the background as soon as the
request arrives: ``StepInput.grammars``) and synced each step to the request's output tokens
(each rank keeps its copy; a ``RequestStep`` carries the ones it has not had yet). Within a step a
``DraftMasker`` advances those matchers along the emitted tokens and each new draft, and rolls
them back when the loop ends. All ranks of a tensor-parallel group see the same steps, so they
compute the same masks and feed the same drafts to the sharded draft layers.

Host work: a constrained step reads the emitted tokens, then each draft but the last, back to
the host (K host reads on top of the step's one sync) and fills the masks on the CPU; it runs the
draft loop eagerly (under attention DP every rank does, when any rank has a constrained request).
Steps without a constrained request never build a masker. Draft trees read each depth's
frontier paths instead and mask every frontier node's children with the grammar's state after
its path (``DraftMasker.node_masks``).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import torch
from torch import Tensor

from tandem.engine.step import RequestStep
from tandem.engine.structured_output import (
    COMPILE_THREADS,
    GrammarCompiler,
    StructuredOutputError,
    StructuredSpec,
)

# What a draft loop calls before choosing draft position j: (j, the drafts so far, each [B])
# -> [B, W] int32 bitmask (all ones for unconstrained rows), or None for no mask.
DraftMask = Callable[[int, list[Tensor]], Tensor | None]


class DraftGrammars:
    """One rank's matchers for masked drafting. A matcher out of step with the engine's would
    cost acceptance, never exactness: verification masks with the engine's own states."""

    def __init__(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        self._make_compiler = make_compiler
        self._compiler: GrammarCompiler | None = None
        self._compiler_lock = threading.Lock()
        self._background: ThreadPoolExecutor | None = None
        self.executor: Any = None
        # request id -> (its spec, matcher, output tokens fed)
        self.matchers: dict[str, tuple[StructuredSpec, Any, int]] = {}
        # request id -> its output tokens as this rank has them (steps send only new ones)
        self.outputs: dict[str, list[int]] = {}

    @property
    def compiler(self) -> GrammarCompiler:
        """Built on first use (in a rank process it loads the tokenizer): by ``prefetch``, off
        the step, when the first constrained request arrives."""
        with self._compiler_lock:
            if self._compiler is None:
                self._compiler = self._make_compiler()
            return self._compiler

    def prefetch(self, specs: list[StructuredSpec]) -> None:
        """Compile ``specs`` (new requests' grammars, sent when they arrive) on a background
        thread, so a rank's first constrained step finds them compiled. A grammar that fails
        here fails in the engine too (the request is never scheduled)."""
        if not specs:
            return
        if self._background is None:
            self._background = ThreadPoolExecutor(1, thread_name_prefix="draft-grammars")
        for spec in specs:
            self._background.submit(self._compile, spec)

    def _compile(self, spec: StructuredSpec) -> None:
        with contextlib.suppress(StructuredOutputError):
            self.compiler.template(spec)

    def use_compiler(self, make_compiler: Callable[[], GrammarCompiler]) -> None:
        """Build the compiler with ``make_compiler`` instead (the engine's own, when this rank
        runs in the engine's process: no second tokenizer, no second compile per grammar)."""
        if self._compiler is None:
            self._make_compiler = make_compiler

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.matchers.pop(rid, None)
            self.outputs.pop(rid, None)

    def masker(
        self, sampled: list[RequestStep], num_accepted: Tensor, tokens: Tensor
    ) -> DraftMasker | None:
        """The step's ``draft_mask`` hook, or None when no sampled request (``RequestStep``) is
        constrained. ``num_accepted`` [B], ``tokens`` [B, K + 1]: the step's verification."""
        constrained = [
            (i, r)
            for i, r in enumerate(sampled)
            if r.token_bitmask is not None and r.params is not None and r.params.structured
        ]
        if not constrained:
            return None
        rows = {i: (r.request_id, self._synced(r)) for i, r in constrained}
        if self.executor is None:
            import llguidance

            self.executor = llguidance.LLExecutor(COMPILE_THREADS)
        width = -(-int(self.compiler.ll_tokenizer.vocab_size) // 32)
        return DraftMasker(self, width, len(sampled), rows, num_accepted, tokens)

    def receive(self, requests: list[RequestStep]) -> None:
        """Extend this rank's copy of each constrained request's output tokens with what the
        step sends (every step, masked or not, so the copy never misses tokens); a gap (which
        cannot happen while every rank runs every step) drops the copy: unmasked from then."""
        for r in requests:
            if r.output_offset is None or r.params is None or r.params.structured is None:
                continue
            out = self.outputs.setdefault(r.request_id, [])
            if r.output_offset == 0:
                out[:] = r.output_token_ids
            elif r.output_offset == len(out):
                out.extend(r.output_token_ids)
            else:
                del self.outputs[r.request_id]

    def _synced(self, r: RequestStep) -> Any | None:
        """The request's matcher, fed exactly its output tokens (None: its grammar cannot follow
        them here; its rows stay unmasked)."""
        assert r.params is not None and r.params.structured is not None
        out, spec = self.outputs.get(r.request_id), r.params.structured
        if out is None:
            self.matchers.pop(r.request_id, None)
            return None
        entry = self.matchers.get(r.request_id)
        if entry is None or entry[0] != spec or entry[2] > len(out):
            try:
                entry = (spec, self.compiler.matcher(spec), 0)
            except StructuredOutputError:  # the engine refused it too: never scheduled
                return None
        _, matcher, fed = entry
        if fed < len(out) and matcher.try_consume_tokens(out[fed:]) != len(out) - fed:
            self.matchers.pop(r.request_id, None)
            return None
        self.matchers[r.request_id] = (spec, matcher, len(out))
        return matcher


class DraftMasker:
    """The ``draft_mask`` hook of one step: ``masker(j, drafts)`` feeds the rows' matchers what
    precedes draft position j (at j = 0 the emitted tokens, else draft j - 1) and returns the
    [B, W] int32 bitmask of position j on the tokens' device. A row whose grammar cannot continue
    (finished by its emitted tokens, or a draft it does not allow: an unmasked fallback) is all
    ones from then on: its drafts are cut or rejected by the engine anyway. ``close`` rolls every
    matcher back to the state it had before the step."""

    def __init__(
        self,
        grammars: DraftGrammars,
        width: int,
        batch_size: int,
        rows: dict[int, tuple[str, Any | None]],
        num_accepted: Tensor,
        tokens: Tensor,
    ) -> None:
        """``rows``: sampled row -> (request id, its synced matcher or None)."""
        self.grammars = grammars
        self.width = width
        self.batch_size = batch_size
        self.num_accepted = num_accepted
        self.tokens = tokens
        self.rows = {i: (rid, m) for i, (rid, m) in rows.items() if m is not None}
        self.live = {i: m for i, (_, m) in self.rows.items()}
        self.fed = dict.fromkeys(self.live, 0)

    def __call__(self, j: int, drafts: list[Tensor]) -> Tensor:
        if j == 0:  # host read: the emitted tokens
            both = torch.cat([self.num_accepted[:, None], self.tokens], dim=1).tolist()
            feed = {i: both[i][1 : 2 + both[i][0]] for i in self.live}
        else:  # host read: the previous draft
            last = drafts[-1].tolist()
            feed = {i: [last[i]] for i in self.live}
        for i, tokens in feed.items():
            m = self.live[i]
            n = m.try_consume_tokens(tokens) if not m.is_stopped() else 0
            self.fed[i] += n
            if n < len(tokens) or m.is_stopped():
                del self.live[i]
        bitmask = torch.full((self.batch_size, self.width), -1, dtype=torch.int32)
        if self.live:
            import llguidance.torch

            llguidance.torch.fill_next_token_bitmask_par(
                self.grammars.executor, [(m, i) for i, m in self.live.items()], bitmask
            )
            rows = list(self.live)
            for i, allowed in zip(rows, bitmask[rows].ne(0).any(dim=1).tolist(), strict=True):
                if not allowed:  # a dead end: the step's emitted token fails the request
                    bitmask[i] = -1
                    del self.live[i]
        return bitmask.to(self.tokens.device, non_blocking=True)

    def node_masks(self, paths: list[list[list[int]]]) -> Tensor:
        """Draft trees: ``paths[i][f]``, the tokens from row i's new root to its frontier node f
        (after the emitted tokens ``self(0, [])`` fed) -> [B * F, W] bitmask of each node's
        children: the grammar's state after the node's path (all ones where the row is not
        masked, or the grammar does not allow the path). The matchers end as they began."""
        import llguidance.torch

        f = len(paths[0]) if paths else 0
        bitmask = torch.full((self.batch_size * f, self.width), -1, dtype=torch.int32)
        for i, m in self.live.items():
            for node, path in enumerate(paths[i]):
                n = m.try_consume_tokens(path) if not m.is_stopped() else 0
                if n == len(path) and not m.is_stopped():
                    llguidance.torch.fill_next_token_bitmask(m, bitmask, i * f + node)
                    if not bitmask[i * f + node].ne(0).any():  # a dead end: left unmasked
                        bitmask[i * f + node] = -1
                if n:
                    m.rollback(n)
        return bitmask.to(self.tokens.device, non_blocking=True)

    def close(self) -> None:
        """Roll the matchers back to the request's output tokens."""
        for i, n in self.fed.items():
            rid, m = self.rows[i]
            if n:
                m.rollback(n)
            if m.is_error():  # rebuilt from the output tokens next step
                self.grammars.forget([rid])
        self.fed.clear()
