"""MTP head training: the inference module ``models.mtp.MTPDraft`` (one DeepSeek-layout MTP
layer, reused K times at serving), with the embedding and LM head shared with — and frozen
from — the target. Written as a folder ``load_draft`` reads with ``spec.model`` = the folder:
the target's ``config.json`` and tensors ``model.layers.{num_hidden_layers}.*`` only."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.mtp import MTPDraft
from tandem.models.parallel import ParallelMapping
from tandem.training.export import init_linear_, save_head, unfused_state
from tandem.training.features import Features


class MTPHead:
    """The trainable MTP layer bound to a frozen target."""

    method = "mtp"

    def __init__(
        self,
        target: nn.Module,
        target_path: str | os.PathLike,
        max_loss_rows: int = 1024,
        seed: int = 0,
        init: str = "head",
    ) -> None:
        if init not in ("head", "scratch"):
            raise ValueError(f"init={init!r} is invalid: use head or scratch")
        self.init_mode = init
        self.target = target
        self.target_config = target.config
        self.target_path = Path(target_path)
        self.max_loss_rows = max_loss_rows
        self.generator = torch.Generator().manual_seed(seed + 1)
        self.draft = MTPDraft(
            target.config,
            ParallelMapping(),
            1,
            bool(type(target).qkv_bias or getattr(target.config, "attention_bias", False)),
            bool(type(target).qk_norm),
        )
        self.draft.bind_target(target)
        self.d2t: torch.Tensor | None = None  # a draft vocabulary carried over by load_head
        self._init(target, seed)
        for p in self.draft.parameters():
            p.requires_grad_(True)

    def _init(self, target: nn.Module, seed: int) -> None:
        """Random linears, ones norms; with ``head`` (default) ``shared_head.norm`` starts
        as the target's final norm (the scale its shared LM head expects)."""
        g = torch.Generator().manual_seed(seed)
        layer = self.draft.mtp_layers[0]
        for module in layer.modules():
            w = getattr(module, "weight", None)
            if w is not None and w.dim() == 2:
                init_linear_(w, g)
            elif w is not None:
                with torch.no_grad():
                    w.fill_(1.0)
        if self.init_mode == "head":
            with torch.no_grad():
                layer.shared_head.norm.weight.copy_(target.model.norm.weight)

    def hidden0(self, f: Features) -> torch.Tensor:
        """[B, T, H]: the target's final hidden state (what the engine passes to MTP)."""
        return f.final.float()

    def loss(
        self, hidden: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """The loss through the frozen full-vocabulary LM head on at most ``max_loss_rows``
        random rows (the head is 49152 × H for the built-in model): with ``teacher`` (the
        target's final states [n, H] that predict ``labels``) the KL divergence from the
        target's distribution, else cross-entropy against ``labels``. Returns (mean loss,
        correct argmax count over those rows — scaled so the count estimates all rows)."""
        n = labels.numel()
        if n > self.max_loss_rows:
            keep = torch.randperm(n, generator=self.generator)[: self.max_loss_rows]
            keep = keep.to(labels.device)
            hidden, labels = hidden[keep], labels[keep]
            teacher = None if teacher is None else teacher[keep]
        logits = self.draft.compute_logits(0, hidden).float()
        if teacher is None:
            loss = F.cross_entropy(logits, labels)
        else:
            with torch.no_grad(), torch.autocast(teacher.device.type, enabled=False):
                log_p = self.target.compute_logits(teacher.float()).float()
                log_p = log_p.log_softmax(-1)
            loss = F.kl_div(logits.log_softmax(-1), log_p, log_target=True, reduction="batchmean")
        correct = int((logits.argmax(-1) == labels).sum()) * n / max(1, labels.numel())
        return loss, round(correct)

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        flat = hidden.reshape(-1, hidden.shape[-1])
        return self.draft.compute_logits(0, flat).argmax(-1).view(hidden.shape[:-1])

    def export(self, folder: str | os.PathLike) -> None:
        first = int(self.target_config.num_hidden_layers)
        tensors = {
            f"model.layers.{first}.{name.removeprefix('mtp_layers.0.')}": value
            for name, value in unfused_state(self.draft).items()
        }
        if self.d2t is not None:
            tensors["d2t"] = self.d2t
        config = json.loads((self.target_path / "config.json").read_text())
        config["num_nextn_predict_layers"] = 1
        save_head(folder, tensors, config)

    def load_head(self, folder: str | os.PathLike) -> None:
        """Start from a saved MTP head's weights (and keep its draft vocabulary, if any)."""
        from tandem.models.checkpoint import find_tensor, iterate_checkpoint, safetensors_files

        first = int(self.target_config.num_hidden_layers)
        self.d2t = find_tensor(safetensors_files(folder), "d2t")
        files = iterate_checkpoint(safetensors_files(folder))
        loaded = self.draft.load_weights(files, first, 1)
        missing = self.draft.expected_weights() - loaded
        if missing:
            raise ValueError(f"{folder} is missing tensors: {sorted(missing)[:5]}")

    def extra_state(self) -> dict[str, Any]:
        return {"mtp_d2t": self.d2t}
