"""``tandem bench compare``: one model, one prompt set, one machine, one run — tokens/s of

  - transformers ``generate`` (greedy; batched with left padding at concurrency > 1),
  - transformers ``generate`` with an ``assistant_model`` (only when ``--assistant-model`` names a
    small model with the same tokenizer; transformers' assisted generation is batch 1 only),
  - Tandem's offline engine without speculation, with an Eagle3 head and with MTP,

at batch 1 (decode only: tokens after the first / time after the first) and aggregate at each
``--concurrency`` (that many requests in flight, prefill included). Ratios are printed against
transformers and against Tandem without speculation, with the machine's memory bandwidth (probed
between the batch-1 prompts) and the batch-1 roofline: bandwidth / bytes one decode step reads
(every weight a step reads — the tied embedding / LM head once, an untied input embedding not at
all, since a step reads one row of it — plus the KV cache at the mean context length). Every
system is loaded first and they run in turn (prompt by prompt for the batch-1 column, then
concurrency by concurrency), so that a machine whose speed drifts during the run slows every row alike.

    tandem bench compare                          # the built-in model and its shipped heads
    tandem bench compare --model PATH --eagle3 HEAD --mtp HEAD --dtype bfloat16
    tandem bench compare --quick                  # small numbers, to see that everything runs
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tandem.bench.serve import EVAL_PROMPTS, BenchError, int_list, read_jsonl_prompts

REPO = Path(__file__).resolve().parent.parent
SHIPPED_HEADS = REPO / "models" / "heads"
BUILTIN_EAGLE3 = SHIPPED_HEADS / "smollm2-135m-instruct-eagle3"
BUILTIN_MTP = SHIPPED_HEADS / "smollm2-135m-instruct-mtp"
NONE = "none"  # --eagle3 none / --mtp none: skip that row
BATCH1_PROMPTS = 16  # default prompts timed one at a time for the batch-1 column
SPEEDUP_GOAL = 1.6  # speculation's batch-1 goal over no speculation (README, "Benchmarks")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None, metavar="PATH", help="default: the built-in model")
    p.add_argument(
        "--eagle3",
        default=None,
        metavar="PATH",
        help=f"Eagle3 head (default for the built-in model: {BUILTIN_EAGLE3.relative_to(REPO)} "
        f"when present; '{NONE}' skips the row)",
    )
    p.add_argument(
        "--mtp",
        default=None,
        metavar="PATH",
        help=f"MTP head (default: the model's own MTP layers, or for the built-in model "
        f"{BUILTIN_MTP.relative_to(REPO)} when present; '{NONE}' skips the row)",
    )
    p.add_argument(
        "--assistant-model",
        default=None,
        metavar="PATH",
        help="a small model with the same tokenizer for transformers' assisted generation",
    )
    p.add_argument("--num-speculative-tokens", type=int, default=3)
    p.add_argument(
        "--disable-by-batch-size",
        type=int,
        default=None,
        metavar="N",
        help="speculative rows: no drafts in steps of at least N requests (speculative_config's "
        "disable_by_batch_size)",
    )
    p.add_argument(
        "--draft-quantization",
        choices=("none", "int8"),
        default="none",
        help="speculative rows: speculative_config.draft_quantization (int8 draft matrices on "
        "the CPU fast path)",
    )
    p.add_argument(
        "--trees",
        default="",
        metavar="TOPK:N,...",
        help="speculative rows also with draft trees (speculative_config topk and "
        "num_draft_tokens; depth --num-speculative-tokens), e.g. 2:4,2:8,4:8,4:16",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--device", default="cpu", help="cpu or cuda (the same for every system)")
    p.add_argument("--prompts", default=None, metavar="FILE", help="JSONL {prompt} (eval set)")
    p.add_argument("--num-prompts", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64, help="new tokens per request")
    p.add_argument(
        "--stop-at-eos",
        action="store_true",
        help="requests end at EOS (at most --max-tokens), as answers do; default: exactly "
        "--max-tokens each, EOS ignored",
    )
    p.add_argument("--concurrency", type=int_list, default=[1, 4, 16, 32])
    p.add_argument(
        "--batch1-prompts",
        type=int,
        default=None,
        metavar="N",
        help=f"prompts timed one at a time for the batch-1 column (default {BATCH1_PROMPTS}, 1 "
        "with --quick; at most --num-prompts)",
    )
    p.add_argument(
        "--rounds",
        type=int,
        default=1,
        metavar="N",
        help="run the concurrency columns N times, in turn forward and backward (1, 4, 16, then "
        "16, 4, 1): each figure is the tokens over the time of all rounds, so columns measured "
        "minutes apart share a drifting machine's phases",
    )
    p.add_argument(
        "--json-schema",
        default=None,
        metavar="FILE",
        help="constrain every Tandem row's output to this JSON schema (structured output, "
        "plain and speculative alike); the transformers rows are skipped",
    )
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--quick", action="store_true", help="tiny numbers (tests, a smoke run)")
    p.add_argument(
        "--result-file", default=None, help="JSON (default: bench_results/compare-DATE.json)"
    )


# ----------------------------------------------------------------------------- roofline


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


# ----------------------------------------------------------------------------- systems


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


def _cycle(prompts: list[list[int]], n: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(n)]


class TandemSystem:
    """Tandem's offline engine, driven step by step (requests kept in flight by hand)."""

    def __init__(
        self,
        model: str,
        cfg: BenchConfig,
        spec: dict[str, Any] | None,
        name: str,
        warm_up: list[int],
    ) -> None:
        from tandem.engine.config import EngineArgs
        from tandem.engine.llm_engine import LLMEngine
        from tandem.engine.sampling_params import SamplingParams

        self.row = Row(name)
        self.spec = spec
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=model,
                dtype=cfg.dtype,
                device=cfg.device,
                max_num_seqs=max(cfg.concurrency),
                enable_prefix_caching=False,  # every run prefills like the first
                speculative_config=spec,
            )
        )
        from tandem.engine.structured_output import StructuredSpec

        structured = StructuredSpec("json_schema", cfg.json_schema) if cfg.json_schema else None
        self.params = SamplingParams(
            temperature=0.0,
            max_tokens=cfg.max_tokens,
            ignore_eos=not cfg.stop_at_eos,
            structured=structured,
        )
        self.counter = iter(range(1 << 30))
        self.engine.add_request("warm-up", warm_up, SamplingParams(temperature=0.0, max_tokens=4))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.before = self.engine.get_stats()

    def batch1(self, ids: list[int]) -> tuple[int, float, int]:
        """(tokens after the first, seconds after the first, engine steps after the first) of
        one request alone."""
        engine = self.engine
        engine.add_request(f"b1-{next(self.counter)}", ids, self.params)
        first = last = None
        n = steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if first is not None:
                    steps += 1
                elif out.outputs[0].token_ids:
                    first = now
                n, last = len(out.outputs[0].token_ids), now
        if first is None or last is None:
            return 0, 0.0, 0
        return n - 1, last - first, steps

    def aggregate(self, prompts: list[list[int]], conc: int) -> tuple[int, float] | None:
        """(output tokens, seconds) with ``conc`` requests in flight until every prompt is
        done."""
        engine = self.engine
        queue = _cycle(prompts, max(len(prompts), conc))
        in_flight: set[str] = set()
        tokens = 0
        start = time.perf_counter()
        while queue or in_flight:
            while queue and len(in_flight) < conc:
                rid = f"c{conc}-{next(self.counter)}"
                engine.add_request(rid, queue.pop(0), self.params)
                in_flight.add(rid)
            for out in engine.step():
                if out.finished:
                    in_flight.discard(out.request_id)
                    tokens += len(out.outputs[0].token_ids)
        return tokens, time.perf_counter() - start

    def close(self) -> None:
        try:
            if self.spec is not None:
                after = self.engine.get_stats()
                drafts = after.spec_num_drafts - self.before.spec_num_drafts
                accepted = after.spec_num_accepted_tokens - self.before.spec_num_accepted_tokens
                self.row.tokens_per_step = 1 + accepted / drafts if drafts else None
        finally:
            self.engine.shutdown()
            del self.engine
            gc.collect()


