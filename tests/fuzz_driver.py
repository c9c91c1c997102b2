"""Fuzz at scale: seeded schema-based, mutation-based and protocol-level requests (see
`fuzz_cases.py`) against real servers: (a) speculating with Eagle3 draft trees, (b) ``-tp 2``,
(c) ``-dp 2``, all on tiny checkpoints. Counted: no answer >= 500 but a 503 ``queue_full`` with
Retry-After, no hang (every request answered, or closed by the server, within the client's
limit), no server-side error event in a stream, no traceback in the log, and at the end /health
200 with nothing running, waiting, in flight or holding a KV block. Prints a table (requests per
kind, status codes, p50/p99 latency) and, per failure, the command that replays it.

    python tests/fuzz_driver.py --requests 51000 --seed 1 --server all   # `make fuzz`
    python tests/fuzz_driver.py --requests 51000 --seed 1 --server tp2 --index 4711
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import socket
import sys
import tempfile
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from fuzz_cases import (
    BODY_LIMIT,
    KINDS,
    MAX_MODEL_LEN,
    MODEL,
    Request,
    kind_of,
    mutation_request,
    protocol_request,
    request_rng,
    schema_requests,
)

from server_utils import RemoteServer, is_openai_error_text, metric, scrape_metrics, wait_until

SERVERS = ("spec", "tp2", "dp2")
# Longer than any answer takes: a request past it is a hang. The longest are requests without
# an output limit (up to the whole context, some 500 tokens), 24 at a time on a busy machine.
CLIENT_TIMEOUT_S = 300.0
IDLE_TIMEOUT_S = 60.0  # the drain after the last request
BASE_ARGS = [
    "--served-model-name", MODEL, "--max-num-seqs", "24", "--max-waiting-requests", "16",
    "--max-request-body-size", str(BODY_LIMIT),
]  # fmt: skip
IDLE_GAUGES = (
    "num_requests_running", "num_requests_waiting", "kv_cache_used_blocks",
    "num_requests_in_flight",
)  # fmt: skip


@dataclass(frozen=True)
class Outcome:
    server: str
    request: Request
    status: str  # "200", "400", ..., "closed" (no answer, the server hung up), "hang", "unsent"
    latency_s: float
    problem: str | None = None  # why this counts as a failure


@dataclass
class Report:
    seed: int
    requests: int
    outcomes: list[Outcome] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # failures outside one request
    seconds: float = 0.0
    counts: dict[str, int] = field(default_factory=dict)  # requests planned per server

    @property
    def failures(self) -> list[Outcome]:
        return [o for o in self.outcomes if o.problem]

    @property
    def ok(self) -> bool:
        return not self.failures and not self.problems


# ------------------------------------------------------------------ servers


def build_models(root: Path) -> dict[str, Path]:
    """The tiny target and a random Eagle3 head for it (built once per ``root``)."""
    from checkpoints import build_eagle3_draft, build_llama

    target, head = root / "target", root / "eagle3"
    if not (target / "config.json").exists():
        build_llama(target)
    if not (head / "config.json").exists():
        build_eagle3_draft(head, target, draft_vocab=160)
    return {"target": target, "eagle3": head}


def start_server(name: str, models: dict[str, Path]) -> RemoteServer:
    """(a) Eagle3 draft trees (2 children per node, 4 nodes, depth 2), (b) TP=2, (c) DP=2."""
    from checkpoints import eagle3_tree_spec

    extra = {
        "spec": ["--speculative-config", json.dumps(eagle3_tree_spec(models["eagle3"], 2, 4, k=2))],
        "tp2": ["-tp", "2"],
        "dp2": ["-dp", "2"],
    }[name]
    return RemoteServer(models["target"], [*BASE_ARGS, *extra], max_model_len=MAX_MODEL_LEN)


# ------------------------------------------------------------------ sending


class Plan:
    """The ``count`` requests for ``server``, built as they are sent (a 51,000-request run
    would not fit in memory otherwise): request i is a function of (seed, server, i), the schema
    cases by their running number among the plan's."""

    def __init__(self, seed: int, server: str, count: int, openapi: dict) -> None:
        self.seed, self.server = seed, server
        self.kinds = [kind_of(request_rng(seed, server, i)) for i in range(count)]
        at = [i for i, kind in enumerate(self.kinds) if kind == "schema"]
        cases = schema_requests(openapi, len(at), seed * 7 + SERVERS.index(server))
        self.schema = {
            i: dataclasses.replace(case, index=i) for i, case in zip(at, cases, strict=True)
        }

    def __len__(self) -> int:
        return len(self.kinds)

    def request(self, i: int) -> Request:
        if self.kinds[i] == "schema":
            return self.schema[i]
        rng = request_rng(self.seed, self.server, i)
        rng.random()  # the draw kind_of made
        if self.kinds[i] == "mutation":
            return mutation_request(rng, i)
        return protocol_request(rng, i)


