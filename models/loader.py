"""Load a Hugging Face model folder (config + safetensors) into our modules."""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from torch import nn

from tandem.kernels.fp8 import fp8_gemm_block_unsupported
from tandem.models.checkpoint import (
    find_tensor,
    iterate_checkpoint,
    safetensors_files,
    stored_float_dtype,
)
from tandem.models.draft_model import DraftModel, checkpoint_num_params, draft_mapping
from tandem.models.parallel import ParallelMapping
from tandem.models.quantization import (
    dequantize_fp8,
    fp8_compute_unavailable,
    fp8_scheme,
    keep_fp8_weights,
    read_scales,
)
from tandem.models.registry import resolve_model_class

logger = logging.getLogger(__name__)

_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
}


def load_hf_config(path: str | os.PathLike) -> Any:
    from transformers import AutoConfig

    folder = Path(path)
    if not (folder / "config.json").is_file():
        raise ValueError(f"{path} is not a model folder: config.json not found")
    return AutoConfig.from_pretrained(str(folder), trust_remote_code=False)


def resolve_dtype(dtype: str | torch.dtype, config: Any) -> torch.dtype:
    """``"auto"`` takes the checkpoint's dtype (fp32 when the config names none)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if dtype == "auto":
        cfg = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
        if isinstance(cfg, torch.dtype):
            return cfg
        return _DTYPES.get(str(cfg or "float32").replace("torch.", ""), torch.float32)
    if dtype not in _DTYPES:
        raise ValueError(f"dtype={dtype!r} is not supported; use auto, {', '.join(_DTYPES)}")
    return _DTYPES[dtype]


def checkpoint_weights(
    files: list[Path], config: Any, desc: str = "loading weights"
) -> Iterator[tuple[str, Any]]:
    """``iterate_checkpoint`` with FP8 weights read as their dequantized values
    (``models.quantization``): the model computes in its own dtype (weight-only)."""
    scheme = fp8_scheme(config)
    weights = iterate_checkpoint(files, desc)
    scales = read_scales(files) if scheme is not None else {}
    return dequantize_fp8(weights, scheme, scales, str(files[0].parent))


def keep_fp8(model: nn.Module, config: Any, device: torch.device, where: str) -> int:
    """Where FP8 GEMMs run (``fp8_compute_unavailable``), the block-quantized layers of an FP8
    checkpoint keep their weights in FP8 (1 byte each, plus a float32 scale per block) and
    quantize activations per token at run time; elsewhere the loader dequantizes them to the
    model's dtype (weight-only). Says which in the log. Returns how many layers keep FP8."""
    scheme = fp8_scheme(config)
    if scheme is None:
        return 0
    reason = fp8_compute_unavailable(device)
    if reason is None and scheme.block is None:
        reason = "per-tensor FP8 weights are not kept as FP8"
    if reason is None:
        reason = fp8_gemm_block_unsupported(scheme.block)
    if reason is not None:
        logger.info("%s: FP8 weights dequantized at load (%s)", where, reason)
        return 0
    n = keep_fp8_weights(model, scheme.block)
    logger.info("%s: FP8 weights kept as FP8 in %d layers (blocks %s)", where, n, scheme.block)
    return n


@contextlib.contextmanager
def default_dtype(dtype: torch.dtype) -> Iterator[None]:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(old)


def check_complete(model: nn.Module, loaded: set[str], path: str | os.PathLike) -> None:
    missing = sorted(model.expected_weights() - loaded)
    if missing:
        shown = ", ".join(m.split("#")[0] for m in missing[:8])
        more = f" (+{len(missing) - 8} more)" if len(missing) > 8 else ""
        raise ValueError(f"checkpoint {path} is missing tensors: {shown}{more}")


def load_model(
    path: str | os.PathLike,
    dtype: str | torch.dtype = "auto",
    device: str | torch.device = "cpu",
    mapping: ParallelMapping | None = None,
    config: Any = None,
) -> nn.Module:
    """Build the registered class for the folder's architecture and load its weights."""
    config = config if config is not None else load_hf_config(path)
    cls = resolve_model_class(config)
    torch_dtype = resolve_dtype(dtype, config)
    with default_dtype(torch_dtype), torch.device(device):
        model = cls(config, mapping or ParallelMapping())
    keep_fp8(model, config, torch.device(device), str(path))
    loaded = model.load_weights(checkpoint_weights(safetensors_files(path), config))
    check_complete(model, loaded, path)
    model.eval()
    return model


def _count_mtp_layers(files: list[Path], first: int) -> int:
    found: set[int] = set()
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                parts = name.split(".")
                if name.startswith("model.layers.") and int(parts[2]) >= first:
                    found.add(int(parts[2]))
    return len(found)


def resolve_draft_dtype(
    spec: Any, target_dtype: torch.dtype, device: str | torch.device, folder: str | os.PathLike
) -> torch.dtype:
    """The dtype a draft head runs in (``speculative_config.draft_dtype``). ``"auto"``: the
    target's, but a CPU fp32 target runs a head stored in bfloat16 in bfloat16: draft passes are
    bound by reading weights, and the stored values lose nothing. ``folder``: the head's
    checkpoint (an MTP head's may be the target's own)."""
    name = getattr(spec, "draft_dtype", "auto")
    if name != "auto":
        return resolve_dtype(name, None)
    if (
        torch.device(device).type == "cpu"
        and target_dtype == torch.float32
        and stored_float_dtype(folder) == torch.bfloat16
    ):
        return torch.bfloat16
    return target_dtype