class _StepTimes:
    """A ``generate`` streamer that timestamps every put (the prompt first, then new tokens)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int]] = []

    def put(self, value: Any) -> None:
        self.events.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass

    def decode(self) -> tuple[int, float]:
        """(tokens after the first, seconds after the first) of one generate call."""
        new = self.events[1:]  # events[0] is the prompt
        if len(new) < 2:
            return 0, 0.0
        return sum(n for _, n in new[1:]), new[-1][0] - new[0][0]


class TransformersSystem:
    """transformers ``generate``, greedy, ``max_tokens`` new tokens each (EOS ignored), or up to
    EOS with ``stop_at_eos``."""

    def __init__(
        self, model_path: str, cfg: BenchConfig, warm_up: list[int], assistant: str | None = None
    ) -> None:
        import torch
        import transformers as tf

        from tandem.engine.tokenizer import as_id_set

        dtype = getattr(torch, cfg.dtype)
        self.dev = torch.device(cfg.device)
        self.model = tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model = self.model.to(self.dev).eval()
        self.helper = None
        if assistant is not None:
            helper = tf.AutoModelForCausalLM.from_pretrained(assistant, dtype=dtype)
            self.helper = helper.to(self.dev).eval()
        # Tandem's end tokens: the generation config's, the model config's and the tokenizer's.
        self.eos: set[int] = set()
        if cfg.stop_at_eos:
            tok = tf.AutoTokenizer.from_pretrained(model_path)
            for ids in (
                self.model.generation_config.eos_token_id,
                self.model.config.eos_token_id,
                tok.eos_token_id,
            ):
                self.eos |= as_id_set(ids)
            if not self.eos:
                raise BenchError("--stop-at-eos: the model names no EOS token")
        for m in (self.model, self.helper):  # None: run the full length, like ignore_eos
            if m is not None:
                m.generation_config.eos_token_id = sorted(self.eos) or None
        pad = self.model.generation_config.pad_token_id
        self.pad = 0 if pad is None else int(pad if isinstance(pad, int) else pad[0])
        self.kw: dict[str, Any] = dict(
            do_sample=False,
            max_new_tokens=cfg.max_tokens,
            min_new_tokens=None if cfg.stop_at_eos else cfg.max_tokens,
            pad_token_id=self.pad,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        if self.helper is not None:
            self.kw["assistant_model"] = self.helper
        self.row = Row("transformers generate" + (" + assistant" if self.helper else ""))
        self.generate([warm_up])

    def generate(self, batch: list[list[int]], streamer: Any = None) -> int:
        import torch

        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                ids.to(self.dev), attention_mask=mask.to(self.dev), streamer=streamer, **self.kw
            )
        return sum(_until_eos(row, self.eos) for row in out[:, width:].tolist())

    def batch1(self, ids: list[int]) -> tuple[int, float, int | None]:
        timer = _StepTimes()
        self.generate([ids], timer)
        return (*timer.decode(), None)  # generate's steps are not counted

    def aggregate(self, prompts: list[list[int]], conc: int) -> tuple[int, float] | None:
        if self.helper is not None and conc > 1:
            self.row.note = "assisted generation runs one request at a time"
            return None
        queue = _cycle(prompts, max(len(prompts), conc))
        tokens = 0
        start = time.perf_counter()
        for i in range(0, len(queue), conc):
            tokens += self.generate(queue[i : i + conc])
        return tokens, time.perf_counter() - start

    def close(self) -> None:
        del self.model, self.helper
        gc.collect()


def _until_eos(tokens: list[int], eos: set[int]) -> int:
    """New tokens of one ``generate`` row: up to and including its first EOS (the padding after
    it is not output), all of them when ``eos`` is empty."""
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


def run_interleaved(
    systems: list[Any],
    prompts: list[list[int]],
    cfg: BenchConfig,
    probe: Callable[[], float] | None = None,
) -> list[float]:
    """Every system's batch-1 figure, prompt by prompt in turn, then each concurrency in turn:
    the systems share the machine's slow and fast phases, so their ratios hold up to drift.
    ``probe`` (memory bandwidth) runs before each batch-1 prompt round and after the last;
    returns its values. The concurrency columns run ``cfg.rounds`` times, in turn forward and
    backward, each figure the tokens over the seconds of every round."""
    probes: list[float] = []
    for ids in prompts[: cfg.batch1_prompts]:
        if probe is not None:
            probes.append(probe())
        for system in systems:
            n, sec, steps = system.batch1(ids)
            row = system.row
            row.batch1_tokens += n
            row.batch1_seconds += sec
            if steps is not None:
                row.batch1_steps = (row.batch1_steps or 0) + steps
    if probe is not None:
        probes.append(probe())
    for system in systems:
        row = system.row
        row.batch1 = row.batch1_tokens / row.batch1_seconds if row.batch1_seconds > 0 else None
    runs: dict[tuple[int, int], list[tuple[int, float] | None]] = {}
    for r in range(cfg.rounds):
        for conc in cfg.concurrency if r % 2 == 0 else cfg.concurrency[::-1]:
            for i, system in enumerate(systems):
                runs.setdefault((i, conc), []).append(system.aggregate(prompts, conc))
    for (i, conc), got in runs.items():
        done = [g for g in got if g is not None]
        seconds = sum(sec for _, sec in done)
        value = sum(n for n, _ in done) / seconds if done and seconds > 0 else None
        systems[i].row.by_concurrency[conc] = value
    return probes


# ----------------------------------------------------------------------------- main


@dataclass
class BenchConfig:
    dtype: str
    device: str
    max_tokens: int
    concurrency: list[int]
    batch1_prompts: int
    rounds: int = 1
    stop_at_eos: bool = False
    json_schema: str | None = None  # the text of a schema every Tandem request must match


def _load_prompts(path: str | None, model: str, num: int) -> list[list[int]]:
    """The prompts as chat (the model's template) token ids, ``num`` of them (cycled)."""
    from transformers import AutoTokenizer

    texts = [p for p, _ in read_jsonl_prompts(path or EVAL_PROMPTS)]
    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
    out = []
    for text in _cycle(texts, num):  # type: ignore[arg-type]
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tok.encode(text)
        out.append([int(i) for i in ids])
    return out


def _same_tokenizer(a: str, b: str) -> bool:
    from transformers import AutoTokenizer

    ta = AutoTokenizer.from_pretrained(a, trust_remote_code=False)
    tb = AutoTokenizer.from_pretrained(b, trust_remote_code=False)
    return ta.get_vocab() == tb.get_vocab()


def _trees(value: str, k: int) -> list[tuple[int, int]]:
    """``--trees``: (topk, num_draft_tokens) pairs, each a valid tree of depth ``k``."""
    from tandem.engine.speculative.tree import check_tree_shape

    trees = []
    for item in filter(None, value.split(",")):
        try:
            topk, n = (int(x) for x in item.split(":"))
            check_tree_shape(k, topk, n)
        except ValueError as e:
            raise BenchError(f"--trees {item!r}: expected TOPK:N with a valid tree ({e})") from None
        if topk < 2:
            raise BenchError(f"--trees {item!r}: topk must be >= 2 (topk 1 is the chain row)")
        trees.append((topk, n))
    return trees


def _spec_choice(
    given: str | None, default: Path | None, method: str, k: int
) -> tuple[dict[str, Any] | None, str]:
    """(speculative config or None, why not)."""
    if given == NONE:
        return None, f"skipped (--{method} {NONE})"
    if given is not None:
        if not Path(given).is_dir():
            raise BenchError(f"--{method} {given!r} is not a folder")
        return {"method": method, "model": given, "num_speculative_tokens": k}, ""
    if default is not None and default.is_dir():
        return {"method": method, "model": str(default), "num_speculative_tokens": k}, ""
    where = f"no head at {default.relative_to(REPO)}" if default is not None else "no head given"
    return None, f"{where}; pass --{method} PATH"


def format_table(rows: list[Row], concurrency: list[int], baseline: dict[str, Row | None]) -> str:
    cols = ["batch 1", *[f"c={c}" for c in concurrency]]
    name_w = max(28, *(len(r.name) + 2 for r in rows))

    def values(r: Row) -> list[float | None]:
        return [r.batch1, *[r.by_concurrency.get(c) for c in concurrency]]

    def line(label: str, cells: list[str], tail: str = "") -> str:
        return f"{label:<{name_w}}" + "".join(f"{c:>10}" for c in cells) + tail

    out = [line("tokens/s", cols, f"{'tok/step':>10}")]
    for r in rows:
        cells = ["n/a" if v is None else f"{v:.1f}" for v in values(r)]
        tps = f"{r.tokens_per_step:.2f}" if r.tokens_per_step else "-"
        out.append(line(r.name, cells, f"{tps:>10}" + (f"   {r.note}" if r.note else "")))
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


def _per_step(r: Row) -> tuple[float, float] | None:
    """(ms per decode step, tokens per step) of a row's batch-1 column, when steps were counted."""
    if not r.batch1_steps or r.batch1_seconds <= 0:
        return None
    return 1e3 * r.batch1_seconds / r.batch1_steps, r.batch1_tokens / r.batch1_steps


def format_step_costs(rows: list[Row], plain: Row, goal: float = SPEEDUP_GOAL) -> str:
    """Speculation's batch-1 speedup taken apart: tokens per step over the cost of a step in
    plain (no speculation) steps, and what either would need to be for ``goal``."""
    base = _per_step(plain)
    measured = [(r, _per_step(r)) for r in rows]
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


def main(ns: argparse.Namespace) -> int:
    """``tandem bench compare``; returns the exit status (2 for a usage error)."""
    try:
        return _main(ns)
    except BenchError as e:
        print(f"tandem bench compare: error: {e}", file=sys.stderr)
        return 2


def _main(ns: argparse.Namespace) -> int:
    import torch

    if ns.quick:
        ns.num_prompts, ns.max_tokens = min(ns.num_prompts, 2), min(ns.max_tokens, 8)
        ns.concurrency = [c for c in ns.concurrency if c <= 2] or [1]
        if 2 not in ns.concurrency:
            ns.concurrency.append(2)
    if ns.num_prompts < 1 or ns.max_tokens < 2:
        raise BenchError("--num-prompts must be >= 1 and --max-tokens >= 2")
    if ns.batch1_prompts is None:
        ns.batch1_prompts = 1 if ns.quick else BATCH1_PROMPTS
    if ns.batch1_prompts < 1 or ns.rounds < 1:
        raise BenchError("--batch1-prompts and --rounds must be >= 1")
    builtin = ns.model is None
    if builtin:
        from tandem.models.builtin import builtin_model_path

        try:
            model = builtin_model_path()
        except ValueError as e:
            raise BenchError(str(e)) from None
    else:
        model = ns.model
        if not Path(model).is_dir():
            raise BenchError(f"--model {model!r} is not a model folder")
    from tandem.models.loader import load_hf_config

    config = load_hf_config(model)
    k = ns.num_speculative_tokens
    eagle3, eagle3_why = _spec_choice(ns.eagle3, BUILTIN_EAGLE3 if builtin else None, "eagle3", k)
    own_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0) > 0
    if ns.mtp is None and own_mtp:
        mtp, mtp_why = {"method": "mtp", "num_speculative_tokens": k}, ""
    else:
        mtp, mtp_why = _spec_choice(ns.mtp, BUILTIN_MTP if builtin else None, "mtp", k)
    trees = _trees(ns.trees, k)
    for spec in (eagle3, mtp):
        if spec is not None and ns.disable_by_batch_size is not None:
            spec["disable_by_batch_size"] = ns.disable_by_batch_size
        if spec is not None and ns.draft_quantization != "none":
            spec["draft_quantization"] = ns.draft_quantization
    assistant_why = ""
    if ns.assistant_model is None:
        assistant_why = "no --assistant-model (a smaller model with the same tokenizer) given"
    elif not Path(ns.assistant_model).is_dir():
        raise BenchError(f"--assistant-model {ns.assistant_model!r} is not a folder")
    elif not _same_tokenizer(model, ns.assistant_model):
        assistant_why = "the assistant's tokenizer differs from the model's"

    schema = None
    if ns.json_schema is not None:
        try:
            schema = json.dumps(json.loads(Path(ns.json_schema).read_text()))
        except (OSError, ValueError) as e:
            raise BenchError(f"--json-schema {ns.json_schema!r}: {e}") from None
        ns.skip_transformers = True  # transformers generate has no grammar to hold it to
    prompts = _load_prompts(ns.prompts, model, ns.num_prompts)
    cfg = BenchConfig(
        dtype=ns.dtype,
        device=ns.device,
        max_tokens=ns.max_tokens,
        concurrency=ns.concurrency,
        batch1_prompts=min(len(prompts), ns.batch1_prompts),
        rounds=ns.rounds,
        stop_at_eos=ns.stop_at_eos,
        json_schema=schema,
    )
    length = f"up to EOS, at most {ns.max_tokens}" if ns.stop_at_eos else f"{ns.max_tokens}"
    print(
        f"model {model}, {ns.dtype} on {ns.device}, {len(prompts)} prompts "
        f"(mean {sum(map(len, prompts)) / len(prompts):.0f} tokens; the first "
        f"{cfg.batch1_prompts} at batch 1), {length} new tokens, {cfg.rounds} round(s) of "
        f"the concurrency columns, {torch.get_num_threads()} threads"
        + (f"; every Tandem request held to the JSON schema {ns.json_schema}" if schema else ""),
        flush=True,
    )
    na = {c: None for c in cfg.concurrency}
    # Rows in table order: a system, or a Row that says why it is missing.
    entries: list[Any] = []

    def add(label: str, open_system: Callable[[], Any]) -> None:
        print(f"loading {label} ...", flush=True)
        entries.append(open_system())

    try:
        if ns.skip_transformers:
            why = "no grammar (--json-schema)" if schema else "skipped"
            entries.append(Row("transformers generate", by_concurrency=dict(na), note=why))
        else:
            add("transformers generate", lambda: TransformersSystem(model, cfg, prompts[0]))
        if ns.skip_transformers or assistant_why:
            why = (
                ("no grammar (--json-schema)" if schema else "skipped")
                if ns.skip_transformers
                else assistant_why
            )
            entries.append(
                Row("transformers generate + assistant", by_concurrency=dict(na), note=why)
            )
        else:
            add(
                "transformers generate with the assistant",
                lambda: TransformersSystem(model, cfg, prompts[0], ns.assistant_model),
            )
        add("tandem", lambda: TandemSystem(model, cfg, None, "tandem", prompts[0]))
        for method, chain, why in (("eagle3", eagle3, eagle3_why), ("mtp", mtp, mtp_why)):
            for topk, n in [(1, k), *trees]:  # the chain, then each tree
                how = [f"K={k}"] + ([f"topk {topk} N {n}"] if topk > 1 else [])
                if ns.draft_quantization != "none":
                    how.append(ns.draft_quantization)
                if ns.disable_by_batch_size is not None:
                    how.append(f"off at {ns.disable_by_batch_size}+")
                name = f"tandem + {method} ({', '.join(how)})"
                if chain is None:
                    entries.append(Row(name, by_concurrency=dict(na), note=why))
                    continue
                spec = chain if topk == 1 else {**chain, "topk": topk, "num_draft_tokens": n}
                add(
                    name,
                    lambda spec=spec, name=name: TandemSystem(model, cfg, spec, name, prompts[0]),
                )
        print("running every system in turn ...", flush=True)
        # The roofline's bandwidth is probed between the batch-1 prompts: the same phase of a
        # machine whose speed drifts as the batch-1 figures it bounds.
        probe_bytes = (16 << 20) if ns.quick else (256 << 20)
        probes = run_interleaved(
            [e for e in entries if not isinstance(e, Row)],
            prompts,
            cfg,
            lambda: measure_memory_bandwidth(probe_bytes, 2, ns.device)["bandwidth"],
        )
    finally:
        for system in entries:
            if not isinstance(system, Row):
                system.close()
    rows: list[Row] = [e if isinstance(e, Row) else e.row for e in entries]

    size = (64 << 20) if ns.quick else (1 << 30)
    bw = measure_memory_bandwidth(size, 2 if ns.quick else 5, ns.device)
    dtype_bytes = 2 if ns.dtype == "bfloat16" else 4
    n1 = cfg.batch1_prompts
    # New tokens per batch-1 answer: fixed, or (up to EOS) what Tandem's answers held.
    answer = (rows[2].batch1_tokens + n1) / n1 if ns.stop_at_eos else ns.max_tokens
    context = sum(map(len, prompts[:n1])) / n1 + answer / 2
    weights = weight_bytes_per_step(config, dtype_bytes)
    kv = kv_bytes_per_step(config, dtype_bytes, context)
    during = statistics.median(probes)
    roof = roofline_tokens_per_s(during, weights + kv)
    ours = rows[2].batch1

    print()
    print(format_table(rows, cfg.concurrency, {"vs transformers": rows[0], "vs tandem": rows[2]}))
    print()
    print(format_step_costs(rows, rows[2]))
    print()
    print(
        f"memory bandwidth: {during / 2**30:.1f} GiB/s during the batch-1 column (median of "
        f"{len(probes)} probes around its prompts, {min(probes) / 2**30:.1f}-"
        f"{max(probes) / 2**30:.1f}; {probe_bytes >> 20} MiB); {bw['bandwidth'] / 2**30:.1f} after "
        f"the run (best of copy {bw['copy'] / 2**30:.1f}, sum {bw['sum'] / 2**30:.1f}; "
        f"{bw['buffer_bytes'] / 2**20:.0f} MiB)"
    )
    print(
        f"bytes per decode step: weights {weights / 2**20:.1f} MiB + KV {kv / 2**20:.2f} MiB "
        f"(context {context:.0f}; answers of {answer:.0f} tokens) -> batch-1 roofline "
        f"{roof:.1f} tokens/s"
    )
    frac = f"{ours / roof:.0%}" if ours else "n/a"
    print(f"tandem batch 1: {ours or 0:.1f} tokens/s = {frac} of the roofline")

    result = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S"),
        "model": model,
        "dtype": ns.dtype,
        "device": ns.device,
        "threads": torch.get_num_threads(),
        "num_prompts": len(prompts),
        "max_tokens": ns.max_tokens,
        "stop_at_eos": ns.stop_at_eos,
        "batch1_mean_answer_tokens": answer,
        "concurrency": cfg.concurrency,
        "batch1_prompts": cfg.batch1_prompts,
        "rounds": cfg.rounds,
        "draft_quantization": ns.draft_quantization,
        "rows": [
            {
                "name": r.name,
                "batch1": r.batch1,
                "concurrency": {str(c): v for c, v in r.by_concurrency.items()},
                "tokens_per_step": r.tokens_per_step,
                **dict(
                    zip(
                        ("batch1_ms_per_step", "batch1_tokens_per_step"),
                        _per_step(r) or (None, None),
                        strict=True,
                    )
                ),
                "note": r.note,
            }
            for r in rows
        ],
        "memory_bandwidth": bw,
        "memory_bandwidth_batch1_probes": probes,
        "bytes_per_step": {"weights": weights, "kv": kv, "context_len": context},
        "roofline_bandwidth": during,
        "roofline_tokens_per_s": roof,
        "roofline_fraction": ours / roof if ours else None,
    }
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = Path(ns.result_file or f"bench_results/compare-{stamp}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1) + "\n")
    print(f"results: {path}")
    return 0
