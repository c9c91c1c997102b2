"""Test-only: ``tandem serve`` whose API process keeps ``TANDEM_TEST_LEAK_BYTES`` bytes (random,
so the pages are touched) for every ``/v1/`` request it answers: a leak for
tests/test_reliability_soak.py to show that its leak check notices one. Run as
``python tests/leaky_server.py serve MODEL ...``; the engine process, which imports this file
again as ``__mp_main__``, runs unchanged."""

from __future__ import annotations

import os
import sys
from typing import Any

ENV_VAR = "TANDEM_TEST_LEAK_BYTES"


class LeakMiddleware:
    """Keeps ``size`` bytes per ``/v1/`` request, forever."""

    def __init__(self, app: Any, size: int) -> None:
        self.app = app
        self.size = size
        self.kept: list[bytes] = []

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1/"):
            self.kept.append(os.urandom(self.size))
        await self.app(scope, receive, send)


def main() -> int:
    import tandem.server.app as server_app
    from tandem.cli import main as cli_main

    size = int(os.environ[ENV_VAR])
    build_app = server_app.build_app

    def leaky_build_app(*args: Any, **kwargs: Any) -> Any:
        app = build_app(*args, **kwargs)
        app.add_middleware(LeakMiddleware, size=size)
        return app

    server_app.build_app = leaky_build_app  # the CLI imports it when it serves
    return cli_main(sys.argv[1:])


if __name__ == "__main__":
    sys.exit(main())
