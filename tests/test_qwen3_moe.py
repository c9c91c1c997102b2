"""Qwen3-MoE (``Qwen3MoeForCausalLM``, issue #48 item 1): greedy tokens and log-probs equal
transformers' on tiny checkpoints whose config.json spells and sets what the released ones do
(``num_experts``, ``norm_topk_prob: true``, head_dim 2x hidden / heads, GQA, rope_theta 1e6,
40960 positions, a bfloat16 ``torch_dtype``); the routing equals transformers' router; an FP8
block-quantized copy computes like its dequantized twin; TP = 2 and attention DP = 2 with
LM-head TP, speculating with an Eagle3 head, equal one rank (tokens, log-probs and accepted
drafts per position), and greedy Eagle3 speculation equals plain decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import (
    assert_matches_hf,
    build_qwen3_moe,
    hf_greedy,
    make_echo_target,
    perfect_eagle3_draft,
)
from tandem import LLM, SamplingParams

PROMPTS = [[5, 6, 7], list(range(40, 52)), [100], list(range(60, 97))]
NEW_TOKENS = 24
CASES: dict[str, dict[str, Any]] = {
    # Qwen3-30B-A3B's rule (every layer sparse) but for one dense layer, renormalized top-k.
    "sparse": {"mlp_only_layers": [1]},
    # Every second layer sparse, top-k weights as the softmax gives them.
    "every-second": {"decoder_sparse_step": 2, "norm_topk_prob": False, "top_k": 3},
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("qwen3moe")
    out = {"sparse": build_qwen3_moe(root / "sparse", **CASES["sparse"])}
    out["every-second"] = build_qwen3_moe(root / "every-second", seed=1, **CASES["every-second"])
    # Speculation that accepts and rejects: a near-echo target (its layers' writes, experts'
    # included, scaled by 0.3) and a near-perfect Eagle3 head for it.
    echo = build_qwen3_moe(root / "echo", seed=2, **CASES["sparse"])
    make_echo_target(echo, residual_scale=0.3)
    out["echo"] = echo
    out["eagle3"] = perfect_eagle3_draft(root / "eagle3", echo, residual_scale=0.3)
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_matches_transformers(ckpts: dict[str, Path], name: str) -> None:
    folder = ckpts[name]
    ref = hf_greedy(folder, PROMPTS, NEW_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(folder), dtype="float32", max_model_len=512) as llm:
        model = llm.engine.executor.worker.model
        outs = llm.generate(PROMPTS, params)
    assert type(model).__name__ == "Qwen3MoeForCausalLM"
    want = {
        "sparse": ["Qwen3MoeSparseMoe", "LlamaMLP", "Qwen3MoeSparseMoe"],
        "every-second": ["LlamaMLP", "Qwen3MoeSparseMoe", "LlamaMLP"],
    }[name]
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == want
    assert_matches_hf(outs, ref)


@pytest.mark.parametrize("norm", [True, False])
def test_routing_equals_transformers_router(norm: bool) -> None:
    import transformers as tf
    from transformers.models.qwen3_moe import modeling_qwen3_moe as hf

    from tandem.kernels.moe import softmax_topk

    cfg = tf.Qwen3MoeConfig(hidden_size=16, num_experts=16, num_experts_per_tok=4)
    cfg.norm_topk_prob = norm
    router = hf.Qwen3MoeTopKRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 16, generator=gen))
        x = torch.randn(50, 16, generator=gen)
        _, ref_w, ref_ids = router(x)
    weights, ids = softmax_topk(x @ router.weight.detach().T, 4, norm)
    assert torch.equal(ids, ref_ids)
    torch.testing.assert_close(weights, ref_w)
    if norm:
        torch.testing.assert_close(weights.sum(-1), torch.ones(50))
    with pytest.raises(ValueError, match="num_experts_per_tok=17"):
        softmax_topk(x, 17, norm)


@pytest.mark.timeout(180)
def test_fp8_block_checkpoint_computes_like_its_dequantized_twin(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """The FP8 release format (``weight_block_size`` [128, 128] scaled down to the tiny shapes;
    the router and norms unquantized): every expert, dense and attention weight read through
    the FP8 loader gives the twin's tokens and log-probs."""
    from test_fp8 import dequantized_twin, quantize_checkpoint

    fp8 = quantize_checkpoint(ckpts["sparse"], tmp_path / "fp8", [16, 16])
    twin = dequantized_twin(fp8, tmp_path / "twin")
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=0)
    runs = []
    for folder in (fp8, twin):
        with LLM(str(folder), dtype="float32", max_model_len=512) as llm:
            outs = llm.generate(PROMPTS, params)
        runs.append(
            [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]
        )
    for (t1, l1), (t2, l2) in zip(*runs, strict=True):
        assert t1 == t2
        assert max(abs(a - b) for a, b in zip(l1, l2, strict=True)) < 1e-5


