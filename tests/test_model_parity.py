"""Greedy generation and log-probabilities equal transformers' own, across the Llama family."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints import build_llama, hf_greedy
from tandem import LLM, SamplingParams
from tandem.kernels import cpu_decode

PROMPTS = [[5, 6, 7], [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50], [100], list(range(60, 97))]
NEW_TOKENS = 32

CASES = {
    "llama-gqa-untied": dict(arch="llama", heads=4, kv_heads=2),
    "llama-mqa-tied": dict(arch="llama", heads=4, kv_heads=1, tie=True),
    "llama3-rope-scaling": dict(
        arch="llama",
        rope={
            "rope_type": "llama3",
            "rope_theta": 500000.0,
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ),
    "qwen2-bias": dict(arch="qwen2", heads=4, kv_heads=2),
    "qwen3-qknorm-head-dim": dict(arch="qwen3", heads=4, kv_heads=2, head_dim=24),
    "llama-sharded": dict(arch="llama", max_shard_size="60KB"),
    "llama-bf16-on-disk": dict(arch="llama", dtype=torch.bfloat16),
}


# oneDNN's bf16 kernels (AVX-512 BW and up): the packed-weight tests check packing where the CPU
# has them and the plain fallback where it does not; neither case skips.
ONEDNN_BF16 = bool(
    torch.backends.mkldnn.is_available() and torch.ops.mkldnn._is_mkldnn_bf16_supported()
)


@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_matches_transformers(name: str, tmp_path: Path) -> None:
    folder = build_llama(tmp_path / name, **CASES[name])
    if name == "llama-sharded":
        assert (folder / "model.safetensors.index.json").is_file()
        assert len(list(folder.glob("*.safetensors"))) > 1
    ref = hf_greedy(folder, PROMPTS, NEW_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(folder), dtype="float32", max_num_seqs=8) as llm:
        outs = llm.generate(PROMPTS, params)
    for out, expected in zip(outs, ref, strict=True):
        got = out.outputs[0]
        assert got.token_ids == expected["tokens"]
        assert got.finish_reason == "length"
        diffs = [
            abs(lp.logprob - e) for lp, e in zip(got.logprobs, expected["logprobs"], strict=True)
        ]
        assert max(diffs) < 1e-4


def test_dtype_auto_follows_checkpoint(tmp_path: Path) -> None:
    folder = build_llama(tmp_path / "bf16", dtype=torch.bfloat16)
    with LLM(str(folder), dtype="auto") as llm:
        model = llm.engine.executor.worker.model
        assert model.lm_head.weight.dtype == torch.bfloat16
        out = llm.generate(
            [[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
        )
        assert len(out[0].outputs[0].token_ids) == 4


def test_packed_bf16_linears_match_plain_ones(tmp_path: Path) -> None:
    # On CPU the engine packs bf16 linear weights for oneDNN; logits stay those of F.linear.
    from tandem.models.cpu_linears import pack_cpu_linears
    from tandem.models.layers import LinearBase
    from tandem.models.loader import load_model

    folder = build_llama(tmp_path / "m", dtype=torch.bfloat16, tie=True)
    model = load_model(str(folder), torch.bfloat16, torch.device("cpu"))
    hidden = torch.randn(5, model.config.hidden_size).to(torch.bfloat16)
    linear = model.model.layers[0].mlp.gate_up_proj
    plain = linear(hidden), model.compute_logits(hidden)
    packed_count = pack_cpu_linears(model)
    assert isinstance(linear, LinearBase)
    if not ONEDNN_BF16:  # e.g. AVX2 only: nothing is packed and the plain product serves
        assert packed_count == 0 and linear.packed_weight is None
    else:  # a CPU that has it must get it (a failed probe here is a bug, not a skip)
        assert packed_count > 0 and linear.packed_weight is not None
    packed = linear(hidden), model.compute_logits(hidden)
    for a, b in zip(plain, packed, strict=True):
        torch.testing.assert_close(a.float(), b.float(), rtol=1e-2, atol=1e-2)


def test_packed_bf16_engine_keeps_greedy_tokens(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    folder = build_llama(tmp_path / "bf16", dtype=torch.bfloat16)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    # oneDNN's copy serves what the CPU fast path's packed weights do not: turn the fast path off.
    monkeypatch.setenv(cpu_decode.ENV_VAR, "0")

    def run() -> tuple[bool, list[list[int]]]:
        with LLM(str(folder), dtype="bfloat16", max_num_seqs=4) as llm:
            model = llm.engine.executor.worker.model
            packed = model.model.layers[0].self_attn.qkv_proj.packed_weight is not None
            return packed, [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params)]

    packed, tokens = run()
    assert packed == ONEDNN_BF16  # without oneDNN bf16 this compares the same plain path twice
    monkeypatch.setattr("tandem.engine.worker.pack_cpu_linears", lambda model: 0)
    assert run() == (False, tokens)
