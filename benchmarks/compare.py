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
import json
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.bench.compare_systems import (
    LlamaCppSystem,
    TandemSystem,
    TransformersSystem,
    run_interleaved,
)
from tandem.bench.compare_tables import (
    Row,
    format_step_costs,
    format_table,
    kv_bytes_per_step,
    measure_memory_bandwidth,
    per_step_costs,
    roofline_tokens_per_s,
    weight_bytes_per_step,
)
from tandem.bench.compare_workloads import (
    NONE,
    REPO,
    SHIPPED_HEADS,
    WORKLOADS,
    BenchConfig,
    load_prompts,
    parse_trees,
    same_tokenizer,
    spec_choice,
)
from tandem.bench.serve import int_list
from tandem.bench.support import BenchError

BUILTIN_EAGLE3 = SHIPPED_HEADS / "smollm2-135m-instruct-eagle3"
BUILTIN_MTP = SHIPPED_HEADS / "smollm2-135m-instruct-mtp"
# The penalised Eagle3 row's presence_penalty (Qwen's serving examples send up to 1.5).
PENALTY = 0.5
BATCH1_PROMPTS = 16  # default prompts timed one at a time for the batch-1 column


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
    p.add_argument(
        "--ngram",
        default="1:3",
        metavar="MIN:MAX",
        help="the n-gram row's prompt_lookup_min:prompt_lookup_max (K --num-speculative-tokens); "
        f"'{NONE}' skips the row",
    )
    p.add_argument(
        "--suffix",
        default="16",
        metavar="NODES",
        help="the suffix row's suffix_max_tree_nodes (depth --num-speculative-tokens); "
        f"'{NONE}' skips the row",
    )
    p.add_argument(
        "--draft-model",
        default=None,
        metavar="PATH",
        help="a draft-model row: a small model with the same tokenizer as the draft",
    )
    p.add_argument(
        "--schedule",
        default=None,
        metavar="JSON",
        help="an adaptive row per chain method: num_speculative_tokens by batch size (e.g. "
        '\'{"1": 4, "4": 2, "16": 0}\') with "adaptive": true',
    )
    p.add_argument(
        "--cost-aware",
        action="store_true",
        help='with --schedule, a second adaptive row per chain method with "cost_aware": true',
    )
    p.add_argument(
        "--confidence",
        default="",
        metavar="C[,C...]",
        help="with --schedule, an adaptive row per head method (eagle3, mtp) for each "
        '"confidence_threshold" C',
    )
    p.add_argument(
        "--workload",
        choices=tuple(WORKLOADS),
        default="chat",
        help="the prompt set when --prompts is not given: chat (questions) or grounded "
        "(rewrite, fix, summarise a text or code given in the prompt)",
    )
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument(
        "--cpu-weights",
        default="dtype",
        metavar="W[,W...]",
        help="the CPU fast path's matrices of every Tandem row (dtype, q8, q4: --cpu-weights of "
        "tandem serve); a list repeats each Tandem row for each value (named [W])",
    )
    p.add_argument(
        "--llama-cpp",
        default=None,
        metavar="PYTHON",
        help="a llama.cpp row (batch 1): an interpreter that imports llama_cpp "
        "(llama-cpp-python in a scratch venv; never a dependency of ours), on --gguf",
    )
    p.add_argument(
        "--gguf", default=None, metavar="FILE", help="llama.cpp's file (default: the built-in's)"
    )
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


# ----------------------------------------------------------------------------- systems


