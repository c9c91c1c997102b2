"""Soak: 64 concurrent clients against a speculating server (MTP, K=3) for a bounded time, mixing
streaming and non-streaming, completions and chat, greedy and sampled, n=1 and n=2, with random
disconnects and aborts. Every completed request must carry correct usage, greedy answers must not
depend on the load, and after the drain nothing may be left: no running or waiting request, no
KV block held, nothing tracked by the API process (all read from /metrics over HTTP).

``TANDEM_SOAK_S`` sets how long the clients send (default 10 s: some 1,100 requests on 2 cores,
every kind of job over a hundred times, some 180 disconnects and aborts; the drain adds a few
seconds)."""

from __future__ import annotations

import asyncio
import json
import os
import random
import time
from collections import Counter, defaultdict
from dataclasses import dataclass, field

import httpx
import pytest

from server_utils import RemoteServer, metric, scrape_metrics, tiny_mtp_model, wait_until

SOAK_S = float(os.environ.get("TANDEM_SOAK_S", "10"))  # load; the drain adds a few s
CLIENTS = 64
NAME = "soak"
LABEL = {"model_name": NAME}
PROMPTS = [
    "The quick brown fox",
    "Hello world! How are you today?",
    "Paris is the capital of",
    "Speculative decoding drafts tokens and",
    "0123456789",
    "user assistant system: tokens, blocks, caches;",
]
STOPS = [" the", "o", "."]

pytestmark = pytest.mark.timeout(int(SOAK_S) + 240)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_mtp_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
    args = [
        "--speculative-config", spec, "--max-num-seqs", "32", "--max-waiting-requests", "512",
        "--served-model-name", NAME,
    ]  # fmt: skip
    with RemoteServer(model_dir, args) as s:
        yield s


@dataclass
class Tally:
    completed: Counter = field(default_factory=Counter)  # by kind
    sequences: int = 0  # choices of completed requests
    completion_tokens: int = 0
    disconnects: int = 0
    aborts: int = 0
    errors: Counter = field(default_factory=Counter)  # by kind: anything unexpected
    problems: list[str] = field(default_factory=list)
    greedy: dict[tuple, set[str]] = field(default_factory=lambda: defaultdict(set))
    ids: list[str] = field(default_factory=list)

    def problem(self, text: str) -> None:
        self.errors["bad_response"] += 1
        self.problems.append(text)


@dataclass
class Job:
    chat: bool
    stream: bool
    greedy: bool
    prompt: int
    max_tokens: int
    n: int
    stop: str | None
    logprobs: bool
    leave: str | None  # None | "disconnect" (stream: after some events) | "abort" (cancel)

    @property
    def exact(self) -> bool:
        """Every choice runs to max_tokens (ignore_eos, no stop string)."""
        return self.stop is None

    def body(self, rng: random.Random) -> dict:
        body: dict = {"model": NAME, "max_tokens": self.max_tokens, "n": self.n}
        if self.chat:
            body["messages"] = [{"role": "user", "content": PROMPTS[self.prompt]}]
            if self.logprobs:
                body |= {"logprobs": True, "top_logprobs": 1}
        else:
            body["prompt"] = PROMPTS[self.prompt]
            if self.logprobs:
                body["logprobs"] = 1
        if self.greedy:
            body["temperature"] = 0
        else:
            body |= {"temperature": 0.8, "top_p": 0.9}
            if rng.random() < 0.5:
                body["seed"] = rng.randrange(1 << 30)
        if self.stop is not None:
            body["stop"] = [self.stop]
        else:
            body["ignore_eos"] = True
        if self.stream:
            body |= {"stream": True, "stream_options": {"include_usage": True}}
        return body


def draw(rng: random.Random) -> Job:
    stream = rng.random() < 0.5
    leave = None
    r = rng.random()
    if r < 0.08 and stream:
        leave = "disconnect"
    elif r < 0.16:
        leave = "abort"
    return Job(
        chat=rng.random() < 0.5,
        stream=stream,
        greedy=rng.random() < 0.5,
        prompt=rng.randrange(len(PROMPTS)),
        max_tokens=rng.choice([1, 2, 5, 8, 16, 24, 40]),
        n=2 if rng.random() < 0.15 else 1,
        stop=rng.choice(STOPS) if rng.random() < 0.2 else None,
        logprobs=rng.random() < 0.2,
        leave=leave,
    )


