"""Target features for draft training: one target forward per batch under ``inference_mode``,
optionally cached on disk so that later epochs (and the other head) skip the target."""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path

import torch
from torch import nn

from tandem.training.data import Batch, TrainSequence, collate
from tandem.training.ttt import dense_attention, target_forward

LOGITS_CHUNK = 1024  # rows per LM-head call when text labels need the target's argmax


@dataclass
class Features:
    tokens: torch.Tensor  # [B, T] int64
    labels: torch.Tensor  # [B, T] int64: the target's next token at each position, -1 = none
    aux: torch.Tensor  # [B, T, C*H] residual stream after each capture layer (Eagle3's input)
    final: torch.Tensor  # [B, T, H] final normed hidden (MTP's input)


def compute_features(
    target: nn.Module,
    batch: Batch,
    capture_layers: tuple[int, ...],
    dtype: torch.dtype = torch.bfloat16,
) -> Features:
    """Labels: a distilled response's own tokens from ``label_start`` on; for text, the
    target's argmax at the previous position."""
    b, t = batch.tokens.shape
    idx = torch.arange(t)
    valid = (idx >= batch.label_start[:, None]) & (idx < batch.lengths[:, None])
    with torch.inference_mode(), dense_attention(target):
        final, captured = target_forward(target, batch.tokens, capture_layers)
        labels = batch.tokens.clone()
        if bool(batch.from_text.any()):
            rows = final[batch.from_text].reshape(-1, final.shape[-1])
            pred = torch.cat(
                [
                    target.compute_logits(rows[s : s + LOGITS_CHUNK]).argmax(-1)
                    for s in range(0, rows.shape[0], LOGITS_CHUNK)
                ]
            ).view(-1, t)
            text = labels[batch.from_text]
            text[:, 1:] = pred[:, :-1]
            labels[batch.from_text] = text
        labels = labels.masked_fill(~valid, -1)
    # Copies outside inference mode: these are ordinary tensors autograd may save.
    return Features(
        tokens=batch.tokens.clone(),
        labels=labels.clone(),
        aux=torch.cat(captured, dim=-1).to(dtype, copy=True),
        final=final.to(dtype, copy=True),
    )


def feature_key(target: nn.Module, capture_layers: tuple[int, ...]) -> str:
    """What a cached sequence's features depend on besides its tokens."""
    name = str(getattr(target.config, "_name_or_path", "") or "")
    return json.dumps([str(Path(name).resolve()) if name else "", list(capture_layers)])


class FeatureStore:
    """Features of batch ``i``: from the cache folder when every sequence of the batch is there,
    else computed in one target forward (and each sequence cached). The cache is per sequence,
    keyed by its tokens, the target and the capture layers, so it stays valid as the data grow
    and is shared by both methods and by evaluation."""

    def __init__(
        self,
        target: nn.Module,
        seqs: list[TrainSequence],
        batches: list[list[int]],
        capture_layers: tuple[int, ...],
        cache_dir: str | os.PathLike | None = None,
    ) -> None:
        self.target = target
        self.seqs = seqs
        self.batches = batches
        self.capture_layers = capture_layers
        self.key = feature_key(target, capture_layers)
        self.cache = Path(cache_dir) if cache_dir else None
        if self.cache is not None:
            self.cache.mkdir(parents=True, exist_ok=True)

    def __len__(self) -> int:
        return len(self.batches)

    def num_tokens(self, index: int) -> int:
        return sum(len(self.seqs[i].tokens) for i in self.batches[index])

    def _path(self, seq: TrainSequence) -> Path:
        assert self.cache is not None
        h = hashlib.sha1(
            json.dumps([self.key, seq.tokens, seq.label_start, seq.from_text]).encode()
        )
        return self.cache / f"seq-{h.hexdigest()[:20]}.pt"

    def get(self, index: int) -> Features:
        seqs = [self.seqs[i] for i in self.batches[index]]
        if self.cache is not None:
            paths = [self._path(s) for s in seqs]
            if all(p.is_file() for p in paths):
                return _stack([torch.load(p, weights_only=True) for p in paths])
        f = compute_features(self.target, collate(seqs), self.capture_layers)
        if self.cache is not None:
            for b, (seq, path) in enumerate(zip(seqs, paths, strict=True)):
                n = len(seq.tokens)
                one = {
                    "tokens": f.tokens[b, :n].int().clone(),
                    "labels": f.labels[b, :n].int().clone(),
                    "aux": f.aux[b, :n].cpu().clone(),
                    "final": f.final[b, :n].cpu().clone(),
                }
                tmp = path.with_suffix(f".{os.getpid()}.tmp")  # runs may share the cache
                torch.save(one, tmp)
                os.replace(tmp, path)
        return f


def _stack(items: list[dict[str, torch.Tensor]]) -> Features:
    """Pad per-sequence features to one batch (tokens 0, labels -1, states 0)."""
    t = max(int(d["tokens"].shape[0]) for d in items)
    b = len(items)
    tokens = torch.zeros(b, t, dtype=torch.int64)
    labels = torch.full((b, t), -1, dtype=torch.int64)
    aux = items[0]["aux"].new_zeros(b, t, items[0]["aux"].shape[-1])
    final = items[0]["final"].new_zeros(b, t, items[0]["final"].shape[-1])
    for i, d in enumerate(items):
        n = int(d["tokens"].shape[0])
        tokens[i, :n] = d["tokens"]
        labels[i, :n] = d["labels"]
        aux[i, :n] = d["aux"]
        final[i, :n] = d["final"]
    return Features(tokens, labels, aux, final)
