"""Ending a long-running process (the API server, the engine process, a rank) once it has shut
down in order."""

from __future__ import annotations

import atexit
import os
import sys
from typing import NoReturn


def exit_process(code: int) -> NoReturn:
    """Exit with ``code`` now, without Python's teardown: once the work is stopped and its
    results sent, freeing every module of torch only delays the exit (some 0.4 s of CPU per
    process here, which every restart, every rank and every test that stops a server waited
    on). What exits at Python's exit still runs first (``atexit``: logging's flush,
    multiprocessing's finalizers, which release the queues' semaphores); callers flush their
    own queues."""
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code)
