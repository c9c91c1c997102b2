"""GPU benchmark: a Llama-3.1-8B-shaped model with random bf16 weights, built in memory.

One command, TP = 1, prints tables:
  1. HBM bandwidth (copy / sum over a 2 GiB buffer, best of N) against the nominal figure;
  2. decode step latency at batch 1…64, eager and CUDA-graph-replayed, against the HBM roofline
     (weight bytes + KV bytes one step reads / measured bandwidth);
  3. an Eagle3 K = 3 speculative step (verify K + 1 rows, accept, draft loop with a random-weight
     head) against a plain decode step: the tokens per step speculation must reach to pay;
  4. draft-tree steps (topk 2 / 4, num_draft_tokens 4 / 8 / 16; eager, benchmarks/gpu_tree.py)
     against the chain step and the plain one, with the same break-even;
  5. the Triton kernels (kernels/paged_attention.py, kernels/spec_decode.py) against their
     PyTorch references: time and largest difference.

    python -m tandem.bench.gpu              # about a minute on one H200
    python -m tandem.bench.gpu --quick      # fewer batch sizes and iterations (gpu_check)
    python -m tandem.bench.gpu --smoke      # tiny model on CPU: checks the code paths only

CUDA graphs here are captured around the benchmark's own step with ``torch.cuda.CUDAGraph``: it
measures the same decode step that engine/cuda_graph.py replays. ``ENGINE_GRAPH_SWITCHES`` lists
the ``EngineArgs`` field names the engine may grow for that switch; the script reports whether
one exists.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections.abc import Callable
from typing import Any

from tandem.bench.gpu_setup import (
    BLOCK_SIZE,
    Setup,
    StepInputs,
    Timer,
    bind_kv_cache,
    build_draft,
    build_model,
    capture_graph,
    capture_layers,
    device_name,
    free_draft,
    measure_bandwidth,
    step_inputs,
    table,
    tiny_config,
    weight_bytes,
)
from tandem.bench.gpu_tree import tree_step
from tandem.bench.shapes import llama_config

ENGINE_GRAPH_SWITCHES = ("enforce_eager", "cuda_graphs", "use_cuda_graphs", "enable_cuda_graphs")


# ----------------------------------------------------------------------------- timing


# ----------------------------------------------------------------------------- model and cache


# ----------------------------------------------------------------------------- sections


def _graphs_wanted(s: Setup) -> bool:
    return s.args.cuda_graphs != "off" and s.device.type == "cuda"


def decode_latency(s: Setup, model: Any, kv_per_token: int, bandwidth: float) -> None:
    import torch

    wbytes = weight_bytes(model)
    ctx = s.args.context
    print(
        f"\n== decode step, context {ctx}: weights {wbytes / 2**30:.2f} GiB, "
        f"KV {kv_per_token / 2**10:.0f} KiB/token, roofline at {bandwidth / 1e12:.2f} TB/s"
    )
    header = ["batch", "eager ms", "graph ms", "tok/s", "roofline ms", "eager %roof", "graph %roof"]
    rows = []
    for b in s.args.batch_sizes:
        if s.time_left() < 10:
            print(f"(time budget spent: skipping batch {b} and above)")
            break
        inp = step_inputs(b, 1, ctx, s.args.blocks_per_seq, s.config.vocab_size, s.device)

        def step(inp: StepInputs = inp) -> torch.Tensor:
            hidden, _ = model(inp.input_ids, inp.positions, inp.meta)
            return model.compute_logits(hidden).argmax(-1)

        eager = s.timer(step)
        graph = None
        if _graphs_wanted(s):
            try:
                graph = s.timer(capture_graph(step))
            except Exception as e:  # report and go on: eager numbers still count
                s.failures.append(f"CUDA graph capture at batch {b}: {type(e).__name__}: {e}")
                print(f"  graph capture failed at batch {b}: {type(e).__name__}: {e}")
        roof = 1000 * (wbytes + b * ctx * kv_per_token) / bandwidth
        best = min(eager, graph) if graph else eager
        rows.append(
            [
                str(b),
                f"{eager:.3f}",
                f"{graph:.3f}" if graph else "-",
                f"{1000 * b / best:.0f}",
                f"{roof:.3f}",
                f"{roof / eager:.0%}",
                f"{roof / graph:.0%}" if graph else "-",
            ]
        )
        del inp
    print(table(header, rows))


def eagle3_step(s: Setup, model: Any, k: int) -> dict[int, tuple[float, float]]:
    """A speculative step (verify K + 1 rows per request, accept, K draft steps) vs a plain one.
    Returns {batch: (plain ms, spec ms)}."""
    import torch

    from tandem.kernels.spec_decode import accept_matching

    draft = build_draft(s, model)
    capture = capture_layers(s.config)
    ctx, bps, vocab = s.args.context, s.args.blocks_per_seq, s.config.vocab_size
    timings: dict[int, tuple[float, float]] = {}

    print(f"\n== Eagle3 K={k} step vs plain decode step (random draft head, eager)")
    header = ["batch", "plain ms", "spec ms", "ratio", "break-even tok/step"]
    rows = []
    for b in s.args.spec_batch_sizes:
        if s.time_left() < 10:
            print(f"(time budget spent: skipping batch {b} and above)")
            break
        plain = step_inputs(b, 1, ctx, bps, vocab, s.device)
        verify = step_inputs(b, k + 1, ctx + k, bps, vocab, s.device)
        later = [step_inputs(b, 1, ctx + k + j, bps, vocab, s.device) for j in range(1, k)]
        drafts = torch.randint(0, vocab, (b, k), device=s.device)
        num_drafts = torch.full((b,), k, device=s.device)
        first_row = torch.arange(b, device=s.device) * (k + 1)

        def plain_step(inp: StepInputs = plain) -> torch.Tensor:
            hidden, _ = model(inp.input_ids, inp.positions, inp.meta)
            return model.compute_logits(hidden).argmax(-1)

        def spec_step(
            v: StepInputs = verify,
            later: list[StepInputs] = later,
            drafts: torch.Tensor = drafts,
            num_drafts: torch.Tensor = num_drafts,
            first_row: torch.Tensor = first_row,
            b: int = b,
        ) -> torch.Tensor:
            hidden, captured = model(v.input_ids, v.positions, v.meta, capture)
            target = model.compute_logits(hidden).argmax(-1).view(b, k + 1)
            num_accepted, _ = accept_matching(target, drafts, num_drafts)
            x = draft(0, v.positions, v.input_ids, draft.combine_hidden(captured), v.meta,
                      pick_rows=first_row + num_accepted)  # fmt: skip
            out = [draft.to_target_ids(draft.compute_logits(0, x).argmax(-1))]
            for inp in later:
                x = draft(0, inp.positions, out[-1], x, inp.meta)
                out.append(draft.to_target_ids(draft.compute_logits(0, x).argmax(-1)))
            return torch.stack(out, 1)

        t_plain, t_spec = s.timer(plain_step), s.timer(spec_step)
        timings[b] = (t_plain, t_spec)
        rows.append(
            [str(b), f"{t_plain:.3f}", f"{t_spec:.3f}", f"{t_spec / t_plain:.2f}x",
             f"{t_spec / t_plain:.2f}"]
        )  # fmt: skip
    print(table(header, rows))
    print("break-even: the tokens per step (1 + accepted) a real head must reach to win")
    free_draft(draft)
    return timings


def kernel_section(s: Setup) -> None:
    """Triton kernels against their PyTorch references (time, largest difference)."""
    import torch

    from tandem.kernels.spec_decode import (
        accept_matching,
        build_draft_step0_inputs,
        rejection_sample,
    )

    print("\n== Triton kernels vs PyTorch (median ms; max |difference|)")
    from tandem.kernels.launch import triton_interpreter_enabled

    if s.device.type != "cuda" and not triton_interpreter_enabled():
        print("(Triton runs on CUDA, or on CPU under TRITON_INTERPRET=1; skipped)")
        return
    dev = s.device
    rows = []
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = ((1, 1), (2, 4)) if s.args.smoke else ((1, 1), (32, 1), (32, 4), (64, 1))
    for b, ql in shapes:
        if s.time_left() < 10:
            print("(time budget spent: skipping the rest)")
            break
        rows.append(_attention_case(s, b, ql, gen))

    b, k, vocab = 4 if s.args.smoke else 64, 3, s.config.vocab_size
    drafts = torch.randint(0, vocab, (b, k), device=dev, generator=gen)
    target = drafts.new_zeros(b, k + 1)
    target[:, :k] = torch.where(torch.rand(b, k, device=dev, generator=gen) < 0.7, drafts, 0)
    num_drafts = torch.full((b,), k, device=dev)
    cases: list[tuple[str, Callable[[bool], Any]]] = [
        (f"accept_matching B={b} K={k}",
         lambda t: accept_matching(target, drafts, num_drafts, use_triton=t)),
    ]  # fmt: skip
    if s.time_left() > 20:
        p = torch.softmax(torch.randn(b, k + 1, vocab, device=dev, generator=gen), -1)
        q = torch.softmax(torch.randn(b, k, vocab, device=dev, generator=gen), -1)
        u = torch.rand(b, k, device=dev, generator=gen)
        noise = torch.empty(b, k + 1, vocab, device=dev).exponential_(generator=gen)
        cases.append(
            (f"rejection_sample B={b} K={k} V={vocab}",
             lambda t: rejection_sample(p, q, drafts, num_drafts, u, noise, use_triton=t))
        )  # fmt: skip
        rows_t = b * (k + 1)
        ids = torch.randint(0, vocab, (rows_t,), device=dev, generator=gen)
        last = torch.arange(b, device=dev) * (k + 1) + k
        nxt = torch.randint(0, vocab, (b,), device=dev, generator=gen)
        acc = torch.randint(0, k + 1, (b,), device=dev, generator=gen)
        tok = torch.randint(0, vocab, (b, k + 1), device=dev, generator=gen)
        first = torch.arange(b, device=dev) * (k + 1)
        cases.append(
            (f"build_draft_step0_inputs B={b} K={k}",
             lambda t: build_draft_step0_inputs(first, acc, tok, ids, last, nxt, use_triton=t))
        )  # fmt: skip
    for name, fn in cases:
        got, want = fn(True), fn(False)
        diff = max((g.long() - w.long()).abs().max().item() for g, w in zip(got, want, strict=True))
        t_tri, t_ref = s.timer(lambda fn=fn: fn(True)), s.timer(lambda fn=fn: fn(False))
        rows.append(
            [name, f"{t_tri:.3f}", f"{t_ref:.3f}", "-", f"{t_ref / t_tri:.1f}x", f"{diff:.0f}"]
        )
    print(table(["kernel", "triton", "torch", "reference", "speed-up", "max diff"], rows))
    print("(rejection_sample may differ where two race values tie within rounding)")


def _attention_case(s: Setup, b: int, ql: int, gen: Any) -> list[str]:
    """One paged-attention shape: Triton, the vectorized PyTorch path and the loop reference."""
    import torch

    from tandem.kernels.attention_torch import build_attention_plan, paged_attention_reference
    from tandem.kernels.paged_attention import paged_attention

    dev, dt, ctx = s.device, s.dtype, s.args.context
    heads, kv_heads = s.config.num_attention_heads, s.config.num_key_value_heads
    hd = getattr(s.config, "head_dim", None) or s.config.hidden_size // heads
    bps = -(-ctx // BLOCK_SIZE)
    k_cache = torch.randn(b * bps, BLOCK_SIZE, kv_heads, hd, device=dev, dtype=dt, generator=gen)
    v_cache = torch.randn_like(k_cache)
    q = torch.randn(b * ql, heads, hd, device=dev, dtype=dt, generator=gen)
    tables = torch.arange(b * bps, device=dev, dtype=torch.int32).view(b, bps)
    seq = torch.full((b,), ctx, dtype=torch.int32, device=dev)
    qsl = torch.arange(b + 1, dtype=torch.int32, device=dev) * ql
    scale = hd**-0.5
    plan = build_attention_plan(tables, seq, qsl, BLOCK_SIZE, ql, ctx, num_tokens=b * ql)
    args = (q, k_cache, v_cache, tables, seq, qsl, scale, ql, ctx)

    def triton_fn() -> torch.Tensor:
        return paged_attention(*args, use_triton=True)

    def torch_fn() -> torch.Tensor:
        return paged_attention(*args, plan=plan, use_triton=False)

    def reference_fn() -> torch.Tensor:
        return paged_attention_reference(*args)

    diff = (triton_fn().float() - reference_fn().float()).abs().max().item()
    t_tri, t_torch, t_ref = s.timer(triton_fn), s.timer(torch_fn), s.timer(reference_fn)
    return [
        f"paged_attention B={b} q={ql} ctx={ctx}", f"{t_tri:.3f}", f"{t_torch:.3f}",
        f"{t_ref:.3f}", f"{t_torch / t_tri:.1f}x", f"{diff:.2e}",
    ]  # fmt: skip


def engine_section(s: Setup, switch: str) -> None:
    """The engine end to end on ``--engine-model``, with its CUDA-graph switch off and on."""
    from tandem import LLM, SamplingParams

    sizes = s.args.batch_sizes
    tokens = 8 if s.args.smoke else 64
    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    print(f"\n== engine decode on {s.args.engine_model} (EngineArgs.{switch}; {tokens} tokens)")
    results: dict[bool, list[str]] = {}
    for eager in (True, False):
        kw = {switch: eager if switch == "enforce_eager" else not eager}
        dtype = "bfloat16" if s.device.type == "cuda" else "float32"
        with LLM(s.args.engine_model, dtype=dtype, max_num_seqs=max(sizes), **kw) as llm:
            vocab = int(llm.engine.config.model_config.vocab_size)
            llm.generate([[1, 2, 3]], SamplingParams(temperature=0.0, max_tokens=4))  # warm-up
            cells = []
            for b in sizes:
                prompts = [[(7 * i + j) % vocab for j in range(16)] for i in range(b)]
                t = time.perf_counter()
                outs = llm.generate(prompts, params)
                n = sum(len(o.outputs[0].token_ids) for o in outs)
                cells.append(f"{n / (time.perf_counter() - t):.0f}")
            results[eager] = cells
    print(
        table(
            ["tokens/s", *[f"b={b}" for b in sizes]],
            [["eager", *results[True]], ["graphs", *results[False]]],
        )
    )


# ----------------------------------------------------------------------------- main


def engine_graph_switch() -> str | None:
    """The ``EngineArgs`` field that turns CUDA graphs on or off, once the engine has one."""
    from tandem.engine.config import EngineArgs

    names = EngineArgs.field_names()
    return next((n for n in ENGINE_GRAPH_SWITCHES if n in names), None)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--quick", action="store_true", help="fewer sizes and iterations")
    ap.add_argument("--smoke", action="store_true", help="a tiny model on CPU (code paths only)")
    ap.add_argument("--layers", type=int, default=32, help="decoder layers (8B: 32)")
    ap.add_argument("--batch-sizes", default=None, help="default 1,2,4,8,16,32,64")
    ap.add_argument("--context", type=int, default=1024, help="KV length of every sequence")
    ap.add_argument("--num-speculative-tokens", type=int, default=3)
    ap.add_argument(
        "--tree-configs",
        default="2:4,2:8,2:16,4:4,4:8,4:16",
        metavar="TOPK:N,...",
        help="draft trees to time (topk:num_draft_tokens; depth = --num-speculative-tokens)",
    )
    ap.add_argument("--iters", type=int, default=None, help="timed repetitions (default 20)")
    ap.add_argument("--cuda-graphs", choices=("on", "off"), default="on")
    ap.add_argument(
        "--engine-model",
        default=None,
        metavar="PATH",
        help="also run the engine on this model folder with its CUDA-graph switch off and on",
    )
    ap.add_argument(
        "--time-budget", type=float, default=460.0, help="seconds; later sections are skipped"
    )
    args = ap.parse_args(argv)
    quick = args.quick or args.smoke
    if args.batch_sizes is None:
        args.batch_sizes = "1,4" if args.smoke else "1,8,32,64" if quick else "1,2,4,8,16,32,64"
    args.batch_sizes = [int(x) for x in args.batch_sizes.split(",")]
    args.spec_batch_sizes = [b for b in (1, 8, 32) if b <= max(args.batch_sizes)] or [1]
    if args.smoke:
        args.context = min(args.context, 64)
    args.iters = args.iters or (3 if args.smoke else 10 if quick else 20)
    k = args.num_speculative_tokens
    try:
        args.tree_configs = [
            (int(a), int(n)) for a, n in (c.split(":") for c in args.tree_configs.split(",") if c)
        ]
    except ValueError:
        ap.error(f"--tree-configs: expected TOPK:N,... (e.g. 2:8,4:16), got {args.tree_configs!r}")
    # KV room past the context: the chain's verify and draft rows, a tree's N + 1 verify rows
    # and its (K - 1) * topk frontier rows after the new root (at most K + 1 further on).
    room = max([2 * k + 2] + [max(n + 1, k + 1 + (k - 1) * a) for a, n in args.tree_configs])
    args.blocks_per_seq = -(-(args.context + room) // BLOCK_SIZE)
    args.num_blocks = max(args.batch_sizes + args.spec_batch_sizes) * args.blocks_per_seq
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.smoke:  # the Triton kernels run in the interpreter (set before triton is imported)
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import torch

    if not args.smoke and not torch.cuda.is_available():
        print(
            "tandem.bench.gpu needs a CUDA device (torch sees none); run it on a GPU node, or pass "
            "--smoke for a tiny CPU run that only checks the code paths",
            file=sys.stderr,
        )
        return 2
    device = torch.device("cuda" if not args.smoke else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    config = (
        tiny_config() if args.smoke else llama_config("llama3.1-8b", num_hidden_layers=args.layers)
    )
    s = Setup(
        args,
        device,
        dtype,
        config,
        Timer(device, args.iters),
        time.monotonic() + args.time_budget,
        [],
    )
    torch.manual_seed(0)
    switch = engine_graph_switch()
    print(
        f"tandem.bench.gpu: {device_name(device)}, torch {torch.__version__}, "
        f"{'tiny smoke model' if args.smoke else f'Llama-3.1-8B shape ({args.layers} layers)'}, "
        f"{str(dtype).removeprefix('torch.')}, TP=1; engine CUDA-graph switch: "
        f"{f'EngineArgs.{switch}' if switch else 'none yet (graphs captured here directly)'}"
    )
    run_engine = bool(args.engine_model and switch)
    if args.engine_model and not switch:
        print("--engine-model: the engine has no CUDA-graph switch yet; skipped")

    k = args.num_speculative_tokens
    chain: dict[int, tuple[float, float]] = {}  # eagle3 step timings, the tree table's baseline
    with torch.inference_mode():
        bandwidth = measure_bandwidth(s)
        t = time.monotonic()
        model = build_model(config, device, dtype)
        kv_per_token = bind_kv_cache(model.attention_layers(), args.num_blocks, dtype, device)
        print(f"model built in {time.monotonic() - t:.1f} s")
        for name, section in (
            ("decode latency", lambda: decode_latency(s, model, kv_per_token, bandwidth)),
            ("eagle3 step", lambda: chain.update(eagle3_step(s, model, k))),
            ("tree step", lambda: tree_step(s, model, k, chain)),
            ("kernels", lambda: kernel_section(s)),
            ("engine", lambda: engine_section(s, switch) if run_engine else None),
        ):
            if s.time_left() < 10:
                print(f"\n(time budget spent: {name} skipped)")
                continue
            try:
                section()
            except Exception as e:  # one section failing should not hide the others
                s.failures.append(f"{name}: {type(e).__name__}: {e}")
                print(f"\n{name} FAILED: {type(e).__name__}: {e}")
    if s.failures:
        print("\nfailures:\n  " + "\n  ".join(s.failures))
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