def load_draft(
    spec: Any,
    target: nn.Module,
    target_path: str | os.PathLike,
    dtype: torch.dtype,
    device: str | torch.device,
    mapping: ParallelMapping | None = None,
) -> nn.Module:
    """Build and load the draft head named by a ``SpeculativeConfig``, bound to ``target`` (or
    for method ``draft_model`` the draft model, models/draft_model.py)."""
    from tandem.models.eagle3 import Eagle3Draft
    from tandem.models.eagle3_layout import read_eagle3_config
    from tandem.models.mtp import MTPDraft

    mapping = mapping or ParallelMapping()
    if spec.method == "draft_model":  # a whole causal LM, not a head bound to the target
        return load_draft_model(spec, target, target_path, dtype, device, mapping)
    target_config = target.config
    if spec.method == "eagle3":
        folder = spec.model
        config = read_eagle3_config(folder)  # every public layout, or a ValueError naming it
        with default_dtype(resolve_draft_dtype(spec, dtype, device, folder)), torch.device(device):
            draft = Eagle3Draft(config, target_config, mapping)
        draft.bind_target(target)
        loaded = draft.load_weights(iterate_checkpoint(safetensors_files(folder), "loading draft"))
        draft.finish_loading(target, loaded, folder)  # the LM head it lacks, d2t checked
        check_complete(draft, loaded, folder)
        return draft.eval()

    folder = spec.model or target_path
    config = target_config if spec.model is None else load_hf_config(folder)
    if int(config.hidden_size) != int(target_config.hidden_size):
        raise ValueError(
            f"the MTP draft's hidden_size ({config.hidden_size}) does not match the target's "
            f"({target_config.hidden_size})"
        )
    if int(config.vocab_size) != int(target_config.vocab_size):
        raise ValueError(
            f"the MTP draft's vocab_size ({config.vocab_size}) does not match the target's "
            f"({target_config.vocab_size})"
        )
    first = int(config.num_hidden_layers)
    files = safetensors_files(folder)
    available = _count_mtp_layers(files, first)
    if available == 0:
        raise ValueError(
            f"{folder} has no MTP layers: expected tensors under model.layers.{first}.* "
            "(enorm, hnorm, eh_proj, decoder block, shared_head.norm)"
        )
    num_layers = 1 if spec.mtp_mode == "eagle" else spec.num_speculative_tokens
    build_mtp = getattr(target, "build_mtp_draft", None)  # a family with its own MTP block
    draft_dtype = resolve_draft_dtype(spec, dtype, device, folder)
    if build_mtp is not None:  # a family's own MTP block runs in the target's dtype
        if getattr(spec, "draft_dtype", "auto") != "auto" and draft_dtype != dtype:
            raise ValueError(
                f"speculative_config.draft_dtype: the MTP layers of {type(target).__name__} run "
                f"in the target's dtype ({dtype}), not {draft_dtype}"
            )
        draft_dtype = dtype
    with default_dtype(draft_dtype), torch.device(device):
        if build_mtp is not None:
            draft = build_mtp(config, mapping, num_layers)
        else:
            draft = MTPDraft(
                config,
                mapping,
                num_layers,
                bool(type(target).qkv_bias or getattr(config, "attention_bias", False)),
                bool(type(target).qk_norm),
            )
    draft.bind_target(target)
    keep_fp8(draft, config, torch.device(device), str(folder))
    loaded = draft.load_weights(checkpoint_weights(files, config, "loading MTP"), first, available)
    check_complete(draft, loaded, folder)
    d2t = find_tensor(files, "d2t")
    if getattr(spec, "draft_vocab", "auto") == "auto" and d2t is not None:
        draft.use_draft_vocab(d2t)
    return draft.eval()


def load_draft_model(
    spec: Any,
    target: nn.Module,
    target_path: str | os.PathLike,
    dtype: torch.dtype,
    device: str | torch.device,
    mapping: ParallelMapping,
) -> DraftModel:
    """Load ``spec.model`` (a folder) as a draft model for ``target`` (models/draft_model.py): refused when its
    vocabulary size differs from the target's; a draft with more parameters than the target
    is served, and logged."""
    folder = spec.model
    config = load_hf_config(folder)
    draft_vocab, target_vocab = int(config.vocab_size), int(target.config.vocab_size)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"speculative_config.model {folder}: the draft model's vocab_size ({draft_vocab}) "
            f"differs from the target's ({target_vocab}); a draft model must use the target's "
            "tokenizer"
        )
    ranks = draft_mapping(spec, mapping)
    draft_params, target_params = checkpoint_num_params(folder), checkpoint_num_params(target_path)
    if draft_params > target_params and mapping.is_first_rank:
        logger.warning(
            "the draft model (%d parameters) is larger than the target (%d): it is served, but "
            "drafting may cost more than it saves",
            draft_params,
            target_params,
        )
    draft_dtype = resolve_draft_dtype(spec, dtype, device, folder)
    model = load_model(folder, draft_dtype, device, ranks, config)
    return DraftModel(model, draft_dtype)
