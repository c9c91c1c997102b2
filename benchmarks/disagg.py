"""Disaggregated against colocated serving, side by side in one run: ``python -m
tandem.bench.disagg`` starts ``tandem router`` in front of one ``--role prefill`` and one
``--role decode`` instance, then two ``--role both`` replicas behind the DP dispatcher
(``-dp 2``), and loads each with the same mixed requests through ``tandem bench serve``: long
prompts with short answers (a document to summarise) among short chats with longer answers.
Prints TTFT and inter-token latency (p50 / p99) and throughput per setup; on this machine's
CPUs both setups share the same cores, which the table says.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench.serve_requests import EVAL_PROMPTS, read_jsonl_prompts
from tandem.bench.support import LocalServer, _free_port

WORDS = (
    "river market engine window garden signal paper orbit copper harbor lantern meadow "
    "thunder velvet castle pepper island rocket marble silver anchor canyon violet kettle"
).split()


def mixed_prompts(
    num_long: int, num_short: int, long_words: int, seed: int
) -> list[dict[str, Any]]:
    """Long documents to summarise in a sentence (24 tokens), and short chat prompts (64),
    interleaved."""
    rng = random.Random(seed)
    longs = [
        {
            "prompt": " ".join(rng.choice(WORDS) for _ in range(long_words))
            + "\n\nSummarise the text above in one sentence.",
            "max_tokens": 24,
        }
        for _ in range(num_long)
    ]
    shorts = [
        {"prompt": p, "max_tokens": 64} for p, _ in read_jsonl_prompts(EVAL_PROMPTS)[:num_short]
    ]
    out: list[dict[str, Any]] = []
    while longs or shorts:
        for bucket in (shorts, shorts, longs):
            if bucket:
                out.append(bucket.pop(0))
    return out


def _bench(url: str, dataset: Path, concurrency: int, result: Path) -> dict[str, Any]:
    cmd = [
        sys.executable, "-m", "tandem.cli", "bench", "serve", "--base-url", url,
        "--dataset", "jsonl", "--dataset-path", str(dataset), "--max-concurrency",
        str(concurrency), "--temperature", "0", "--ignore-eos", "--result-file", str(result),
    ]  # fmt: skip
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    return json.loads(result.read_text())["runs"][0]


def _router(prefill: str, decode: str) -> tuple[subprocess.Popen[bytes], str]:
    import httpx

    port = _free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "router", "--port", str(port), "--prefill",
         prefill, "--decode", decode, "--log-level", "warning"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.25)
    proc.kill()
    raise RuntimeError("the router did not come up")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m tandem.bench.disagg", description=__doc__)
    ap.add_argument("--model", default="builtin", help="a model folder, or builtin")
    ap.add_argument("--serve-args", default="", help="extra options for every instance")
    ap.add_argument("--num-long", type=int, default=8)
    ap.add_argument("--num-short", type=int, default=16)
    ap.add_argument("--long-words", type=int, default=700, help="words per long prompt")
    ap.add_argument("--concurrency", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ns = ap.parse_args(argv)
    rows = []
    with tempfile.TemporaryDirectory(prefix="tandem-disagg-") as tmp:
        dataset = Path(tmp) / "mixed.jsonl"
        prompts = mixed_prompts(ns.num_long, ns.num_short, ns.long_words, ns.seed)
        dataset.write_text("".join(json.dumps(p) + "\n" for p in prompts))
        # Disaggregated: router + 1 prefill + 1 decode instance.
        prefill = LocalServer(ns.model, f"--role prefill {ns.serve_args}", None)
        decode = LocalServer(ns.model, f"--role decode {ns.serve_args}", None)
        router = None
        try:
            prefill.wait_ready()
            decode.wait_ready()
            router, url = _router(prefill.base_url, decode.base_url)
            rows.append(("router + 1 prefill + 1 decode", _bench(url, dataset, ns.concurrency,
                                                                  Path(tmp) / "pd.json")))  # fmt: skip
        finally:
            if router is not None:
                router.terminate()
                router.wait(timeout=30)
            prefill.stop()
            decode.stop()
        # Colocated: two replicas behind the DP dispatcher.
        both = LocalServer(ns.model, f"-dp 2 {ns.serve_args}", None)
        try:
            both.wait_ready()
            rows.append(("-dp 2 (two --role both)", _bench(both.base_url, dataset,
                                                            ns.concurrency, Path(tmp) / "dp.json")))  # fmt: skip
        finally:
            both.stop()
    cores = os.cpu_count()
    print(
        f"\nmixed load: {ns.num_long} prompts of {ns.long_words} words (24 tokens out) among "
        f"{ns.num_short} chat prompts (64 out), concurrency {ns.concurrency}, greedy; model "
        f"{ns.model}; every process on this machine's {cores} CPU cores"
    )
    print("| setup | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | ITL p99 ms | output tok/s |")
    print("|---|---|---|---|---|---|")
    for name, r in rows:
        print(
            f"| {name} | {r['median_ttft_ms']:.0f} | {r['p99_ttft_ms']:.0f} | "
            f"{r['median_itl_ms']:.1f} | {r['p99_itl_ms']:.1f} | {r['output_throughput']:.1f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
