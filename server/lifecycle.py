"""How the HTTP server stops: on SIGTERM or SIGINT stop accepting connections, let requests in
flight finish for ``--shutdown-timeout`` seconds, abort the rest, stop the engine and exit 0.

uvicorn does the first part (close the listening sockets, wait for open responses) and runs the
app's lifespan shutdown, which stops the engine process. Two things are changed here: the app is
told when shutdown begins (``on_drain``: it refuses new requests and arms the abort timer), and
the signal is not raised again after a graceful shutdown (uvicorn does that, so the process would
die of the signal instead of exiting 0). A second Ctrl-C forces the exit: ``on_force_exit`` aborts
what is in flight and stops the engine at once (uvicorn skips the lifespan shutdown then).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
import threading
from collections.abc import Callable, Generator
from types import FrameType

import uvicorn

logger = logging.getLogger("tandem")

HANDLED_SIGNALS = (signal.SIGINT, signal.SIGTERM)
FORCE_EXIT_FLUSH_S = 0.2


class GracefulServer(uvicorn.Server):
    def __init__(
        self,
        config: uvicorn.Config,
        on_drain: Callable[[], None],
        on_force_exit: Callable[[], None],
    ) -> None:
        super().__init__(config)
        self.on_drain = on_drain
        self.on_force_exit = on_force_exit
        self.exit_signal: int | None = None  # the first signal that asked us to stop

    @contextlib.contextmanager
    def capture_signals(self) -> Generator[None, None, None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        previous = {sig: signal.signal(sig, self.handle_exit) for sig in HANDLED_SIGNALS}
        try:
            yield
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self.exit_signal is None:
            self.exit_signal = sig
            logger.info("got %s: shutting down", signal.Signals(sig).name)
        super().handle_exit(sig, frame)

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_drain()
        await super().shutdown(sockets)
        if self.force_exit:
            logger.warning("forced exit: aborting requests in flight and stopping the engine")
            self.on_force_exit()
            await asyncio.sleep(FORCE_EXIT_FLUSH_S)  # the aborted requests send their 503s
