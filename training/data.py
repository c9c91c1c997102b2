"""Training data for draft heads: the target's own greedy responses to a prompt set
(self-distillation, cached as JSONL) and/or plain text files, cut into batches.

A responses file holds one JSON object a line::

    {"prompt": str, "prompt_ids": [int], "response_ids": [int], "finish_reason": str}

plus ``"temperature": float`` on sampled answers (greedy ones leave it out).

Only complete lines count, so a file that another process is still appending to can be read.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
import os
import random
from collections.abc import Sequence
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

PROMPT_SETS = ("train", "eval")


@dataclass(frozen=True)
class TrainSequence:
    """One training sequence. Tokens from ``label_start`` on are labels: for a distilled
    response they are the target's own greedy tokens; for text (``from_text``) the labels are
    the target's argmax predictions, computed in the feature pass."""

    tokens: tuple[int, ...]
    label_start: int
    from_text: bool = False


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, T] int64, padded with 0 at the end
    lengths: torch.Tensor  # [B]
    label_start: torch.Tensor  # [B]
    from_text: torch.Tensor  # [B] bool


def shipped_prompts_path(name: str) -> Path:
    """The prompt set that ships with the project: ``train`` (2650) or ``eval`` (60)."""
    if name not in PROMPT_SETS:
        raise ValueError(f"prompt set {name!r} is unknown; use one of {PROMPT_SETS}")
    return Path(str(resources.files("tandem.training") / "data" / f"{name}_prompts.jsonl"))


def load_prompts(path: str | os.PathLike | None = None, name: str = "train") -> list[str]:
    """Prompts from a JSONL file of ``{"prompt": ...}`` lines (default: a shipped set)."""
    path = Path(path) if path is not None else shipped_prompts_path(name)
    prompts = []
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                prompts.append(str(json.loads(line)["prompt"]))
            except (ValueError, KeyError, TypeError):
                raise ValueError(f"{path}:{n}: expected a JSON object with a 'prompt'") from None
    return prompts


def chat_prompt_ids(tokenizer: Any, prompt: str) -> list[int]:
    """A user turn through the tokenizer's chat template, ready for the assistant's answer."""
    ids = tokenizer.apply_chat_template(
        [{"role": "user", "content": prompt}],
        add_generation_prompt=True,
        tokenize=True,
        return_dict=False,
    )
    return [int(i) for i in ids]


def read_responses(path: str | os.PathLike) -> list[dict[str, Any]]:
    """The complete lines of a responses file (a partial last line is ignored); ``.gz``
    files are read compressed."""
    rows: list[dict[str, Any]] = []
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        for line in f:
            if not line.endswith("\n"):
                break  # still being written
            try:
                row = json.loads(line)
            except ValueError:
                break
            rows.append(row)
    return rows


def _keep_lines(path: Path, n: int) -> None:
    """Cut ``path`` (if it exists) after its first ``n`` lines: drops a partial last line
    before a resumed run appends."""
    if not path.is_file():
        return
    raw = path.read_bytes()
    keep = sum(len(line) for line in raw.splitlines(keepends=True)[:n])
    if keep != len(raw):
        with open(path, "r+b") as f:
            f.truncate(keep)


