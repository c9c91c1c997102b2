"""An FP8 KV cache (``--kv-cache-dtype fp8``, issue #50 item 3) on the CPU's PyTorch attention
path: e4m3 values with a per-layer scale (the checkpoint's ``k_scale`` / ``v_scale``, else 1.0).
Greedy tokens follow a bf16 KV cache's at >= 95 % of positions (teacher-forced: each position
from the bf16 run's own prefix; the logprob MAE printed), the same budget holds twice the
tokens, speculation stays exact against FP8 KV without it, DeepSeek's latent cache and
gpt-oss's sinks and windows read it too, and the checkpoint's scales are used."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import add_mtp_layers, build_deepseek_v3, build_gpt_oss, build_llama
from tandem import LLM, SamplingParams
from tandem.engine.config import EngineArgs, fp8_kv_unavailable
from tandem.kernels.fp8 import FP8_MIN_CAPABILITY
from tandem.kernels.paged_attention import FP8_KV_DTYPE

PROMPTS = [
    [5, 17, 99, 3, 42, 8],
    [200, 11, 7, 150, 64, 64, 9, 12],
    [33, 34, 35, 36],
    [250, 1, 120, 77, 91],
]
STEPS = 24
NEAR_TIE = 0.05  # nats between the bf16 run's top two tokens
GREEDY = SamplingParams(temperature=0, max_tokens=STEPS, ignore_eos=True, detokenize=False)


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("fp8kv") / "llama", layers=2, seed=3)


def _caches(llm: LLM) -> list[torch.Tensor]:
    return [c for caches in llm.engine.executor.worker.runner.kv_caches for c in caches]


def _greedy(model: Path, **kw: object) -> list[list[int]]:
    with LLM(str(model), max_model_len=128, **kw) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
        if kw.get("kv_cache_dtype", "auto") != "auto":
            assert {c.dtype for c in _caches(llm)} == {FP8_KV_DTYPE}
    return [o.outputs[0].token_ids for o in outs]


def test_fp8_kv_follows_bf16_kv_at_95_percent_of_positions(llama: Path) -> None:
    """Teacher-forced: each position continues the bf16-KV run's own prefix. A random tiny
    model has many near-ties (a fifth of its positions have top-2 logprobs within 0.05 nats;
    bf16's own resolution there is 0.008), where any rounding picks either token (bf16 against
    fp32 KV flips some too); past them the tokens must agree."""
    _check_follows_bf16_kv(llama)


def _check_follows_bf16_kv(llama: Path, **kw: Any) -> None:
    params = SamplingParams(
        temperature=0, max_tokens=STEPS, ignore_eos=True, detokenize=False, logprobs=2
    )
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=0, detokenize=False)
    with LLM(str(llama), dtype="bfloat16", max_model_len=128, **kw) as llm:
        ref = llm.generate(PROMPTS, params)
    prefixes, expected = [], []
    for prompt, out in zip(PROMPTS, ref, strict=True):
        tokens, logprobs = out.outputs[0].token_ids, out.outputs[0].logprobs
        for j, token in enumerate(tokens):
            prefixes.append(prompt + tokens[:j])
            top = logprobs[j].top_logprobs
            expected.append((token, logprobs[j].logprob, top[0] - top[1]))
    with LLM(str(llama), dtype="bfloat16", max_model_len=128, kv_cache_dtype="fp8", **kw) as llm:
        assert {c.dtype for c in _caches(llm)} == {FP8_KV_DTYPE}
        got = llm.generate(prefixes, one)
    same = [o.outputs[0].token_ids[0] == t for o, (t, _, _) in zip(got, expected, strict=True)]
    errors = [
        abs(o.outputs[0].logprobs[0].logprob - lp)
        for o, (_, lp, _), s in zip(got, expected, same, strict=True)
        if s
    ]
    clear = [s for s, (_, _, margin) in zip(same, expected, strict=True) if margin > NEAR_TIE]
    mae = sum(errors) / len(errors)
    print(
        f"\nfp8 KV vs bf16 KV: {sum(same)}/{len(same)} positions equal ({sum(clear)}/{len(clear)} "
        f"past near-ties of {NEAR_TIE} nats), logprob MAE {mae:.4f}"
    )
    assert len(clear) >= 0.7 * len(same)
    assert sum(clear) >= 0.95 * len(clear)
    assert sum(same) >= 0.85 * len(same)
    assert mae > 0  # the FP8 cache was read (its rounding shows)


def test_the_same_budget_holds_twice_the_tokens(llama: Path) -> None:
    budget = {"dtype": "bfloat16", "kv_cache_memory_bytes": 1 << 20, "max_model_len": 128}
    blocks = {}
    for kv in ("auto", "fp8"):
        config = EngineArgs(model=str(llama), kv_cache_dtype=kv, **budget)
        with LLM(str(llama), kv_cache_dtype=kv, **budget) as llm:
            blocks[kv] = llm.engine.executor.num_blocks
            assert config.create_engine_config().cache_config.fp8_kv == (kv == "fp8")
    assert blocks["fp8"] in (2 * blocks["auto"], 2 * blocks["auto"] + 1), blocks


def test_speculation_is_exact_against_fp8_kv_without_it(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "mtp", layers=2, seed=4)
    add_mtp_layers(model, 1, perfect=True)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    plain = _greedy(model, dtype="float32", kv_cache_dtype="fp8")
    speculated = _greedy(model, dtype="float32", kv_cache_dtype="fp8", speculative_config=spec)
    assert speculated == plain


@pytest.mark.parametrize("family", ["deepseek_v3", "gpt_oss"])
def test_latent_and_windowed_caches_read_fp8_too(tmp_path: Path, family: str) -> None:
    """DeepSeek's latent rows (one scale for key and value) and gpt-oss's sinks and sliding
    windows (their own pool) in FP8: the outputs follow their bf16-KV runs' first tokens."""
    build = build_deepseek_v3 if family == "deepseek_v3" else build_gpt_oss
    model = build(tmp_path / family)
    ref = _greedy(model, dtype="bfloat16")
    got = _greedy(model, dtype="bfloat16", kv_cache_dtype="fp8")
    same = sum(
        a == b for r, g in zip(ref, got, strict=True) for a, b in zip(r[:4], g[:4], strict=True)
    )
    assert same >= 0.9 * 4 * len(PROMPTS), (ref, got)


