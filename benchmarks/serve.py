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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.support import BenchError, LocalServer, plot_runs, require_matplotlib

EVAL_PROMPTS = Path(__file__).resolve().parent.parent / "training/data/eval_prompts.jsonl"
DEFAULT_TEXT_MAX_TOKENS = 256  # eval / jsonl prompts without their own max_tokens
DEFAULT_RANDOM_NUM_PROMPTS = 100
METRIC_PREFIX = "tandem:spec_decode_"
# A neutral vocabulary for random prompts when no tokenizer is at hand.
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
).split()


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


@dataclass
class SampleRequest:
    prompt: str | list[int]  # token ids only for /v1/completions
    max_tokens: int


def read_jsonl_prompts(path: str | os.PathLike) -> list[tuple[str, int | None]]:
    """(prompt, max_tokens or None) per line of a JSONL file ``{"prompt": str[, "max_tokens"]}``."""
    file = Path(path)
    if not file.is_file():
        raise BenchError(f"dataset file {str(file)!r} does not exist")
    rows: list[tuple[str, int | None]] = []
    with file.open(encoding="utf-8") as fh:
        for n, line in enumerate(fh, 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
            except ValueError as e:
                raise BenchError(f"{file} line {n}: not JSON ({e})") from None
            if not isinstance(obj, dict) or not isinstance(obj.get("prompt"), str):
                raise BenchError(f'{file} line {n}: expected an object {{"prompt": "..."}}')
            mt = obj.get("max_tokens")
            if mt is not None and (not isinstance(mt, int) or mt < 1):
                raise BenchError(f"{file} line {n}: max_tokens must be a positive integer")
            rows.append((obj["prompt"], mt))
    if not rows:
        raise BenchError(f"{file} holds no prompts")
    return rows


def random_prompts(
    num: int, input_len: int, tokenizer: Any, as_ids: bool, seed: int
) -> list[str | list[int]]:
    """``num`` prompts of ``input_len`` random tokens of ``tokenizer`` (ids, or their text when
    ``as_ids`` is false), or of ``input_len`` random words without a tokenizer."""
    import numpy as np

    rng = np.random.default_rng(seed)
    if tokenizer is None:
        return [" ".join(rng.choice(_WORDS, size=input_len).tolist()) for _ in range(num)]
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    vocab = [i for i in range(len(tokenizer)) if i not in special]
    out: list[str | list[int]] = []
    for _ in range(num):
        ids = rng.choice(vocab, size=input_len).tolist()
        out.append(ids if as_ids else tokenizer.decode(ids))
    return out


def build_requests(ns: argparse.Namespace, endpoint: str, tokenizer: Any) -> list[SampleRequest]:
    if ns.dataset == "random":
        if ns.random_input_len < 1 or ns.random_output_len < 1:
            raise BenchError("--random-input-len and --random-output-len must be >= 1")
        num = ns.num_prompts or DEFAULT_RANDOM_NUM_PROMPTS
        prompts = random_prompts(
            num, ns.random_input_len, tokenizer, endpoint == "completions", ns.seed
        )
        max_tokens = ns.max_tokens or ns.random_output_len
        return [SampleRequest(p, max_tokens) for p in prompts]
    if ns.dataset == "jsonl" and not ns.dataset_path:
        raise BenchError("--dataset jsonl needs --dataset-path FILE")
    rows = read_jsonl_prompts(EVAL_PROMPTS if ns.dataset == "eval" else ns.dataset_path)
    num = ns.num_prompts or len(rows)
    return [
        SampleRequest(prompt, ns.max_tokens or mt or DEFAULT_TEXT_MAX_TOKENS)
        for prompt, mt in (rows[i % len(rows)] for i in range(num))
    ]


def load_tokenizer(path: str | None) -> Any:
    if not path or not Path(path).is_dir():
        return None
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(path, trust_remote_code=False)
    except (OSError, ValueError):
        return None


# ----------------------------------------------------------------------------- requests


@dataclass
class RequestResult:
    success: bool
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    ttft: float = 0.0  # seconds to the first content chunk
    latency: float = 0.0  # seconds to the end of the stream
    itl: list[float] = field(default_factory=list)  # seconds between content chunks
    start: float = 0.0  # seconds after the run began


def _payload(
    req: SampleRequest, endpoint: str, model: str, ns: argparse.Namespace, index: int
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": req.max_tokens,
        "temperature": float(ns.temperature),
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if ns.ignore_eos:
        body["ignore_eos"] = True
    if ns.temperature > 0:
        body["seed"] = ns.seed + index  # reproducible samples per request
    if endpoint == "chat":
        text = req.prompt if isinstance(req.prompt, str) else " ".join(map(str, req.prompt))
        body["messages"] = [{"role": "user", "content": text}]
    else:
        body["prompt"] = req.prompt
    return body


def _content(chunk: dict[str, Any]) -> str:
    out = ""
    for choice in chunk.get("choices") or []:
        delta = choice.get("delta")
        out += (delta.get("content") or "") if isinstance(delta, dict) else ""
        out += choice.get("text") or ""
    return out


async def send_request(client: Any, url: str, body: dict[str, Any], t0: float) -> RequestResult:
    """One streamed request; never raises (a failure is a result with ``success=False``)."""
    start = time.perf_counter()
    result = RequestResult(success=False, start=start - t0)
    last = start
    chunks = 0
    usage: dict[str, Any] | None = None
    try:
        async with client.stream("POST", url, json=body) as r:
            if r.status_code != 200:
                text = (await r.aread()).decode(errors="replace")
                result.error = f"HTTP {r.status_code}: {text[:300]}"
                return result
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                chunk = json.loads(data)
                if "error" in chunk:
                    result.error = str(chunk["error"].get("message", chunk["error"]))[:300]
                    return result
                now = time.perf_counter()
                if _content(chunk):
                    if chunks == 0:
                        result.ttft = now - start
                    else:
                        result.itl.append(now - last)
                    chunks += 1
                    last = now
                if chunk.get("usage"):
                    usage = chunk["usage"]
    except Exception as e:  # network errors, timeouts, a broken stream
        result.error = f"{type(e).__name__}: {e}"[:300]
        return result
    result.latency = time.perf_counter() - start
    if usage is not None:
        result.prompt_tokens = int(usage.get("prompt_tokens", 0))
        result.output_tokens = int(usage.get("completion_tokens", 0))
    else:  # a server without include_usage: one token per content chunk
        result.output_tokens = chunks
    if chunks == 0 and result.output_tokens == 0:
        result.ttft = result.latency  # nothing generated: the stream's end is the first answer
    result.success = True
    return result


def arrival_delays(num: int, rate: float, seed: int) -> list[float]:
    """Gaps before each request: Poisson arrivals at ``rate`` per second (0 for ``inf``)."""
    if math.isinf(rate):
        return [0.0] * num
    import numpy as np

    return np.random.default_rng(seed).exponential(1.0 / rate, size=num).tolist()


async def run_requests(
    base_url: str,
    endpoint: str,
    model: str,
    requests: list[SampleRequest],
    ns: argparse.Namespace,
    max_concurrency: int | None,
) -> tuple[list[RequestResult], float]:
    """Send every request (arrivals by ``ns.request_rate``, at most ``max_concurrency`` in
    flight); returns the results in request order and the run's wall time."""
    import httpx

    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    headers = {"Authorization": f"Bearer {ns.api_key}"} if ns.api_key else {}
    limit = max_concurrency or len(requests)
    gate = asyncio.Semaphore(limit)
    delays = arrival_delays(len(requests), ns.request_rate, ns.seed)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    async with httpx.AsyncClient(
        base_url=base_url, headers=headers, timeout=ns.request_timeout, limits=limits
    ) as client:

        async def one(i: int, req: SampleRequest, t0: float) -> RequestResult:
            async with gate:
                return await send_request(client, path, _payload(req, endpoint, model, ns, i), t0)

        t0 = time.perf_counter()
        tasks = []
        for i, (req, delay) in enumerate(zip(requests, delays, strict=True)):
            if delay > 0:
                await asyncio.sleep(delay)
            tasks.append(asyncio.create_task(one(i, req, t0)))
        results = await asyncio.gather(*tasks)
        return list(results), time.perf_counter() - t0


# ----------------------------------------------------------------------------- metrics


def parse_metrics(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text → {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out: dict[tuple[str, tuple[tuple[str, str], ...]], float] = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def _sum(samples: dict, name: str) -> float:
    return sum(v for (n, _), v in samples.items() if n == name)


def speculative_stats(before: dict, after: dict) -> dict[str, Any] | None:
    """The run's speculative numbers from two ``/metrics`` scrapes (None: no drafts)."""

    def delta(name: str) -> float:
        return _sum(after, METRIC_PREFIX + name) - _sum(before, METRIC_PREFIX + name)

    drafts = delta("num_drafts_total")
    if drafts <= 0:
        return None
    draft_tokens = delta("num_draft_tokens_total")
    accepted = delta("num_accepted_tokens_total")
    per_pos: dict[int, float] = {}
    name = METRIC_PREFIX + "num_accepted_tokens_per_pos_total"
    for (n, labels), v in after.items():
        if n == name:
            pos = int(dict(labels)["position"])
            per_pos[pos] = per_pos.get(pos, 0.0) + v - before.get((n, labels), 0.0)
    return {
        "num_drafts": int(drafts),
        "num_draft_tokens": int(draft_tokens),
        "num_accepted_tokens": int(accepted),
        "tokens_per_step": 1.0 + accepted / drafts,
        "draft_acceptance_rate": accepted / draft_tokens if draft_tokens else 0.0,
        "per_position_acceptance": [per_pos[i] / drafts for i in sorted(per_pos)],
    }


def _stats(values: list[float], scale: float = 1000.0) -> tuple[float, float, float]:
    """(mean, median, p99) of ``values`` times ``scale`` (0 for an empty list)."""
    import numpy as np

    if not values:
        return 0.0, 0.0, 0.0
    a = np.asarray(values, dtype=float) * scale
    return float(a.mean()), float(np.median(a)), float(np.percentile(a, 99))


def summarize(
    results: list[RequestResult],
    duration: float,
    max_concurrency: int | None,
    request_rate: float,
    spec: dict[str, Any] | None,
) -> dict[str, Any]:
    ok = [r for r in results if r.success]
    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    tpots = [
        (r.latency - r.ttft) / (r.output_tokens - 1) for r in ok if r.output_tokens > 1
    ]  # fmt: skip
    summary: dict[str, Any] = {
        "max_concurrency": max_concurrency,
        "request_rate": None if math.isinf(request_rate) else request_rate,
        "completed": len(ok),
        "failed": len(results) - len(ok),
        "duration": duration,
        "total_input_tokens": in_tokens,
        "total_output_tokens": out_tokens,
        "request_throughput": len(ok) / duration if duration > 0 else 0.0,
        "output_throughput": out_tokens / duration if duration > 0 else 0.0,
        "total_token_throughput": (in_tokens + out_tokens) / duration if duration > 0 else 0.0,
    }
    for key, values in (
        ("ttft", [r.ttft for r in ok]),
        ("tpot", tpots),
        ("itl", [x for r in ok for x in r.itl]),
        ("e2el", [r.latency for r in ok]),
    ):
        mean, median, p99 = _stats(values)
        summary[f"mean_{key}_ms"], summary[f"median_{key}_ms"] = mean, median
        summary[f"p99_{key}_ms"] = p99
    summary["speculative"] = spec
    summary["input_lens"] = [r.prompt_tokens for r in ok]
    summary["output_lens"] = [r.output_tokens for r in ok]
    summary["ttfts"] = [r.ttft for r in ok]
    summary["latencies"] = [r.latency for r in ok]
    summary["itls"] = [r.itl for r in ok]
    summary["errors"] = [r.error for r in results if not r.success]
    return summary


def format_block(s: dict[str, Any]) -> str:
    width = 50

    def row(label: str, value: Any, fmt: str = "") -> str:
        return f"{label:<40}{value:{fmt}}"

    def rule(title: str) -> str:
        return title.center(width, "-")

    lines = [" Serving Benchmark Result ".center(width, "=")]
    lines.append(row("Successful requests:", s["completed"]))
    lines.append(row("Failed requests:", s["failed"]))
    conc = s["max_concurrency"]
    lines.append(row("Maximum request concurrency:", conc if conc else "unlimited"))
    rate = s["request_rate"]
    lines.append(row("Request rate (req/s):", f"{rate:.2f}" if rate else "inf"))
    lines.append(row("Benchmark duration (s):", s["duration"], ".2f"))
    lines.append(row("Total input tokens:", s["total_input_tokens"]))
    lines.append(row("Total generated tokens:", s["total_output_tokens"]))
    lines.append(row("Request throughput (req/s):", s["request_throughput"], ".2f"))
    lines.append(row("Output token throughput (tok/s):", s["output_throughput"], ".2f"))
    lines.append(row("Total token throughput (tok/s):", s["total_token_throughput"], ".2f"))
    for key, title, name in (
        ("ttft", "Time to First Token", "TTFT"),
        ("tpot", "Time per Output Token (excl. 1st token)", "TPOT"),
        ("itl", "Inter-token Latency", "ITL"),
        ("e2el", "End-to-end Latency", "E2EL"),
    ):
        lines.append(rule(title))
        lines.append(row(f"Mean {name} (ms):", s[f"mean_{key}_ms"], ".2f"))
        lines.append(row(f"Median {name} (ms):", s[f"median_{key}_ms"], ".2f"))
        lines.append(row(f"P99 {name} (ms):", s[f"p99_{key}_ms"], ".2f"))
    spec = s.get("speculative")
    lines.append(rule("Speculative Decoding"))
    if spec is None:
        lines.append("no drafts in /metrics during the run (speculation off)")
    else:
        lines.append(row("Tokens per step:", spec["tokens_per_step"], ".2f"))
        lines.append(row("Draft acceptance rate (%):", 100 * spec["draft_acceptance_rate"], ".2f"))
        lines.append(row("Drafts (verification steps):", spec["num_drafts"]))
        lines.append(row("Draft tokens:", spec["num_draft_tokens"]))
        lines.append(row("Accepted tokens:", spec["num_accepted_tokens"]))
        per_pos = ", ".join(f"{100 * a:.1f}" for a in spec["per_position_acceptance"])
        lines.append(row("Per-position acceptance (%):", per_pos))
    for err in sorted(set(s["errors"]))[:3]:
        lines.append(f"error: {err}")
    lines.append("=" * width)
    return "\n".join(lines)


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