def distill(
    target: str | os.PathLike,
    prompts: list[str],
    out: str | os.PathLike,
    max_tokens: int = 320,
    chunk: int = 32,
    temperature: float = 0.0,
    seed: int = 0,
    **engine_args: Any,
) -> list[dict[str, Any]]:
    """Generate the target's answers to ``prompts`` with our engine, appending them to ``out``;
    resumes after the complete lines already there (their prompts must match).

    ``temperature`` 0 gives the greedy answers; above 0, answer ``i`` is sampled with seed
    ``seed + i`` (reproducible, and resumable to the same text). Sampled answers widen the
    contexts the head sees; train on them with soft labels (the target's distribution at each
    position), since a sampled token is not the target's greedy choice."""
    from tandem import LLM, SamplingParams

    out = Path(out)
    done: list[dict[str, Any]] = read_responses(out) if out.is_file() else []
    for i, row in enumerate(done[: len(prompts)]):
        if row.get("prompt") != prompts[i]:
            raise ValueError(
                f"{out} line {i + 1} answers another prompt; remove it or pass another --out"
            )
        if float(row.get("temperature", 0.0)) != float(temperature):
            raise ValueError(
                f"{out} line {i + 1} was written at temperature {row.get('temperature', 0.0)}, "
                f"not {temperature}; remove it or pass another --out"
            )
    _keep_lines(out, len(done))
    todo = prompts[len(done) :]
    if not todo:
        return done[: len(prompts)]
    out.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    def params(i: int) -> SamplingParams:
        if temperature <= 0:
            return SamplingParams(temperature=0.0, max_tokens=max_tokens)
        return SamplingParams(temperature=temperature, seed=seed + i, max_tokens=max_tokens)

    with LLM(str(target), max_num_seqs=chunk, **engine_args) as llm, open(out, "a") as f:
        bar = tqdm(total=len(prompts), initial=len(done), desc="self-distillation", unit="prompt")
        for s in range(0, len(todo), chunk):
            part = todo[s : s + chunk]
            ids = [chat_prompt_ids(llm.tokenizer, p) for p in part]
            first = len(done)
            plist = [params(first + j) for j in range(len(part))]
            for p, pid, o in zip(part, ids, llm.generate(ids, plist), strict=True):
                row = {
                    "prompt": p,
                    "prompt_ids": pid,
                    "response_ids": list(o.outputs[0].token_ids),
                    "finish_reason": o.outputs[0].finish_reason,
                }
                if temperature > 0:
                    row["temperature"] = temperature
                f.write(json.dumps(row) + "\n")
                done.append(row)
            f.flush()
            bar.update(len(part))
        bar.close()
    return done


_TURN_MARK = "\x00TANDEM_USER_TURN\x00"


def user_turn_prefix(tokenizer: Any) -> tuple[list[int], list[int]]:
    """(the chat template's tokens up to a user message's text, the ids that end a user turn):
    a chat model continuing the prefix writes a user message of its own."""
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": _TURN_MARK}], tokenize=False, add_generation_prompt=False
    )
    if text.count(_TURN_MARK) != 1:
        raise ValueError("the tokenizer's chat template does not place a user message once")
    before, after = text.split(_TURN_MARK)
    ids = [int(i) for i in tokenizer.encode(before, add_special_tokens=False)]
    end = tokenizer.encode(after.strip(), add_special_tokens=False) if after.strip() else []
    stop = [int(end[0])] if len(end) == 1 else []
    return ids, stop


def prompt_key(text: str) -> str:
    """A prompt compared case- and spacing-blind."""
    return " ".join(text.lower().split())