async def send_http(client: httpx.AsyncClient, server: str, req: Request) -> Outcome:
    start = time.monotonic()
    try:
        async with client.stream(req.method, req.path, content=req.body, headers=req.headers) as r:
            text = (await r.aread()).decode("utf-8", "replace")
    except httpx.TimeoutException:
        return Outcome(server, req, "hang", time.monotonic() - start, "no answer in time")
    except (httpx.InvalidURL, httpx.UnsupportedProtocol, UnicodeEncodeError, ValueError):
        return Outcome(server, req, "unsent", 0.0)  # httpx refuses to send it (a bad header)
    except httpx.TransportError as e:
        return Outcome(server, req, "closed", time.monotonic() - start, f"dropped: {e!r}")
    latency = time.monotonic() - start
    return Outcome(server, req, str(r.status_code), latency, judge(r.status_code, r.headers, text))


def judge(status: int, headers: httpx.Headers, text: str, shaped: bool = True) -> str | None:
    """Why an answer is a failure, or None. ``shaped``: a 4xx must carry the OpenAI error shape
    (the HTTP parser's own 400s for broken framing, before the app, are plain text)."""
    if status == 503:
        if '"queue_full"' not in text or int(headers.get("retry-after", "0")) < 1:
            return "503 that is not an overloaded queue with Retry-After"
        return None
    if status >= 500:
        return f"{status}"
    if status >= 400 and shaped and not is_openai_error_text(text):
        return "error without the OpenAI shape"
    if status == 200 and "text/event-stream" in headers.get("content-type", ""):
        if '"server_error"' in text:
            return "a server error inside the stream"
        if not text.rstrip().endswith("data: [DONE]"):
            return "stream without data: [DONE]"
    return None


async def send_raw(port: int, server: str, req: Request) -> Outcome:
    """Raw bytes on a socket; the answer is read until the server closes (Connection: close)."""
    start = time.monotonic()

    async def exchange() -> bytes:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        try:
            for i, chunk in enumerate(req.raw):
                if i and req.pause_s:
                    await asyncio.sleep(req.pause_s)
                writer.write(chunk)
                await writer.drain()
            if req.abandon:  # the server writes into a window that never opens, then loses us
                writer.transport.get_extra_info("socket").setsockopt(
                    socket.SOL_SOCKET, socket.SO_RCVBUF, 1024
                )
                await asyncio.sleep(req.pause_s)
                return b""
            if req.shut_write and writer.can_write_eof():
                writer.write_eof()
            return await reader.read(-1)
        finally:
            writer.close()

    try:
        answer = await asyncio.wait_for(exchange(), CLIENT_TIMEOUT_S)
    except TimeoutError:
        return Outcome(server, req, "hang", time.monotonic() - start, "no answer in time")
    except (ConnectionError, OSError):
        return Outcome(server, req, "closed", time.monotonic() - start)
    latency = time.monotonic() - start
    if req.abandon:
        return Outcome(server, req, "abandoned", latency)
    if not answer:
        return Outcome(server, req, "closed", latency)
    head, _, body = answer.partition(b"\r\n\r\n")
    try:
        status = int(head.split(b" ", 2)[1])
    except (IndexError, ValueError):
        return Outcome(server, req, "closed", latency, f"not HTTP: {answer[:80]!r}")
    headers = httpx.Headers(
        [
            tuple(x.strip() for x in line.split(b":", 1))
            for line in head.split(b"\r\n")[1:]
            if b":" in line
        ]
    )
    if headers.get("transfer-encoding") == "chunked":
        body = _dechunk(body)
    return Outcome(
        server,
        req,
        str(status),
        latency,
        judge(status, headers, body.decode("utf-8", "replace"), shaped=False),
    )


