"""Every public Eagle3 head layout, read into one config: which tensors a head carries and how
its layers are wired (``Eagle3Layout``), from the folder's ``config.json`` and tensor names.

Layouts (all: ``fc`` over 3 captured target layers, a first layer over
``cat[input_layernorm(embed), hidden_norm(fc(...))]``, ``norm``, ``lm_head``, ``d2t``):

- EAGLE3 / SpecForge: ``midlayer.*``, ``architectures`` LlamaForCausalLMEagle3; the capture
  layers in ``eagle_config.eagle_aux_hidden_state_layer_ids`` (the output of layer i).
- ``layers.{i}.*`` heads (one layer or several; later layers are plain decoder layers on H).
- NVIDIA ModelOpt exports: a nested ``eagle_config`` whose flags drop norms
  (``use_last_layernorm``, ``use_input_layernorm_in_first_layer``), ``midlayer.{i}.*`` for
  several layers, no ``lm_head`` / ``d2t`` when the draft vocabulary is the target's.
- speculators (``Eagle3Speculator``): the layer config nested in ``transformer_layer_config``,
  ``norm_before_residual``, top-level ``eagle_aux_hidden_state_layer_ids`` counted as vLLM
  does (hidden state i is the input of layer i, so the output of layer i - 1).

Any head may carry its own ``embed_tokens`` (required when its hidden size differs from the
target's), tie its LM head to it, store ``d2t`` as int32, and use Qwen3 q/k norms or a
Llama-4 ``intermediate_size_mlp`` where its config says so. Anything else is refused with a
``ValueError`` naming what was found.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from safetensors import safe_open

from tandem.models.checkpoint import safetensors_files

EAGLE3_ARCHITECTURES = ("LlamaForCausalLMEagle3", "Eagle3LlamaForCausalLM", "LlamaForCausalLM")
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
LAYER_MODEL_TYPES = ("llama", "qwen2", "qwen3")  # the head's decoder layers
QK_NORM_MODEL_TYPES = ("qwen3",)
SUPPORTED = (
    "supported: EAGLE3/SpecForge heads (midlayer.*, fc, norm, lm_head, d2t; "
    "LlamaForCausalLMEagle3), layers.{i}.* heads of one or more layers, NVIDIA ModelOpt "
    "exports (eagle_config), speculators Eagle3Speculator heads"
)
ECFG_SOURCE = "the draft checkpoint's eagle_config.eagle_aux_hidden_state_layer_ids"

_INDEXED = re.compile(r"(midlayer|layers)\.(\d+)\.(.+)")


def split_layer_key(name: str) -> tuple[str, int, str] | None:
    """(scheme, layer index, rest) of a draft layer tensor name — ``midlayer.X`` (layer 0),
    ``midlayer.{i}.X`` or ``layers.{i}.X`` — else None. ``name`` without a ``model.``
    prefix."""
    m = _INDEXED.fullmatch(name)
    if m is not None:
        scheme = "midlayer.{i}" if m.group(1) == "midlayer" else "layers.{i}"
        return scheme, int(m.group(2)), m.group(3)
    if name.startswith("midlayer."):
        return "midlayer", 0, name[len("midlayer.") :]
    return None


@dataclass(frozen=True)
class Eagle3Layout:
    """How one Eagle3 head is built and wired (``Eagle3Draft`` reads it)."""

    num_layers: int = 1
    embed_norm: bool = True  # input_layernorm on the token embedding (first layer)
    hidden_norm: bool = True  # hidden_norm on fc's output (first layer)
    final_norm: bool = True  # norm before the LM head
    norm_before_residual: bool = False  # the first layer's residual is hidden_norm(h), not h
    qk_norm: bool = False  # per-head q/k RMSNorm (Qwen3)
    qkv_bias: bool = False
    intermediate_size: int | None = None  # None: the config's intermediate_size
    own_embedding: bool = False  # the head carries embed_tokens (used instead of the target's)
    # With no lm_head tensor: a narrow head with its own embedding uses it (else the target's).
    tie_word_embeddings: bool = False
    capture_layers: tuple[int, ...] | None = None  # output-of-layer indices from the checkpoint
    capture_source: str = ECFG_SOURCE
    capture_error: str | None = None  # the checkpoint's layers cannot be read unambiguously

    @classmethod
    def from_config(cls, config: Any) -> Eagle3Layout:
        """The layout a plain head config implies (one ``midlayer``, every norm): what training
        builds."""
        model_type = getattr(config, "model_type", "llama")
        return cls(
            num_layers=int(getattr(config, "num_hidden_layers", 1) or 1),
            norm_before_residual=bool(getattr(config, "norm_before_residual", False)),
            qk_norm=model_type in QK_NORM_MODEL_TYPES,
            qkv_bias=bool(getattr(config, "attention_bias", False)) or model_type == "qwen2",
            capture_layers=_ids(getattr(config, "eagle_config", None)),
        )

    def fast_path_unsupported(self) -> str | None:
        """Why the CPU fast path (one plain midlayer, every norm) cannot serve this head."""
        if self.num_layers != 1:
            return f"a {self.num_layers}-layer head"
        if self.norm_before_residual:
            return "norm_before_residual"
        if not (self.embed_norm and self.hidden_norm and self.final_norm):
            return "a head without one of its norms"
        return None


def _ids(eagle_config: Any) -> tuple[int, ...] | None:
    if not isinstance(eagle_config, dict):
        return None
    ids = eagle_config.get("eagle_aux_hidden_state_layer_ids")
    return None if ids is None else tuple(int(i) for i in ids)


def checkpoint_tensors(folder: str | os.PathLike) -> dict[str, tuple[int, ...]]:
    """Every tensor's name (``model.`` prefix dropped) and shape, read from the headers."""

    out: dict[str, tuple[int, ...]] = {}
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                out[name.removeprefix("model.")] = tuple(fh.get_slice(name).get_shape())
    return out


