"""Suite-wide settings. ``make test`` runs the files on three processes (pytest-xdist, whole
files per process): the slowest files are collected first, so they start first and no long one
is left for the end while the other processes idle (longest first keeps them balanced)."""

from __future__ import annotations

import gc
import os
import time

import pytest
import torch

from tandem.engine.process_exit import pace_garbage_collector
from tandem.models.device import cpu_threads

# A full collection after a test whose process grew by more than this since the last one: the
# test process paces its collector like the engine's, and what garbage cycles still hold (a
# library's, a test's) must not pile up until the kernel stops a worker.
COLLECT_AFTER_GROWTH_BYTES = 1 << 30
_rss_after_collect = 0

# Measured on 2 cores from a clean clone under `make test` (whole-file wall times, each over
# 15 s, slowest first); every other file follows in its usual order.
SLOWEST_FIRST = (
    "test_install.py",
    "test_multinode.py",
    "test_multinode_partitions.py",
    "test_capture_safety.py",
    "test_multinode_modes.py",
    "test_cpu_decode.py",
    "test_gpu_aot.py",
    "test_structured_spec.py",
    "test_train_draft.py",
    "test_rejection_sampling.py",
    "test_builtin_model.py",
    "test_launch.py",
    "test_bench.py",
    "test_tools.py",
    "test_launchers.py",
    "test_tree_spec.py",
    "test_moe_spec_sampling.py",
    "test_tensor_parallel.py",
    "test_server_multirank.py",
    "test_cpu_quant.py",
    "test_paged_attention.py",
    "test_server_errors.py",
    "test_reliability_fuzz_scale.py",
    "test_reliability_fuzz.py",
    "test_reliability_faults.py",
    "test_reliability_storm.py",
    "test_server_speculative.py",
    "test_attention_dp.py",
    "test_structured_output.py",
    "test_fp8.py",
    "test_moe_kernels.py",
    "test_reliability_soak.py",
    "test_reasoning.py",
    "test_shipped_heads.py",
    "test_reliability_shutdown.py",
    "test_data_parallel.py",
)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(SLOWEST_FIRST)))


def _share_default_ssl_context() -> None:
    """httpx builds an SSL context for every client (certifi's bundle parsed: some 20 ms of CPU),
    and every ``httpx.get``/``post``/``stream`` and every ``openai.OpenAI`` makes a client; the
    tests speak plain HTTP to 127.0.0.1. The default context (verify on, no client certificate,
    the same certificate variables) is built once per test process and shared: a context only
    configures connections, so sharing it changes nothing a test sees."""
    import functools

    import httpx._transports.default as transports

    build = transports.create_ssl_context

    @functools.cache
    def default_context(cafile: str | None, capath: str | None) -> object:
        return build(verify=True, cert=None, trust_env=True)

    def create_ssl_context(verify: object = True, cert: object = None, trust_env: bool = True):  # noqa: ANN202
        if verify is True and cert is None and trust_env:
            return default_context(os.environ.get("SSL_CERT_FILE"), os.environ.get("SSL_CERT_DIR"))
        return build(verify=verify, cert=cert, trust_env=trust_env)

    transports.create_ssl_context = create_ssl_context


def pytest_configure(config: pytest.Config) -> None:
    """Under pytest-xdist, each process (and what it starts: servers, engines) gets its share of
    the cores for its intra-op threads: two processes with a thread per core each spin against
    each other (the CPU-bound sampling tests ran six times slower). The offline engines of the
    tests run in this process: its collector keeps the engine process's pace (Python's default
    pace cost the suite some 200 s of CPU), bounded by ``pytest_runtest_teardown``."""
    pace_garbage_collector()
    _share_default_ssl_context()
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))
    if workers > 1:
        threads = cpu_threads(workers)
        os.environ["OMP_NUM_THREADS"] = str(threads)
        torch.set_num_threads(threads)


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        return 0


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item: pytest.Item, nextitem: pytest.Item | None) -> None:
    """A full collection once the process grew ``COLLECT_AFTER_GROWTH_BYTES`` since the last."""
    global _rss_after_collect
    if _rss_bytes() > _rss_after_collect + COLLECT_AFTER_GROWTH_BYTES:
        gc.collect()
        _rss_after_collect = _rss_bytes()


# TANDEM_TEST_CPU_LOG=path: each test process appends a line per test file to ``path``: its wall
# seconds, its own CPU seconds and those of the processes it started and reaped (servers, ranks,
# pip), the file, the xdist worker and the wall clock at its end, to find what to cut as the
# suite grows and where a worker idled (``--durations`` shows wall time only).
_CPU_LOG = os.environ.get("TANDEM_TEST_CPU_LOG")
_current: list = []  # [file, wall, own CPU, children's CPU] at the file's first test


def _clock() -> tuple[float, float, float]:
    import resource
    import time

    own = resource.getrusage(resource.RUSAGE_SELF)
    kids = resource.getrusage(resource.RUSAGE_CHILDREN)
    return time.monotonic(), own.ru_utime + own.ru_stime, kids.ru_utime + kids.ru_stime


def _log_file_cpu() -> None:
    if _CPU_LOG and _current:
        name, *start = _current
        wall, own, kids = (now - then for now, then in zip(_clock(), start, strict=True))
        with open(_CPU_LOG, "a") as f:
            worker = os.environ.get("PYTEST_XDIST_WORKER", "-")
            f.write(f"{wall:8.1f} {own:8.1f} {kids:8.1f} {name} {worker} {time.time():.1f}\n")


def pytest_runtest_setup(item: pytest.Item) -> None:
    if _CPU_LOG and (not _current or _current[0] != item.path.name):
        _log_file_cpu()
        _current[:] = [item.path.name, *_clock()]


def pytest_sessionfinish(session: pytest.Session) -> None:
    _log_file_cpu()
