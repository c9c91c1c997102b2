"""FP8 checkpoints (DeepSeek-V3/R1's block-quantized format, and per-tensor exports) load and
run exactly: against transformers' own loader of the same FP8 folder (which dequantizes on a
CPU), against a twin checkpoint holding the dequantized values, with FP8 MTP layers, and across
two TP ranks whose shards cut FP8 blocks in half."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import (
    add_deepseek_mtp_layers,
    build_deepseek_v3,
    build_llama,
    hf_greedy,
    scale_residual_writes,
)
from tandem import LLM, SamplingParams
from tandem.models.quantization import (
    DequantizedWeight,
    dequantize_fp8_blockwise,
    quantize_fp8_blockwise,
)

PROMPTS = [[5, 6, 7], list(range(40, 60)), [100], list(range(60, 90))]
NEW_TOKENS = 24
PARAMS = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
NOT_QUANTIZED = ("norm", "embed_tokens", "lm_head", "shared_head.head", "mlp.gate.weight")


def _reference_dequantize(q: torch.Tensor, scale: torch.Tensor, block: list[int]) -> torch.Tensor:
    """Block-wise ``q * scale`` written out independently: pad to whole blocks, broadcast."""
    bn, bk = block
    n, k = q.shape
    gn, gk = math.ceil(n / bn), math.ceil(k / bk)
    padded = torch.zeros(gn * bn, gk * bk)
    padded[:n, :k] = q.float()
    out = padded.view(gn, bn, gk, bk) * scale.view(gn, 1, gk, 1)
    return out.view(gn * bn, gk * bk)[:n, :k].contiguous()


def quantize_checkpoint(src: Path, dst: Path, block: list[int] | None) -> Path:
    """Copy ``src`` to ``dst`` with every linear weight (MTP layers' too) stored as FP8: block-wise
    (``weight_scale_inv`` grids, power-of-two scales so dequantized values are exact in bf16)
    or, with ``block=None``, per tensor (a scalar ``weight_scale``)."""
    shutil.copytree(src, dst)
    files = sorted(dst.glob("*.safetensors"))
    assert len(files) == 1
    state = load_file(str(files[0]))
    out: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(0)
    for name, w in state.items():
        if w.dim() != 2 or not name.endswith(".weight") or any(s in name for s in NOT_QUANTIZED):
            out[name] = w
            continue
        if block is None:
            scale = torch.exp2(torch.ceil(torch.log2(w.abs().amax() / 448)))
            out[name] = (w / scale).to(torch.float8_e4m3fn)
            out[name + "_scale"] = scale.float()
        else:
            q, scale = quantize_fp8_blockwise(w, tuple(block), power_of_two=True)
            # Blocks' scales 1x to 8x apart (q divided to match, exactly: powers of two), so
            # a block read with its neighbour's scale changes the result.
            shift = torch.exp2(torch.randint(0, 4, scale.shape, generator=g).float())
            q = (q.float() / _reference_dequantize(torch.ones_like(q), shift, block)).to(q.dtype)
            out[name], out[name + "_scale_inv"] = q.contiguous(), scale * shift
    save_file(out, str(files[0]), metadata={"format": "pt"})
    cfg = json.loads((dst / "config.json").read_text())
    qc: dict[str, Any] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic"}
    if block is not None:
        qc["weight_block_size"] = block
    cfg["quantization_config"] = qc
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    return dst


def dequantized_twin(fp8: Path, dst: Path) -> Path:
    """The FP8 checkpoint's values, dequantized here and stored in float32, without a
    quantization_config: what the FP8 checkpoint must compute exactly like."""
    shutil.copytree(fp8, dst)
    cfg = json.loads((dst / "config.json").read_text())
    qc = cfg.pop("quantization_config")
    (dst / "config.json").write_text(json.dumps(cfg, indent=2))
    f = next(dst.glob("*.safetensors"))
    state = load_file(str(f))
    out = {}
    for name, t in state.items():
        if name.endswith(("_scale_inv", "_scale")):
            continue
        if t.dtype == torch.float8_e4m3fn:
            if "weight_block_size" in qc:
                t = _reference_dequantize(t, state[name + "_scale_inv"], qc["weight_block_size"])
            else:
                t = t.float() * state[name + "_scale"]
        out[name] = t
    save_file(out, str(f), metadata={"format": "pt"})
    return dst


def _generate(folder: Path, **kw: Any) -> tuple[list[list[int]], list[list[float]], list[Any]]:
    with LLM(str(folder), dtype="float32", max_num_batched_tokens=32, **kw) as llm:
        outs = llm.generate(PROMPTS, PARAMS)
    return (
        [o.outputs[0].token_ids for o in outs],
        [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs],
        [o.spec_stats.accepted_per_pos if o.spec_stats else None for o in outs],
    )


@pytest.fixture(scope="module")
def root(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("fp8")


@pytest.fixture(scope="module")
def dsv3(root: Path) -> Path:
    """A 2-layer DeepSeek-V3 (dense, MoE) with one echo MTP layer, in float32."""
    folder = build_deepseek_v3(root / "dense", layers=2, seed=5)
    scale_residual_writes(folder, 0.05)
    add_deepseek_mtp_layers(folder, 1, echo=True)
    return folder


# ----------------------------------------------------------------------------- the lazy view


@pytest.mark.parametrize("shape", [(50, 37), (3, 50, 33)])
def test_dequantized_weight_slices_equal_slices_of_the_whole(shape: tuple[int, ...]) -> None:
    torch.manual_seed(0)
    w = torch.randn(*shape)
    q, scale = quantize_fp8_blockwise(w, (16, 16))
    assert scale.shape == (*shape[:-2], 4, 3)  # partial edge blocks
    whole = dequantize_fp8_blockwise(q, scale, (16, 16), torch.float32)
    if len(shape) == 2:
        assert torch.equal(whole, _reference_dequantize(q, scale, [16, 16]))
    assert (whole - w).abs().max() <= w.abs().max() / 8  # e4m3: 3 mantissa bits
    view = DequantizedWeight("x.weight", q, scale, (16, 16))
    assert torch.equal(view[:], whole)
    for a, b in ((0, 7), (5, 21), (17, 50), (33, 34)):
        assert torch.equal(view[a:b], whole[a:b])
        assert torch.equal(view[:, a : min(b, shape[1])], whole[:, a : min(b, shape[1])])
    if len(shape) == 3:
        assert torch.equal(view[1:3, 9:30, 2:20], whole[1:3, 9:30, 2:20])


def test_a_scale_grid_that_does_not_fit_the_weight_is_refused() -> None:
    q, scale = quantize_fp8_blockwise(torch.randn(40, 32), (16, 16))
    with pytest.raises(ValueError, match=r"does not match the weight \(40, 32\) in blocks of"):
        DequantizedWeight("x.weight", q, scale[:2], (16, 16))


# ----------------------------------------------------------------------------- DeepSeek-V3


def _assert_matches_transformers(fp8: Path) -> list[list[int]]:
    """Greedy tokens equal, logprobs within 1e-4, of transformers' own load of ``fp8``."""
    ref = hf_greedy(fp8, PROMPTS, NEW_TOKENS)
    tokens, logprobs, _ = _generate(fp8)
    assert tokens == [r["tokens"] for r in ref]
    diff = max(
        abs(a - b)
        for got, r in zip(logprobs, ref, strict=True)
        for a, b in zip(got, r["logprobs"], strict=True)
    )
    assert diff < 1e-4
    return tokens


@pytest.mark.timeout(300)
def test_block_fp8_deepseek_v3_equals_transformers_dequantized(dsv3: Path, root: Path) -> None:
    """Blocks of [8, 8] divide every shape (transformers requires it); transformers, on a CPU,
    dequantizes the FP8 folder itself ("default to dequantizing the model to bf16")."""
    fp8 = quantize_checkpoint(dsv3, root / "fp8-8", [8, 8])
    tokens = _assert_matches_transformers(fp8)
    # The oracle saw FP8 weights, not the float ones: they generate something else.
    assert tokens != _generate(dsv3)[0]


@pytest.mark.timeout(300)
def test_partial_blocks_and_fp8_mtp_equal_the_dequantized_twin(dsv3: Path, root: Path) -> None:
    """[16, 16] blocks leave partial edge blocks (kv_a_proj has 40 rows); the MTP layer is FP8
    too. Tokens, logprobs and what MTP drafts (accepted per position) equal a checkpoint holding
    the dequantized values."""
    fp8 = quantize_checkpoint(dsv3, root / "fp8-16", [16, 16])
    state = load_file(str(next(fp8.glob("*.safetensors"))))
    assert state["model.layers.2.eh_proj.weight"].dtype == torch.float8_e4m3fn  # MTP layer
    assert state["model.layers.0.self_attn.kv_a_proj_with_mqa.weight_scale_inv"].shape == (3, 4)
    twin = dequantized_twin(fp8, root / "twin-16")
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    plain = _generate(twin)
    assert _generate(fp8)[:2] == plain[:2]
    want = _generate(twin, speculative_config=spec)
    got = _generate(fp8, speculative_config=spec)
    assert got[0] == want[0] == plain[0]
    assert got[2] == want[2]  # the FP8 MTP layer drafts what its dequantized twin drafts
    assert sum(sum(a) for a in got[2]) > 0


@pytest.mark.timeout(300)
def test_tp2_cuts_fp8_blocks_and_equals_one_rank(dsv3: Path, root: Path) -> None:
    """[32, 32] blocks: each rank's half of q_b_proj (48 of 96 rows), o_proj (48 of 96 input
    columns) and the shared experts' (16 of 32) starts or ends inside a block."""
    fp8 = quantize_checkpoint(dsv3, root / "fp8-32", [32, 32])
    spec = {"method": "mtp", "num_speculative_tokens": 2}
    one = _generate(fp8, speculative_config=spec)
    two = _generate(fp8, speculative_config=spec, tensor_parallel_size=2)
    assert two[0] == one[0]
    assert two[2] == one[2]
    diff = max(
        abs(a - b) for x, y in zip(one[1], two[1], strict=True) for a, b in zip(x, y, strict=True)
    )
    assert diff < 1e-4


def test_block_fp8_glm4_moe_equals_transformers_dequantized(root: Path) -> None:
    """GLM-4.5 through the same loader: q/k/v (fused here, with their unquantized biases),
    dense and expert weights in [8, 8] FP8 blocks; transformers dequantizes the same folder."""
    from test_glm4_moe import build_glm4_moe

    folder = build_glm4_moe(root / "glm", use_qk_norm=True, head_dim=32)
    fp8 = quantize_checkpoint(folder, root / "glm-fp8", [8, 8])
    tokens = _assert_matches_transformers(fp8)
    assert tokens != _generate(folder)[0]  # the FP8 values, not the float ones


# ----------------------------------------------------------------------------- per tensor


def test_per_tensor_fp8_llama_equals_the_dequantized_twin(root: Path) -> None:
    folder = build_llama(root / "llama")
    fp8 = quantize_checkpoint(folder, root / "llama-fp8", None)
    twin = dequantized_twin(fp8, root / "llama-twin")
    assert _generate(fp8)[:2] == _generate(twin)[:2]


# ----------------------------------------------------------------------------- refusals


def _edit(folder: Path, dst: Path, config: dict[str, Any] | None = None, drop: str = "") -> Path:
    shutil.copytree(folder, dst)
    if config is not None:
        cfg = json.loads((dst / "config.json").read_text())
        cfg.update(config)
        (dst / "config.json").write_text(json.dumps(cfg))
    if drop:
        f = next(dst.glob("*.safetensors"))
        state = load_file(str(f))
        del state[drop]
        save_file(state, str(f), metadata={"format": "pt"})
    return dst


def test_fp8_checkpoints_we_cannot_read_exactly_are_refused(dsv3: Path, root: Path) -> None:
    fp8 = quantize_checkpoint(dsv3, root / "fp8-bad", [16, 16])
    qc = json.loads((fp8 / "config.json").read_text())["quantization_config"]
    scale = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    cases = {
        "no-scale": (
            {},
            scale,
            r"model.layers.1.self_attn.o_proj.weight is stored in float8 without a scale",
        ),
        "no-config": (
            {"quantization_config": None},
            "",
            "is stored in float8 but config.json has no quantization_config",
        ),
        "method": (
            {"quantization_config": {**qc, "quant_method": "gptq"}},
            "",
            r"quant_method='gptq' is not supported; supported: 'fp8'",
        ),
        "static": (
            {"quantization_config": {**qc, "activation_scheme": "static"}},
            "",
            r"activation_scheme='static' is not supported",
        ),
        "block": (
            {"quantization_config": {**qc, "weight_block_size": [8, 8]}},
            "",
            r"does not match the weight .* in blocks of \[8, 8\]",
        ),
        "not-converted": (
            {"quantization_config": {**qc, "modules_to_not_convert": ["o_proj"]}},
            "",
            "o_proj.weight is stored in float8 but quantization_config.modules_to_not_convert",
        ),
    }
    for name, (config, drop, message) in cases.items():
        bad = _edit(fp8, root / f"bad-{name}", config, drop)
        with pytest.raises(ValueError, match=message):
            LLM(str(bad), dtype="float32")
    # A per-tensor checkpoint under a block config: the error names the scale that was found
    # (it named a `weight_scale_inv` the checkpoint does not have) and what the config expects.
    per_tensor = quantize_checkpoint(dsv3, root / "fp8-bad-per-tensor", None)
    bad = _edit(per_tensor, root / "bad-per-tensor", {"quantization_config": qc})
    with pytest.raises(
        ValueError, match=r"\.weight_scale: a per-tensor scale \(shape \(\)\), but "
    ) as e:
        LLM(str(bad), dtype="float32")
    assert "weight_block_size [16, 16] expects" in str(e.value)
    assert "_scale_inv of shape" in str(e.value)


# ----------------------------------------------------------------------------- weights kept FP8

_RESIDENT = r"""
import json, sys
import torch
from triton_utils import interpret_without_overflow_checks
interpret_without_overflow_checks()
from safetensors.torch import load_file
from tandem import LLM, SamplingParams
from tandem.models.quantization import dequantize_fp8_blockwise

fp8, twin = sys.argv[1], sys.argv[2]
params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
spec = {"method": "mtp", "num_speculative_tokens": 2}
with LLM(fp8, dtype="float32", speculative_config=spec, max_num_batched_tokens=32) as llm:
    worker = llm.engine.executor.worker
    state = load_file(next(__import__("pathlib").Path(twin).glob("*.safetensors")).as_posix())
    kept, fp8_bytes, mismatched, compared = [], 0, [], []
    for root, model in (("", worker.model), ("mtp.", worker.runner.spec.draft)):
        for name, m in model.named_modules():
            if getattr(m, "fp8_block", None) is None:
                continue
            kept.append(root + name)
            if hasattr(m, "w13"):
                fp8_bytes += m.w13.numel() * m.w13.element_size() + m.w2.numel() * m.w2.element_size()
                continue
            fp8_bytes += m.weight.numel() * m.weight.element_size()
            ckpt = name + ".weight"
            if root:  # the MTP layer's names in the checkpoint
                ckpt = ckpt.replace("mtp_layers.0.", "model.layers.2.", 1)
            if ckpt in state:
                compared.append(ckpt)
                w = dequantize_fp8_blockwise(m.weight, m.weight_scale_inv, m.fp8_block, torch.float32)
                if not torch.equal(w, state[ckpt]):
                    mismatched.append(ckpt)
    outs = llm.generate([[5, 6, 7], list(range(40, 60))], params)
print(json.dumps({
    "kept": kept, "fp8_bytes": fp8_bytes, "mismatched": mismatched, "compared": compared,
    "tokens": [o.outputs[0].token_ids for o in outs],
    "logprobs": [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs],
    "kv_b": str(worker.model.model.layers[0].self_attn.kv_b_proj.weight.dtype),
}))
"""


@pytest.mark.timeout(600)
def test_gpu_paths_keep_fp8_weights_and_quantize_activations(dsv3: Path, root: Path) -> None:
    """Where FP8 GEMMs run (here: the GPU code paths forced on a CPU, Triton through the
    interpreter), the quantized linears and experts of target and MTP layer keep FP8 weights
    whose dequantized values are the checkpoint's, and generation (activations quantized per
    token) stays close to the weight-only run."""
    import os
    import subprocess
    import sys

    fp8 = quantize_checkpoint(dsv3, root / "fp8-kept", [32, 32])
    twin = dequantized_twin(fp8, root / "twin-kept")
    env = {**os.environ, "TANDEM_TEST_GPU_PATHS": "1", "TRITON_INTERPRET": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).parent), env.get("PYTHONPATH", "")])
    proc = subprocess.run(
        [sys.executable, "-c", _RESIDENT, str(fp8), str(twin)],
        env=env, capture_output=True, text=True, timeout=540,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    kept = got["kept"]
    assert not got["mismatched"]
    # q_a, q_b, kv_a, o of layers 0, 1 and the MTP layer; eh_proj; dense and shared down_proj x 3
    assert len(got["compared"]) == 16
    assert got["kv_b"] == "torch.float32"  # read as per-head matrices: dequantized
    for part in ("q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "o_proj", "gate_up_proj",
                 "down_proj", "experts", "shared_experts.gate_up_proj"):  # fmt: skip
        assert any(k.endswith(part) for k in kept), part
    assert any(k.startswith("mtp.") and k.endswith("eh_proj") for k in kept)
    assert got["fp8_bytes"] > 0
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(str(twin), dtype="float32") as llm:
        outs = llm.generate([[5, 6, 7], list(range(40, 60))], params)
    assert got["tokens"] == [o.outputs[0].token_ids for o in outs]
    diff = max(
        abs(a - b.logprob)
        for lps, o in zip(got["logprobs"], outs, strict=True)
        for a, b in zip(lps, o.outputs[0].logprobs, strict=True)
    )
    assert 0 < diff < 0.05  # activation quantization: close, not equal


def test_blocks_the_fp8_kernels_cannot_take_are_dequantized(
    dsv3: Path, root: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Where FP8 GEMMs could run, [16, 16] blocks (an FP8 dot needs K steps of 32) are
    dequantized at load, and the log says why; [32, 32] blocks are kept (here they run through
    the PyTorch references: the GPU paths are off)."""
    import logging

    from tandem.models import loader

    monkeypatch.setattr(loader, "fp8_compute_unavailable", lambda device: None)
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    for block, kept in (([16, 16], False), ([32, 32], True)):
        fp8 = quantize_checkpoint(dsv3, root / f"fp8-blocks-{block[0]}", block)
        with caplog.at_level(logging.INFO, logger="tandem.models.loader"):
            with LLM(str(fp8), dtype="float32") as llm:
                model = llm.engine.executor.worker.model
                n = sum(getattr(m, "fp8_block", None) is not None for m in model.modules())
                out = llm.generate([[5, 6, 7]], params)
        assert (n > 0) == kept
        assert len(out[0].outputs[0].token_ids) == 4
    assert "column blocks that are a power of two of at least 32" in caplog.text


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.timeout(300)
def test_cuda_keeps_fp8_weights_resident(dsv3: Path, root: Path) -> None:
    """``make gpu-check``: on a GPU with FP8 tensor cores the quantized layers hold 1 byte per
    weight (+ a float32 scale per block); prints the bytes against the same layers in bf16, and
    generation stays close to the dequantized twin's."""
    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("FP8 tensor cores need compute capability 8.9")
    fp8 = quantize_checkpoint(dsv3, root / "fp8-cuda", [32, 32])
    twin = dequantized_twin(fp8, root / "twin-cuda")
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)
    runs = {}
    for name, folder in (("fp8", fp8), ("twin", twin)):
        with LLM(str(folder), dtype="bfloat16", device="cuda") as llm:
            model = llm.engine.executor.worker.model
            kept = [m for m in model.modules() if getattr(m, "fp8_block", None) is not None]
            weights = [
                t for m in kept for n, t in m.named_parameters() if n in ("weight", "w13", "w2")
            ]
            scales = [t for m in kept for n, t in m.named_buffers() if n.endswith("scale_inv")]
            runs[name] = (llm.generate(PROMPTS, params), kept, weights, scales)
    outs, kept, weights, scales = runs["fp8"]
    assert kept and all(w.dtype == torch.float8_e4m3fn for w in weights)
    fp8_bytes = sum(w.numel() for w in weights) + sum(s.numel() * 4 for s in scales)
    bf16_bytes = sum(w.numel() * 2 for w in weights)
    print(f"\nFP8 layers: {len(kept)}; weights + scales {fp8_bytes} B, the same in bf16 "
          f"{bf16_bytes} B ({fp8_bytes / bf16_bytes:.3f}x)")  # fmt: skip
    assert fp8_bytes < 0.6 * bf16_bytes
    twin_outs = runs["twin"][0]
    same = sum(
        a.outputs[0].token_ids == b.outputs[0].token_ids
        for a, b in zip(outs, twin_outs, strict=True)
    )
    print(f"greedy continuations equal to the bf16 twin's: {same} of {len(outs)}")
    assert same >= len(outs) // 2