def synthesize_prompts(
    target: str | os.PathLike,
    num: int,
    out: str | os.PathLike,
    exclude: Sequence[str] = (),
    seed: int = 0,
    temperature: float = 1.0,
    top_p: float = 0.95,
    max_tokens: int = 96,
    chunk: int = 64,
    **engine_args: Any,
) -> list[str]:
    """The target's own user prompts, ``num`` of them, appended to ``out`` (``{"prompt",
    "attempt"}`` lines; a rerun resumes after the last complete line): the chat template up to
    a user message, continued by the target (attempt ``j`` sampled with seed ``seed + j``),
    kept when the message ends its turn, has 3+ words and is neither a duplicate nor one of
    ``exclude`` (case and spacing ignored). Gives a target without a prompt set varied
    prompts from its own chat distribution to self-distill (the shipped eval prompts are
    excluded by the CLI). At most ``4 * num`` attempts; fewer prompts come back if they run out."""
    from tandem import LLM, SamplingParams

    if num < 1:
        raise ValueError(f"num={num!r} is invalid: must be >= 1")
    out = Path(out)
    rows = read_responses(out) if out.is_file() else []
    prompts = [str(r["prompt"]) for r in rows]
    seen = {prompt_key(p) for p in prompts} | {prompt_key(p) for p in exclude}
    attempt = int(rows[-1].get("attempt", len(rows) - 1)) + 1 if rows else 0
    _keep_lines(out, len(rows))
    if len(prompts) >= num:
        return prompts[:num]
    out.parent.mkdir(parents=True, exist_ok=True)
    from tqdm import tqdm

    with LLM(str(target), max_num_seqs=chunk, **engine_args) as llm, open(out, "a") as f:
        prefix, stop = user_turn_prefix(llm.tokenizer)
        bar = tqdm(total=num, initial=len(prompts), desc="prompt synthesis", unit="prompt")
        tried = kept = 0  # this run's attempts and kept prompts: the last chunk asks for fewer
        while len(prompts) < num and attempt < 4 * num:
            need = num - len(prompts)
            n = min(chunk, 4 * num - attempt, max(need, -(-need * tried // max(kept, 1))))
            params = [
                SamplingParams(
                    temperature=temperature,
                    top_p=top_p,
                    seed=seed + attempt + j,
                    max_tokens=max_tokens,
                    stop_token_ids=stop,
                )
                for j in range(n)
            ]
            for j, o in enumerate(llm.generate([prefix] * n, params)):
                text = o.outputs[0].text.strip()
                key = prompt_key(text)
                if o.outputs[0].finish_reason != "stop" or len(key.split()) < 3 or key in seen:
                    continue
                seen.add(key)
                if len(prompts) < num:
                    prompts.append(text)
                    f.write(json.dumps({"prompt": text, "attempt": attempt + j}) + "\n")
                    bar.update(1)
                    kept += 1
            attempt += n
            tried += n
            f.flush()
        bar.close()
    if len(prompts) < num:
        logger.warning("prompt synthesis kept %d of %d prompts", len(prompts), num)
    return prompts


def response_sequences(rows: list[dict[str, Any]], max_len: int) -> list[TrainSequence]:
    seqs = []
    for row in rows:
        prompt, response = list(row["prompt_ids"]), list(row["response_ids"])
        tokens = (prompt + response)[:max_len]
        if len(response) >= 2 and len(tokens) > len(prompt) + 1:
            seqs.append(TrainSequence(tuple(tokens), len(prompt)))
    return seqs


def text_sequences(tokenizer: Any, files: list[str], seq_len: int) -> list[TrainSequence]:
    """Each file tokenized whole (no special tokens) and cut into ``seq_len`` pieces."""
    seqs = []
    for name in files:
        text = Path(name).read_text(encoding="utf-8")
        ids = tokenizer.encode(text, add_special_tokens=False)
        for s in range(0, len(ids), seq_len):
            piece = ids[s : s + seq_len]
            if len(piece) >= 4:
                seqs.append(TrainSequence(tuple(int(i) for i in piece), 1, from_text=True))
    return seqs


def fingerprint(seqs: list[TrainSequence], extra: Any = None) -> str:
    h = hashlib.sha1(json.dumps(extra, sort_keys=True, default=str).encode())
    for s in seqs:
        h.update(json.dumps([s.tokens, s.label_start, s.from_text]).encode())
    return h.hexdigest()[:16]


def make_batches(
    seqs: list[TrainSequence], batch_tokens: int, max_batch: int = 64
) -> list[list[int]]:
    """Sequence indices per batch: sorted by length so that padding stays small, each batch at
    most ``batch_tokens`` padded tokens (one over-long sequence still makes a batch)."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i].tokens), i))
    batches: list[list[int]] = []
    current: list[int] = []
    for i in order:
        longest = len(seqs[i].tokens)  # sorted: the newest is the longest
        if current and (longest * (len(current) + 1) > batch_tokens or len(current) >= max_batch):
            batches.append(current)
            current = []
        current.append(i)
    if current:
        batches.append(current)
    return batches


def epoch_order(num_batches: int, epoch: int, seed: int) -> list[int]:
    order = list(range(num_batches))
    random.Random(seed * 1_000_003 + epoch).shuffle(order)
    return order


def collate(seqs: list[TrainSequence]) -> Batch:
    t = max(len(s.tokens) for s in seqs)
    tokens = torch.zeros(len(seqs), t, dtype=torch.int64)
    for i, s in enumerate(seqs):
        tokens[i, : len(s.tokens)] = torch.tensor(s.tokens)
    return Batch(
        tokens=tokens,
        lengths=torch.tensor([len(s.tokens) for s in seqs]),
        label_start=torch.tensor([s.label_start for s in seqs]),
        from_text=torch.tensor([s.from_text for s in seqs]),
    )


def token_counts(seqs: list[TrainSequence], vocab_size: int) -> torch.Tensor:
    """How often each token appears as a label (response tokens; all tokens of text)."""
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    for s in seqs:
        ids = torch.tensor(s.tokens[s.label_start :], dtype=torch.int64)
        counts += torch.bincount(ids, minlength=vocab_size)[:vocab_size]
    return counts


def choose_draft_vocab(counts: torch.Tensor, size: int, always: list[int] = ()) -> torch.Tensor:
    """The ``size`` most frequent label tokens (plus ``always``, e.g. EOS), sorted by id."""
    size = min(size, counts.numel())
    score = counts.double().clone()
    for t in always:
        score[t] = float("inf")
    # Ties (unseen tokens) go to the lower id, deterministically.
    score -= torch.arange(counts.numel(), dtype=torch.float64) * 1e-9
    return score.topk(size).indices.sort().values
