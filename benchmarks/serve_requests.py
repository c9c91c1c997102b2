"""`tandem bench serve`'s workload: the prompts (the shipped eval set, a JSONL file or random
words), the requests built from them, and their streamed sending at a rate or a concurrency
(time to first token, the gaps between chunks, latency)."""

from __future__ import annotations

import argparse
import asyncio
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.support import BenchError

EVAL_PROMPTS = Path(__file__).resolve().parent.parent / "training/data/eval_prompts.jsonl"


DEFAULT_TEXT_MAX_TOKENS = 256  # eval / jsonl prompts without their own max_tokens


DEFAULT_RANDOM_NUM_PROMPTS = 100


# A neutral vocabulary for random prompts when no tokenizer is at hand.
_WORDS = (
    "time year people way day man thing woman life child world school state family student "
    "group country problem hand part place case week company system program question work "
    "government number night point home water room mother area money story fact month lot "
    "right study book eye job word business issue side kind head house service friend father "
    "power hour game line end member law car city community name president team minute idea"
).split()


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
