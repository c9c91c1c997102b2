"""Ahead-of-time compilation of every Triton kernel in the package for real GPU targets, on any
machine (no GPU needed): ``python -m tandem.bench.aot`` (``make gpu-aot``).

The variants are the ones the code dispatches, not a hand-kept list: the kernels' own entry
points (``write_kv_cache``, ``paged_attention``, ``grouped_topk``, ``moe_experts``,
``gpt_oss_experts_mxfp4``, ``accept_matching``, ``rejection_sample``,
``build_draft_step0_inputs``) run on fake CUDA
tensors (PyTorch's ``FakeTensorMode``: shapes and dtypes, no memory, no device) with the shapes
of the model each shipped preset serves (its tensor-parallel size, attention DP, K, block size,
batch limits) and of the models the engine does not serve on GPUs yet (gpt-oss-20b: attention
sinks and windows, MXFP4 experts; ``UNPRESET_MODELS``), bf16 and fp16, K = 1..8, decode, verify, draft-tree verify and prefill; every
launch is recorded
instead of run. Each distinct variant (constexprs, argument dtypes, launch options) is compiled
with ``triton.compile`` for ``cuda:80`` (A100), ``cuda:90`` (H100/H200) and ``cuda:100`` where
the installed Triton knows it, and measured with the Triton wheel's ``cuobjdump -res-usage``.

A variant fails on a compile error, on shared memory above the target's per-block limit, or on
more than ``SPILL_LIMIT_BYTES`` of spills (local/stack memory per thread). An entry point that
cannot run on fake tensors (a data-dependent shape or a host read in its launcher, which would
also break CUDA-graph capture) fails too. The table goes to stdout and the report, a JSON list of
objects with ``kernel``, ``variant``, ``target``, ``registers``, ``spill_bytes``,
``shared_bytes``, ``ok`` (and ``error``), to ``--out``; the last line printed is its path.
Exit status 1 if anything failed.

Int arguments compile as plain i32/i64 (the JIT also specializes values equal to 1 and multiples
of 16, which changes registers a little, never shared memory).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from tandem.bench.aot_record import Variant, collect_variants, preset_shapes
from tandem.bench.shapes import UNPRESET_MODELS
from tandem.engine.presets import PRESETS_DIR

# Per-block shared memory a kernel may use (opt-in maximum): A100 163 KiB, H100/H200 and B200
# 227 KiB.
TARGETS = {80: 166_912, 90: 232_448, 100: 232_448}
# Spilled bytes per thread we accept: a spill costs a local-memory round trip (L1 when it hits)
# inside the KV loop; the kernels are memory bound, so a few words are tolerable, a KV tile's
# worth (hundreds of bytes) is not.
SPILL_LIMIT_BYTES = 64


# --------------------------------------------------------------------------------------------
# Recording launches on fake CUDA tensors
# --------------------------------------------------------------------------------------------


# --------------------------------------------------------------------------------------------
# Compiling and measuring
# --------------------------------------------------------------------------------------------


def _cuobjdump() -> str:
    import triton

    path = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    if not path.is_file():
        raise FileNotFoundError(f"{path}: this Triton wheel carries no cuobjdump")
    return str(path)


def resource_usage(cubin: bytes) -> dict[str, int]:
    """Registers, stack (spills) and static shared memory per ``cuobjdump -res-usage``."""
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        out = subprocess.run(
            [_cuobjdump(), "-res-usage", f.name], capture_output=True, text=True, check=True
        ).stdout
    usage = dict(re.findall(r"\b(REG|STACK|SHARED|LOCAL):(\d+)", out))
    return {k: int(v) for k, v in usage.items()}


def supported_targets() -> list[int]:
    from triton.backends.nvidia.compiler import CUDABackend

    ok = []
    for cc in TARGETS:
        with contextlib.suppress(Exception):
            from triton.backends.compiler import GPUTarget

            CUDABackend(GPUTarget("cuda", cc, 32)).parse_options({})
            ok.append(cc)
    return ok


def compile_variant(v: Variant, cc: int) -> dict[str, Any]:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    row: dict[str, Any] = {"kernel": v.kernel, "variant": v.name, "target": f"cuda:{cc}"}
    try:
        src = ASTSource(fn=v.fn, signature=dict(v.signature), constexprs=dict(v.constexprs))
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(v.options))
        usage = resource_usage(compiled.asm["cubin"])
    except Exception as exc:
        first = str(exc).strip().splitlines()
        return {**row, "registers": None, "spill_bytes": None, "shared_bytes": None,
                "ok": False, "error": f"compile: {type(exc).__name__}: {first[-1] if first else ''}"[:300]}  # fmt: skip
    shared = int(compiled.metadata.shared) + usage.get("SHARED", 0)
    spill = usage.get("STACK", 0) + usage.get("LOCAL", 0)
    errors = []
    if shared > TARGETS[cc]:
        errors.append(f"shared memory {shared} B > the target's {TARGETS[cc]} B")
    if spill > SPILL_LIMIT_BYTES:
        errors.append(f"spills {spill} B > {SPILL_LIMIT_BYTES} B")
    return {
        **row, "registers": usage.get("REG"), "spill_bytes": spill, "shared_bytes": shared,
        "ok": not errors, **({"error": "; ".join(errors)} if errors else {}),
    }  # fmt: skip


def min_capability(v: Variant) -> int:
    """The oldest target a variant is dispatched on: FP8 operands need FP8 tensor cores
    (``kernels.fp8.FP8_MIN_CAPABILITY``, sm_89); below that FP8 weights are dequantized."""
    from tandem.kernels.fp8 import FP8_MIN_CAPABILITY

    if any(t == "*fp8e4nv" for _, t in v.signature):
        return 10 * FP8_MIN_CAPABILITY[0] + FP8_MIN_CAPABILITY[1]
    return 0


def subset(variants: list[Variant]) -> list[Variant]:
    """Every kernel once: the variant with the largest constexpr tile (the likeliest to fail)."""
    best: dict[str, Variant] = {}

    def size(v: Variant) -> int:
        return sum(
            int(x) for k, x in v.constexprs if k.startswith("BLOCK") and not isinstance(x, bool)
        )

    for v in variants:
        if v.kernel not in best or size(v) > size(best[v.kernel]):
            best[v.kernel] = v
    return list(best.values())


def package_kernels() -> set[str]:
    """Names of every ``@triton.jit`` kernel in the kernel modules (the coverage check): every
    module of ``tandem.kernels``, so a new module's kernels are counted without a list here.
    A kernel's name ends in ``_kernel``; other jit functions are helpers that kernels call
    (compiled inside them)."""
    import importlib
    import pkgutil

    import triton
    from triton.runtime.interpreter import InterpretedFunction

    import tandem.kernels

    kinds = (triton.runtime.jit.JITFunction, InterpretedFunction)  # TRITON_INTERPRET=1 too
    modules = [
        importlib.import_module(f"tandem.kernels.{info.name}")
        for info in pkgutil.iter_modules(tandem.kernels.__path__)
    ]
    return {
        name.lstrip("_")
        for m in modules
        for name, obj in vars(m).items()
        if isinstance(obj, kinds) and name.endswith("_kernel")
    }


def _cell(x: Any) -> str:
    return "-" if x is None else str(x)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m tandem.bench.aot", description=__doc__.split("\n\n")[0]
    )
    ap.add_argument("--subset", action="store_true", help="every kernel once per target (fast)")
    ap.add_argument("--presets", nargs="*", help="only these presets (default: all shipped)")
    ap.add_argument(
        "--targets", nargs="*", type=int, choices=sorted(TARGETS),
        help="compute capabilities (default: every one the installed Triton knows)",
    )  # fmt: skip
    ap.add_argument("--kernels", nargs="*", help="only these kernels (names as printed)")
    ap.add_argument("--out", default=None, help="report path (default: a temporary file)")
    args = ap.parse_args(argv)

    import triton

    from tandem.kernels.launch import triton_interpreter_enabled

    if triton_interpreter_enabled():
        ap.error("TRITON_INTERPRET=1 is set: the interpreter compiles nothing; unset it")
    shipped = sorted(p.stem for p in PRESETS_DIR.glob("*.yaml")) + sorted(UNPRESET_MODELS)
    unknown = sorted(set(args.presets or ()) - set(shipped))
    if unknown:
        ap.error(f"unknown preset(s) {', '.join(unknown)}; shipped: {', '.join(shipped)}")
    kernels = package_kernels()
    unknown = sorted(set(args.kernels or ()) - kernels)
    if unknown:
        ap.error(f"unknown kernel(s) {', '.join(unknown)}; kernels: {', '.join(sorted(kernels))}")
    started = time.monotonic()
    variants, failures = collect_variants(preset_shapes(args.presets))
    missing = kernels - {v.kernel for v in variants}
    for name in sorted(missing):
        failures.append({"kernel": name, "variant": "-", "error": "no entry point launched it"})
    if args.kernels:
        variants = [v for v in variants if v.kernel in args.kernels]
        failures = [f for f in failures if any(k in f["kernel"] for k in args.kernels)]
    targets = args.targets or supported_targets()
    rows: list[dict[str, Any]] = []
    chosen: list[Variant] = []
    for cc in targets:
        mine = [v for v in variants if cc >= min_capability(v)]
        mine = subset(mine) if args.subset else mine
        chosen += [v for v in mine if v not in chosen]
        # A cache per target: nothing compiled for one target is reused for another.
        with tempfile.TemporaryDirectory(prefix=f"tandem-aot-sm{cc}-") as cache:
            os.environ["TRITON_CACHE_DIR"] = cache
            rows += [compile_variant(v, cc) for v in mine]
    rows += [{**f, "target": "-", "registers": None, "spill_bytes": None,
              "shared_bytes": None, "ok": False} for f in failures]  # fmt: skip

    print(f"Triton {triton.__version__}; {len(chosen)} variants of {len({v.kernel for v in chosen})} "
          f"kernels x targets {', '.join(f'cuda:{t}' for t in targets)}; shared-memory limits "
          f"{', '.join(f'cuda:{t} {TARGETS[t]} B' for t in targets)}; spill limit {SPILL_LIMIT_BYTES} B; "
          "FP8 variants for cuda:89 and newer only")  # fmt: skip
    header = (
        f"{'kernel':24s} {'target':8s} {'regs':>5s} {'spill B':>8s} {'shared B':>9s}  ok  variant"
    )
    print(header)
    for r in sorted(rows, key=lambda r: (r["kernel"], r["target"], r["variant"])):
        print(f"{r['kernel']:24s} {r['target']:8s} {_cell(r['registers']):>5s} "
              f"{_cell(r['spill_bytes']):>8s} {_cell(r['shared_bytes']):>9s}  "
              f"{'ok' if r['ok'] else 'NO'}  {r['variant']}"
              + (f"\n{'':24s} ^ {r['error']}" if not r["ok"] else ""))  # fmt: skip
    bad = [r for r in rows if not r["ok"]]
    print(f"{len(rows) - len(bad)} ok, {len(bad)} failed, {time.monotonic() - started:.0f} s")
    out = (
        Path(args.out)
        if args.out
        else Path(tempfile.mkstemp(prefix="tandem-aot-", suffix=".json")[1])
    )
    out.write_text(json.dumps(rows, indent=1))
    print(out)
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
