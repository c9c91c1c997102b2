"""Eagle3 head training: the inference module ``models.eagle3.Eagle3Draft`` with a reduced
draft vocabulary (``d2t``/``t2d``), written in the public Eagle3 checkpoint layout."""

from __future__ import annotations

import logging
import os
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tandem.models.eagle3 import Eagle3Draft
from tandem.models.parallel import ParallelMapping
from tandem.training.export import init_linear_, save_head, unfused_state
from tandem.training.features import Features

logger = logging.getLogger(__name__)

INIT_MODES = ("head", "scratch")


def default_capture_layers(num_layers: int) -> tuple[int, int, int]:
    """The engine's default: the residual stream after layers (1, L//2 - 1, L - 4)."""
    return (1, num_layers // 2 - 1, num_layers - 4)


def eagle3_config(
    target_config: Any, draft_vocab_size: int, capture_layers: tuple[int, ...]
) -> dict[str, Any]:
    """A Llama ``config.json`` with one layer, the target's shapes and the draft vocabulary."""
    t = target_config
    rope = dict(getattr(t, "rope_parameters", None) or {})
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": t.hidden_size,
        "target_hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_attention_heads": t.num_attention_heads,
        "num_key_value_heads": t.num_key_value_heads,
        "head_dim": getattr(t, "head_dim", None) or t.hidden_size // t.num_attention_heads,
        "num_hidden_layers": 1,
        "vocab_size": t.vocab_size,
        "draft_vocab_size": draft_vocab_size,
        "rms_norm_eps": t.rms_norm_eps,
        "max_position_embeddings": t.max_position_embeddings,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "attention_bias": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(capture_layers)},
    }
    if rope:
        cfg["rope_parameters"] = rope
        cfg["rope_theta"] = rope.get("rope_theta", 10000.0)
    return cfg


def head_vocab_ids(folder: str | os.PathLike) -> torch.Tensor:
    """The draft vocabulary (target ids, sorted) of a saved Eagle3 head, from its ``d2t``."""
    from tandem.models.checkpoint import find_tensor, safetensors_files

    d2t = find_tensor(safetensors_files(folder), "d2t")
    if d2t is None:
        raise ValueError(f"{folder} has no d2t tensor (not an Eagle3 head?)")
    return d2t + torch.arange(d2t.numel())


def fit_linear_map(a: torch.Tensor, b: torch.Tensor, ridge: float = 1e-4) -> torch.Tensor:
    """[H_a, H_b]: the ``m`` minimising ``|a @ m - b|^2 + ridge * mean(diag(a^T a)) * |m|^2``
    for rows ``a`` [n, H_a] and ``b`` [n, H_b] (float64 normal equations)."""
    a64, b64 = a.double(), b.double()
    gram = a64.T @ a64
    gram.diagonal().add_(ridge * float(gram.diagonal().mean()))
    return torch.linalg.solve(gram, a64.T @ b64).to(a.dtype)


