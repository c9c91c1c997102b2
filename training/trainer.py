"""``train_draft``: train an Eagle3 or MTP head for a Llama-family target, on CPU or GPU.

Per step: one batch of sequences → target features (one ``inference_mode`` forward, or the
feature cache) → the draft unrolled ``ttt_steps`` times as the engine's draft loop runs it →
the summed per-step losses (weighted ``step_decay ** j``) → one AdamW step. Checkpoints
(``training_state.pt``) and the exported head are written every ``save_every`` steps and at
the end; ``resume=True`` continues from the last checkpoint with the same data and schedule
(a different ``max_steps`` moves the schedule's end: the cosine goes on from the current step).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.models.device import cpu_threads
from tandem.training import data as D
from tandem.training.features import FeatureStore
from tandem.training.ttt import dense_attention, unroll_draft

logger = logging.getLogger(__name__)

STATE_FILE = "training_state.pt"
LOG_FILE = "train_log.jsonl"
METHODS = ("eagle3", "mtp")
LABELS = ("soft", "hard")
_HARD_ON_SAMPLED = (
    "{what} with labels='hard' would teach the sampled tokens, not the target's greedy ones: "
    "use labels='soft'"
)


@dataclass
class TrainArgs:
    method: str
    out: str
    target: str | None = None  # default: the built-in model
    # Reuse responses JSONL files, read in order (read only; the last may still be growing).
    responses: str | tuple[str, ...] | None = None
    prompts: str | None = None  # prompt JSONL to self-distill (default: the shipped train set)
    num_prompts: int | None = None
    # The target writes this many user prompts of its own (OUT/prompts.jsonl) to self-distill.
    synthesize_prompts: int | None = None
    eval_prompts: str | None = None  # held out of synthesis (default: the shipped eval set)
    text_files: tuple[str, ...] = ()
    distill: bool = True
    max_response_tokens: int = 320
    distill_temperature: float = 0.0  # 0: greedy answers; above: sampled (soft labels only)
    max_seq_len: int = 1024
    batch_tokens: int = 4096
    epochs: float = 1.0
    max_steps: int | None = None
    lr: float = 1e-3
    min_lr_ratio: float = 0.1
    warmup_steps: int = 20
    weight_decay: float = 0.0
    grad_clip: float = 1.0
    ttt_steps: int = 3
    step_decay: float = 0.8
    labels: str = "soft"  # soft: the target's distribution (Eagle3's loss); hard: its token
    bf16: bool = False  # the draft's forward and backward under bf16 autocast (fp32 weights)
    draft_vocab_size: int = 8192
    capture_layers: tuple[int, ...] | None = None
    max_loss_rows: int = 1024
    feature_cache: str | None = None
    init_from: str | None = None  # start from a trained head of the same method (fine-tune)
    # Eagle3 with init_from: choose the draft vocabulary from this run's data (rows carry over).
    new_vocab: bool = False
    init: str = "head"  # a new head's start: "head" (the target's LM head rows) or "scratch"
    save_every: int = 50
    log_every: int = 10
    time_limit_s: float | None = None
    resume: bool = False
    seed: int = 0
    threads: int | None = None
    device: str = "cpu"
    progress: bool = True

    def __post_init__(self) -> None:
        if self.method not in METHODS:
            raise ValueError(f"method={self.method!r} is invalid: use one of {METHODS}")
        if self.labels not in LABELS:
            raise ValueError(f"labels={self.labels!r} is invalid: use one of {LABELS}")
        for name in ("batch_tokens", "ttt_steps", "draft_vocab_size", "save_every", "log_every"):
            if int(getattr(self, name)) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} is invalid: must be >= 1")
        if self.epochs <= 0 and self.max_steps is None:
            raise ValueError(f"epochs={self.epochs!r} is invalid: must be > 0")
        if self.max_steps is not None and self.max_steps < 1:
            raise ValueError(f"max_steps={self.max_steps!r} is invalid: must be >= 1")
        if self.lr <= 0:
            raise ValueError(f"lr={self.lr!r} is invalid: must be > 0")
        n = self.synthesize_prompts
        if n is not None and (not isinstance(n, int) or isinstance(n, bool) or n < 1):
            raise ValueError(f"synthesize_prompts={n!r} is invalid: must be an integer >= 1")
        if n is not None and not self.distill:
            raise ValueError("synthesize_prompts answers its prompts: it needs distill=True")
        if n is not None and (self.prompts or self.responses):
            raise ValueError(
                "synthesize_prompts writes the prompts to answer: give it without prompts or "
                "responses (reused answers), not both"
            )
        if self.new_vocab and (self.method != "eagle3" or not self.init_from):
            raise ValueError(
                "new_vocab re-chooses an Eagle3 head's draft vocabulary: give it with "
                "method='eagle3' and init_from"
            )
        t = self.distill_temperature
        if not isinstance(t, int | float) or isinstance(t, bool) or not 0 <= t <= 2:
            raise ValueError(f"distill_temperature={t!r} is invalid: must be in [0, 2]")
        if t > 0 and self.labels == "hard":
            raise ValueError(_HARD_ON_SAMPLED.format(what=f"distill_temperature={t!r}"))

    @property
    def response_files(self) -> tuple[str, ...]:
        if isinstance(self.responses, str):
            return (self.responses,)
        return tuple(str(r) for r in self.responses or ())


@dataclass
class TrainResult:
    out: str
    steps: int
    total_steps: int
    num_sequences: int
    num_tokens: int
    wall_s: float
    last: dict[str, Any] = field(default_factory=dict)  # the last logged losses / accuracies


def lr_factor(step: int, total: int, warmup: int, min_ratio: float) -> float:
    """Linear warm-up, then cosine decay to ``min_ratio``."""
    if step < warmup:
        return (step + 1) / warmup
    frac = min(1.0, (step - warmup) / max(1, total - warmup))
    return min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * frac))


def _load_target(path: str, device: str) -> Any:
    from tandem.models.loader import load_model

    target = load_model(path, dtype=torch.float32, device=device)
    target.requires_grad_(False)
    return target


def _sequences(args: TrainArgs, target_path: str, tokenizer: Any, num_rows: int | None) -> tuple:
    """(sequences, responses rows used)."""
    rows: list[dict[str, Any]] = []
    if args.response_files:
        rows = [row for name in args.response_files for row in D.read_responses(name)]
        if args.num_prompts is not None:
            rows = rows[: args.num_prompts]
    elif args.distill and (args.prompts or args.synthesize_prompts or not args.text_files):
        if args.synthesize_prompts:
            prompts = D.synthesize_prompts(
                target_path,
                args.synthesize_prompts,
                Path(args.out) / "prompts.jsonl",
                exclude=D.load_prompts(args.eval_prompts, name="eval"),
                seed=args.seed,
                device=args.device,
            )
        else:
            prompts = D.load_prompts(args.prompts)
        if args.num_prompts is not None:
            prompts = prompts[: args.num_prompts]
        rows = D.distill(
            target_path,
            prompts,
            Path(args.out) / "responses.jsonl",
            max_tokens=args.max_response_tokens,
            temperature=args.distill_temperature,
            seed=args.seed,
            device=args.device,
        )
    if args.labels == "hard" and any(row.get("temperature", 0) > 0 for row in rows):
        raise ValueError(_HARD_ON_SAMPLED.format(what="responses sampled with a temperature"))
    if num_rows is not None:  # resuming: the data the run started with
        if len(rows) < num_rows:
            raise ValueError(f"resume needs {num_rows} response lines, found {len(rows)}")
        rows = rows[:num_rows]
    seqs = D.response_sequences(rows, args.max_seq_len)
    if args.text_files:
        seqs += D.text_sequences(tokenizer, list(args.text_files), args.max_seq_len)
    if not seqs:
        raise ValueError("no training data: give --responses, prompts to distill or --text-file")
    return seqs, len(rows)


def _capture_layers(args: TrainArgs, target: Any) -> tuple[int, ...]:
    from tandem.training.eagle3 import default_capture_layers

    layers = args.capture_layers or default_capture_layers(int(target.config.num_hidden_layers))
    return tuple(int(i) for i in layers)


def _make_head(args: TrainArgs, target: Any, target_path: str, seqs: list, saved: dict) -> Any:
    if args.method == "mtp":
        from tandem.training.mtp import MTPHead

        return MTPHead(
            target, target_path, max_loss_rows=args.max_loss_rows, seed=args.seed, init=args.init
        )
    from tandem.training.eagle3 import Eagle3Head

    capture = tuple(saved.get("capture_layers") or _capture_layers(args, target))
    if "vocab_ids" in saved:
        vocab_ids = saved["vocab_ids"]
    elif args.init_from and not args.new_vocab:
        from tandem.training.eagle3 import head_vocab_ids

        vocab_ids = head_vocab_ids(args.init_from)
    else:
        eos = getattr(target.config, "eos_token_id", None)
        always = [eos] if isinstance(eos, int) else list(eos or [])
        counts = D.token_counts(seqs, int(target.config.vocab_size))
        vocab_ids = D.choose_draft_vocab(counts, args.draft_vocab_size, always)
    return Eagle3Head(target, vocab_ids, capture, seed=args.seed, init=args.init)


def _cpu_has_bf16() -> bool:
    """Whether this CPU has native bf16 matmul instructions (AVX-512 BF16 or AMX)."""
    return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())


def train_draft(args: TrainArgs) -> TrainResult:
    """Train (or resume training) a draft head; the head is written to ``args.out``. Runs on
    ``args.threads`` torch threads (default: ``cpu_threads()``, all the cores unless
    ``$OMP_NUM_THREADS`` says otherwise) and gives the caller's setting back afterwards."""
    previous = torch.get_num_threads()
    torch.set_num_threads(args.threads or cpu_threads())
    try:
        return _train_draft(args)
    finally:
        torch.set_num_threads(previous)


