"""The CPU decode fast path (kernels/cpu_decode.cpp): every step it takes equals the eager
layers on the same inputs (hidden states, captured layers and KV cache), greedy output equals
transformers', and whatever it cannot run falls back to the eager path."""

from __future__ import annotations

import dataclasses
import fcntl
import os
import re
import shutil
import subprocess
import sys
import sysconfig
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import pytest
import torch
from torch import nn

from checkpoints import add_mtp_layers, build_eagle3_draft, build_llama, eagle3_tree_spec, hf_greedy
from tandem import LLM, SamplingParams
from tandem.kernels import cpu_decode
from tandem.models.attention import AttentionMetadata
from tandem.models.layers import LinearBase
from tandem.models.llama import CpuStackFastPath, LlamaModel, enable_cpu_fast_path

pytestmark = pytest.mark.skipif(
    cpu_decode.isa() is None, reason="the CPU has neither AVX-512 (F, BW) nor AVX2 + FMA"
)

# Odd sizes on purpose: hidden 72 and head_dim 18 leave tails after the 16/32-lane loops.
TINY = dict(hidden_size=72, heads=4, kv_heads=2, intermediate=100, layers=3, vocab_size=300)
PROMPTS = [[5, 6, 7], list(range(40, 59)), [100], list(range(60, 97))]


def inner_model(llm: LLM) -> LlamaModel:
    model = llm.engine.executor.worker.model.model
    assert isinstance(model, LlamaModel)
    return model


def _outputs(result: Any) -> list[torch.Tensor]:
    """A stack's (hidden, captured) or a draft layer's tensor, as one list."""
    if isinstance(result, tuple):
        return [result[0], *result[1]]
    return [result]


@contextmanager
def checked_against_eager(owner: nn.Module, records: list[dict[str, Any]]) -> Iterator[None]:
    """Every fast-path step of ``owner`` (a ``LlamaModel`` or an ``Eagle3MidLayer``) also runs
    its eager forward on a copy of the KV cache first; the differences (outputs: hidden, then
    captured layers; cache) are recorded per step."""
    fast = owner.fast_path
    assert fast is not None, "the fast path is off"
    attention = fast.attention if isinstance(fast.attention, list) else [fast.attention]

    def step(*args: Any) -> Any:
        meta = next(a for a in args if isinstance(a, AttentionMetadata))
        before = [(a.k_cache.clone(), a.v_cache.clone()) for a in attention]
        owner.fast_path = None
        ref = _outputs(owner(*args))
        owner.fast_path = checker
        ref_kv = [(a.k_cache.clone(), a.v_cache.clone()) for a in attention]
        for a, (k, v) in zip(attention, before, strict=True):
            a.k_cache.copy_(k)
            a.v_cache.copy_(v)
        result = fast(*args)
        out = _outputs(result)
        kv = max(
            max((a.k_cache - k).abs().max().item(), (a.v_cache - v).abs().max().item())
            for a, (k, v) in zip(attention, ref_kv, strict=True)
        )
        diffs = [(o.float() - r.float()).abs().max().item() for o, r in zip(out, ref, strict=True)]
        records.append(
            {
                "rows": meta.slot_mapping.shape[0],
                "seqs": meta.seq_lens.shape[0],
                "tree": meta.tree_mask is not None and bool(meta.tree_mask.any()),
                "out_rows": out[0].shape[0],
                "hidden": diffs[0],
                "captured": diffs[1:],
                "scale": ref[0].float().abs().max().item(),
                "kv": kv,
            }
        )
        return result

    class Checker:
        accepts = fast.accepts

        def __init__(self) -> None:
            self.attention = fast.attention

        def __call__(self, *args: Any) -> Any:
            return step(*args)

    checker = Checker()
    owner.fast_path = checker
    try:
        yield
    finally:
        owner.fast_path = fast


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("cpu-fast") / "llama", **TINY)


def assert_greedy_matches(outs: list[Any], ref: list[dict[str, Any]]) -> None:
    """Tokens equal transformers' greedy ones, chosen logprobs within 1e-4 (fp32)."""
    for out, expected in zip(outs, ref, strict=True):
        got = out.outputs[0]
        assert got.token_ids == expected["tokens"]
        diffs = [
            abs(lp.logprob - e) for lp, e in zip(got.logprobs, expected["logprobs"], strict=True)
        ]
        assert max(diffs) < 1e-4


