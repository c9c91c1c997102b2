"""`tandem bench compare`'s tables: the rows it prints, the memory-bandwidth probe and the batch-1
roofline (bytes one decode step reads), and what a speculative step costs against a plain one."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

SPEEDUP_GOAL = 1.6  # speculation's batch-1 goal over no speculation (README, "Benchmarks")


def measure_memory_bandwidth(
    size_bytes: int = 1 << 30, repeats: int = 5, device: str = "cpu"
) -> dict[str, float]:
    """Best-of-``repeats`` bytes/s of a copy (read + write counted) and a sum (read) over a
    buffer much larger than the caches; ``bandwidth`` is the larger of the two."""
    import torch

    dev = torch.device(device)
    n = max(1, size_bytes // 4)
    src = torch.ones(n, dtype=torch.float32, device=dev)
    dst = torch.empty_like(src)

    def best(fn: Callable[[], object]) -> float:
        fn()  # first touch / warm-up
        times = []
        for _ in range(max(1, repeats)):
            if dev.type == "cuda":
                torch.cuda.synchronize()
            t = time.perf_counter()
            fn()
            if dev.type == "cuda":
                torch.cuda.synchronize()
            times.append(time.perf_counter() - t)
        return min(times)

    copy_s = best(lambda: dst.copy_(src))
    sum_s = best(lambda: src.sum())
    nbytes = n * 4
    out = {"copy": 2 * nbytes / copy_s, "sum": nbytes / sum_s, "buffer_bytes": float(nbytes)}
    out["bandwidth"] = max(out["copy"], out["sum"])
    return out


def weight_bytes_per_step(config: Any, dtype_bytes: int) -> int:
    """Bytes of the weights one decode step reads: every parameter once (tied embedding and LM
    head are one tensor), less an untied input embedding (a step reads one row of it)."""
    import torch
    import transformers as tf

    with torch.device("meta"):
        model = tf.AutoModelForCausalLM.from_config(config)
    total = sum(p.numel() for p in model.parameters())  # shared tensors are listed once
    embed = model.get_input_embeddings().weight
    out = model.get_output_embeddings()
    if out is None or out.weight is not embed:
        total -= embed.numel()
    return int(total) * dtype_bytes


def kv_bytes_per_step(config: Any, dtype_bytes: int, context_len: float) -> int:
    """K and V of every layer over ``context_len`` positions (what attention reads at batch 1)."""
    heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    return int(2 * config.num_hidden_layers * kv_heads * head_dim * dtype_bytes * context_len)


def roofline_tokens_per_s(bandwidth: float, bytes_per_step: float) -> float:
    """Upper bound on batch-1 decode tokens/s when a step must stream ``bytes_per_step``."""
    if bandwidth <= 0 or bytes_per_step <= 0:
        raise ValueError("bandwidth and bytes per step must be positive")
    return bandwidth / bytes_per_step


@dataclass
class Row:
    name: str
    batch1: float | None = None  # decode tokens/s of one request alone
    by_concurrency: dict[int, float | None] = field(default_factory=dict)
    tokens_per_step: float | None = None
    note: str = ""
    batch1_steps: int | None = None  # decode steps of the batch-1 column (Tandem rows)
    batch1_tokens: int = 0
    batch1_seconds: float = 0.0
    rss_mib: float | None = None  # resident memory the system added (its own process: all of it)


def format_table(rows: list[Row], concurrency: list[int], baseline: dict[str, Row | None]) -> str:
    cols = ["batch 1", *[f"c={c}" for c in concurrency]]
    name_w = max(28, *(len(r.name) + 2 for r in rows))

    def values(r: Row) -> list[float | None]:
        return [r.batch1, *[r.by_concurrency.get(c) for c in concurrency]]

    def line(label: str, cells: list[str], tail: str = "") -> str:
        return f"{label:<{name_w}}" + "".join(f"{c:>10}" for c in cells) + tail

    out = [line("tokens/s", cols, f"{'tok/step':>10}{'RSS MiB':>10}")]
    for r in rows:
        cells = ["n/a" if v is None else f"{v:.1f}" for v in values(r)]
        tps = f"{r.tokens_per_step:.2f}" if r.tokens_per_step else "-"
        rss = f"{r.rss_mib:.0f}" if r.rss_mib is not None else "-"
        note = f"   {r.note}" if r.note else ""
        out.append(line(r.name, cells, f"{tps:>10}{rss:>10}" + note))
    for title, base in baseline.items():
        out.append("")
        if base is None or all(v is None for v in values(base)):
            out.append(f"{title}: n/a (no baseline numbers)")
            continue
        out.append(line(title, cols))
        for r in rows:
            cells = [
                "n/a" if v is None or b is None or b <= 0 else f"{v / b:.2f}x"
                for v, b in zip(values(r), values(base), strict=True)
            ]
            out.append(line(r.name, cells))
    return "\n".join(out)


def per_step_costs(r: Row) -> tuple[float, float] | None:
    """(ms per decode step, tokens per step) of a row's batch-1 column, when steps were counted."""
    if not r.batch1_steps or r.batch1_seconds <= 0:
        return None
    return 1e3 * r.batch1_seconds / r.batch1_steps, r.batch1_tokens / r.batch1_steps


def format_step_costs(rows: list[Row], plain: Row, goal: float = SPEEDUP_GOAL) -> str:
    """Speculation's batch-1 speedup taken apart: tokens per step over the cost of a step in
    plain (no speculation) steps, and what either would need to be for ``goal``."""
    base = per_step_costs(plain)
    measured = [(r, per_step_costs(r)) for r in rows]
    measured = [(r, m) for r, m in measured if m is not None]
    if base is None or not measured:
        return "batch 1 per decode step: n/a (no steps counted)"
    name_w = max(28, *(len(r.name) + 2 for r, _ in measured))
    head = ("ms/step", "tok/step", "cost", "speedup")
    out = [f"{'batch 1, per decode step':<{name_w}}" + "".join(f"{h:>10}" for h in head)]
    needs = []
    for r, (ms, tps) in measured:
        cost = ms / base[0]
        speedup = (tps / cost) / base[1]
        cells = (f"{ms:.1f}", f"{tps:.2f}", f"{cost:.2f}x", f"{speedup:.2f}x")
        out.append(f"{r.name:<{name_w}}" + "".join(f"{c:>10}" for c in cells))
        if r is not plain:
            needs.append(
                f"  {r.name}: {goal * cost * base[1]:.2f} tokens/step at this step cost, or a "
                f"step of at most {tps / (goal * base[1]):.2f} plain steps at {tps:.2f} tokens/step"
            )
    out.append(
        "cost = ms/step over the plain step's; speedup = tok/step / cost (the batch-1 ratio)."
    )
    if needs:
        out.append(f"for {goal:g}x at batch 1:")
        out.extend(needs)
    return "\n".join(out)
