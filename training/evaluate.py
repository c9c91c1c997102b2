"""Measure a draft head with our engine: tokens per step, acceptance rate and per-position
acceptance at temperature 0, and whether greedy outputs equal those without speculation."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from tandem.training.data import chat_prompt_ids


@dataclass
class EvalResult:
    num_prompts: int
    num_speculative_tokens: int
    tokens_per_step: float  # includes the bonus / correction token
    acceptance_rate: float  # accepted / drafted
    accepted_per_pos: list[float]  # fraction of steps whose draft j was accepted
    num_steps: int
    num_output_tokens: int
    greedy_equal: bool | None  # None when not checked
    mismatched_prompts: list[int] = field(default_factory=list)
    spec_wall_s: float = 0.0
    base_wall_s: float = 0.0

    def table(self) -> str:
        pos = ", ".join(f"{a:.3f}" for a in self.accepted_per_pos)
        rows = [
            ("prompts", str(self.num_prompts)),
            ("draft tokens per step (K)", str(self.num_speculative_tokens)),
            ("tokens per step", f"{self.tokens_per_step:.3f}"),
            ("draft acceptance rate", f"{self.acceptance_rate:.3f}"),
            ("per-position acceptance", pos),
            ("verify steps", str(self.num_steps)),
            ("output tokens", str(self.num_output_tokens)),
            (
                "greedy output == no speculation",
                "not checked"
                if self.greedy_equal is None
                else ("yes" if self.greedy_equal else f"NO ({self.mismatched_prompts[:10]})"),
            ),
            (
                "wall time speculative / plain (s)",
                f"{self.spec_wall_s:.1f} / {self.base_wall_s:.1f}",
            ),
        ]
        width = max(len(k) for k, _ in rows)
        return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def evaluate_head(
    target: str,
    speculative_config: dict[str, Any],
    prompts: list[str],
    max_tokens: int = 256,
    check_greedy: bool = True,
    max_num_seqs: int = 64,
    baseline: list[list[int]] | None = None,
    **engine_args: Any,
) -> EvalResult:
    """Greedy generation of ``prompts`` (chat template) with and without speculation;
    ``baseline``: the outputs without speculation when already known (same ``max_tokens``)."""
    from tandem import LLM, SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens)
    engine_args = {"max_num_seqs": max_num_seqs, **engine_args}
    base: list[list[int]] | None = baseline
    base_wall = 0.0
    if check_greedy and base is None:
        start = time.monotonic()
        with LLM(target, **engine_args) as llm:
            ids = [chat_prompt_ids(llm.tokenizer, p) for p in prompts]
            base = [list(o.outputs[0].token_ids) for o in llm.generate(ids, params)]
        base_wall = time.monotonic() - start
    start = time.monotonic()
    with LLM(target, speculative_config=speculative_config, **engine_args) as llm:
        ids = [chat_prompt_ids(llm.tokenizer, p) for p in prompts]
        outs = llm.generate(ids, params)
        stats = llm.engine.spec_stats
    spec_wall = time.monotonic() - start
    got = [list(o.outputs[0].token_ids) for o in outs]
    mismatched = (
        []
        if base is None
        else [i for i, (a, b) in enumerate(zip(base, got, strict=True)) if a != b]
    )
    k = int(speculative_config.get("num_speculative_tokens", 3))
    steps = max(1, stats.num_drafts)
    per_pos = list(stats.accepted_per_pos) + [0] * (k - len(stats.accepted_per_pos))
    return EvalResult(
        num_prompts=len(prompts),
        num_speculative_tokens=k,
        tokens_per_step=stats.mean_tokens_per_step,
        acceptance_rate=stats.acceptance_rate,
        accepted_per_pos=[c / steps for c in per_pos[:k]],
        num_steps=stats.num_drafts,
        num_output_tokens=sum(len(g) for g in got),
        greedy_equal=None if base is None else not mismatched,
        mismatched_prompts=mismatched,
        spec_wall_s=spec_wall,
        base_wall_s=base_wall,
    )


def simulate_greedy_speculation(
    head: Any,
    rows: list[dict[str, Any]],
    k: int,
    batch_tokens: int = 4096,
    feature_cache: str | None = None,
) -> EvalResult:
    """Offline estimate from distilled responses (no engine): the training forward, fed its
    own argmax, proposes the engine's drafts at every root, so walking each response the way
    greedy verification does (accept the matching prefix, then one more token) gives the
    tokens per step the engine would see on these outputs."""
    import torch

    from tandem.training import data as D
    from tandem.training.features import compute_features
    from tandem.training.ttt import dense_attention, unroll_draft

    target = head.target
    from tandem.training.eagle3 import default_capture_layers

    layers = int(target.config.num_hidden_layers)
    capture = getattr(head, "capture_layers", None) or default_capture_layers(layers)
    seqs = D.response_sequences(rows, max_len=1 << 30)
    steps = emitted = drafted = accepted = 0
    per_pos = [0] * k
    batches = D.make_batches(seqs, batch_tokens)
    store = None
    if feature_cache:  # bf16 features, kept for the next evaluation
        from tandem.training.features import FeatureStore

        store = FeatureStore(target, seqs, batches, tuple(capture), feature_cache)
    for n, idx in enumerate(batches):
        if store is not None:
            f = store.get(n)
        else:
            batch = D.collate([seqs[i] for i in idx])
            f = compute_features(target, batch, tuple(capture), torch.float32)
        with torch.no_grad(), dense_attention(head.draft):
            outs = unroll_draft(
                head.draft, f.tokens, head.hidden0(f), k, lambda j, h: head.predict(h)
            )
            preds = torch.stack([head.predict(o) for o in outs], -1).tolist()  # [B, T, K]
        for b, i in enumerate(idx):
            tokens, start = seqs[i].tokens, seqs[i].label_start
            root = start - 1  # drafts proposed after prefill sampled the first token
            while root + 2 < len(tokens):
                n = 0
                while (
                    n < k
                    and root + 2 + n < len(tokens)
                    and preds[b][root][n] == tokens[root + 2 + n]
                ):
                    per_pos[n] += 1
                    n += 1
                steps += 1
                drafted += min(k, len(tokens) - root - 2)
                accepted += n
                emitted += n + 1
                root += n + 1
    return EvalResult(
        num_prompts=len(seqs),
        num_speculative_tokens=k,
        tokens_per_step=emitted / max(1, steps),
        acceptance_rate=accepted / max(1, drafted),
        accepted_per_pos=[c / max(1, steps) for c in per_pos],
        num_steps=steps,
        num_output_tokens=sum(len(s.tokens) - s.label_start for s in seqs),
        greedy_equal=None,
    )


def load_trained_head(method: str, folder: str, target: Any, target_path: str) -> Any:
    """A saved head as a training-side head object (for offline evaluation or fine-tuning)."""
    import json
    from pathlib import Path

    if method == "eagle3":
        from tandem.training.eagle3 import Eagle3Head, head_vocab_ids

        cfg = json.loads((Path(folder) / "config.json").read_text())
        capture = tuple(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
        head = Eagle3Head(target, head_vocab_ids(folder), capture)
    else:
        from tandem.training.mtp import MTPHead

        head = MTPHead(target, target_path)
    head.load_head(folder)
    return head