def read_eagle3_config(folder: str | os.PathLike) -> Any:
    """The head's (layer) config with ``draft_vocab_size``, ``target_hidden_size`` and
    ``eagle3_layout`` set, for any supported layout; a ``ValueError`` naming what was found
    otherwise."""
    from transformers import AutoConfig

    path = Path(folder) / "config.json"
    if not path.is_file():
        raise ValueError(f"{folder} is not a model folder: config.json not found")
    raw = json.loads(path.read_text())
    archs = list(raw.get("architectures") or [])
    tensors = checkpoint_tensors(folder)
    speculators = (
        SPECULATORS_ARCHITECTURE in archs
        or "transformer_layer_config" in raw
        or "speculators_model_type" in raw
    )
    if speculators:
        layer = _speculators_layer_config(raw, folder)
        model_type = layer.get("model_type", "llama")
        _check_model_type(model_type, folder)
        config = AutoConfig.for_model(
            model_type, **{k: v for k, v in layer.items() if k != "model_type"}
        )
        config.draft_vocab_size = raw.get("draft_vocab_size")
        config.target_hidden_size = raw.get("target_hidden_size")
    elif set(archs) & set(EAGLE3_ARCHITECTURES):
        layer = raw
        model_type = raw.get("model_type", "llama")
        _check_model_type(model_type, folder)
        config = AutoConfig.from_pretrained(str(folder), trust_remote_code=False)
    else:
        raise ValueError(
            f"{folder} is not an Eagle3 draft: architectures {archs}; expected one of "
            f"{', '.join((*EAGLE3_ARCHITECTURES, SPECULATORS_ARCHITECTURE))} ({SUPPORTED})"
        )
    config.eagle3_layout = _layout(raw, layer, config, tensors, speculators, folder)
    return config


def _check_model_type(model_type: str, folder: str | os.PathLike) -> None:
    if model_type not in LAYER_MODEL_TYPES:
        raise ValueError(
            f"{folder}: an Eagle3 head with {model_type!r} decoder layers is not supported; "
            f"its layers must be one of {', '.join(LAYER_MODEL_TYPES)}"
        )


