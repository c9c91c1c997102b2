"""Capture safety of the CUDA-graph regions, and the host syncs of a step, checked on a CPU
(``engine/capture_check.py``).

The checks need the GPU code paths (Triton kernels through the interpreter, no CPU attention
plan, no CPU fast path), which are chosen at import: ``test_in_a_process_on_the_gpu_paths`` runs
the ``inner`` tests of this file in a fresh Python with ``TANDEM_TEST_GPU_PATHS=1``,
``TRITON_INTERPRET=1``, static graph buffers and the CPU fast path off.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from tandem.kernels.launch import FORCE_GPU_PATHS, GPU_PATHS_ENV

ROOT = Path(__file__).resolve().parents[1]
METHODS = ["none", "mtp-eagle", "eagle3", "mtp-vanilla", "eagle3-tree"]
inner = pytest.mark.skipif(not FORCE_GPU_PATHS, reason=f"needs {GPU_PATHS_ENV}=1 at import")
if FORCE_GPU_PATHS:
    from triton_utils import interpret_without_overflow_checks

    interpret_without_overflow_checks()


def test_in_a_process_on_the_gpu_paths() -> None:
    if FORCE_GPU_PATHS:
        pytest.skip("this process is the inner run")
    env = {
        **os.environ,
        GPU_PATHS_ENV: "1",
        "TRITON_INTERPRET": "1",
        "TANDEM_TEST_STATIC_GRAPHS": "1",
        "TANDEM_CPU_FAST_DECODE": "0",
    }
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", "inner", __file__],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == len(METHODS) + 6, proc.stdout[-3000:]


# --------------------------------------------------------------------------------------------
# Inner tests (GPU code paths on a CPU)
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    from graph_checks import build_graph_models

    return build_graph_models(tmp_path_factory.mktemp("capture"))


def _worker(tiny: dict[str, Path], method: str, **kw: Any) -> Any:
    from graph_checks import method_worker

    return method_worker(tiny, method, **kw)


class _Watched:
    """Every segment replay of ``runner`` runs under ``CaptureHazards`` (reads checked against
    the static tensors); the hazards of all replays collect in ``hazards``."""

    def __init__(self, runner: Any, monkeypatch: pytest.MonkeyPatch) -> None:
        from tandem.engine import graph_runner
        from tandem.engine.capture_check import CaptureHazards, static_tensors

        self.hazards: list[Any] = []
        self.replays = 0
        real = graph_runner.Segment.replay

        def replay(segment: Any) -> Any:
            check = CaptureHazards(allowed=static_tensors(runner))
            with check.watch():
                out = real(segment)
            self.hazards += check.hazards
            self.replays += 1
            return out

        monkeypatch.setattr(graph_runner.Segment, "replay", replay)


def _report(hazards: list[Any]) -> str:
    return "\n".join(sorted({str(h) for h in hazards}))


@inner
@pytest.mark.parametrize("method", METHODS)
def test_inner_every_graph_key_replays_capture_safe(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch, method: str
) -> None:
    """The target forward and the draft loop of every key (1, 2 and 3 live rows padded to 4;
    greedy and sampled variants) read only static tensors, never sync with the host, draw no
    random numbers and make no data-dependent shapes."""
    from graph_checks import GREEDY, MIXED, check_variant
    from tandem.engine.cuda_graph import ADVANCED, SAMPLED
    from tandem.engine.cuda_graph import GREEDY as GREEDY_VARIANT

    worker = _worker(tiny, method)
    watched = _Watched(worker.runner, monkeypatch)
    check_variant(worker, [GREEDY] * 4, GREEDY_VARIANT)
    check_variant(worker, MIXED, ADVANCED if method != "none" else SAMPLED)
    assert watched.replays >= (6 if method == "none" else 12)  # target (+ draft) x 3 x 2
    assert not watched.hazards, _report(watched.hazards)


@inner
def test_inner_gpt_oss_mxfp4_with_windows_replays_capture_safe(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """gpt-oss on the GPU paths: its experts stay MXFP4 as released (the loaded blocks and
    scales are the checkpoint's) and run in the Triton kernels; its sliding-window layers read
    the window group's slots and tables from static buffers too. The one captured key (4 rows,
    greedy) of an Eagle3 draft tree replays, for three live rows and a padding row, what eager
    execution gives, capture-safe."""
    from safetensors.torch import load_file

    from checkpoints import build_eagle3_draft, build_gpt_oss
    from graph_checks import (
        GREEDY,
        assert_same,
        generation_step,
        make_worker,
        replay_and_eager,
        spec_config,
    )
    from tandem.engine.cuda_graph import GREEDY as GREEDY_VARIANT

    # Four experts (every one chosen: top-4), one KV head: few interpreted programs a step.
    target = build_gpt_oss(
        tmp_path / "gpt", mxfp4=True, heads=2, kv_heads=1, experts=4, sliding_window=8
    )
    head = build_eagle3_draft(tmp_path / "head", target)
    worker = make_worker(target, spec_config("eagle3-tree", head), "cpu", batch_sizes=(4,))
    assert worker.window == 8 and worker.runner.graph_runner.windowed
    experts = worker.model.model.layers[0].mlp.experts
    stored = load_file(str(next(target.glob("*.safetensors"))))
    assert experts.mxfp4 and not hasattr(experts, "w13")
    name = "model.layers.0.mlp.experts.gate_up_proj"
    assert torch.equal(experts.w13_blocks, stored[f"{name}_blocks"])
    assert torch.equal(experts.w13_scales, stored[f"{name}_scales"])
    watched = _Watched(worker.runner, monkeypatch)
    # Three live rows padded to four (the sampled variant runs the same target forward).
    step = generation_step(worker, [GREEDY] * 3)
    eager, graphed, key, _ = replay_and_eager(worker, step)
    assert key.variant == GREEDY_VARIANT and key.batch_size == 4
    assert_same(eager, graphed)
    assert watched.replays >= 2 and not watched.hazards, _report(watched.hazards)


@inner
def test_inner_the_adp_dummy_replays_capture_safe(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from graph_checks import check_adp_dummy

    worker = _worker(tiny, "mtp-eagle", adp=True)
    watched = _Watched(worker.runner, monkeypatch)
    check_adp_dummy(worker)
    assert watched.replays >= 2 and not watched.hazards, _report(watched.hazards)


@inner
def test_inner_an_item_in_the_draft_loop_is_caught(
    tiny: dict[str, Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The check can fail: a ``.item()`` added in the draft loop is reported with its frame."""
    from graph_checks import GREEDY, check_variant
    from tandem.engine.cuda_graph import GREEDY as GREEDY_VARIANT
    from tandem.engine.speculative import decoder

    real = decoder.SpecDecoder.draft_loop

    def draft_loop_with_an_item(self: Any, *args: Any, **kwargs: Any) -> Any:
        out = real(self, *args, **kwargs)
        print("ITEM CALLED", flush=True)
        out[0].sum().item()
        return out

    monkeypatch.setattr(decoder.SpecDecoder, "draft_loop", draft_loop_with_an_item)
    worker = _worker(tiny, "mtp-eagle")
    watched = _Watched(worker.runner, monkeypatch)
    check_variant(worker, [GREEDY] * 4, GREEDY_VARIANT)
    assert any(h.op == "Tensor.item()" and "with_an_item" in h.frame for h in watched.hazards), (
        _report(watched.hazards)
    )


