"""Two hosts on one machine, joined by a network link the tests can degrade or cut.

Host 0 is the test's own network namespace; host 1 is a new namespace (``ip netns``). The link
between them is a pair of TAP devices, one in each namespace, whose Ethernet frames a thread of
the test process carries across: it drops a seeded fraction of them (``loss``) and holds each for
``delay_s`` before delivering it, so packet loss and latency need no kernel queueing discipline
(``tc netem`` is missing from many kernels, this machine's included). ``down()`` / ``up()`` run
``ip link set down`` / ``up`` on host 1's end, the kernel's own link state: a cable pulled.

Needs Linux, root (namespaces and TAP devices), ``ip`` from iproute2 and ``/dev/net/tun``;
``unavailable()`` says what is missing, for a skip message."""

from __future__ import annotations

import fcntl
import heapq
import os
import random
import select
import shutil
import struct
import subprocess
import sys
import threading
import time

TUNSETIFF = 0x400454CA
IFF_TAP = 0x0002
IFF_NO_PI = 0x1000
_COUNT = iter(range(1, 1 << 30))


def unavailable() -> str | None:
    """Why two hosts cannot be made here, or None when they can."""
    if not sys.platform.startswith("linux"):
        return "network namespaces need Linux"
    if os.geteuid() != 0:
        return "network namespaces and TAP devices need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    if not os.path.exists("/dev/net/tun"):
        return "/dev/net/tun is missing (no TAP devices)"
    name = f"tdmprobe{os.getpid() % 100000}"
    made = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if made.returncode != 0:
        return f"`ip netns add` failed: {made.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return None


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _tap(name: str) -> int:
    fd = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(fd, TUNSETIFF, struct.pack("16sH22x", name.encode(), IFF_TAP | IFF_NO_PI))
    return fd


class Link:
    """Host 0 (this namespace, ``addr0`` on ``if0``) and host 1 (namespace ``netns``, ``addr1``
    on ``if1``), one /24 between them. Use as a context manager; ``close()`` removes both."""

    def __init__(self, seed: int = 0) -> None:
        n = os.getpid() % 100000
        k = next(_COUNT)
        self.netns = f"tdm{n}n{k}"
        self.if0, self.if1 = f"tdm{n}a{k}", f"tdm{n}b{k}"
        subnet = f"10.{200 + n % 50}.{(n // 50 * 7 + k) % 250}"
        self.addr0, self.addr1 = f"{subnet}.1", f"{subnet}.2"
        self.delay_s = 0.0
        self.loss = 0.0
        self.frames = {"carried": 0, "dropped": 0}
        self._rng = random.Random(seed)
        self._stop = threading.Event()
        self._fds: list[int] = []
        try:
            _ip("netns", "add", self.netns)
            self._fds = [_tap(self.if0), _tap(self.if1)]
            _ip("link", "set", self.if1, "netns", self.netns)
            _ip("addr", "add", f"{self.addr0}/24", "dev", self.if0)
            _ip("link", "set", self.if0, "up")
            _ip("-n", self.netns, "addr", "add", f"{self.addr1}/24", "dev", self.if1)
            _ip("-n", self.netns, "link", "set", self.if1, "up")
            _ip("-n", self.netns, "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise
        self._thread = threading.Thread(target=self._carry, name="link", daemon=True)
        self._thread.start()

    def prefix(self) -> list[str]:
        """The command prefix that runs a program on host 1."""
        return ["ip", "netns", "exec", self.netns]

    def degrade(self, delay_s: float = 0.0, loss: float = 0.0) -> None:
        """From now on each frame (either way) is dropped with probability ``loss``, else
        delivered ``delay_s`` after it was sent."""
        self.delay_s, self.loss = delay_s, loss

    def down(self) -> None:
        _ip("-n", self.netns, "link", "set", self.if1, "down")

    def up(self) -> None:
        _ip("-n", self.netns, "link", "set", self.if1, "up")

    def _carry(self) -> None:
        a, b = self._fds
        other = {a: b, b: a}
        queue: list[tuple[float, int, int, bytes]] = []  # (due, order, out fd, frame)
        order = 0
        while not self._stop.is_set():
            now = time.monotonic()
            wait = min(0.05, max(0.0, queue[0][0] - now)) if queue else 0.05
            readable, _, _ = select.select([a, b], [], [], wait)
            now = time.monotonic()
            for fd in readable:
                while True:
                    try:
                        frame = os.read(fd, 65536)
                    except (BlockingIOError, OSError):
                        break
                    if self.loss and self._rng.random() < self.loss:
                        self.frames["dropped"] += 1
                        continue
                    order += 1
                    heapq.heappush(queue, (now + self.delay_s, order, other[fd], frame))
            while queue and queue[0][0] <= now:
                _, _, out, frame = heapq.heappop(queue)
                try:
                    os.write(out, frame)
                    self.frames["carried"] += 1
                except OSError:  # that end is down: the frame is lost
                    self.frames["dropped"] += 1

    def close(self) -> None:
        self._stop.set()
        if getattr(self, "_thread", None) is not None:
            self._thread.join(timeout=5)
        for fd in self._fds:
            os.close(fd)
        self._fds = []
        subprocess.run(["ip", "netns", "del", self.netns], capture_output=True)

    def __enter__(self) -> Link:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