def _dechunk(data: bytes) -> bytes:
    out = b""
    while data:
        size_line, _, rest = data.partition(b"\r\n")
        try:
            size = int(size_line.split(b";")[0], 16)
        except ValueError:
            break
        if size == 0:
            break
        out += rest[:size]
        data = rest[size + 2 :]
    return out


async def drive(
    server: RemoteServer, name: str, plan: Plan, indices: range, concurrency: int
) -> list[Outcome]:
    """Send ``plan``'s ``indices``, ``concurrency`` at a time. Outcomes keep the body of a
    failing request only."""
    todo = iter(indices)
    outcomes: list[Outcome] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    timeout = httpx.Timeout(CLIENT_TIMEOUT_S)
    async with httpx.AsyncClient(
        base_url=server.base_url, timeout=timeout, limits=limits
    ) as client:

        async def worker() -> None:
            for i in todo:
                req = plan.request(i)
                if req.raw:
                    outcome = await send_raw(server.port, name, req)
                else:
                    outcome = await send_http(client, name, req)
                if outcome.problem is None:
                    light = Request(req.kind, req.index, req.variant, req.method, req.path)
                    outcome = dataclasses.replace(outcome, request=light)
                outcomes.append(outcome)

        await asyncio.gather(*[worker() for _ in range(concurrency)])
    return outcomes


def settle(server: RemoteServer, name: str) -> list[str]:
    """What is wrong with ``server`` after the load: its health, what it still holds, its log."""
    problems = []
    try:
        if httpx.get(server.url("/health"), timeout=10).status_code != 200:
            problems.append(f"{name}: /health is not 200 after the run")

        def idle() -> bool:
            m = scrape_metrics(server)
            return all(metric(m, f"tandem:{g}", model_name=MODEL) == 0 for g in IDLE_GAUGES)

        wait_until(idle, timeout_s=IDLE_TIMEOUT_S, interval_s=0.5)
        r = httpx.post(server.url("/v1/completions"), timeout=60,
                       json={"model": MODEL, "prompt": "Hello", "max_tokens": 4})  # fmt: skip
        if r.status_code != 200:
            problems.append(f"{name}: a plain completion after the run got {r.status_code}")
    except TimeoutError:
        m = scrape_metrics(server)
        held = {g: metric(m, f"tandem:{g}", model_name=MODEL) for g in IDLE_GAUGES}
        problems.append(f"{name}: not idle {IDLE_TIMEOUT_S:.0f} s after the run: {held}")
    except httpx.HTTPError as e:
        problems.append(f"{name}: unreachable after the run: {e!r}")
    log = server.log_tail(1 << 30)
    if "Traceback" in log:
        at = log.index("Traceback")
        problems.append(f"{name}: a traceback in the server log:\n{log[at : at + 6000]}")
    return problems


# ------------------------------------------------------------------ the run