def _train_draft(args: TrainArgs) -> TrainResult:
    from transformers import AutoTokenizer

    start_wall = time.monotonic()
    torch.manual_seed(args.seed)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    if args.target is None:
        from tandem.models.builtin import builtin_model_path

        target_path = builtin_model_path()
    else:
        target_path = str(args.target)
    state_path = out / STATE_FILE
    saved: dict[str, Any] = {}
    if args.resume:
        if not state_path.is_file():
            raise ValueError(f"--resume: no {STATE_FILE} in {out}")
        saved = torch.load(state_path, weights_only=False)
        if saved["method"] != args.method:
            raise ValueError(f"--resume: {out} trains a {saved['method']} head, not {args.method}")
    elif state_path.is_file():
        raise ValueError(f"{out} holds a training run; pass --resume or another --out")

    if args.bf16 and torch.device(args.device).type == "cpu" and not _cpu_has_bf16():
        logger.warning(
            "--bf16 on a CPU without AVX-512 BF16 or AMX: bf16 matmuls are emulated there and "
            "training runs many times slower than fp32 (drop --bf16)"
        )
    target = _load_target(target_path, args.device)
    tokenizer = AutoTokenizer.from_pretrained(target_path)
    # Rotary tables cover max_position_embeddings (+ a margin for the draft steps).
    limit = int(getattr(target.config, "max_position_embeddings", args.max_seq_len))
    if args.max_seq_len > limit:
        args = dataclasses.replace(args, max_seq_len=limit)
    seqs, num_rows = _sequences(args, target_path, tokenizer, saved.get("num_rows"))
    batches = D.make_batches(seqs, args.batch_tokens)
    with torch.device(args.device):  # modules are built in place (no .to(): rope caches)
        head = _make_head(args, target, target_path, seqs, saved)
    draft = head.draft
    # Features hold the Eagle3 capture layers for either method, so both share one cache.
    capture = getattr(head, "capture_layers", None) or _capture_layers(args, target)
    key = D.fingerprint(
        seqs, [str(Path(target_path).resolve()), capture, args.batch_tokens, args.max_seq_len]
    )
    if saved and saved["key"] != key:
        raise ValueError("--resume: the training data differ from the run's; cannot resume")
    store = FeatureStore(target, seqs, batches, tuple(capture), args.feature_cache)
    nb = len(batches)
    total = args.max_steps or max(1, math.ceil(args.epochs * nb))
    params = [p for p in draft.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=args.lr, betas=(0.9, 0.95), weight_decay=args.weight_decay)
    step = 0
    if args.init_from and not saved:
        if args.new_vocab:
            head.load_head(args.init_from, new_vocab=True)
        else:
            head.load_head(args.init_from)
    elif saved and "input_scale" in saved:
        head.input_scale = saved["input_scale"]
    elif hasattr(head, "set_input_scale"):  # a new Eagle3 head: from the first batch
        head.set_input_scale(store.get(D.epoch_order(nb, 0, args.seed)[0]).aux)
    if saved and saved.get("mtp_d2t") is not None:  # an MTP head's carried draft vocabulary
        head.d2t = saved["mtp_d2t"]
    if saved:
        draft.load_state_dict(saved["draft"])
        opt.load_state_dict(saved["optimizer"])
        step = int(saved["step"])
        total = int(saved["total_steps"])
        if args.max_steps is not None and args.max_steps != total:  # a new schedule end
            if args.max_steps <= step:
                raise ValueError(
                    f"--resume --max-steps {args.max_steps}: the run is at step {step} already"
                )
            total = args.max_steps
    num_tokens = sum(len(s.tokens) for s in seqs)
    logger.info(
        "training %s head: %d sequences (%d tokens), %d batches, %d steps",
        args.method, len(seqs), num_tokens, nb, total,
    )  # fmt: skip

    def save() -> None:
        state = {
            "method": args.method,
            "step": step,
            "total_steps": total,
            "key": key,
            "num_rows": num_rows,
            "draft": draft.state_dict(),
            "optimizer": opt.state_dict(),
            "args": asdict(args),
            **head.extra_state(),
        }
        tmp = state_path.with_suffix(".tmp")
        torch.save(state, tmp)
        os.replace(tmp, state_path)
        head.export(out)

    from tqdm import tqdm

    bar = tqdm(total=total, initial=step, desc=f"train {args.method}", disable=not args.progress)
    window: dict[str, float] = {}
    last: dict[str, Any] = {}
    seen_tokens, t0 = 0, time.monotonic()
    stopped_early = False
    while step < total:
        epoch, pos = divmod(step, nb)
        index = D.epoch_order(nb, epoch, args.seed)[pos]
        for g in opt.param_groups:
            g["lr"] = args.lr * lr_factor(step, total, args.warmup_steps, args.min_lr_ratio)
        stats = train_step(head, store.get(index), args, opt, params)
        step += 1
        seen_tokens += store.num_tokens(index)
        for k, v in stats.items():
            window[k] = window.get(k, 0.0) + v
        bar.update(1)
        if step % args.log_every == 0 or step == total:
            last = _summarize(window, step, time.monotonic() - t0, seen_tokens)
            window = {}
            bar.set_postfix({k: last[k] for k in last if k.startswith(("loss", "acc"))})
            with open(out / LOG_FILE, "a") as f:
                f.write(json.dumps(last) + "\n")
        if step % args.save_every == 0 or step == total:
            save()
        if args.time_limit_s is not None and time.monotonic() - start_wall > args.time_limit_s:
            stopped_early = step < total
            break
    if stopped_early:
        save()
        logger.info("time limit reached at step %d of %d; --resume continues", step, total)
    bar.close()
    return TrainResult(
        out=str(out),
        steps=step,
        total_steps=total,
        num_sequences=len(seqs),
        num_tokens=num_tokens,
        wall_s=time.monotonic() - start_wall,
        last=last,
    )