def test_greedy_matches_transformers_through_the_fast_path(tiny: Path) -> None:
    ref = hf_greedy(tiny, PROMPTS, 24)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, logprobs=0)
    records: list[dict[str, Any]] = []
    with LLM(str(tiny), dtype="float32", max_num_seqs=8) as llm:
        model = inner_model(llm)
        with checked_against_eager(model, records):
            outs = llm.generate(PROMPTS, params)
            steps = len(records)
            alone = llm.generate(PROMPTS[1:2], params)  # its prefill fits the fast path
    assert_greedy_matches(outs, ref)
    assert alone[0].outputs[0].token_ids == ref[1]["tokens"]
    # Every step took the fast path: the 60-row batched prefill, the decode steps, and the lone
    # prompt's prefill and decode.
    assert steps == 24 and records[0]["rows"] == 60 and records[0]["seqs"] == 4
    assert len(records) == 24 + 24
    # 19 tokens: the first block (16) hits the prefix cache, 3 causal rows run over it.
    assert records[24]["rows"] == 3 and records[24]["seqs"] == 1
    for r in records:
        assert r["hidden"] < 1e-4 * max(1.0, r["scale"]), r
        assert r["kv"] < 1e-5, r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_speculative_steps_equal_eager_layers(tiny: Path, tmp_path: Path, dtype: str) -> None:
    """Eagle3 verification (K + 1 causal rows per sequence, captured layers) and the draft
    midlayer (every row's draft KV, the MLP on picked rows only)."""
    draft = build_eagle3_draft(tmp_path / "eagle3", tiny)
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    records: list[dict[str, Any]] = []
    drafts: list[dict[str, Any]] = []
    with LLM(str(tiny), dtype=dtype, max_num_seqs=4, speculative_config=spec) as llm:
        model = inner_model(llm)
        spec = llm.engine.executor.worker.runner.spec
        # Every draft step through the midlayer (the one-call chain: test_speculative).
        spec.fast_chain = False
        midlayer = spec.draft.midlayer
        with checked_against_eager(model, records), checked_against_eager(midlayer, drafts):
            llm.generate(PROMPTS[:3], params)
    verify = [r for r in records if r["rows"] == 4 * r["seqs"]]
    assert verify, records
    assert all(len(r["captured"]) == 3 for r in records)
    assert any(r["out_rows"] < r["rows"] for r in drafts), "no row-picked draft step"
    assert any(r["rows"] == r["seqs"] for r in drafts), "no later draft step"
    # bf16: the two paths round the same values but sum in different orders.
    tol = 1e-4 if dtype == "float32" else 0.03
    for r in records + drafts:
        assert r["hidden"] <= tol * max(1.0, r["scale"]), r
        assert all(c <= tol * max(1.0, r["scale"]) * 4 for c in r["captured"]), r
        assert r["kv"] <= tol * 4, r


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_tree_steps_equal_eager_layers(tiny: Path, tmp_path: Path, dtype: str) -> None:
    """Draft trees through the fast path: the target's tree verification (root + N nodes per
    sequence, tree attention words) and the draft's frontier passes (tree words over the
    frontier rows, the MLP on the rows expanded next) equal the eager layers."""
    draft = build_eagle3_draft(tmp_path / "eagle3", tiny)
    spec = eagle3_tree_spec(draft, 2, 6)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    records: list[dict[str, Any]] = []
    drafts: list[dict[str, Any]] = []
    with LLM(str(tiny), dtype=dtype, max_num_seqs=4, speculative_config=spec) as llm:
        midlayer = llm.engine.executor.worker.runner.spec.draft.midlayer
        with (
            checked_against_eager(inner_model(llm), records),
            checked_against_eager(midlayer, drafts),
        ):
            llm.generate(PROMPTS[:3], params)
    assert any(r["tree"] and r["rows"] == 7 * r["seqs"] for r in records), records
    frontier = [r for r in drafts if r["tree"]]
    # Depth x topk rows per sequence; row pick: the MLP on the topk rows expanded next.
    assert {r["rows"] // r["seqs"] for r in frontier} == {2, 4}
    assert all(r["out_rows"] == 2 * r["seqs"] for r in frontier)
    tol = 1e-4 if dtype == "float32" else 0.03
    for r in records + drafts:
        assert r["hidden"] <= tol * max(1.0, r["scale"]), r
        assert r["kv"] <= tol * 4, r


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_greedy_speculation_is_exact_with_the_fast_path(
    tiny: Path, tmp_path: Path, method: str
) -> None:
    """Greedy output with speculation equals the plain one; every bias-free linear the draft
    runs eagerly (Eagle3's fc, the MTP block's projections) reads a packed copy."""
    target = tiny
    if method == "eagle3":
        draft = build_eagle3_draft(tmp_path / "eagle3", tiny)
        spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 2}
    else:
        target = build_llama(tmp_path / "mtp", **TINY)
        add_mtp_layers(target)
        spec = {"method": "mtp", "num_speculative_tokens": 2}
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(target), dtype="float32", max_num_seqs=4) as llm:
        assert inner_model(llm).fast_path is not None
        plain = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    with LLM(str(target), dtype="float32", max_num_seqs=4, speculative_config=spec) as llm:
        assert inner_model(llm).fast_path is not None
        draft_module = llm.engine.executor.worker.runner.spec.draft
        linears = [m for m in draft_module.modules() if isinstance(m, LinearBase)]
        assert linears and all(m.fast_weight is not None for m in linears)
        specd = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]
    assert specd == plain