class Eagle3Head:
    """The trainable Eagle3 draft bound to a frozen target."""

    method = "eagle3"

    def __init__(
        self,
        target: nn.Module,
        vocab_ids: torch.Tensor,
        capture_layers: tuple[int, ...],
        seed: int = 0,
        init: str = "head",
    ) -> None:
        from transformers import LlamaConfig

        if init not in INIT_MODES:
            raise ValueError(f"init={init!r} is invalid: use one of {INIT_MODES}")
        self.init_mode = init
        self.target = target
        self.target_config = target.config
        self.capture_layers = tuple(capture_layers)
        self.vocab_ids = vocab_ids.long().sort().values  # [draft_V] target ids
        self.config = eagle3_config(target.config, len(self.vocab_ids), self.capture_layers)
        hf = LlamaConfig(**{k: v for k, v in self.config.items() if k != "eagle_config"})
        hf.eagle_config = self.config["eagle_config"]
        self.draft = Eagle3Draft(hf, target.config, ParallelMapping())
        self.draft.bind_target(target)
        vocab = int(target.config.vocab_size)
        # target id → draft id, -1 outside the draft vocabulary
        self.t2d_index = torch.full((vocab,), -1, dtype=torch.int64)
        self.t2d_index[self.vocab_ids] = torch.arange(len(self.vocab_ids))
        with torch.no_grad():
            self.draft.d2t.copy_(self.vocab_ids - torch.arange(len(self.vocab_ids)))
        self._init(target, seed)
        h = int(target.config.hidden_size)
        self.input_scale = torch.ones(len(self.capture_layers) * h)  # folded into fc on export
        for p in self.draft.parameters():
            p.requires_grad_(True)

    def _init(self, target: nn.Module, seed: int) -> None:
        """Random linears, ones norms. ``head`` (default) starts the LM head from the target's
        rows for the draft vocabulary and the final norm from the target's (its output
        geometry and scale); ``scratch`` keeps all random."""
        g = torch.Generator().manual_seed(seed)
        d = self.draft
        for module in d.modules():
            w = getattr(module, "weight", None)
            if w is not None and w.dim() == 2:
                init_linear_(w, g)
        if self.init_mode == "head":
            with torch.no_grad():
                d.lm_head.weight.copy_(target.lm_head.weight[self.vocab_ids])
                d.norm.weight.copy_(target.model.norm.weight)

    def set_input_scale(self, aux: torch.Tensor) -> None:
        """Train ``fc`` on unit-scale inputs: the captured residual streams carry a few massive
        dimensions (for the built-in model one column has rms ~1400 against a median ~5) that
        would swamp a random ``fc`` and every Adam step on it. ``fc`` trains on
        ``aux * input_scale`` and is saved as ``fc.weight * input_scale`` — the same map."""
        rms = aux.float().reshape(-1, aux.shape[-1]).pow(2).mean(0).sqrt()
        self.input_scale = 1.0 / rms.clamp(min=1.0)

    def hidden0(self, f: Features) -> torch.Tensor:
        """[B, T, H]: ``fc`` over the captured target states (scaled, see
        ``set_input_scale``)."""
        return self.draft.combine_hidden([f.aux.float() * self.input_scale.to(f.aux.device)])

    def loss(
        self, hidden: torch.Tensor, labels: torch.Tensor, teacher: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, int]:
        """Returns (mean loss, correct argmax count; labels outside the draft vocabulary count
        as misses). With ``teacher`` (the target's final states [n, H] that predict
        ``labels``): the KL divergence from the target's distribution over the draft
        vocabulary (its LM-head rows for those tokens, renormalised, as Eagle3 trains); else
        cross-entropy against ``labels``."""
        logits = self.draft.compute_logits(0, hidden).float()  # [n, draft_V]
        target = self.t2d_index.to(labels.device)[labels]
        n = max(1, labels.numel())
        if teacher is None:
            loss = F.cross_entropy(logits, target, ignore_index=-1, reduction="sum") / n
        else:
            with torch.no_grad(), torch.autocast(teacher.device.type, enabled=False):
                rows = self.target.lm_head.weight[self.vocab_ids.to(teacher.device)].float()
                log_p = (teacher.float() @ rows.T).log_softmax(-1)
            loss = F.kl_div(logits.log_softmax(-1), log_p, log_target=True, reduction="sum") / n
        correct = int((logits.argmax(-1) == target).sum())
        return loss, correct

    def predict(self, hidden: torch.Tensor) -> torch.Tensor:
        """Greedy target-vocabulary tokens from pre-norm draft outputs [..., H]."""
        flat = hidden.reshape(-1, hidden.shape[-1])
        ids = self.draft.to_target_ids(self.draft.compute_logits(0, flat).argmax(-1))
        return ids.view(hidden.shape[:-1])

    def export(self, folder: str | os.PathLike) -> None:
        tensors = unfused_state(self.draft)
        tensors["fc.weight"] = tensors["fc.weight"] * self.input_scale.to(tensors["fc.weight"])
        tensors["d2t"] = self.draft.d2t.detach().clone()
        t2d = torch.zeros(int(self.target_config.vocab_size), dtype=torch.bool)
        t2d[self.vocab_ids] = True
        tensors["t2d"] = t2d
        save_head(folder, tensors, self.config)

    def load_head(self, folder: str | os.PathLike, new_vocab: bool = False) -> None:
        """Start from a saved head's weights. Its draft vocabulary must be this one's, unless
        ``new_vocab``: then the LM-head rows of the tokens both vocabularies hold carry over, and
        each new token's row is the target's row through the linear map that best takes the
        target's rows of the carried tokens to their saved rows (least squares): the saved
        head's final norm and output geometry have moved away from the target's, so the
        target's own rows would start the new tokens off scale."""
        from tandem.models.checkpoint import iterate_checkpoint, safetensors_files

        old_ids = head_vocab_ids(folder)
        same = torch.equal(old_ids, self.vocab_ids)
        if not same and not new_vocab:
            raise ValueError(f"{folder}: its draft vocabulary differs from this run's")
        old_rows: list[torch.Tensor] = []

        def weights() -> Iterator[tuple[str, torch.Tensor]]:
            """The saved tensors; under a new vocabulary its LM head is set aside (below) and
            its ``d2t`` skipped (this head's own)."""
            for name, tensor in iterate_checkpoint(safetensors_files(folder)):
                if same or name not in ("lm_head.weight", "d2t"):
                    yield name, tensor
                elif name == "lm_head.weight":
                    old_rows.append(tensor)

        loaded = self.draft.load_weights(weights())
        if old_rows:
            pos = self.t2d_index[old_ids]  # each old row's index here (-1: dropped)
            keep = pos >= 0
            with torch.no_grad():
                w = self.draft.lm_head.weight
                here = pos[keep].to(w.device)
                carried = old_rows[0][keep].to(w.device, torch.float32)
                w[here] = carried.to(w.dtype)
                fresh = torch.ones(len(self.vocab_ids), dtype=torch.bool, device=w.device)
                fresh[here] = False
                if fresh.any() and len(carried):
                    rows = self.target.lm_head.weight
                    src = rows[self.vocab_ids.to(rows.device)].to(w.device, torch.float32)
                    w[fresh] = (src[fresh] @ fit_linear_map(src[here], carried)).to(w.dtype)
            loaded |= {"lm_head.weight", "d2t"}
            logger.info(
                "draft vocabulary: %d tokens carried over from %s, %d new, %d dropped",
                int(keep.sum()),
                folder,
                len(self.vocab_ids) - int(keep.sum()),
                int((~keep).sum()),
            )
        self.input_scale = torch.ones_like(self.input_scale)  # saved heads hold the folded fc
        missing = self.draft.expected_weights() - loaded
        if missing:
            raise ValueError(f"{folder} is missing tensors: {sorted(missing)[:5]}")

    def extra_state(self) -> dict[str, Any]:
        return {
            "vocab_ids": self.vocab_ids,
            "capture_layers": list(self.capture_layers),
            "input_scale": self.input_scale,
        }
