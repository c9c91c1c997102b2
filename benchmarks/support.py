"""Support for ``tandem bench serve``: its error type, the PNG plots and a local server to load.

``LocalServer`` runs ``tandem serve MODEL`` on a free port in its own process group, for
``tandem bench serve --model PATH``; ``plot_runs`` draws throughput against concurrency and latency
CDFs (matplotlib, only when ``--plot`` asks for it).
"""

from __future__ import annotations

import os
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

READY_TIMEOUT_S = 900.0


class BenchError(Exception):
    """A problem the user can fix (bad option, missing file, unreachable server)."""


# ----------------------------------------------------------------------------- plot


def require_matplotlib() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise BenchError(
            "--plot needs matplotlib, which is not installed: pip install matplotlib "
            '(or pip install -e ".[test]")'
        ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_runs(runs: list[dict[str, Any]], path: str, title: str) -> None:
    """Output throughput against concurrency, and latency CDFs (TTFT, end-to-end) per run."""
    import numpy as np

    plt = require_matplotlib()
    fig, (ax0, ax1) = plt.subplots(1, 2, figsize=(11, 4.2))
    xs = [r["max_concurrency"] or len(r["latencies"]) for r in runs]
    ax0.plot(xs, [r["output_throughput"] for r in runs], "o-")
    if len(set(xs)) > 1:
        ax0.set_xscale("log", base=2)
    ax0.set_xticks(xs, [str(x) for x in xs])
    ax0.set_xlabel("max concurrency")
    ax0.set_ylabel("output tokens/s")
    ax0.set_title("throughput vs concurrency")
    ax0.grid(alpha=0.3)
    for r, x in zip(runs, xs, strict=True):
        for key, style in (("latencies", "-"), ("ttfts", "--")):
            values = np.sort(np.asarray(r[key], dtype=float) * 1000.0)
            if values.size:
                frac = np.arange(1, values.size + 1) / values.size
                label = f"c={x} {'e2e' if key == 'latencies' else 'TTFT'}"
                ax1.step(values, frac, style, where="post", label=label)
    ax1.set_xlabel("latency (ms)")
    ax1.set_ylabel("fraction of requests")
    ax1.set_title("latency CDF")
    ax1.grid(alpha=0.3)
    ax1.legend(fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


# ----------------------------------------------------------------------------- server


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    """``tandem serve MODEL`` in its own process group on a free local port."""

    def __init__(self, model: str, serve_args: str, api_key: str | None) -> None:
        self.port = _free_port()
        self.log = tempfile.NamedTemporaryFile(prefix="tandem-bench-", suffix=".log", delete=False)
        cmd = [sys.executable, "-m", "tandem.cli", "serve"]
        if model != "builtin":
            cmd.append(model)
        cmd += ["--host", "127.0.0.1", "--port", str(self.port), *shlex.split(serve_args)]
        if api_key:
            cmd += ["--api-key", api_key]
        root = str(Path(__file__).resolve().parent.parent)
        paths = [root, *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(paths))
        self.proc = subprocess.Popen(
            cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def log_tail(self, n: int = 3000) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise BenchError(
                    f"the server exited with {self.proc.returncode}:\n{self.log_tail()}"
                )
            try:
                if httpx.get(self.base_url + "/ready", timeout=2.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.25)
        raise BenchError(f"the server was not ready after {timeout_s:.0f} s:\n{self.log_tail()}")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (engine ranks)
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.proc.wait(timeout=10)
        self.log.close()
        os.unlink(self.log.name)
