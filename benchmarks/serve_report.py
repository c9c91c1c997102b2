"""`tandem bench serve`'s report: the server's `/metrics` before and after a run (speculative
decoding's tokens per step and acceptance), the latency statistics, and the printed block."""

from __future__ import annotations

import math
from typing import Any

from tandem.bench.serve_requests import RequestResult

METRIC_PREFIX = "tandem:spec_decode_"


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