def check_usage(job: Job, usage: dict, choices: dict[int, dict], prompt_tokens: int,
                tally: Tally, where: str) -> None:  # fmt: skip
    """``choices``: index -> {"text", "finish_reason", "tokens" (logprob entries or None)}."""
    if sorted(choices) != list(range(job.n)):
        return tally.problem(f"{where}: choices {sorted(choices)} for n={job.n}")
    if usage["prompt_tokens"] != prompt_tokens:
        return tally.problem(f"{where}: prompt_tokens {usage['prompt_tokens']} != {prompt_tokens}")
    if usage["total_tokens"] != usage["prompt_tokens"] + usage["completion_tokens"]:
        return tally.problem(f"{where}: total_tokens {usage}")
    per_choice = [c["tokens"] for c in choices.values()]
    if job.exact:
        want = job.n * job.max_tokens
        if usage["completion_tokens"] != want or any(
            c["finish_reason"] != "length" for c in choices.values()
        ):
            return tally.problem(f"{where}: usage {usage} choices {choices} want {want}")
    elif not job.n <= usage["completion_tokens"] <= job.n * job.max_tokens:
        return tally.problem(f"{where}: completion_tokens {usage['completion_tokens']}")
    if job.logprobs and sum(per_choice) != usage["completion_tokens"]:
        return tally.problem(f"{where}: {per_choice} logprob entries vs {usage}")
    spec = usage.get("spec_decode")
    if spec is not None and not (
        0 <= spec["num_accepted_tokens"] <= spec["num_draft_tokens"] <= 3 * spec["num_drafts"]
    ):
        return tally.problem(f"{where}: spec_decode {spec}")
    if job.exact and job.max_tokens >= 5 and spec is None:
        return tally.problem(f"{where}: no spec_decode usage under speculation: {usage}")
    if job.greedy:
        key = (job.chat, job.prompt, job.max_tokens, job.stop)
        for c in choices.values():
            tally.greedy[key].add(c["text"])
    tally.completed["stream" if job.stream else "plain"] += 1
    tally.sequences += job.n
    tally.completion_tokens += usage["completion_tokens"]


async def run_job(c: httpx.AsyncClient, job: Job, body: dict, prompt_tokens: int,
                  tally: Tally) -> None:  # fmt: skip
    path = "/v1/chat/completions" if job.chat else "/v1/completions"
    where = f"{path} {body}"
    if not job.stream:
        r = await c.post(path, json=body)
        if r.status_code != 200:
            tally.errors[f"http_{r.status_code}"] += 1
            tally.problems.append(f"{where}: {r.status_code} {r.text[:200]}")
            return
        data = r.json()
        tally.ids.append(data["id"])
        choices = {}
        for ch in data["choices"]:
            text = ch["message"]["content"] if job.chat else ch["text"]
            lp = ch["logprobs"]
            tokens = None
            if job.logprobs:
                tokens = len(lp["content"]) if job.chat else len(lp["tokens"])
            choices[ch["index"]] = {
                "text": text, "finish_reason": ch["finish_reason"], "tokens": tokens,
            }  # fmt: skip
        return check_usage(job, data["usage"], choices, prompt_tokens, tally, where)

    choices: dict[int, dict] = {}
    usage = None
    events = 0
    async with c.stream("POST", path, json=body) as r:
        if r.status_code != 200:
            await r.aread()
            tally.errors[f"http_{r.status_code}"] += 1
            tally.problems.append(f"{where}: {r.status_code} {r.text[:200]}")
            return
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                break
            events += 1
            if job.leave == "disconnect" and events >= 2:
                tally.disconnects += 1
                return  # leaving the block closes the connection mid-stream
            chunk = json.loads(payload)
            if "error" in chunk:
                tally.errors["stream_error"] += 1
                tally.problems.append(f"{where}: {chunk}")
                return
            if events == 1:
                tally.ids.append(chunk["id"])
            usage = chunk.get("usage") or usage
            for ch in chunk["choices"]:
                slot = choices.setdefault(
                    ch["index"], {"text": "", "finish_reason": None, "tokens": 0}
                )
                slot["text"] += (ch["delta"].get("content") or "") if job.chat else ch["text"]
                slot["finish_reason"] = ch["finish_reason"] or slot["finish_reason"]
                lp = ch.get("logprobs")
                if lp:
                    slot["tokens"] += len(lp["content"]) if job.chat else len(lp["tokens"])
    if usage is None:
        return tally.problem(f"{where}: stream without usage")
    if not job.logprobs:
        for slot in choices.values():
            slot["tokens"] = None
    check_usage(job, usage, choices, prompt_tokens, tally, where)