@inner
@pytest.mark.parametrize("method", ["none", "mtp-eagle", "eagle3-tree"])
def test_inner_a_step_syncs_with_the_host_once(tiny: dict[str, Path], method: str) -> None:
    """Prefill, decode (greedy and sampled, with logprobs), speculative verify + draft loop and
    a mixed prefill + decode step each read their results back in one host sync."""
    from graph_checks import GREEDY, MIXED, PROMPTS, _blocks, generation_step
    from tandem.engine.capture_check import CaptureHazards
    from tandem.engine.step import RequestStep, StepInput

    worker = _worker(tiny, method)
    runner = worker.runner

    def syncs(step: StepInput) -> int:
        check = CaptureHazards()
        with check.watch():
            runner.execute(step)
        return check.host_syncs

    counts = {}
    for name, params in (("greedy", [GREEDY] * 2), ("sampled", MIXED[:2])):
        decode = generation_step(worker, params)
        counts[f"decode {name}"] = syncs(decode)
    fresh = [RequestStep("p", PROMPTS[1], 0, _blocks(3, worker), True, GREEDY)]
    counts["prefill"] = syncs(StepInput(fresh))
    decode = generation_step(worker, [GREEDY])
    mixed = [RequestStep("m", PROMPTS[3], 0, _blocks(2, worker), True, GREEDY), *decode.requests]
    counts["mixed"] = syncs(StepInput(mixed))
    assert counts == dict.fromkeys(counts, 1), counts
