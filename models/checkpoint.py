"""Checkpoint folders on disk: their safetensors files (sharded or not), lazy tensor reads, the
stored dtype, and a digest of what they hold. Below the loader and the Eagle3 layout reader,
which both read folders."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from tqdm import tqdm

PROGRESS_MIN_BYTES = 256 << 20  # show a progress bar for checkpoints larger than this


def safetensors_files(folder: str | os.PathLike) -> list[Path]:
    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({folder / f for f in weight_map.values()})
        missing = [str(f) for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"checkpoint shards listed in {index.name} are missing: {missing}")
        return files
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise ValueError(f"no *.safetensors files in {folder}")
    return files


# ``checkpoint_digest`` reads this many windows of this many bytes from each file's tensor data.
DIGEST_WINDOWS = 16


DIGEST_WINDOW_BYTES = 4096


def checkpoint_digest(folder: str | os.PathLike) -> str:
    """SHA-256 of a checkpoint's tensors as stored, wherever the folder is: each safetensors
    file's tensor entries (names, dtypes, shapes, offsets) and ``DIGEST_WINDOWS`` evenly spaced
    windows of its data. Copies agree; two trainings of one architecture differ (their weights
    differ everywhere), at the cost of reading a few KiB a file, not the weights."""
    h = hashlib.sha256()
    for f in safetensors_files(folder):
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            header.pop("__metadata__", None)
            h.update(json.dumps(header, sort_keys=True).encode())
            start, end = 8 + n, os.fstat(fh.fileno()).st_size
            span = max(end - start - DIGEST_WINDOW_BYTES, 0)
            for i in range(DIGEST_WINDOWS):
                fh.seek(start + span * i // (DIGEST_WINDOWS - 1))
                h.update(fh.read(DIGEST_WINDOW_BYTES))
    return h.hexdigest()


def iterate_checkpoint(
    files: list[Path], desc: str = "loading weights"
) -> Iterator[tuple[str, Any]]:
    """Yield (name, lazy slice) for every tensor; slices read only what a rank indexes."""
    total = sum(f.stat().st_size for f in files)
    bar = tqdm(
        total=total, unit="B", unit_scale=True, desc=desc, disable=total < PROGRESS_MIN_BYTES
    )
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118 - safe_open has no __iter__
                yield name, fh.get_slice(name)
        bar.update(f.stat().st_size)
    bar.close()


_STORED_DTYPES = {"F32": torch.float32, "BF16": torch.bfloat16, "F16": torch.float16}


def stored_float_dtype(folder: str | os.PathLike) -> torch.dtype | None:
    """The dtype of the first floating-point tensor of a checkpoint (None: none found)."""
    for f in safetensors_files(folder):
        with safe_open(str(f), framework="pt") as fh:
            for name in fh.keys():  # noqa: SIM118
                found = _STORED_DTYPES.get(fh.get_slice(name).get_dtype())
                if found is not None:
                    return found
    return None


def find_tensor(files: list[Path], name: str) -> torch.Tensor | None:
    """One tensor of a checkpoint by name, None when no file holds it."""
    for f in files:
        with safe_open(str(f), framework="pt") as fh:
            if name in fh.keys():  # noqa: SIM118
                return fh.get_tensor(name)
    return None
