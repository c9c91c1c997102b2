"""The device a user names (``--device``) as a ``torch.device``, for the engine and the built-in
model's default dtype alike; the CPU threads a process takes."""

from __future__ import annotations

import os

import torch


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device not in ("cpu", "cuda") and not device.startswith("cuda:"):
        raise ValueError(f"device={device!r} is invalid: use auto, cpu or cuda")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ValueError(f"device={device!r} requested but CUDA is not available")
    return torch.device(device)


def cpu_threads(sharing: int = 1) -> int:
    """torch's intra-op threads for a process that shares the host's cores with ``sharing - 1``
    others (the ranks of a node): ``$OMP_NUM_THREADS`` where it is set, as torch itself takes it,
    else its share of the cores. Setting more threads than cores a process can get makes their
    OpenMP barriers spin against the other processes (several times the CPU time for the same
    work on a busy host)."""
    value = os.environ.get("OMP_NUM_THREADS", "").strip()
    if value.isdigit() and int(value) > 0:
        return int(value)
    return max(1, (os.cpu_count() or 1) // max(1, sharing))
