"""Shared helpers for the server tests: a tiny checkpoint and a real `tandem serve` process."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from checkpoints import build_llama

REPO = Path(__file__).resolve().parent.parent
MAX_MODEL_LEN = 256
READY_TIMEOUT_S = 120.0
_MODEL_CACHE: dict[str, Path] = {}


def tiny_model(tmp_path_factory: Any) -> Path:
    """One tiny random Llama + tokenizer per test session (built on first use)."""
    if "llama" not in _MODEL_CACHE:
        _MODEL_CACHE["llama"] = build_llama(tmp_path_factory.mktemp("tiny_llama"))
    return _MODEL_CACHE["llama"]


def tiny_mtp_model(tmp_path_factory: Any) -> Path:
    """The tiny model plus one MTP layer (DeepSeek layout), for serving with speculation."""
    if "mtp" not in _MODEL_CACHE:
        import shutil

        from checkpoints import add_mtp_layers

        folder = tmp_path_factory.mktemp("tiny_mtp") / "mtp"
        shutil.copytree(tiny_model(tmp_path_factory), folder)
        add_mtp_layers(folder, 1)
        _MODEL_CACHE["mtp"] = folder
    return _MODEL_CACHE["mtp"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_pids(pid: int) -> list[int]:
    """Direct children of ``pid`` (Linux /proc)."""
    out: list[int] = []
    task_dir = Path(f"/proc/{pid}/task")
    if not task_dir.is_dir():
        return out
    for task in task_dir.iterdir():
        try:
            out += [int(p) for p in (task / "children").read_text().split()]
        except OSError:
            pass
    return out


def comm(pid: int) -> str:
    """The process's name (``/proc/PID/comm``): the engine names itself ``tandem-engine``."""
    try:
        return Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return ""


def cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_text().replace("\0", " ")
    except OSError:
        return ""


class RemoteServer:
    """`python -m tandem.cli serve MODEL ...` on 127.0.0.1 and a free port, in its own
    process group; ``stop()`` ends it and anything it started. ``model`` None serves the built-in
    model (no MODEL argument). ``port`` replaces the free port. ``launcher`` replaces
    ``python -m tandem.cli`` (e.g. another venv's ``tandem``), ``cwd`` the checkout as the
    working folder, ``env`` adds variables; ``max_model_len`` None leaves the model's own."""

    def __init__(
        self,
        model: Path | None,
        args: list[str],
        api_key: str | None = None,
        launcher: list[str] | None = None,
        cwd: Path | None = None,
        env: dict[str, str] | None = None,
        headless: bool = False,
        port: int | None = None,
        max_model_len: int | None = MAX_MODEL_LEN,
    ) -> None:
        self.held: socket.socket | None = None
        # A port free_port picked may be taken (an outgoing connection's ephemeral port) before
        # the server binds it: such a start is retried on another (``wait_ready``).
        self.picked_port = port is None and not headless
        if port is not None:
            self.port = port
        elif headless:  # no SO_REUSEADDR: the server cannot bind the port either
            self.held = socket.socket()
            self.held.bind(("127.0.0.1", 0))
            self.port = self.held.getsockname()[1]
        else:
            self.port = free_port()
        self.api_key = api_key
        self.model = model
        self.log = tempfile.NamedTemporaryFile(prefix="tandem-server-", suffix=".log", delete=False)
        self.command = [
            *(launcher or [sys.executable, "-m", "tandem.cli"]),
            "serve",
            *([str(model)] if model is not None else []),
            "--host",
            "127.0.0.1",
            *(["--max-model-len", str(max_model_len)] if max_model_len else []),
            *args,
        ]
        if api_key:
            self.command += ["--api-key", api_key]
        self.env = {**os.environ, **(env or {})}
        self.env.pop("TANDEM_API_KEY", None)
        self.cwd = cwd or REPO
        self.polls: list[tuple[int, int]] = []  # (/ready, /health) statuses while starting
        self._launch()

    def _launch(self) -> None:
        self.log.seek(0)
        self.log.truncate()
        self.proc = subprocess.Popen(
            [*self.command, "--port", str(self.port)],
            cwd=self.cwd,
            stdout=self.log,
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self.pgid = self.proc.pid

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def url(self, path: str) -> str:
        return self.base_url + path

    def log_tail(self, n: int = 4000) -> str:
        try:
            return Path(self.log.name).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def wait_ready(self, timeout_s: float = READY_TIMEOUT_S) -> None:
        """Poll /ready (and /health) until ready; ``self.polls`` keeps what they answered."""
        deadline = time.monotonic() + timeout_s
        retries = 3 if self.picked_port else 0
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                if retries and "Address already in use" in self.log_tail():
                    retries -= 1
                    self.port = free_port()
                    self._launch()
                    continue
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log_tail()}")
            try:
                ready = httpx.get(self.url("/ready"), timeout=2.0).status_code
                health = httpx.get(self.url("/health"), timeout=2.0).status_code
                self.polls.append((ready, health))
                if ready == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"server not ready after {timeout_s} s:\n{self.log_tail()}")

    def engine_pid(self) -> int:
        for pid in child_pids(self.proc.pid):
            if comm(pid).startswith("tandem-engine"):
                return pid
        raise RuntimeError("engine process not found")

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                pass
        try:  # whatever is left of the group (the engine, the resource tracker)
            os.killpg(self.pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            pass
        self.log.close()
        Path(self.log.name).unlink(missing_ok=True)  # stop() may run twice
        if self.held is not None:
            self.held.close()

    def __enter__(self) -> RemoteServer:
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


def scrape_metrics(server: RemoteServer) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """/metrics parsed with prometheus-client's own parser: {(sample name, labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    r = httpx.get(server.url("/metrics"), timeout=10)
    r.raise_for_status()
    out = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def metric(samples: dict, name: str, **labels: str) -> float:
    """Sum of the samples called ``name`` whose labels include ``labels``."""
    total = 0.0
    found = False
    for (n, lbl), v in samples.items():
        if n == name and all(dict(lbl).get(k) == want for k, want in labels.items()):
            total += v
            found = True
    if not found:
        raise KeyError(f"no sample {name} {labels}")
    return total


def is_openai_error(r: Any) -> bool:
    """Whether ``r`` (a response: its ``text``) is an error in OpenAI's shape."""
    return is_openai_error_text(r.text)


def is_openai_error_text(text: str) -> bool:
    """Whether ``text`` is an error body in OpenAI's shape."""
    try:
        body = json.loads(text)
    except ValueError:
        return False
    err = body.get("error") if isinstance(body, dict) else None
    return (
        set(body) == {"error"}
        and isinstance(err, dict)
        and set(err) == {"message", "type", "param", "code"}
        and isinstance(err["message"], str)
        and bool(err["message"])
    )


def wait_until(predicate: Any, timeout_s: float = 30.0, interval_s: float = 0.1) -> Any:
    deadline = time.monotonic() + timeout_s
    last = None
    while time.monotonic() < deadline:
        last = predicate()
        if last:
            return last
        time.sleep(interval_s)
    raise TimeoutError(f"condition not met within {timeout_s} s (last: {last!r})")
