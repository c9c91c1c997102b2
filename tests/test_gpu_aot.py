"""Every Triton kernel compiles for real GPU targets on this CPU machine (``make gpu-aot``): the
subset that covers each kernel once per target, with the Docker image's Triton where ``make
setup`` installed it beside the venv's; and the checks themselves can fail."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from triton_utils import run_in_fresh_interpreter

ROOT = Path(__file__).resolve().parents[1]
IMAGE_TRITON = ROOT / ".venv" / "triton-image"

aot = pytest.importorskip("tandem.bench.aot")


def test_every_kernel_compiles_for_sm80_and_sm90_within_limits(tmp_path: Path) -> None:
    report = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if IMAGE_TRITON.is_dir():  # the image's Triton (make setup), else the venv's
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(IMAGE_TRITON), env.get("PYTHONPATH")])
        )
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.bench.aot", "--subset", "--targets", "80", "90",
         "--out", str(report)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    print(proc.stdout[-6000:])
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    assert proc.stdout.strip().splitlines()[-1] == str(report)
    rows = json.loads(report.read_text())
    kernels = aot.package_kernels()
    fp8 = {"fp8_gemm_kernel", "quantize_group_kernel"}  # FP8 tensor cores: sm_89 and newer
    for target, expected in (("cuda:80", kernels - fp8), ("cuda:90", kernels)):
        covered = {r["kernel"] for r in rows if r["target"] == target and r["ok"]}
        assert covered == expected, (target, expected ^ covered)
    assert fp8 <= kernels
    for r in rows:
        assert set(r) >= {
            "kernel",
            "variant",
            "target",
            "registers",
            "spill_bytes",
            "shared_bytes",
            "ok",
        }


def test_the_checks_catch_shared_memory_spills_and_host_syncs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Tiles like the MLA ones before this tool (the whole 576-wide head in one 1024 tile) are
    refused for shared memory and spills (32 query rows and 128 keys a step: 12 s to compile
    here, where the old 128 x 64 tiles took 37 s); an entry point that reads a value back to the host is
    a failure, not a silent pass."""
    from tandem.kernels.launch import triton_interpreter_enabled

    # Another test module switched the interpreter on (some kernels may have been made under
    # it): compile in a fresh process.
    if os.environ.get("TRITON_INTERPRET") == "1" or triton_interpreter_enabled():
        assert run_in_fresh_interpreter(__file__, "catch_shared", interpret=False) == 1
        return
    import torch

    variants, _ = aot.collect_variants(aot.preset_shapes(["deepseek-v3-mtp-tp8"]))
    mla = next(
        v for v in variants
        if v.kernel == "paged_attention_kernel" and dict(v.constexprs)["HEAD_DIM"] == 576
    )  # fmt: skip
    wide = {"BLOCK_M": 32, "BLOCK_N": 128, "BLOCK_DK": 1024, "BLOCK_DV": 1024, "NUM_DV": 1}
    old = {**dict(mla.constexprs), **wide}
    old_tiles = aot.Variant(mla.kernel, "whole-head MLA tiles", mla.fn, mla.signature,
                            tuple(old.items()), (("num_stages", 2), ("num_warps", 4)))  # fmt: skip
    row = aot.compile_variant(old_tiles, 90)
    assert not row["ok"] and "shared memory" in row["error"] and "spills" in row["error"], row
    assert row["shared_bytes"] > aot.TARGETS[90]

    # The MoE aligner once counted experts with torch.bincount, which reads the largest key
    # back to the host on CUDA: the fake-tensor run reports that entry point.
    from tandem.kernels import moe

    real = moe.moe_align_blocks

    def counting_with_bincount(ids: torch.Tensor, *args: int) -> tuple[torch.Tensor, torch.Tensor]:
        torch.bincount(ids.reshape(-1))
        return real(ids, *args)

    monkeypatch.setattr(moe, "moe_align_blocks", counting_with_bincount)
    _, failures = aot.collect_variants(aot.preset_shapes(["deepseek-v3-mtp-tp8"]))
    assert failures and all("experts" in f["kernel"] for f in failures), failures
    assert all("bincount" in f["error"] for f in failures), failures


@pytest.mark.gpu
@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs CUDA")
def test_the_aot_report_is_what_the_gpu_loads() -> None:
    """``make gpu-check``: each kernel's subset variant compiled ahead of time for this GPU's
    target (registers and spills read by cuobjdump, as on the CPU machine) and the same cubin
    loaded by the driver: the registers and local memory the driver reports agree."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if os.environ.get("TRITON_INTERPRET") == "1":
        pytest.skip("the interpreter compiles nothing; make gpu-check runs this without it")
    major, minor = torch.cuda.get_device_capability()
    cc = 10 * major + minor
    if cc not in aot.TARGETS:
        pytest.skip(f"sm_{cc} is not an AOT target ({sorted(aot.TARGETS)})")
    variants, failures = aot.collect_variants(aot.preset_shapes())
    assert not failures
    chosen = aot.subset([v for v in variants if cc >= aot.min_capability(v)])
    assert {v.kernel for v in chosen} == {
        k for k in aot.package_kernels() if cc >= 89 or "fp8" not in k and "quantize" not in k
    }
    print(
        f"\n{'kernel':24s} {'AOT regs':>9s} {'GPU regs':>9s} {'AOT spill B':>12s} {'GPU local B':>12s}"
    )
    mismatched = []
    for v in chosen:
        row = aot.compile_variant(v, cc)
        src = ASTSource(fn=v.fn, signature=dict(v.signature), constexprs=dict(v.constexprs))
        compiled = triton.compile(src, target=GPUTarget("cuda", cc, 32), options=dict(v.options))
        compiled._init_handles()  # the driver loads the cubin
        local = 4 * compiled.n_spills  # Triton reports the driver's local bytes / 4
        print(f"{v.kernel:24s} {row['registers']!s:>9s} {compiled.n_regs:>9d} "
              f"{row['spill_bytes']!s:>12s} {local:>12d}")  # fmt: skip
        if row["registers"] != compiled.n_regs or (row["spill_bytes"] == 0) != (local == 0):
            mismatched.append((v.kernel, row, compiled.n_regs, local))
        assert row["ok"], row
    assert not mismatched, mismatched