def _speculators_layer_config(raw: dict[str, Any], folder: str | os.PathLike) -> dict[str, Any]:
    kind = raw.get("speculators_model_type", "eagle3")
    if kind != "eagle3":
        raise ValueError(
            f"{folder}: speculators_model_type {kind!r} is not an Eagle3 head (only 'eagle3')"
        )
    layer = raw.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(
            f"{folder}: a speculators Eagle3 config needs transformer_layer_config (the head's "
            f"decoder layer config), found {type(layer).__name__}"
        )
    if "norm_before_residual" not in raw:
        # speculators' own default is false, vLLM reads a missing value as true.
        raise ValueError(
            f"{folder}: the speculators config does not say norm_before_residual (true or "
            "false); runtimes disagree on its default, so set it in config.json"
        )
    if raw.get("norm_before_fc"):
        raise ValueError(
            f"{folder}: norm_before_fc (an RMSNorm over the 3 captured layers before fc) is "
            "not supported"
        )
    return layer


def _layout(
    raw: dict[str, Any],
    layer: dict[str, Any],
    config: Any,
    tensors: dict[str, tuple[int, ...]],
    speculators: bool,
    folder: str | os.PathLike,
) -> Eagle3Layout:
    found = ", ".join(sorted(tensors)[:12]) + (" ..." if len(tensors) > 12 else "")
    if "fc.weight" not in tensors:
        raise ValueError(
            f"{folder} has no fc.weight: an Eagle3 head combines 3 captured target layers "
            f"through fc (found: {found}); {SUPPORTED}"
        )
    layers: dict[int, set[str]] = {}
    schemes: set[str] = set()
    for name in tensors:
        key = split_layer_key(name)
        if key is not None:
            schemes.add(key[0])
            layers.setdefault(key[1], set()).add(key[2])
    if not layers:
        raise ValueError(
            f"{folder} has no draft layer tensors (midlayer.* or layers.{{i}}.*; found: "
            f"{found}); {SUPPORTED}"
        )
    if len(schemes) > 1:
        shown = ", ".join(f"{scheme}.*" for scheme in sorted(schemes))
        raise ValueError(f"{folder} mixes layer key layouts: {shown}")
    n = len(layers)
    if sorted(layers) != list(range(n)):
        raise ValueError(f"{folder}: draft layers {sorted(layers)} are not 0 .. {n - 1}")
    declared = int(layer.get("num_hidden_layers", n))
    if declared != n:
        raise ValueError(
            f"{folder}: config num_hidden_layers={declared} but the checkpoint holds {n} draft "
            f"layer(s) ({schemes.pop()}.*)"
        )
    first = layers[0]
    model_type = layer.get("model_type", "llama")
    qk_norm = model_type in QK_NORM_MODEL_TYPES
    has_qk = any(rest.startswith("self_attn.q_norm.") for rest in first)
    if has_qk != qk_norm:
        raise ValueError(
            f"{folder}: the checkpoint {'has' if has_qk else 'has no'} q/k norms "
            f"(self_attn.q_norm) but its layers' model_type {model_type!r} says "
            f"{'they have' if qk_norm else 'they have none'}"
        )
    embed_norm, hidden_norm, final_norm = _norms(raw, first, tensors, folder)
    capture, capture_source, capture_error = _capture(raw, speculators, folder)
    return Eagle3Layout(
        num_layers=n,
        embed_norm=embed_norm,
        hidden_norm=hidden_norm,
        final_norm=final_norm,
        norm_before_residual=bool(raw.get("norm_before_residual", False)),
        qk_norm=qk_norm,
        qkv_bias=bool(getattr(config, "attention_bias", False)) or model_type == "qwen2",
        intermediate_size=_intermediate_size(layer, tensors, folder),
        own_embedding="embed_tokens.weight" in tensors,
        tie_word_embeddings=bool(layer.get("tie_word_embeddings", False))
        and "lm_head.weight" not in tensors,
        capture_layers=capture,
        capture_source=capture_source,
        capture_error=capture_error,
    )


