"""``tandem train-draft``: train (``--resume``: continue) or evaluate (``--eval-only``) a draft
head. Light at import: torch and the trainer load only when the command runs."""

from __future__ import annotations

import argparse
import json
import logging
import sys
from pathlib import Path
from typing import Any


def _layers(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a list of layer indices: {text!r}") from None


def add_train_draft_parser(sub: Any) -> argparse.ArgumentParser:
    """Register ``train-draft`` on the ``tandem`` subcommand parser."""
    p = sub.add_parser(
        "train-draft",
        help="train an Eagle3 or MTP draft head for a Llama-family target",
        description="Train a draft head on the target's own greedy answers (self-distillation) "
        "and/or text files, then optionally measure it with the engine.",
    )
    p.add_argument("--method", required=True, choices=("eagle3", "mtp"))
    p.add_argument("--target", default=None, help="target model folder (default: built-in)")
    p.add_argument("--out", required=True, help="folder of the head (and its training state)")
    d = p.add_argument_group("data")
    d.add_argument(
        "--responses",
        action="append",
        default=None,
        metavar="FILE",
        help="reuse distilled responses (JSONL, .gz too; read only, complete lines); repeatable",
    )
    d.add_argument("--prompts", default=None, metavar="FILE", help="prompts to self-distill")
    d.add_argument("--num-prompts", type=int, default=None)
    d.add_argument(
        "--synthesize-prompts",
        type=int,
        default=None,
        metavar="N",
        help="the target writes N user prompts of its own (OUT/prompts.jsonl; the eval prompts "
        "excluded) and answers them",
    )
    d.add_argument("--max-response-tokens", type=int, default=320)
    d.add_argument(
        "--distill-temperature",
        type=float,
        default=0.0,
        metavar="T",
        help="sample the distilled answers at T (answer i with seed --seed + i; soft labels "
        "only); 0 = greedy",
    )
    d.add_argument("--text-file", action="append", default=[], metavar="FILE")
    d.add_argument(
        "--no-distill", action="store_true", help="train on --text-file only (no generation)"
    )
    d.add_argument("--max-seq-len", type=int, default=1024)
    t = p.add_argument_group("training")
    t.add_argument("--epochs", type=float, default=1.0)
    t.add_argument(
        "--max-steps",
        type=int,
        default=None,
        help="steps in all (instead of --epochs); with --resume, a new end for the run's schedule",
    )
    t.add_argument("--batch-tokens", type=int, default=4096, help="padded tokens per batch")
    t.add_argument("--lr", type=float, default=1e-3)
    t.add_argument("--warmup-steps", type=int, default=20)
    t.add_argument("--ttt-steps", type=int, default=3, help="draft steps unrolled in training")
    t.add_argument("--step-decay", type=float, default=0.8, help="loss weight of step j: d**j")
    t.add_argument(
        "--labels",
        default="soft",
        choices=("soft", "hard"),
        help="learn the target's distribution (soft, Eagle3's loss) or its greedy token (hard)",
    )
    t.add_argument(
        "--bf16",
        action="store_true",
        help="train under bf16 autocast (fp32 weights): faster on GPUs and CPUs with AVX-512 "
        "BF16 or AMX, many times slower on AVX2-only CPUs",
    )
    t.add_argument("--draft-vocab-size", type=int, default=8192, help="Eagle3 only")
    t.add_argument("--capture-layers", type=_layers, default=None, help="Eagle3: e.g. 1,14,26")
    t.add_argument("--max-loss-rows", type=int, default=1024, help="MTP: LM-head rows per step")
    t.add_argument(
        "--init",
        default="head",
        choices=("head", "scratch"),
        help="a new head's start: from the target's LM head (head) or random (scratch)",
    )
    t.add_argument("--seed", type=int, default=0)
    t.add_argument(
        "--threads",
        type=int,
        default=None,
        help="torch threads (default: $OMP_NUM_THREADS, else all the cores)",
    )
    t.add_argument("--device", default="cpu")
    r = p.add_argument_group("run")
    r.add_argument("--feature-cache", default=None, metavar="DIR", help="reuse target features")
    r.add_argument(
        "--init-from", default=None, metavar="DIR", help="start from a trained head (fine-tune)"
    )
    r.add_argument(
        "--new-vocab",
        action="store_true",
        help="Eagle3 with --init-from: choose the draft vocabulary from this run's data "
        "(--draft-vocab-size tokens); LM-head rows of tokens in both carry over",
    )
    r.add_argument("--save-every", type=int, default=50)
    r.add_argument("--time-limit", type=float, default=None, metavar="SECONDS")
    r.add_argument("--resume", action="store_true")
    r.add_argument("--no-progress", action="store_true")
    e = p.add_argument_group("evaluation")
    e.add_argument("--eval", action="store_true", help="evaluate the head after training")
    e.add_argument("--eval-only", action="store_true", help="evaluate the head in --out")
    e.add_argument("--eval-prompts", default=None, metavar="FILE", help="default: shipped set")
    e.add_argument("--eval-max-tokens", type=int, default=256)
    e.add_argument("--num-speculative-tokens", type=int, default=3)
    e.add_argument("--eval-json", default=None, metavar="FILE", help="write the numbers here")
    e.add_argument(
        "--eval-baseline",
        default=None,
        metavar="FILE",
        help="outputs without speculation (responses JSONL): reused, or generated and kept",
    )
    e.add_argument(
        "--eval-offline",
        action="store_true",
        help="also estimate from the baseline with the training forward (no engine)",
    )
    return p


def run_train_draft(ns: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    try:
        if not ns.eval_only:
            result = _train(ns)
            print(json.dumps({"trained": result}, indent=2))
        if ns.eval or ns.eval_only:
            _evaluate(ns)
    except ValueError as e:
        print(f"tandem train-draft: error: {e}", file=sys.stderr)
        return 2
    return 0


def _train(ns: argparse.Namespace) -> dict[str, Any]:
    from dataclasses import asdict

    from tandem.training.trainer import TrainArgs, train_draft

    args = TrainArgs(
        method=ns.method,
        out=ns.out,
        target=ns.target,
        responses=tuple(ns.responses or ()),
        distill_temperature=ns.distill_temperature,
        prompts=ns.prompts,
        num_prompts=ns.num_prompts,
        synthesize_prompts=ns.synthesize_prompts,
        eval_prompts=ns.eval_prompts,
        text_files=tuple(ns.text_file),
        distill=not ns.no_distill,
        max_response_tokens=ns.max_response_tokens,
        max_seq_len=ns.max_seq_len,
        batch_tokens=ns.batch_tokens,
        epochs=ns.epochs,
        max_steps=ns.max_steps,
        lr=ns.lr,
        warmup_steps=ns.warmup_steps,
        ttt_steps=ns.ttt_steps,
        step_decay=ns.step_decay,
        labels=ns.labels,
        bf16=ns.bf16,
        draft_vocab_size=ns.draft_vocab_size,
        capture_layers=ns.capture_layers,
        max_loss_rows=ns.max_loss_rows,
        feature_cache=ns.feature_cache,
        init_from=ns.init_from,
        new_vocab=ns.new_vocab,
        init=ns.init,
        save_every=ns.save_every,
        time_limit_s=ns.time_limit,
        resume=ns.resume,
        seed=ns.seed,
        threads=ns.threads,
        device=ns.device,
        progress=not ns.no_progress,
    )
    return asdict(train_draft(args))


def _evaluate(ns: argparse.Namespace) -> None:
    from dataclasses import asdict

    from tandem.training.data import load_prompts
    from tandem.training.evaluate import evaluate_head

    if ns.target is None:
        from tandem.models.builtin import builtin_model_path

        target = builtin_model_path()
    else:
        target = ns.target
    if not (Path(ns.out) / "model.safetensors").is_file():
        raise ValueError(f"no head to evaluate in {ns.out} (model.safetensors not found)")
    spec = {
        "method": ns.method,
        "model": ns.out,
        "num_speculative_tokens": ns.num_speculative_tokens,
    }
    prompts = load_prompts(ns.eval_prompts, name="eval")
    baseline = None
    report: dict[str, Any] = {}
    if ns.eval_baseline:
        from tandem.training.data import distill

        rows = distill(target, prompts, ns.eval_baseline, max_tokens=ns.eval_max_tokens)
        baseline = [list(r["response_ids"]) for r in rows]
        if ns.eval_offline:
            import torch

            from tandem.models.loader import load_model
            from tandem.training.evaluate import (
                load_trained_head,
                simulate_greedy_speculation,
            )

            model = load_model(target, dtype=torch.float32, device=ns.device)
            head = load_trained_head(ns.method, ns.out, model, target)
            sim = simulate_greedy_speculation(head, rows, ns.num_speculative_tokens)
            print("offline estimate (training forward on the baseline outputs):")
            print(sim.table())
            report["offline"] = asdict(sim)
    result = evaluate_head(
        target,
        spec,
        prompts,
        max_tokens=ns.eval_max_tokens,
        baseline=baseline,
        device=ns.device,
    )
    print("engine:")
    print(result.table())
    report["engine"] = asdict(result)
    if ns.eval_json:
        Path(ns.eval_json).write_text(json.dumps(report, indent=2) + "\n")