SPEC_PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=0)


def _run(folder: Path, **kw: Any) -> tuple[list[list[int]], list[list[float]], list[Any]]:
    with LLM(str(folder), dtype="float32", max_model_len=512, **kw) as llm:
        outs = llm.generate(PROMPTS, SPEC_PARAMS)
        assert llm.engine.get_stats().num_used_kv_blocks == 0
    return (
        [o.outputs[0].token_ids for o in outs],
        [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs],
        [o.spec_stats.accepted_per_pos if o.spec_stats else None for o in outs],
    )


def _max_diff(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.fixture(scope="module")
def one_rank(ckpts: dict[str, Path]) -> tuple[Any, dict[str, Any]]:
    """One rank speculating with the Eagle3 head (greedy: plain decoding's tokens; drafts
    accepted and rejected)."""
    spec = {"method": "eagle3", "model": str(ckpts["eagle3"]), "num_speculative_tokens": 3}
    plain = _run(ckpts["echo"])
    ref = _run(ckpts["echo"], speculative_config=spec)
    assert ref[0] == plain[0]
    assert _max_diff(ref[1], plain[1]) < 1e-4
    # Drafts accepted at every position of some request, and rejected too.
    assert all(any(per_pos[j] for per_pos in ref[2]) for j in range(3)), ref[2]
    assert sum(map(sum, ref[2])) < len(PROMPTS) * SPEC_PARAMS.max_tokens
    return ref, spec


@pytest.mark.timeout(300)
@pytest.mark.parametrize("adp", [False, True], ids=["tp2", "adp2-lm-head-tp-ep"])
def test_two_ranks_equal_one(
    ckpts: dict[str, Path], one_rank: tuple[Any, dict[str, Any]], adp: bool
) -> None:
    """TP = 2 (heads, KV heads and experts split: 4 of 8 per rank) or attention DP = 2 with
    LM-head TP and expert parallelism (attention replicated, each rank's rows sent all-to-all
    to the rank holding their experts), with Eagle3 K = 3: the same tokens, log-probs and
    accepted drafts per position as one rank."""
    (tokens, logprobs, accepted), spec = one_rank
    extra: dict[str, Any] = {}
    if adp:
        extra = {
            "enable_attention_dp": True,
            "enable_lm_head_tp_in_adp": True,
            "enable_expert_parallel": True,
        }
    with LLM(
        str(ckpts["echo"]),
        dtype="float32",
        max_model_len=512,
        tensor_parallel_size=2,
        speculative_config=spec,
        **extra,
    ) as llm:
        assert llm.engine.dp_size == (2 if adp else 1)
        moe = llm.engine.executor.worker.model.model.layers[0].mlp
        assert (moe.dispatcher is not None) == adp
        outs = llm.generate(PROMPTS, SPEC_PARAMS)
        assert llm.engine.get_stats().num_used_kv_blocks == 0
    assert [o.outputs[0].token_ids for o in outs] == tokens
    got = [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs]
    assert _max_diff(got, logprobs) < 1e-4
    assert [o.spec_stats.accepted_per_pos for o in outs] == accepted