async def client(server: RemoteServer, seed: int, deadline: float, prompt_tokens: dict,
                 tally: Tally) -> None:  # fmt: skip
    rng = random.Random(seed)
    timeout = httpx.Timeout(120.0, connect=30.0)
    async with httpx.AsyncClient(base_url=server.base_url, timeout=timeout) as c:
        while time.monotonic() < deadline:
            job = draw(rng)
            body = job.body(rng)
            work = asyncio.ensure_future(
                run_job(c, job, body, prompt_tokens[(job.chat, job.prompt)], tally)
            )
            if job.leave == "abort":
                # Cancel after a random delay: before, during or (rarely) after generation.
                await asyncio.wait({work}, timeout=rng.uniform(0.0, 0.5))
                if not work.done():
                    work.cancel()
                    tally.aborts += 1
            try:
                await work
            except asyncio.CancelledError:
                if not work.cancelled():
                    raise
            except httpx.HTTPError as e:
                tally.errors[type(e).__name__] += 1
                tally.problems.append(f"{body}: {type(e).__name__}: {e}")


def counters(server: RemoteServer) -> dict[str, float]:
    m = scrape_metrics(server)
    out = {
        name: metric(m, f"tandem:{name}", **LABEL)
        for name in (
            "num_requests_running", "num_requests_waiting", "kv_cache_used_blocks",
            "kv_cache_usage_perc", "num_requests_in_flight",
        )
    }  # fmt: skip
    out["success"] = metric(m, "tandem:request_success_total", **LABEL)
    out["generation"] = metric(m, "tandem:generation_tokens_total", **LABEL)
    out["drafts"] = metric(m, "tandem:spec_decode_num_drafts_total", **LABEL)
    return out


def drained(server: RemoteServer) -> dict[str, float] | None:
    c = counters(server)
    keys = ("num_requests_running", "num_requests_waiting", "kv_cache_used_blocks",
            "num_requests_in_flight")  # fmt: skip
    return c if all(c[k] == 0 for k in keys) else None


def test_soak(server):
    with httpx.Client(base_url=server.base_url, timeout=30) as c:
        prompt_tokens = {}
        for i, p in enumerate(PROMPTS):
            r = c.post("/tokenize", json={"prompt": p})
            prompt_tokens[(False, i)] = r.json()["count"]
            r = c.post("/tokenize", json={"messages": [{"role": "user", "content": p}]})
            prompt_tokens[(True, i)] = r.json()["count"]
    before = counters(server)
    tally = Tally()

    async def run() -> None:
        deadline = time.monotonic() + SOAK_S
        await asyncio.gather(
            *[client(server, seed, deadline, prompt_tokens, tally) for seed in range(CLIENTS)]
        )

    start = time.monotonic()
    asyncio.run(run())
    elapsed = time.monotonic() - start
    after = wait_until(lambda: drained(server), timeout_s=60, interval_s=0.5)
    done = sum(tally.completed.values())
    print(
        f"\nsoak: {CLIENTS} clients, {elapsed:.0f} s: {done} requests completed "
        f"({dict(tally.completed)}), {tally.sequences} sequences, "
        f"{tally.completion_tokens} completion tokens; {tally.disconnects} disconnects, "
        f"{tally.aborts} aborts; errors by kind {dict(tally.errors)}; after drain: "
        f"running {after['num_requests_running']:.0f}, waiting "
        f"{after['num_requests_waiting']:.0f}, KV blocks held "
        f"{after['kv_cache_used_blocks']:.0f}, in flight {after['num_requests_in_flight']:.0f}; "
        f"spec drafts {after['drafts'] - before['drafts']:.0f}"
    )
    assert not tally.errors, "\n".join(tally.problems[:20])
    assert done >= CLIENTS  # every client finished something
    assert tally.completed["stream"] > 0 and tally.completed["plain"] > 0
    assert tally.disconnects + tally.aborts > 0
    assert after["kv_cache_usage_perc"] == 0 and after["drafts"] > before["drafts"]
    # Nothing lost: every completed sequence was counted as a success; the extra ones are
    # requests that finished just as their client left.
    success = after["success"] - before["success"]
    assert tally.sequences <= success <= tally.sequences + 2 * (tally.disconnects + tally.aborts)
    assert after["generation"] - before["generation"] >= tally.completion_tokens
    # Greedy output does not depend on the batch it ran in.
    unstable = {k: v for k, v in tally.greedy.items() if len(v) > 1}
    assert not unstable, unstable
    assert len(set(tally.ids)) == len(tally.ids)  # server-side ids never collide
    # And the server still answers afterwards.
    with httpx.Client(base_url=server.base_url, timeout=60) as c:
        assert c.get("/health").status_code == 200
        r = c.post("/v1/completions", json={"model": NAME, "prompt": "x", "max_tokens": 3,
                                            "ignore_eos": True})  # fmt: skip
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