def test_the_checkpoints_kv_scales_are_used(llama: Path, tmp_path: Path) -> None:
    """``model.layers.N.self_attn.k_scale`` / ``v_scale`` set layer N's scales: an FP8 cache
    then holds K / k_scale (the output with scales that fit the values equals the output
    without; absurd scales change it), and a bf16 cache ignores them."""
    import shutil

    scaled = tmp_path / "scaled"
    shutil.copytree(llama, scaled)
    weights = next(scaled.glob("*.safetensors"))
    tensors = load_file(weights)
    layers = json.loads((scaled / "config.json").read_text())["num_hidden_layers"]

    def with_scales(value: float) -> None:
        extra = {
            f"model.layers.{i}.self_attn.{kv}_scale": torch.tensor(value)
            for i in range(layers)
            for kv in "kv"
        }
        save_file({**tensors, **extra}, str(weights), metadata={"format": "pt"})

    with_scales(0.5)  # a power of two: K / 0.5 rounds as K does, so the output is the same
    with LLM(str(scaled), dtype="float32", max_model_len=128, kv_cache_dtype="fp8") as llm:
        attn = llm.engine.executor.worker.model.model.layers[1].self_attn.attn
        assert (attn.k_scale, attn.v_scale) == (0.5, 0.5)
        halved = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY)]
    base = _greedy(llama, dtype="float32", kv_cache_dtype="fp8")
    assert halved == base
    assert _greedy(scaled, dtype="float32") == _greedy(llama, dtype="float32")  # ignored
    with_scales(1e-6)  # every stored value saturates at +-448 x 1e-6
    assert _greedy(scaled, dtype="float32", kv_cache_dtype="fp8") != base


def test_refused_where_it_does_not_run(llama: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """e5m2 is not served; a GPU older than sm_89 (no e4m3 in Triton) is refused naming its
    compute capability; newer GPUs and CPUs serve it."""
    with pytest.raises(ValueError, match="kv_cache_dtype"):
        EngineArgs(model=str(llama), kv_cache_dtype="fp8_e5m2").create_engine_config()
    cuda = torch.device("cuda")
    for capability, allowed in (((8, 0), False), ((8, 6), False), ((8, 9), True), ((10, 0), True)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None, c=capability: c)
        why = fp8_kv_unavailable(cuda)
        assert (why is None) == allowed, (capability, why)
        if why is not None:
            assert f"sm_{capability[0]}{capability[1]}" in why and "sm_89" in why
    assert fp8_kv_unavailable(torch.device("cpu")) is None


def needs_fp8_gpu(test: Any) -> Any:
    """A gpu test that needs e4m3 in Triton (sm_89 or newer)."""
    older = torch.cuda.is_available() and torch.cuda.get_device_capability() < FP8_MIN_CAPABILITY
    reason = "needs a CUDA device" if not torch.cuda.is_available() else "needs sm_89 or newer"
    return pytest.mark.gpu(
        pytest.mark.skipif(not torch.cuda.is_available() or older, reason=reason)(test)
    )


@needs_fp8_gpu
@pytest.mark.parametrize("graphs", [True, False], ids=["graphs", "eager"])
def test_cuda_fp8_kv_follows_bf16_kv(llama: Path, graphs: bool) -> None:
    """The same contract on a GPU: the compiled Triton kernels write and read e4m3, under CUDA
    graphs and eagerly."""
    _check_follows_bf16_kv(llama, device="cuda", enforce_eager=not graphs)


@needs_fp8_gpu
def test_cuda_speculation_is_exact_against_fp8_kv_without_it(tmp_path: Path) -> None:
    model = build_llama(tmp_path / "mtp", layers=2, seed=4)
    add_mtp_layers(model, 1, perfect=True)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    cuda = {"device": "cuda", "dtype": "float32", "kv_cache_dtype": "fp8"}
    plain = _greedy(model, **cuda)
    assert _greedy(model, **cuda, speculative_config=spec) == plain
    assert _greedy(model, **cuda, enforce_eager=True) == plain  # graphs replay what eager runs


def test_served_with_the_flag_as_vllm_spells_it(llama: Path) -> None:
    """`--kv-cache-dtype fp8` on the command line (vLLM's flag): the server answers and says
    what it holds; a value it does not serve stops it with the values it does."""
    import openai

    from server_utils import RemoteServer

    with RemoteServer(llama, ["--kv-cache-dtype", "fp8", "--dtype", "bfloat16"]) as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
        out = client.completions.create(model=str(llama), prompt="hello", max_tokens=4)
        assert out.usage.completion_tokens == 4
        log = server.log_tail(100_000)
        assert "KV cache in FP8 (e4m3) with scale 1.0" in log
        assert "CPU decode fast path off: --kv-cache-dtype fp8" in log
    server = RemoteServer(llama, ["--kv-cache-dtype", "fp8_e5m2"])
    try:
        assert server.proc.wait(timeout=60) != 0
        assert "auto, fp8, fp8_e4m3" in server.log_tail()
    finally:
        server.stop()
