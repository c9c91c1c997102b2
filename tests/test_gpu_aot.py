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

aot = pytest.importorskip("tandem.kernels.aot")


def test_every_kernel_compiles_for_sm80_and_sm90_within_limits(tmp_path: Path) -> None:
    report = tmp_path / "aot.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    if IMAGE_TRITON.is_dir():  # the image's Triton (make setup), else the venv's
        env["PYTHONPATH"] = os.pathsep.join(
            filter(None, [str(IMAGE_TRITON), env.get("PYTHONPATH")])
        )
    proc = subprocess.run(
        [sys.executable, "-m", "tandem.kernels.aot", "--subset", "--targets", "80", "90",
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
    """The MLA tiles before this tool (the whole 576-wide head in one 1024 tile, 128 heads) are
    refused for shared memory and spills; an entry point that reads a value back to the host is
    a failure, not a silent pass."""
    from tandem.kernels.paged_attention import triton_interpreter_enabled

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
    old = {**dict(mla.constexprs), "BLOCK_N": 64, "BLOCK_DK": 1024, "BLOCK_DV": 1024, "NUM_DV": 1}
    old_tiles = aot.Variant(mla.kernel, "old MLA tiles", mla.fn, mla.signature,
                            tuple(old.items()), (("num_stages", 3), ("num_warps", 4)))  # fmt: skip
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
    assert failures and all(f["kernel"].startswith("experts") for f in failures), failures
    assert all("bincount" in f["error"] for f in failures), failures
