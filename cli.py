"""The ``tandem`` command: ``serve`` (the HTTP server, ``tandem.server.cli``), ``router`` (a
front for prefill and decode instances, ``tandem.server.router``), ``bench`` (``tandem.bench``)
and ``train-draft`` (``tandem.training``). Light at import: each command
loads what it needs when it runs."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from tandem.server.cli import add_serve_arguments, run_serve
from tandem.server.launch_flags import LaunchArgumentParser
from tandem.version import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tandem", description="Tandem LLM inference server")
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    # Subcommands read vLLM's spellings too (``--max_model_len``, ``--speculative-config.k v``).
    sub = parser.add_subparsers(dest="command", required=True, parser_class=LaunchArgumentParser)
    add_serve_arguments(
        sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    )
    add_bench_parser(sub)
    add_train_draft_parser(sub)
    add_router_arguments(
        sub.add_parser(
            "router", help="one OpenAI-compatible front for prefill and decode instances"
        )
    )
    return parser


def add_router_arguments(p: argparse.ArgumentParser) -> None:
    """``tandem router`` (``tandem.server.router``, imported when it runs)."""
    p.add_argument("--prefill", nargs="+", required=True, metavar="URL",
                   help="prefill instances (tandem serve --role prefill), e.g. http://h:8100")  # fmt: skip
    p.add_argument("--decode", nargs="+", required=True, metavar="URL",
                   help="decode instances (tandem serve --role decode)")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--timeout", type=float, default=600.0, metavar="S",
                   help="the longest an instance may take to answer (600)")  # fmt: skip
    p.add_argument("--log-level", default="info")


def add_bench_parser(sub: Any) -> None:
    """``tandem bench serve`` (load a server over HTTP) and ``tandem bench compare`` (offline
    engine against transformers and without speculation)."""
    from tandem.bench import compare as bench_compare
    from tandem.bench import serve as bench_serve

    b = sub.add_parser("bench", help="benchmark a server or the offline engine")
    kinds = b.add_subparsers(dest="bench_command", required=True)
    bench_serve.add_arguments(
        kinds.add_parser("serve", help="load a running server, print latency and throughput")
    )
    bench_compare.add_arguments(
        kinds.add_parser("compare", help="tokens/s of tandem (with speculation) and transformers")
    )


def add_train_draft_parser(sub: Any) -> None:
    """``tandem train-draft``: train or evaluate an Eagle3 / MTP head (training/)."""
    from tandem.training.cli import add_train_draft_parser as add

    add(sub)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    ns = parser.parse_args(argv)
    if ns.command == "serve":
        return run_serve(ns, argv[argv.index("serve") + 1 :])
    if ns.command == "bench":
        from tandem.bench import compare as bench_compare
        from tandem.bench import serve as bench_serve

        return (bench_serve if ns.bench_command == "serve" else bench_compare).main(ns)
    if ns.command == "router":
        from tandem.server.router import run_router

        return run_router(ns)
    if ns.command == "train-draft":
        from tandem.training.cli import run_train_draft

        return run_train_draft(ns)
    parser.error(f"unknown command {ns.command!r}")
    return 2


if __name__ == "__main__":
    sys.exit(main())