# ----------------------------------------------------------------------------- main


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
    eagle3, eagle3_why = spec_choice(ns.eagle3, BUILTIN_EAGLE3 if builtin else None, "eagle3", k)
    own_mtp = int(getattr(config, "num_nextn_predict_layers", 0) or 0) > 0
    if ns.mtp is None and own_mtp:
        mtp, mtp_why = {"method": "mtp", "num_speculative_tokens": k}, ""
    else:
        mtp, mtp_why = spec_choice(ns.mtp, BUILTIN_MTP if builtin else None, "mtp", k)
    trees = parse_trees(ns.trees, k)
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
    elif not same_tokenizer(model, ns.assistant_model):
        assistant_why = "the assistant's tokenizer differs from the model's"

    schema = None
    if ns.json_schema is not None:
        try:
            schema = json.dumps(json.loads(Path(ns.json_schema).read_text()))
        except (OSError, ValueError) as e:
            raise BenchError(f"--json-schema {ns.json_schema!r}: {e}") from None
        ns.skip_transformers = True  # transformers generate has no grammar to hold it to
    prompt_file = ns.prompts or str(WORKLOADS[ns.workload])
    prompts = load_prompts(prompt_file, model, ns.num_prompts)
    ngram = None
    if ns.ngram != NONE:
        try:
            lo, hi = (int(v) for v in ns.ngram.split(":"))
        except ValueError:
            raise BenchError(f"--ngram {ns.ngram!r}: expected MIN:MAX, e.g. 1:3") from None
        ngram = {"method": "ngram", "num_speculative_tokens": k}
        ngram.update(prompt_lookup_min=lo, prompt_lookup_max=hi)
    suffix = None
    if ns.suffix != NONE:
        try:
            nodes = int(ns.suffix)
        except ValueError:
            raise BenchError(f"--suffix {ns.suffix!r}: expected a node count, e.g. 16") from None
        suffix = {"method": "suffix", "num_speculative_tokens": k}
        suffix["suffix_max_tree_nodes"] = nodes
    draft_model = None
    if ns.draft_model is not None:
        if not Path(ns.draft_model).is_dir():
            raise BenchError(f"--draft-model {ns.draft_model!r} is not a folder")
        draft_model = {"method": "draft_model", "model": ns.draft_model}
        draft_model["num_speculative_tokens"] = k
    schedule = None
    if ns.schedule is not None:
        try:
            schedule = json.loads(ns.schedule)
        except ValueError as e:
            raise BenchError(f"--schedule: {e}") from None
    try:
        confidences = [float(c) for c in filter(None, ns.confidence.split(","))]
    except ValueError:
        raise BenchError(f"--confidence {ns.confidence!r}: numbers in (0, 1) expected") from None
    if confidences and schedule is None:
        raise BenchError("--confidence needs --schedule (its rows are adaptive)")
    gguf = ns.gguf
    if ns.llama_cpp is not None:
        if gguf is None and builtin:
            from tandem.models.builtin import find_gguf

            gguf = str(find_gguf())
        if gguf is None or not Path(gguf).is_file():
            raise BenchError(f"--llama-cpp needs --gguf FILE (a GGUF file; got {gguf!r})")
    from tandem.engine.config import CPU_WEIGHTS

    weights = [w.strip() for w in ns.cpu_weights.split(",") if w.strip()]
    if not weights or any(w not in CPU_WEIGHTS or w == "auto" for w in weights):
        raise BenchError(f"--cpu-weights {ns.cpu_weights!r}: a list of dtype, q8, q4")
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
        f"model {model}, {ns.dtype} on {ns.device}, {len(prompts)} prompts from "
        f"{Path(prompt_file).name} "
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

        def add_tandem(
            name: str, spec: dict[str, Any] | None, sampling: dict[str, Any] | None = None
        ) -> None:
            for w in weights:
                label = name if w == "dtype" else f"{name} [{w}]"
                add(
                    label,
                    lambda w=w, label=label: TandemSystem(
                        model, cfg, spec, label, prompts[0], sampling, cpu_weights=w
                    ),
                )

        add_tandem("tandem", None)
        methods = [("eagle3", eagle3, eagle3_why), ("mtp", mtp, mtp_why)]
        methods.append(("ngram", ngram, f"skipped (--ngram {NONE})"))
        methods.append(("suffix", suffix, f"skipped (--suffix {NONE})"))
        methods.append(("draft_model", draft_model, "no --draft-model given"))
        for method, chain, why in methods:
            if schedule is not None and chain is not None and method != "suffix":
                variants: list[dict[str, Any]] = [{}]
                if ns.cost_aware and method != "ngram":
                    variants.append({"cost_aware": True})
                if method in ("eagle3", "mtp"):
                    variants += [{"confidence_threshold": c} for c in confidences]
                for extra in variants:
                    how = "adaptive"
                    if extra.get("cost_aware"):
                        how += ", cost-aware"
                    if "confidence_threshold" in extra:
                        how += f", confidence {extra['confidence_threshold']:g}"
                    name = f"tandem + {method} ({how}, schedule {json.dumps(schedule)})"
                    spec = {**chain, "num_speculative_tokens": schedule, "adaptive": True}
                    spec.update(extra)
                    spec.pop("disable_by_batch_size", None)
                    add_tandem(name, spec)
            for topk, n in [(1, k), *trees] if method in ("eagle3", "mtp") else [(1, k)]:
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
                add_tandem(name, spec)
                if method == "eagle3" and topk == 1:  # what a penalty costs under speculation
                    pen = f"{name[:-1]}, presence_penalty {PENALTY})"
                    add_tandem(pen, spec, {"presence_penalty": PENALTY})
        if ns.llama_cpp is not None:
            add(
                "llama.cpp",
                lambda: LlamaCppSystem(ns.llama_cpp, gguf, cfg, prompts[0]),
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
        "cpu_weights": ns.cpu_weights,
        "rows": [
            {
                "name": r.name,
                "batch1": r.batch1,
                "concurrency": {str(c): v for c, v in r.by_concurrency.items()},
                "tokens_per_step": r.tokens_per_step,
                **dict(
                    zip(
                        ("batch1_ms_per_step", "batch1_tokens_per_step"),
                        per_step_costs(r) or (None, None),
                        strict=True,
                    )
                ),
                "note": r.note,
                "rss_mib": r.rss_mib,
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
