"""Running Triton tests through the interpreter when triton was imported before it was enabled."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path


def interpret_without_overflow_checks() -> None:
    """Turn off the interpreter's check of every 32-bit integer add, sub and mul for overflow
    in this process. The kernel tests keep it (the kernels are their subject); the runs of whole
    models on the GPU code paths (capture safety, FP8 weights kept) turn it off: it was a third
    of their CPU time, on the kernels the kernel tests check."""
    import dataclasses

    from triton.runtime import interpreter

    builder = interpreter.interpreter_builder
    builder.options = dataclasses.replace(builder.options, sanitize_overflow=False)


def run_in_fresh_interpreter(test_file: str, selector: str, interpret: bool = True) -> int:
    """Run ``test_file``'s tests matching ``selector`` in a new Python with TRITON_INTERPRET=1
    (it must be set before triton is first imported), or without it (``interpret=False``: the
    compiled kernels on CUDA); returns how many passed."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if interpret:
        env["TRITON_INTERPRET"] = "1"
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", selector, test_file],
        cwd=Path(__file__).resolve().parents[1],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    match = re.search(r"(\d+) passed", proc.stdout)
    return int(match.group(1)) if match else 0