def test_large_steps_and_unsupported_models_use_the_eager_path(
    tiny: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    limit = cpu_decode.MAX_ROWS
    long_prompt = list(range(1, limit + 8))
    records: list[dict[str, Any]] = []
    with LLM(str(tiny), dtype="float32", max_num_seqs=4) as llm:
        model = inner_model(llm)
        with checked_against_eager(model, records):
            llm.generate([long_prompt], SamplingParams(temperature=0, max_tokens=3))
        assert all(r["rows"] <= limit for r in records)
        assert len(records) == 2  # the long prefill ran eager; both decode steps fast
        fast = model.fast_path
        assert fast is not None
        for n, accepted in [(limit, True), (limit + 1, False)]:
            meta = AttentionMetadata(
                slot_mapping=torch.arange(n),
                block_tables=torch.zeros(1, 4, dtype=torch.int32),
                seq_lens=torch.tensor([n], dtype=torch.int32),
                query_start_loc=torch.tensor([0, n], dtype=torch.int32),
                max_query_len=n,
                max_seq_len=n,
            )
            assert fast.accepts(torch.zeros(n, dtype=torch.long), meta) is accepted

    qwen3 = build_llama(tmp_path / "qwen3", arch="qwen3", head_dim=16)
    with LLM(str(qwen3), dtype="float32") as llm:
        model = inner_model(llm)
        assert model.fast_path is None
        assert CpuStackFastPath.unsupported(model) == "q/k norms or projection biases"

    # Heads wider than the attention's register chunks: eager, and it still generates.
    wide = build_llama(tmp_path / "wide", **{**TINY, "layers": 1}, head_dim=272)
    with LLM(str(wide), dtype="float32") as llm:
        model = inner_model(llm)
        assert model.fast_path is None
        assert CpuStackFastPath.unsupported(model) == "head_dim 272 over 256"
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
        assert len(out[0].outputs[0].token_ids) == 3

    monkeypatch.setenv(cpu_decode.ENV_VAR, "0")
    with LLM(str(tiny), dtype="float32") as llm:
        assert inner_model(llm).fast_path is None
        assert enable_cpu_fast_path(llm.engine.executor.worker.model) == "TANDEM_CPU_FAST_DECODE=0"


def test_eager_steps_share_the_fast_paths_packed_weights(tiny: Path) -> None:
    """Steps too large for the fast path run the eager layers, whose linears read the fast
    path's packed matrices (the same tensors: one packed copy in memory, no oneDNN copy, the
    dense weights freed); a prefill of more than MAX_ROWS rows through them still gives
    transformers' greedy output."""
    prompts = [list(range(1, cpu_decode.MAX_ROWS + 30)), [7, 8, 9]]
    ref = hf_greedy(tiny, prompts, 8)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    with LLM(str(tiny), dtype="float32", max_num_seqs=4) as llm:
        model = inner_model(llm)
        fast = model.fast_path
        assert isinstance(fast, CpuStackFastPath)
        per_layer = len(fast.weights) // len(model.layers)
        for i, layer in enumerate(model.layers):
            linears = (layer.self_attn.qkv_proj, layer.self_attn.o_proj)
            linears += (layer.mlp.gate_up_proj, layer.mlp.down_proj)
            for linear, j in zip(linears, (1, 2, 4, 5), strict=True):
                assert linear.fast_weight is fast.weights[i * per_layer + j]
                assert linear.packed_weight is None
                assert linear.weight.device.type == "meta"  # the dense copy is freed
        outs = llm.generate(prompts, params)
    assert_greedy_matches(outs, ref)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_long_contexts_attend_in_pieces_and_equal_eager(tmp_path: Path, dtype: str) -> None:
    """Rows with more than 512 keys attend in pieces merged flash-decoding style: decode steps
    of a 1099-token prompt (3 pieces) next to a short one (1 piece) equal the eager layers, and
    in fp32 the greedy output equals transformers'."""
    folder = build_llama(tmp_path / "long", **TINY, max_position_embeddings=1200)
    prompts = [[(7 * i) % 290 + 5 for i in range(1099)], [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=0)
    records: list[dict[str, Any]] = []
    with LLM(str(folder), dtype=dtype, max_num_seqs=4, max_model_len=1200) as llm:
        with checked_against_eager(inner_model(llm), records):
            outs = llm.generate(prompts, params)
    assert len(records) == 5 and all(r["rows"] == 2 for r in records)  # the decode steps
    tol = 1e-4 if dtype == "float32" else 0.03
    for r in records:
        assert r["hidden"] <= tol * max(1.0, r["scale"]), r
        assert r["kv"] <= tol * 4, r
    if dtype == "float32":
        assert_greedy_matches(outs, hf_greedy(folder, prompts, 6))


def test_bad_rows_are_refused_not_read_out_of_bounds(tiny: Path) -> None:
    with LLM(str(tiny), dtype="float32") as llm:
        fast = inner_model(llm).fast_path
        assert fast is not None
        h = fast.weights[0].shape[0]
        caches = [c for a in fast.attention for c in (a.k_cache, a.v_cache)]
        rows = cpu_decode.StepRows(
            positions=torch.tensor([0]),
            slots=torch.tensor([0]),
            row_seq=torch.tensor([0]),
            kv_len=torch.tensor([1]),
            block_tables=torch.zeros(1, 1, dtype=torch.int32),
        )
        args = dict(
            x=torch.zeros(1, h),
            rows=rows,
            weights=fast.weights,
            caches=caches,
            final_norm=fast.weights[0],
            cos_sin=fast.rope.cos_sin,
            shape=(*fast.shape, caches[0].shape[1], fast.intermediate),
            eps=fast.eps,
            scale=fast.scale,
            capture=[],
        )
        out = cpu_decode.llama_stack(**args)  # type: ignore[arg-type]
        assert out[0].shape == (1, h)
        for key, value in [
            ("positions", torch.tensor([10**7])),
            ("slots", torch.tensor([-1])),
            ("kv_len", torch.tensor([10**6])),
            ("row_seq", torch.tensor([3])),
            ("block_tables", torch.full((1, 1), 10**6, dtype=torch.int32)),
        ]:
            bad = dataclasses.replace(rows, **{key: value})
            with pytest.raises(RuntimeError, match="out of range"):
                cpu_decode.llama_stack(**{**args, "rows": bad})  # type: ignore[arg-type]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_linear_matches_f_linear_and_is_batch_invariant(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(0)
    # Odd K and O not a multiple of 16 or 64: the packed padding; 7 rows: a 6-row tile + 1.
    shapes = [(1, 576, 96), (3, 72, 45), (5, 99, 33), (7, 40, 130), (cpu_decode.MAX_ROWS, 41, 17)]
    for rows, i, o in shapes:
        x = torch.randn(rows, i, generator=g).to(dtype)
        w = torch.randn(o, i, generator=g).to(dtype)
        packed = cpu_decode.pack(w)
        got = cpu_decode.linear(x, packed, o)
        ref = torch.nn.functional.linear(x.float(), w.float())
        assert got.dtype == dtype and got.shape == (rows, o)
        # fp32 sums in another order; bf16 also rounds the output (8 bits of mantissa).
        tol = 1e-4 if dtype == torch.float32 else 2**-7
        assert ((got.float() - ref).abs() <= tol * ref.abs().clamp(min=1.0) * 2).all()
        for r in range(rows):  # one row alone gives bit-identical results
            assert torch.equal(cpu_decode.linear(x[r : r + 1], packed, o)[0], got[r])
    packed = cpu_decode.pack(torch.zeros(4, 9, dtype=dtype))
    for x, o in [(torch.zeros(2, 8, dtype=dtype), 4), (torch.zeros(2, 9, dtype=dtype), 40)]:
        with pytest.raises(RuntimeError, match="does not match its shape"):
            cpu_decode.linear(x, packed, o)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_argmax_equals_torchs_on_ties_infinities_and_nans(dtype: torch.dtype) -> None:
    """The extension's argmax (greedy sampling and drafting) returns torch.argmax's index:
    the first of tied maxima, the first NaN of a row with NaNs, rows of -inf or +inf; widths
    with tails after the 16-lane and 256-value blocks; strided and 3-D inputs."""
    assert cpu_decode.load_extension() is not None
    g = torch.Generator().manual_seed(0)
    for rows, width in [(1, 1), (3, 7), (16, 49152), (4, 12288), (5, 300), (2, 257), (6, 1000)]:
        for case in range(12):
            x = torch.randn(rows, width, generator=g)
            if case % 4 == 1:  # many ties
                x = (x * 2).round()
            elif case % 4 == 2:
                x[0, torch.randint(width, (2,), generator=g)] = float("nan")
            elif case % 4 == 3:
                x[-1, torch.randint(width, (2,), generator=g)] = float("inf")
                x[0] = -float("inf")
            if case == 4:
                x = torch.full((rows, width), -3.0)
            x = x.to(dtype)
            got = cpu_decode.argmax(x)
            assert got.dtype == torch.int64
            assert torch.equal(got, x.argmax(-1)), (rows, width, case)
    x = torch.randn(3, 4, 301, generator=g).to(dtype)
    assert torch.equal(cpu_decode.argmax(x), x.argmax(-1))
    assert torch.equal(cpu_decode.argmax(x[:, 1, :250]), x[:, 1, :250].argmax(-1))
    assert torch.equal(cpu_decode.argmax(x[:, :, ::2]), x[:, :, ::2].argmax(-1))


def test_the_build_targets_the_best_instruction_set_the_cpu_has(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """AVX-512 with BF16 where present, else AVX-512 (F, BW), else AVX2 + FMA, else no fast path
    (with a reason naming each); the extension reports what it was built for."""
    cases = [
        ({"avx2", "fma", "avx512f", "avx512bw", "avx512_bf16"}, "avx512_bf16"),
        ({"avx2", "fma", "avx512f", "avx512bw"}, "avx512"),  # without BF16's dot product
        ({"avx2", "fma", "avx512f"}, "avx2"),  # no AVX-512 BW
        ({"avx2", "fma"}, "avx2"),
        ({"avx2"}, None),
        (set(), None),
    ]
    for flags, want in cases:
        with monkeypatch.context() as m:
            m.setattr(cpu_decode, "cpu_flags", lambda flags=flags: flags)
            m.delenv(cpu_decode.ISA_ENV_VAR, raising=False)  # the best branch, not a chosen one
            assert cpu_decode.isa() == want
            reason = cpu_decode.unavailable_reason()
            if want is None:
                assert reason is not None and all(name in reason for name in cpu_decode.ISA_FLAGS)
            else:
                assert reason is None
    ext = cpu_decode.load_extension()
    assert ext is not None and ext.isa() == cpu_decode.isa()


def test_a_build_killed_midway_does_not_stop_later_loads() -> None:
    """torch's build lock file outlives a build that was killed (Ctrl-C at the first start); the
    next load, in a new process, clears it rather than waiting on it forever. In the shared build
    folder, under the loads' own lock while the stale file is made (a load inside torch's build
    step then would wait on it for ever), so other processes under pytest-xdist are safe: the
    first load after it clears it (a copy of the folder would rebuild, some 18 s)."""
    if cpu_decode.load_extension() is None:
        pytest.skip(f"no fast path here: {cpu_decode.unavailable_reason()}")
    branch = cpu_decode.isa()
    assert branch is not None
    folder = cpu_decode.build_directory(cpu_decode.extension_name(branch))
    lock = folder / "lock"
    load = "from tandem.kernels import cpu_decode; assert cpu_decode.load_extension()"
    with open(folder.with_suffix(".flock"), "a") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        lock.touch()  # what the killed build left
        proc = subprocess.Popen(
            [sys.executable, "-c", load], stderr=subprocess.PIPE, text=True
        )  # waits for the lock this test holds, then finds the stale file
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err[-2000:]
    assert not lock.exists()


def test_another_install_loads_the_cached_build(tmp_path: Path) -> None:
    """A second copy of the same source on the same torch (another checkout, a reinstall at
    another path) finds the build in the shared cache and loads it: the build names a copy of the
    source inside its folder, not the first copy's path (torch rebuilt whenever that path
    changed, so each copy rebuilt the other's extension at its start)."""
    if cpu_decode.load_extension() is None:
        pytest.skip(f"no fast path here: {cpu_decode.unavailable_reason()}")
    branch = cpu_decode.isa()
    assert branch is not None
    library = next(cpu_decode.build_directory(cpu_decode.extension_name(branch)).glob("*.so"))
    built = library.stat().st_mtime_ns
    other = tmp_path / "other" / "tandem"  # the package's kernels at another path
    other.mkdir(parents=True)
    root = Path(cpu_decode.__file__).resolve().parents[1]
    shutil.copy(root / "__init__.py", other)
    shutil.copy(root / "version.py", other)
    shutil.copytree(root / "kernels", other / "kernels")
    load = "from tandem.kernels import cpu_decode; assert cpu_decode.load_extension(); print(cpu_decode.__file__)"
    env = {**os.environ, "PYTHONPATH": str(other.parent)}  # the same cache folder
    proc = subprocess.run(
        [sys.executable, "-c", load], capture_output=True, text=True, timeout=120, env=env,
        cwd=tmp_path,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip() == str(other / "kernels" / "cpu_decode.py")
    assert library.stat().st_mtime_ns == built  # loaded, not rebuilt


def test_an_install_of_torch_elsewhere_builds_its_own(monkeypatch: pytest.MonkeyPatch) -> None:
    """torch installed at another path (the wheel's venv, the image's) names another build: its
    build commands name that torch's headers and libraries, and sharing one folder made each
    install rebuild the other's at every start."""
    branch = cpu_decode.isa() or "avx2"
    here = cpu_decode.extension_name(branch)
    monkeypatch.setattr(torch, "__file__", "/elsewhere/site-packages/torch/__init__.py")
    assert cpu_decode.extension_name(branch) != here
    monkeypatch.undo()
    assert cpu_decode.extension_name(branch) == here


def test_a_branch_the_cpu_cannot_run_is_refused_with_a_reason(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(cpu_decode, "cpu_flags", lambda: {"avx2", "fma"})
    monkeypatch.setenv(cpu_decode.ISA_ENV_VAR, "avx2")
    assert cpu_decode.isa() == "avx2" and cpu_decode.unavailable_reason() is None
    for bad in ("avx512", "sse4"):
        monkeypatch.setenv(cpu_decode.ISA_ENV_VAR, bad)
        assert cpu_decode.isa() is None
        reason = cpu_decode.unavailable_reason()
        assert reason is not None and bad in reason and "it can run: avx2" in reason


# What each lower branch runs again, in a process that builds it: every kernel against its
# eager reference (linear, block products, argmax, exp, the decoder stack and Eagle3 layer steps, long
# contexts) and that the extension reports the branch it was built for.
BRANCH_CHECKS = (
    "build_targets or linear_matches or argmax or vector_exp "
    "or speculative_steps_equal_eager or long_contexts or block_products or block_packing"
)


@pytest.mark.slow
@pytest.mark.parametrize("branch", list(cpu_decode.ISA_FLAGS))
def test_every_branch_this_cpu_can_run_equals_eager(branch: str) -> None:
    """This process runs the best branch the CPU has; an AVX-512 machine can also run the AVX2
    build (and one with BF16's dot product the plain AVX-512 build): build each and run the
    fast path's checks on it (some 15 s to build each)."""
    if os.environ.get(cpu_decode.ISA_ENV_VAR):
        pytest.skip(f"this process runs {cpu_decode.ISA_ENV_VAR}={cpu_decode.isa()}")
    if branch not in cpu_decode.runnable_isas():
        pytest.skip(f"this CPU cannot run {branch}")
    if branch == cpu_decode.isa():
        pytest.skip(f"{branch} is this process's branch: the tests above ran it")
    # The AVX2 build also without VNNI (a Zen 3 EPYC has none): the block products' fallback.
    no_vnni = "1" if branch == "avx2" else "0"
    quant = str(Path(__file__).with_name("test_cpu_quant.py"))
    proc = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-k", BRANCH_CHECKS,
         __file__, quant],
        env={**os.environ, cpu_decode.ISA_ENV_VAR: branch, cpu_decode.NO_VNNI_ENV_VAR: no_vnni},
        cwd=Path(__file__).resolve().parents[1],
        capture_output=True,
        text=True,
        timeout=900,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    passed = re.search(r"(\d+) passed", proc.stdout)
    assert passed and int(passed.group(1)) == 15, proc.stdout[-2000:]


# A -march for each branch of cpu_decode.cpp (the one this machine builds runs in the tests).
MARCH = {"avx512_bf16": "sapphirerapids", "avx512": "icelake-server", "avx2": "haswell"}


@pytest.mark.skipif(shutil.which("g++") is None, reason="no C++ compiler")
def test_every_instruction_set_branch_compiles() -> None:
    """The branches this CPU does not build still compile (g++ -fsyntax-only instantiates the
    templates), and each -march picks the branch it is meant for (a static_assert on ISA). The
    branches it can run are built whole and checked by the test above."""
    from torch.utils.cpp_extension import include_paths

    built = set() if os.environ.get(cpu_decode.ISA_ENV_VAR) else set(cpu_decode.runnable_isas())
    if set(MARCH) <= built:
        pytest.skip(
            "this CPU builds every branch (test_every_branch_this_cpu_can_run_equals_eager)"
        )

    includes = [f"-I{d}" for d in [*include_paths(), sysconfig.get_paths()["include"]]]
    jobs = {
        name: subprocess.Popen(
            [
                "g++",
                "-std=c++20",
                "-fsyntax-only",
                "-fopenmp",
                f"-march={march}",
                "-DTORCH_EXTENSION_NAME=check",
                f'-DTANDEM_EXPECT_ISA="{name}"',
                *includes,
                str(cpu_decode.SOURCE),
            ],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for name, march in MARCH.items()
        if name != cpu_decode.isa() and name not in built
    }
    assert set(MARCH) == set(cpu_decode.ISA_FLAGS)
    for name, job in jobs.items():
        out, _ = job.communicate(timeout=300)
        assert job.returncode == 0, f"{name} (-march={MARCH[name]}):\n{out[-3000:]}"


def test_vector_exp_is_within_one_ulp_and_saturates() -> None:
    """The kernels' exp (softmax, SiLU) on this machine's vector path: within 1 ulp of the
    float64 value over fp32's range (every 2^-10 step of [-87, 88], odd lengths for the tails),
    inf above it (and for inf), 0 or a denormal below it, NaN for NaN."""
    ext = cpu_decode.load_extension()
    assert ext is not None
    x = torch.arange(-87 * 1024, 88 * 1024 + 7, dtype=torch.float64) / 1024
    got = ext.exp_lanes(x.float())
    exact = torch.exp(x.float().double())
    ulp = (exact.float().nextafter(torch.tensor(float("inf"))) - exact.float()).double()
    assert ((got.double() - exact).abs() / ulp).max().item() <= 1.0
    inf = float("inf")
    edges = torch.tensor([89.0, 100.0, 1e30, inf, -104.0, -200.0, -1e30, -inf, float("nan")])
    out = ext.exp_lanes(edges)
    assert torch.isinf(out[:4]).all() and (out[:4] > 0).all(), out
    assert (out[4:8] >= 0).all() and (out[4:8] < 1e-44).all(), out
    assert torch.isnan(out[8]), out
