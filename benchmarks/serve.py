"""``tandem bench serve``: load a running server over HTTP and print the serving benchmark block.

Requests are streamed (``stream: true`` with ``stream_options.include_usage``) so that each one
gives its time to first token (TTFT), the gaps between content chunks (ITL) and its latency;
token counts come from the server's ``usage``. TPOT = (latency − TTFT) / (output tokens − 1).
The speculative section comes from ``/metrics``, scraped before and after each run:
tokens per step = 1 + accepted / drafts, draft acceptance rate = accepted / draft tokens, and
per-position acceptance = accepted at position i / drafts.

    tandem bench serve --base-url http://127.0.0.1:8000 --dataset random \\
        --random-input-len 128 --random-output-len 64 --num-prompts 64 --max-concurrency 1,4,16
    tandem bench serve --model PATH --serve-args '--dtype bfloat16' --dataset eval --plot

Exit status: 0; 1 when a request failed; 2 for a usage error (bad option, missing file, a server
that cannot be reached or started).
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import math
import os
import sys
import time
from pathlib import Path
from typing import Any

from tandem.bench.serve_report import format_block, parse_metrics, speculative_stats, summarize
from tandem.bench.serve_requests import (
    DEFAULT_RANDOM_NUM_PROMPTS,
    DEFAULT_TEXT_MAX_TOKENS,
    SampleRequest,
    build_requests,
    load_tokenizer,
    read_jsonl_prompts,
    run_requests,
)
from tandem.bench.support import BenchError, LocalServer, plot_runs, require_matplotlib

# ----------------------------------------------------------------------------- options


def _float_or_inf(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r} (or 'inf')") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"must be > 0 (or 'inf'), got {text!r}")
    return value


def int_list(text: str) -> list[int]:
    """'1,4,16' -> [1, 4, 16] (each >= 1)."""
    try:
        values = [int(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers like 1,4,16, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise argparse.ArgumentTypeError(f"expected integers >= 1 like 1,4,16, got {text!r}")
    return values


def add_arguments(p: argparse.ArgumentParser) -> None:
    target = p.add_argument_group("server")
    target.add_argument("--base-url", default=None, help="a running server, e.g. http://HOST:PORT")
    target.add_argument(
        "--model",
        default=None,
        metavar="PATH",
        help="start `tandem serve PATH` on a free port for the run and stop it after "
        "('builtin': the built-in model)",
    )
    target.add_argument(
        "--serve-args", default="", help="extra options for the server that --model starts"
    )
    target.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="sent as 'Authorization: Bearer KEY' (default: $TANDEM_API_KEY)",
    )
    target.add_argument(
        "--served-model-name", default=None, help="model name to send (default: /v1/models)"
    )
    target.add_argument(
        "--endpoint",
        choices=("completions", "chat"),
        default=None,
        help="/v1/completions or /v1/chat/completions (default: chat for eval and jsonl "
        "prompts, completions for random)",
    )

    data = p.add_argument_group("prompts")
    data.add_argument("--dataset", choices=("random", "eval", "jsonl"), default="random")
    data.add_argument(
        "--dataset-path", default=None, help='--dataset jsonl: lines {"prompt": str[, ...]}'
    )
    data.add_argument("--random-input-len", type=int, default=128)
    data.add_argument("--random-output-len", type=int, default=128)
    data.add_argument(
        "--tokenizer",
        default=None,
        help="tokenizer folder for random token ids (default: --model, or the served model's "
        "folder when it is on this machine; else random words)",
    )
    data.add_argument(
        "--num-prompts",
        type=int,
        default=None,
        help=f"requests per run (default: every eval/jsonl prompt, {DEFAULT_RANDOM_NUM_PROMPTS} "
        "random ones)",
    )
    data.add_argument("--seed", type=int, default=0)

    load = p.add_argument_group("load and sampling")
    load.add_argument(
        "--max-concurrency",
        type=int_list,
        default=None,
        help="requests in flight at most; a list (1,4,16) runs once per value",
    )
    load.add_argument(
        "--request-rate",
        type=_float_or_inf,
        default=math.inf,
        help="requests per second, Poisson arrivals (default inf: all at once)",
    )
    load.add_argument("--temperature", type=float, default=0.0)
    load.add_argument(
        "--max-tokens",
        type=int,
        default=None,
        help=f"output tokens per request (default: --random-output-len, or "
        f"{DEFAULT_TEXT_MAX_TOKENS} for eval/jsonl prompts without their own)",
    )
    load.add_argument("--ignore-eos", action="store_true", help="generate max tokens even past EOS")
    load.add_argument("--request-timeout", type=float, default=600.0, help="seconds per request")

    out = p.add_argument_group("output")
    out.add_argument("--result-file", default=None, help="write the results as JSON here")
    out.add_argument(
        "--plot",
        nargs="?",
        const="",
        default=None,
        metavar="PNG",
        help="write throughput vs concurrency and latency CDFs (needs matplotlib; default file: "
        "the result file with .png, else bench_serve.png)",
    )


# ----------------------------------------------------------------------------- prompts


# ----------------------------------------------------------------------------- requests


# ----------------------------------------------------------------------------- metrics


# ----------------------------------------------------------------------------- main


def _get_json(base_url: str, path: str, api_key: str | None) -> Any:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        r = httpx.get(base_url + path, headers=headers, timeout=10.0)
    except httpx.HTTPError as e:
        raise BenchError(f"cannot reach {base_url}{path}: {e}") from None
    if r.status_code != 200:
        raise BenchError(f"{base_url}{path} answered {r.status_code}: {r.text[:200]}")
    return r.json() if path != "/metrics" else r.text


def benchmark(ns: argparse.Namespace, base_url: str, tokenizer_hint: str | None) -> dict[str, Any]:
    """Every run of one invocation against ``base_url``; returns the JSON result."""
    models = _get_json(base_url, "/v1/models", ns.api_key).get("data") or []
    if not models and not ns.served_model_name:
        raise BenchError(f"{base_url}/v1/models lists no model; pass --served-model-name")
    model = ns.served_model_name or models[0]["id"]
    root = models[0].get("root") if models else None
    endpoint = ns.endpoint or ("completions" if ns.dataset == "random" else "chat")
    tokenizer = None
    if ns.dataset == "random":
        tokenizer = load_tokenizer(ns.tokenizer or tokenizer_hint or root)
        if ns.tokenizer and tokenizer is None:
            raise BenchError(f"--tokenizer {ns.tokenizer!r}: no tokenizer there")
    requests = build_requests(ns, endpoint, tokenizer)
    if ns.dataset == "random":
        kind = "token ids" if tokenizer is not None else "words (no tokenizer found)"
        print(f"random prompts: {ns.random_input_len} {kind}, {len(requests)} requests")

    # One short request first: a wrong endpoint or model fails here, not N times.
    probe = SampleRequest(requests[0].prompt, min(4, requests[0].max_tokens))
    (test,), _ = asyncio.run(run_requests(base_url, endpoint, model, [probe], ns, 1))
    if not test.success:
        raise BenchError(f"the test request to {base_url} failed: {test.error}")

    runs = []
    for conc in ns.max_concurrency or [None]:
        before = parse_metrics(_get_json(base_url, "/metrics", ns.api_key))
        results, duration = asyncio.run(run_requests(base_url, endpoint, model, requests, ns, conc))
        after = parse_metrics(_get_json(base_url, "/metrics", ns.api_key))
        summary = summarize(
            results, duration, conc, ns.request_rate, speculative_stats(before, after)
        )
        print(format_block(summary), flush=True)
        runs.append(summary)
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "backend": "tandem",
        "base_url": base_url,
        "model": model,
        "endpoint": endpoint,
        "dataset": ns.dataset,
        "dataset_path": ns.dataset_path,
        "num_prompts": len(requests),
        "temperature": ns.temperature,
        "seed": ns.seed,
        "request_rate": None if math.isinf(ns.request_rate) else ns.request_rate,
        "runs": runs,
    }


def main(ns: argparse.Namespace) -> int:
    """``tandem bench serve``; returns the exit status (2 for a usage error)."""
    try:
        if (ns.base_url is None) == (ns.model is None):
            raise BenchError(
                "give exactly one of --base-url URL (a running server) or --model PATH"
            )
        if ns.num_prompts is not None and ns.num_prompts < 1:
            raise BenchError(f"--num-prompts must be >= 1, got {ns.num_prompts}")
        if ns.max_tokens is not None and ns.max_tokens < 1:
            raise BenchError(f"--max-tokens must be >= 1, got {ns.max_tokens}")
        if ns.dataset == "jsonl":
            read_jsonl_prompts(ns.dataset_path or "")  # fail before starting a server
        if ns.dataset != "jsonl" and ns.dataset_path:
            raise BenchError("--dataset-path goes with --dataset jsonl")
        if ns.plot is not None:
            require_matplotlib()
        if importlib.util.find_spec("httpx") is None:
            raise BenchError("tandem bench serve needs httpx: pip install httpx")
        if ns.model is not None:
            if ns.model != "builtin" and not Path(ns.model).is_dir():
                raise BenchError(f"--model {ns.model!r} is not a model folder")
            server = LocalServer(ns.model, ns.serve_args, ns.api_key)
            try:
                print(f"starting tandem serve {ns.model} {ns.serve_args} on {server.base_url}")
                server.wait_ready()
                hint = ns.model if ns.model != "builtin" else None
                result = benchmark(ns, server.base_url, hint)
            finally:
                server.stop()
        else:
            result = benchmark(ns, ns.base_url.rstrip("/"), None)
        if ns.result_file:
            Path(ns.result_file).parent.mkdir(parents=True, exist_ok=True)
            Path(ns.result_file).write_text(json.dumps(result, indent=1) + "\n")
            print(f"results: {ns.result_file}")
        if ns.plot is not None:
            path = ns.plot or (
                str(Path(ns.result_file).with_suffix(".png"))
                if ns.result_file
                else "bench_serve.png"
            )
            title = f"{result['model']} · {result['dataset']} · {result['endpoint']}"
            plot_runs(result["runs"], path, title)
            print(f"plot: {path}")
    except BenchError as e:
        print(f"tandem bench serve: error: {e}", file=sys.stderr)
        return 2
    failed = sum(r["failed"] for r in result["runs"])
    return 1 if failed else 0