def _norms(
    raw: dict[str, Any],
    first: set[str],
    tensors: dict[str, tuple[int, ...]],
    folder: str | os.PathLike,
) -> tuple[bool, bool, bool]:
    """(embedding norm, hidden norm, final norm) — all three unless ModelOpt's
    ``eagle_config`` drops one. ``use_input_layernorm_in_first_layer: false`` makes one of the
    first layer's two input norms an identity: Megatron exports drop the hidden path's
    (``hidden_norm``), the embedding's ``input_layernorm`` staying; the tensor that is absent
    says which."""
    ecfg = raw.get("eagle_config") if isinstance(raw.get("eagle_config"), dict) else {}
    if ecfg.get("use_aux_hidden_state") is False:
        raise ValueError(
            f"{folder}: eagle_config.use_aux_hidden_state is false (an EAGLE-1/2 head on the "
            "last hidden state only); only Eagle3 heads (3 captured layers) are supported"
        )
    if ecfg.get("use_mtp_layernorm"):
        raise ValueError(f"{folder}: eagle_config.use_mtp_layernorm is not supported")
    if int(ecfg.get("parallel_draft_step") or 1) > 1:
        raise ValueError(f"{folder}: eagle_config.parallel_draft_step > 1 is not supported")
    final = ecfg.get("use_last_layernorm") is not False  # absent: required (missing: an error)
    if not final and "norm.weight" in tensors:
        raise ValueError(
            f"{folder}: eagle_config.use_last_layernorm is false but the checkpoint has norm.weight"
        )
    embed = "input_layernorm.weight" in first
    hidden = "hidden_norm.weight" in first
    if ecfg.get("use_input_layernorm_in_first_layer") is False:
        if embed == hidden:
            raise ValueError(
                f"{folder}: eagle_config.use_input_layernorm_in_first_layer is false, so one of "
                "the first layer's input norms (input_layernorm on the embedding, hidden_norm "
                f"on fc's output) must be absent; the checkpoint has "
                f"{'both' if embed else 'neither'}"
            )
        return embed, hidden, final
    return True, True, final


def _intermediate_size(
    layer: dict[str, Any], tensors: dict[str, tuple[int, ...]], folder: str | os.PathLike
) -> int | None:
    """The MLP width: ``intermediate_size``, or for a Llama-4 style config that also gives
    ``intermediate_size_mlp`` (the dense MLP's width there) the one the checkpoint's
    ``gate_proj`` has; a ``ValueError`` when neither fits."""
    declared = [layer.get(k) for k in ("intermediate_size_mlp", "intermediate_size")]
    declared = [int(v) for v in declared if v]
    if len(set(declared)) < 2:
        return declared[0] if declared else None
    rows = {
        shape[0]
        for name, shape in tensors.items()
        if (key := split_layer_key(name)) is not None and key[2] == "mlp.gate_proj.weight"
    }
    fits = [v for v in declared if rows == {v}]
    if not fits:
        raise ValueError(
            f"{folder}: the draft MLP's gate_proj has {sorted(rows)} rows, neither "
            f"intermediate_size_mlp={declared[0]} nor intermediate_size={declared[1]}"
        )
    return fits[0]


def _capture(
    raw: dict[str, Any], speculators: bool, folder: str | os.PathLike
) -> tuple[tuple[int, ...] | None, str, str | None]:
    """(output-of-layer indices or None, where they came from, why they cannot be used)."""
    nested = _ids(raw.get("eagle_config"))
    top = raw.get("eagle_aux_hidden_state_layer_ids")
    if speculators:
        if not top:
            return None, ECFG_SOURCE, None
        ids = [int(i) for i in top]
        source = (
            f"the draft checkpoint's eagle_aux_hidden_state_layer_ids {ids} (speculators: "
            "hidden state i is the output of layer i - 1), as layers"
        )
        return tuple(i - 1 for i in ids), source, None
    if nested is not None or not top:
        return nested, ECFG_SOURCE, None
    error = (
        f"{folder}: the config has a top-level eagle_aux_hidden_state_layer_ids {list(top)} "
        "outside the speculators format; runtimes read it differently (vLLM: the input of "
        "layer i; EAGLE, SGLang and ModelOpt: the output of layer i): put the output-of-layer "
        "indices in eagle_config.eagle_aux_hidden_state_layer_ids or set "
        "speculative_config.eagle3_layers_to_capture"
    )
    return None, ECFG_SOURCE, error