def train_step(
    head: Any, feats: Any, args: TrainArgs, opt: torch.optim.Optimizer, params: list
) -> dict[str, float]:
    """One optimizer step over one batch; returns summed per-step losses and counts.

    ``labels="soft"``: step ``j`` of the chain rooted at row ``i`` learns the target's own
    distribution for the token at ``i + j + 2`` (its LM head over the final state of row
    ``i + j + 1``); the logged loss is then the KL divergence (0 when the draft matches the
    target). ``"hard"``: cross-entropy against the target's greedy token."""
    device = torch.device(args.device)
    tokens = feats.tokens.to(device)
    labels = feats.labels.to(device)
    feats.aux, feats.final = feats.aux.to(device), feats.final.to(device)
    draft = head.draft
    t = tokens.shape[1]
    draft.train()
    amp = torch.autocast(device.type, dtype=torch.bfloat16, enabled=args.bf16)
    with dense_attention(draft), amp:
        outs = unroll_draft(draft, tokens, head.hidden0(feats), args.ttt_steps)
    total = torch.zeros((), device=device)
    stats: dict[str, float] = {}
    for j, hidden in enumerate(outs):
        # Step j of the chain rooted at row i predicts the token at i + j + 2.
        lab = torch.full_like(labels, -1)
        n = labels.shape[1] - (j + 2)
        if n > 0:
            lab[:, :n] = labels[:, j + 2 :]
        valid = lab >= 0
        count = int(valid.sum())
        if count == 0:
            continue
        teacher = None
        if args.labels == "soft":  # the final state that predicts the token at i + j + 2
            teacher = feats.final[:, j + 1 :][valid[:, : t - j - 1]]
        with amp:
            loss, correct = head.loss(hidden[valid], lab[valid], teacher)
        total = total + (args.step_decay**j) * loss
        stats[f"loss{j}"] = float(loss.detach()) * count
        stats[f"acc{j}"] = float(correct)
        stats[f"n{j}"] = float(count)
    opt.zero_grad(set_to_none=True)
    if total.requires_grad:
        total.backward()
        torch.nn.utils.clip_grad_norm_(params, args.grad_clip)
        opt.step()
    draft.eval()
    return stats


def _summarize(window: dict[str, float], step: int, elapsed: float, tokens: int) -> dict:
    out: dict[str, Any] = {"step": step, "elapsed_s": round(elapsed, 1)}
    j = 0
    while f"n{j}" in window:
        n = max(1.0, window[f"n{j}"])
        out[f"loss{j}"] = round(window[f"loss{j}"] / n, 4)
        out[f"acc{j}"] = round(window[f"acc{j}"] / n, 4)
        j += 1
    out["tok_s"] = round(tokens / max(elapsed, 1e-9), 1)
    return out
