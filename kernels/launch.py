"""How every Triton kernel of the package is launched: whether Triton is there, whether work
takes the GPU code paths, the interpreter check, and the one launch function (``launch``) that
``launch_hook`` can route (the AOT tool records launches, the capture check marks them)."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator

import torch
from torch import Tensor

try:
    import triton  # noqa: F401
    import triton.language as tl

    HAS_TRITON = True
except ImportError:  # triton is Linux-only; the PyTorch paths still work
    HAS_TRITON = False


# Test-only: CPU tensors take the GPU code paths (Triton kernels through the interpreter, no CPU
# attention plan), so a CPU run sees the ops a GPU step runs (engine/capture_check.py). Read once,
# at import; never set it in production.
GPU_PATHS_ENV = "TANDEM_TEST_GPU_PATHS"
FORCE_GPU_PATHS = os.environ.get(GPU_PATHS_ENV, "").strip() == "1"


def gpu_paths(where: Tensor | torch.device) -> bool:
    """Whether work on ``where`` (a tensor or a device) takes the GPU code paths: CUDA, or
    anything under ``TANDEM_TEST_GPU_PATHS=1``."""
    device = where.device if isinstance(where, Tensor) else where
    return device.type == "cuda" or FORCE_GPU_PATHS


def triton_interpreter_enabled() -> bool:
    """True if Triton kernels can run on CPU tensors here (through the Triton interpreter).

    That needs TRITON_INTERPRET=1 in the environment before `triton` is first imported: the
    interpreter replaces triton.language's own jit functions at import time.
    """
    if not HAS_TRITON:
        return False
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(tl.sum, InterpretedFunction)


# Where every Triton launch of the kernel modules goes while set (``launch_hook``): the AOT
# tool records launches instead of running them, the capture check marks them as device work.
_launch_hook: Callable[..., None] | None = None


@contextlib.contextmanager
def launch_hook(hook: Callable[..., None]) -> Iterator[None]:
    """Route every ``launch`` (paged attention, MoE, speculative decoding kernels) to
    ``hook(kernel, grid, device, *args, **options)`` inside the block; ``run_launch`` runs one."""
    global _launch_hook
    saved, _launch_hook = _launch_hook, hook
    try:
        yield
    finally:
        _launch_hook = saved


def launch(
    kernel: object, grid: tuple[int, ...], device: torch.device, *args: object, **options: int
) -> None:
    """Launch on CUDA, or in the Triton interpreter for CPU tensors. ``options``: num_warps,
    num_stages (Triton's defaults otherwise)."""
    if _launch_hook is not None:
        _launch_hook(kernel, grid, device, *args, **options)
        return
    run_launch(kernel, grid, device, *args, **options)


def run_launch(
    kernel: object, grid: tuple[int, ...], device: torch.device, *args: object, **options: int
) -> None:
    """The launch itself (what ``launch`` does without a hook)."""
    if device.type != "cuda" and not triton_interpreter_enabled():
        raise RuntimeError(
            "Triton kernels run on CPU only in the Triton interpreter: set TRITON_INTERPRET=1 "
            "before triton is first imported (or use use_triton=False)"
        )
    kernel[grid](*args, **options)  # type: ignore[index]


def next_pow2(x: int) -> int:
    return 1 << max(0, (x - 1).bit_length())
