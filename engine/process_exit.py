"""The life of a long-running process (the API server, the engine process, a rank): its name and
thread count as Linux sees them, its garbage collector's pace, and its end once it has shut down
in order."""

from __future__ import annotations

import atexit
import gc
import multiprocessing
import os
import sys
import threading
from typing import NoReturn

# Allocations between young-generation collections (Python's default: 700). An engine holds many
# long-lived objects (requests, their token lists, blocks) and allocates a few per request per
# step: at the default, collections of the older generations that walk all of them took 40 %
# of the engine's CPU time on 20,000 short requests (5.8 s of CPU against 3.6 s at 50,000).
GC_YOUNG_THRESHOLD = 50_000


def os_threads() -> int:
    """This process's threads (Linux); -1 where it cannot tell (no fork then)."""
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return -1


# The thread count of this process where it marked itself a place to fork from
# (``mark_fork_point``); None: never marked.
_fork_point_threads: int | None = None


def mark_fork_point() -> None:
    """Called by a process that will start CPU processes (the API process for its engine, the
    engine process or a headless node's launcher for ranks) once it has imported what they need
    and before it runs parallel work: as long as it starts no thread after this call (no OpenMP
    pool, no store server, no Python thread), they are forked from it, without a fresh
    interpreter that imports torch, the engine and transformers again (some 2.5 s of CPU each).
    Threads that exist at the mark (those of numpy's BLAS, made at import) are known to survive
    a fork."""
    global _fork_point_threads
    _fork_point_threads = os_threads()


def at_fork_point() -> bool:
    """Whether a fork of this process now is as safe as at its mark: marked, its threads
    countable, and none started since (fewer is fine: numpy's BLAS stops its pool at a fork
    and starts it again only at its next product, so a second fork sees one thread less)."""
    return (
        _fork_point_threads is not None
        and _fork_point_threads > 0
        and "fork" in multiprocessing.get_all_start_methods()
        and threading.active_count() == 1
        and 0 < os_threads() <= _fork_point_threads
    )


def name_process(name: str) -> None:
    """Name this process where ``ps -o comm`` and ``/proc/PID/comm`` show it (Linux keeps 15
    bytes); a fork otherwise shows its parent's name, as its command line is its parent's."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def pace_garbage_collector() -> None:
    """Collect young objects every ``GC_YOUNG_THRESHOLD`` allocations (cycles are still found;
    reference counting frees everything else at once)."""
    _, older, oldest = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, older, oldest)


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