def run(
    requests: int,
    seed: int,
    servers: tuple[str, ...],
    concurrency: int,
    index: int | None = None,
    root: Path | None = None,
) -> Report:
    """``requests`` in all, split evenly over ``servers`` (started together, fuzzed one after
    another); ``index`` sends only that request of each server's plan (a replay)."""
    if root is None:
        with tempfile.TemporaryDirectory(prefix="tandem-fuzz-") as tmp:
            return run(requests, seed, servers, concurrency, index, Path(tmp))
    report = Report(seed, requests)
    start = time.monotonic()
    models = build_models(root)
    started = {name: start_server(name, models) for name in servers}  # they load side by side
    try:
        for i, (name, server) in enumerate(list(started.items())):
            count = requests // len(servers) + (i < requests % len(servers))
            report.counts[name] = count
            server.wait_ready()
            openapi = httpx.get(server.url("/openapi.json"), timeout=30).json()
            todo = Plan(seed, name, count, openapi)
            indices = range(count) if index is None else range(index, index + 1)
            began = time.monotonic()
            outcomes = asyncio.run(drive(server, name, todo, indices, concurrency))
            report.outcomes += outcomes
            report.problems += settle(server, name)
            failed = sum(o.problem is not None for o in outcomes)
            print(f"fuzz: {name}: {len(outcomes)} requests in {time.monotonic() - began:.0f} s, "
                  f"{failed} failed", file=sys.stderr, flush=True)  # fmt: skip
            started.pop(name).stop()
    finally:
        for server in started.values():
            server.stop()
    report.seconds = time.monotonic() - start
    return report


def _percentile(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


def table(report: Report) -> str:
    rows = [f"fuzz: {len(report.outcomes)} requests, seed {report.seed}, {report.seconds:.0f} s"]
    head = f"{'server':<6} {'kind':<9} {'requests':>8} {'p50 ms':>8} {'p99 ms':>8}  status codes"
    rows += [head, "-" * len(head)]
    groups: dict[tuple[str, str], list[Outcome]] = defaultdict(list)
    for o in report.outcomes:
        groups[(o.server, o.request.kind)].append(o)
        groups[("all", o.request.kind)].append(o)
    servers = sorted({o.server for o in report.outcomes}, key=SERVERS.index)
    for server in [*servers, "all"]:
        for kind in KINDS:
            group = groups.get((server, kind), [])
            if not group:
                continue
            lat = [o.latency_s * 1000 for o in group]
            codes = Counter(o.status for o in group)
            text = " ".join(f"{k}:{v}" for k, v in sorted(codes.items()))
            rows.append(f"{server:<6} {kind:<9} {len(group):>8} {_percentile(lat, 0.5):>8.1f} "
                        f"{_percentile(lat, 0.99):>8.1f}  {text}")  # fmt: skip
    total = Counter(o.status for o in report.outcomes)
    rows.append("status codes, all: " + " ".join(f"{k}:{v}" for k, v in sorted(total.items())))
    rows.append(f"failures: {len(report.failures)} requests, {len(report.problems)} other")
    for o in report.failures[:20]:
        body = (o.request.body or b"".join(o.request.raw))[:400]
        rows.append(
            f"  {o.server} #{o.request.index} {o.request.kind} {o.request.variant}: {o.problem} "
            f"({o.status}); replay: python tests/fuzz_driver.py --requests {report.counts[o.server]} "
            f"--seed {report.seed} --server {o.server} --index {o.request.index}\n    body: {body!r}"
        )
    rows += [f"  {p}" for p in report.problems]
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=51_000, help="in all, over the servers")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--server", choices=[*SERVERS, "all"], default="all")
    parser.add_argument("--concurrency", type=int, default=32)
    parser.add_argument("--index", type=int, default=None, help="replay one request's index")
    ns = parser.parse_args(argv)
    servers = SERVERS if ns.server == "all" else (ns.server,)
    report = run(ns.requests, ns.seed, servers, ns.concurrency, ns.index)
    print(table(report), flush=True)
    return 0 if report.ok else 1


if __name__ == "__main__":
    sys.exit(main())
