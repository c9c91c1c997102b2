"""A process that has imported what ``tandem serve`` imports and forks a server on request: a
test's ``RemoteServer`` starts in well under a second of CPU instead of some 2.5 s spent
importing torch, transformers and the HTTP stack again (the suite starts about a hundred).

``python tests/server_zygote.py`` reads one JSON request per line on stdin (``argv`` after
``python -m tandem.cli``, ``env``, ``cwd``, ``log``: the file the server's stdout and stderr
go to) and answers ``{"pid": N}`` on stdout, then ``{"exit": N, "returncode": R}`` once that
server has exited (R as ``subprocess`` reports it: negative for a signal). It exits when stdin
closes. A forked child leaves the loop and runs ``tandem.cli`` as ``python -m`` would, in its own
session, so its exit (threads joined, ``atexit`` handlers, buffers flushed) is the program's
own. The server's command line is this script's; everything else is as with a fresh
interpreter, provided nothing read at import differs (``ServerZygote.can_start``)."""

from __future__ import annotations

import json
import os
import runpy
import select
import subprocess
import sys
from pathlib import Path
from typing import Any

# Variables the zygote's imports have read (tandem reads TANDEM_TEST_GPU_PATHS at import):
# a request whose environment differs from the zygote's elsewhere than in TANDEM_* variables
# other than this one gets a fresh interpreter instead.
IMPORT_TIME_VARIABLES = ("TANDEM_TEST_GPU_PATHS",)
# Set by libraries in the test process itself (torch's inductor names its cache folder), to
# the value a server computes for itself.
SELF_SET_VARIABLES = ("TORCHINDUCTOR_CACHE_DIR",)


def _serve(requests: Any, answers: Any) -> dict[str, Any]:
    """Fork a server per request until stdin closes (the parent), or return the request a
    forked child is to run."""
    children: set[int] = set()
    buffered = b""
    while True:
        ready, _, _ = select.select([requests], [], [], 0.05)
        if ready:
            chunk = os.read(requests.fileno(), 1 << 16)
            if not chunk:
                return {}  # the test process is gone
            buffered += chunk
        while b"\n" in buffered:
            line, buffered = buffered.split(b"\n", 1)
            request = json.loads(line)
            sys.stdout.flush()
            sys.stderr.flush()
            pid = os.fork()
            if pid == 0:
                return request
            children.add(pid)
            answers.write(json.dumps({"pid": pid}) + "\n")
            answers.flush()
        for pid in list(children):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                code = os.waitstatus_to_exitcode(status)
                answers.write(json.dumps({"exit": pid, "returncode": code}) + "\n")
                answers.flush()


def _run(request: dict[str, Any], control: list[int]) -> None:
    """In the forked child: become ``python -m tandem.cli ARGV`` in its own session."""
    for fd in control:
        os.close(fd)
    os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.close(null)
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    sys.argv = ["tandem.cli", *request["argv"]]
    runpy.run_module("tandem.cli", run_name="__main__", alter_sys=True)


class ServerZygote:
    """The test side: one zygote per test process, started on first use."""

    def __init__(self, env: dict[str, str]) -> None:
        self.env = dict(env)
        self.proc = subprocess.Popen(
            [sys.executable, str(Path(__file__).resolve())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            env=self.env,
            cwd=str(Path(__file__).resolve().parent.parent),
        )
        self.exits: dict[int, int] = {}
        self.buffered = b""

    def can_start(self, env: dict[str, str], cwd: Path) -> bool:
        """Whether a fork of this zygote runs as a fresh ``python -m tandem.cli`` would with
        ``env`` in ``cwd`` (the checkout: ``python -m`` puts the working folder on sys.path)."""
        if self.proc.poll() is not None or cwd.resolve() != Path(__file__).resolve().parent.parent:
            return False
        changed = {k for k in env.keys() | self.env.keys() if env.get(k) != self.env.get(k)}
        return all(
            (k.startswith("TANDEM_") and k not in IMPORT_TIME_VARIABLES) or k in SELF_SET_VARIABLES
            for k in changed
        )

    def start(self, argv: list[str], env: dict[str, str], cwd: Path, log: str) -> ForkedServer:
        assert self.proc.stdin is not None
        request = {"argv": argv, "env": env, "cwd": str(cwd), "log": log}
        self.proc.stdin.write((json.dumps(request) + "\n").encode())
        self.proc.stdin.flush()
        while True:
            message = self._read(timeout=60)
            if message is None:
                raise RuntimeError("the server zygote did not answer")
            if "pid" in message:
                return ForkedServer(self, message["pid"], argv)

    def _read(self, timeout: float | None) -> dict[str, Any] | None:
        """The next message (exits are recorded as they pass), or None after ``timeout``."""
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        while b"\n" not in self.buffered:
            ready, _, _ = select.select([fd], [], [], timeout)
            if not ready:
                return None
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return None
            self.buffered += chunk
        line, self.buffered = self.buffered.split(b"\n", 1)
        message = json.loads(line)
        if "exit" in message:
            self.exits[message["exit"]] = message["returncode"]
        return message

    def returncode(self, pid: int, timeout: float | None) -> int | None:
        """``pid``'s exit status once it has exited (None if it has not within ``timeout``;
        0 polls)."""
        import time

        deadline = None if timeout is None else time.monotonic() + timeout
        while pid not in self.exits:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            if self._read(left) is None and (deadline is None or time.monotonic() >= deadline):
                break
        return self.exits.get(pid)


class ForkedServer:
    """What tests use of a ``subprocess.Popen`` (``pid``, ``poll``, ``wait``, ``returncode``,
    signals) for a server the zygote forked."""

    def __init__(self, zygote: ServerZygote, pid: int, argv: list[str]) -> None:
        self.zygote, self.pid, self.args = zygote, pid, argv
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, 0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            self.returncode = self.zygote.returncode(self.pid, timeout)
        if self.returncode is None:
            raise subprocess.TimeoutExpired(self.args, timeout or 0)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        import signal

        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        import signal

        self.send_signal(signal.SIGKILL)


if __name__ == "__main__":
    sys.path[0] = str(Path(__file__).resolve().parent.parent)  # as `python -m` from the checkout
    # What `tandem serve` imports, once: its modules, and those it imports as it starts.
    import importlib

    for name in (
        "tandem.cli", "tandem.server.app", "tandem.engine.llm_engine", "tandem.models.loader",
        "tandem.kernels.cpu_decode", "transformers", "transformers.configuration_utils",
        "transformers.utils.type_validators", "torch.utils.cpp_extension", "uvicorn",
        "pydantic.v1",
    ):  # fmt: skip
        importlib.import_module(name)
    from transformers import AutoConfig, AutoTokenizer  # noqa: F401  (lazy modules loaded)

    stdin, stdout = sys.stdin.buffer, sys.stdout
    request = _serve(stdin, stdout)
    if request:  # a forked child
        _run(request, [stdin.fileno(), stdout.fileno()])
