"""Model folders named by Hugging Face id (``ORG/NAME``): a local folder of that name wins;
otherwise ``huggingface_hub.snapshot_download`` fetches the files Tandem reads into the hub
cache (or ``cache_dir``) and returns the snapshot folder. The hub library brings its progress
bars, ``HF_TOKEN``, ``HF_HUB_CACHE`` and ``HF_HUB_OFFLINE``. Whatever goes wrong is one
``ValueError`` of one line that names the id and what was tried (``tandem serve`` exits 2)."""

from __future__ import annotations

import logging
import os
import re

logger = logging.getLogger(__name__)

# What Tandem reads from a model repository: configs, tokenizer files, the chat template and
# the safetensors weights (an ``original/`` folder of consolidated .pth files is never fetched).
MODEL_FILES = ["*.json", "*.safetensors", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
TOKENIZER_FILES = ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken"]
# ORG/NAME or NAME: letters, digits, '-', '_' and '.', as the Hub allows.
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*(/[\w.-]+)?$")
TRUE = ("1", "on", "yes", "true")


def hub_offline() -> bool:
    """``HF_HUB_OFFLINE`` (or ``TRANSFORMERS_OFFLINE``) as it is now, not at import time."""
    env = os.environ.get("HF_HUB_OFFLINE") or os.environ.get("TRANSFORMERS_OFFLINE") or ""
    return env.strip().lower() in TRUE


def _one_line(error: BaseException, limit: int = 300) -> str:
    text = " ".join(str(error).split())
    text = text if len(text) <= limit else text[: limit - 3] + "..."
    return f"{type(error).__name__}: {text}" if text else type(error).__name__


def resolve_folder(
    name: str,
    *,
    revision: str | None = None,
    cache_dir: str | None = None,
    what: str = "model",
    weights: bool = True,
) -> str:
    """The local folder ``name`` means: ``name`` itself when it is a folder, else the snapshot
    of the Hugging Face repository ``name`` at ``revision`` (default: its main branch) in
    ``cache_dir`` (default: the hub cache), downloaded if needed. ``weights`` False fetches the
    tokenizer's files only. ``what`` names the argument in errors ("model", "tokenizer", ...)."""
    if os.path.isdir(name):
        return name
    at = f" at revision {revision!r}" if revision else ""
    where = f"{what} {name!r}{at}"
    kind = "model" if weights else "tokenizer"
    if not HUB_ID.match(name) or name.count("/") > 1:
        raise ValueError(
            f"{what} {name!r} is not a local {kind} folder, nor a Hugging Face id (ORG/NAME) to "
            "fetch"
        )
    try:
        from huggingface_hub import constants, snapshot_download
    except ImportError:  # pragma: no cover - transformers depends on it
        raise ValueError(
            f"{where} is not a local {kind} folder, and huggingface_hub (to fetch it) is not "
            "installed"
        ) from None
    offline = hub_offline() or bool(constants.HF_HUB_OFFLINE)
    cache = cache_dir or constants.HF_HUB_CACHE
    try:
        folder = snapshot_download(
            name,
            revision=revision,
            cache_dir=cache_dir,
            allow_patterns=MODEL_FILES if weights else TOKENIZER_FILES,
            local_files_only=offline,
        )
    except (OSError, ValueError) as e:  # the hub's errors are OSErrors or ValueErrors
        raise ValueError(_explain(e, what, kind, name, revision, cache, offline)) from None
    logger.info("%s %s: %s", what, name + at, folder)
    return str(folder)


def _explain(
    error: BaseException,
    what: str,
    kind: str,
    name: str,
    revision: str | None,
    cache: str,
    offline: bool,
) -> str:
    """One line for a failed fetch: the id, what was tried, and what to change."""
    from huggingface_hub import errors as hub

    at = f" at revision {revision!r}" if revision else ""
    where = f"{what} {name!r}{at}"
    tried = f"is not a local {kind} folder, nor in the Hugging Face cache {cache}"
    incomplete = getattr(hub, "IncompleteSnapshotError", ())
    if isinstance(error, hub.GatedRepoError):
        return (
            f"{where} is gated on the Hugging Face Hub: accept its terms at "
            f"https://huggingface.co/{name} and set HF_TOKEN to a token of that account"
        )
    if isinstance(error, hub.RepositoryNotFoundError):
        return (
            f"{where} {tried}, and the Hugging Face Hub has no such repository (a private one "
            "needs HF_TOKEN)"
        )
    if isinstance(error, hub.RevisionNotFoundError):
        return (
            f"{what} {name!r}: the Hugging Face Hub has no revision {revision!r} of it "
            "(--revision takes a branch, a tag or a commit)"
        )
    if incomplete and isinstance(error, incomplete):
        return f"{where}: its snapshot in {cache} is incomplete ({_one_line(error)})"
    if isinstance(error, hub.LocalEntryNotFoundError):
        if offline:
            return (
                f"{where} {tried}, and HF_HUB_OFFLINE is set: fetch it once online (or unset "
                "HF_HUB_OFFLINE), or pass a local folder"
            )
        cause = error.__cause__ if error.__cause__ is not None else error
        return (
            f"{where} {tried}, and the Hugging Face Hub could not be reached ({_one_line(cause)})"
        )
    return f"{where} could not be fetched from the Hugging Face Hub: {_one_line(error)}"
