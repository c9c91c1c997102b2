"""DeepSeek-V3 (MLA + grouped-top-k MoE + MTP) on one rank: greedy generation and log-probs equal
transformers', the paged cache holds the compressed latent, and greedy MTP speculation (eagle and
vanilla, with and without draft row picking) equals plain decoding."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import (
    add_deepseek_mtp_layers,
    assert_matches_hf,
    build_deepseek_v3,
    hf_greedy,
    scale_residual_writes,
)
from tandem import LLM, SamplingParams

PARITY_PROMPTS = [
    [5, 6, 7],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [100],
    list(range(60, 97)),
]
NEW_TOKENS = 32
YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 128,
    "mscale": 0.707,
    "mscale_all_dim": 1.0,
    "beta_fast": 32,
    "beta_slow": 1,
}
CASES: dict[str, dict[str, Any]] = {
    "q-lora-default-rope": {},
    "no-q-lora-yarn": {"q_lora_rank": None, "rope": YARN},
}
SPEC_PROMPTS = [[5, 6, 7], list(range(40, 90)), [100, 101], list(range(120, 139))]
SPEC_PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("dsv3")
    out = {name: build_deepseek_v3(root / name, **kw) for name, kw in CASES.items()}
    # A 2-layer target (dense, MoE) with three MTP layers; eagle mode reads the first one.
    mtp = build_deepseek_v3(root / "mtp", layers=2, seed=3)
    scale_residual_writes(mtp, 0.05)
    add_deepseek_mtp_layers(mtp, 3, echo=True)
    out["mtp"] = mtp
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_matches_transformers(ckpts: dict[str, Path], name: str) -> None:
    folder = ckpts[name]
    ref = hf_greedy(folder, PARITY_PROMPTS, NEW_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(folder), dtype="float32", max_num_seqs=8) as llm:
        outs = llm.generate(PARITY_PROMPTS, params)
    assert_matches_hf(outs, ref)


def test_kv_cache_holds_the_compressed_latent(ckpts: dict[str, Path]) -> None:
    with LLM(
        str(ckpts["q-lora-default-rope"]), dtype="float32", num_kv_blocks=12, max_model_len=128
    ) as llm:
        worker = llm.engine.executor.worker
        cfg = worker.model.config
        block_size = worker.runner.block_size
        caches = worker.runner.kv_caches
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=3))
    latent = cfg.kv_lora_rank + cfg.qk_rope_head_dim
    layers = cfg.num_hidden_layers
    assert [tuple(c.shape) for cache in caches for c in cache] == [
        (12, block_size, 1, latent)
    ] * layers
    per_token = worker.bytes_per_block // block_size
    assert per_token == latent * layers * 4  # fp32
    decompressed = (
        cfg.num_attention_heads
        * (cfg.qk_nope_head_dim + cfg.qk_rope_head_dim + cfg.v_head_dim)
        * layers
        * 4
    )
    assert per_token * 4 < decompressed
    assert len(out[0].outputs[0].token_ids) == 3


def _spec(mode: str, k: int) -> dict[str, Any]:
    return {"method": "mtp", "mtp_mode": mode, "num_speculative_tokens": k}


def _run_steps(llm: LLM) -> tuple[list[list[int]], list[list[int]], list[Any]]:
    """Tokens per prompt, every draft proposed after every step (flattened, per request), and
    each request's acceptance per position."""
    engine = llm.engine
    requests = {
        f"r{i}": engine.add_request(f"r{i}", p, SPEC_PARAMS) for i, p in enumerate(SPEC_PROMPTS)
    }
    drafts: dict[str, list[int]] = {rid: [] for rid in requests}
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            drafts[out.request_id] += list(requests[out.request_id].spec_token_ids)
            if out.finished:
                final[out.request_id] = out
    return (
        [final[r].outputs[0].token_ids for r in requests],
        [drafts[r] for r in requests],
        [final[r].spec_stats.accepted_per_pos for r in requests],
    )


@pytest.fixture(scope="module")
def baseline(ckpts: dict[str, Path]) -> list[list[int]]:
    with LLM(str(ckpts["mtp"]), dtype="float32") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, SPEC_PARAMS)]


def _moe_row_counts(llm: LLM) -> list[tuple[int, int]]:
    """(attention rows, MoE rows) of every call of the first MTP layer, recorded by hooks."""
    layer = llm.engine.executor.worker.runner.spec.draft.mtp_layers[-1]
    calls: list[tuple[int, int]] = []
    layer.self_attn.register_forward_hook(lambda m, a, o: calls.append((o.shape[0], -1)))

    def on_mlp(m: Any, args: Any, out: Any) -> None:
        calls[-1] = (calls[-1][0], args[0].shape[0])

    layer.mlp.register_forward_hook(on_mlp)
    return calls


def test_mtp_block_runs_in_the_targets_dtype(ckpts: dict[str, Path]) -> None:
    """DeepSeek-V3's own MTP block (MLA + MoE) has no other draft_dtype: a clear error."""
    spec = {**_spec("eagle", 1), "draft_dtype": "bfloat16"}
    with pytest.raises(ValueError, match="run in the target's dtype"):
        LLM(str(ckpts["mtp"]), dtype="float32", speculative_config=spec)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_mtp_greedy_speculation_is_exact(
    ckpts: dict[str, Path], baseline: list[list[int]], mode: str, k: int, monkeypatch: Any
) -> None:
    # A 16-token budget chunks the 50-token prompt; chunks share steps with decodes.
    with LLM(
        str(ckpts["mtp"]),
        dtype="float32",
        speculative_config=_spec(mode, k),
        max_num_batched_tokens=16,
    ) as llm:
        calls = _moe_row_counts(llm)
        tokens, drafts, accepted = _run_steps(llm)
        stats = llm.engine.get_stats()
        worker = llm.engine.executor.worker
        kv_per_token = worker.bytes_per_block // worker.runner.block_size
    assert tokens == baseline
    assert stats.num_used_kv_blocks == 0
    # The drafts are mostly right, so accepted drafts (and their rewinds) are exercised.
    assert sum(sum(a) for a in accepted) > 0
    # Target and MTP layers each cache one latent row per token.
    num_mtp = 1 if mode == "eagle" else k
    assert kv_per_token == (32 + 8) * (2 + num_mtp) * 4
    # Row pick: on draft step 0 the MoE sees one row per request, attention every row.
    assert any(moe < attn for attn, moe in calls)
    if k != 3:
        return
    monkeypatch.setenv("TLLM_SPEC_DISABLE_DRAFT_ROW_PICK", "1")
    with LLM(
        str(ckpts["mtp"]),
        dtype="float32",
        speculative_config=_spec(mode, k),
        max_num_batched_tokens=16,
    ) as llm:
        calls = _moe_row_counts(llm)
        unpicked, unpicked_drafts, _ = _run_steps(llm)
    assert unpicked == baseline
    assert all(moe == attn for attn, moe in calls)
    flat = [d for per_req in drafts for d in per_req]
    flat_unpicked = [d for per_req in unpicked_drafts for d in per_req]
    assert len(flat) == len(flat_unpicked) > 0
    agreement = sum(a == b for a, b in zip(flat, flat_unpicked, strict=True)) / len(flat)
    assert agreement >= 0.99, agreement


@pytest.mark.timeout(120)
def test_mtp_under_preemption_and_prefix_caching(
    ckpts: dict[str, Path], baseline: list[list[int]]
) -> None:
    # 9 blocks of 16 tokens (with the draft lookahead) cannot hold all four requests at once,
    # and leave some of the first run's blocks cached for the second (hits are counted once per
    # request, at admission: with 7 blocks every cached block is evicted before it is reused).
    with LLM(
        str(ckpts["mtp"]),
        dtype="float32",
        speculative_config=_spec("eagle", 3),
        num_kv_blocks=9,
        max_model_len=80,
    ) as llm:
        outs = llm.generate(SPEC_PROMPTS, SPEC_PARAMS)
        assert [o.outputs[0].token_ids for o in outs] == baseline
        assert llm.engine.get_stats().num_preemptions > 0
        hits = llm.engine.get_stats().prefix_cache_hits
        outs = llm.generate(SPEC_PROMPTS, SPEC_PARAMS)
        assert [o.outputs[0].token_ids for o in outs] == baseline
        stats = llm.engine.get_stats()
        assert stats.prefix_cache_hits > hits
        assert stats.num_used_kv_blocks == 0


def test_router_matches_transformers() -> None:
    """Grouped top-k routing (score-correction bias, group mask, normalization, scaling) picks
    the same experts with the same weights as transformers' router."""
    import transformers as tf

    from tandem.kernels.moe import grouped_topk

    cfg = tf.DeepseekV3Config(
        hidden_size=32, n_routed_experts=16, n_group=4, topk_group=2, num_experts_per_tok=4
    )
    router = tf.models.deepseek_v3.modeling_deepseek_v3.DeepseekV3TopkRouter(cfg)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(16, 32, generator=gen))
        router.e_score_correction_bias.copy_(torch.randn(16, generator=gen) * 0.3)
    x = torch.randn(64, 32, generator=gen)
    with torch.no_grad():
        _, ref_w, ref_ids = router(x)
    w, ids = grouped_topk(x @ router.weight.T, router.e_score_correction_bias, 4, 4, 2, True, 2.5)
    ref_sorted, ref_order = ref_ids.sort(1)
    got_sorted, got_order = ids.sort(1)
    assert torch.equal(got_sorted, ref_sorted)
    torch.testing.assert_close(w.gather(1, got_order), ref_w.gather(1, ref_order))


def test_expert_parallel_loading_reads_each_ranks_experts(ckpts: dict[str, Path]) -> None:
    """Rank 1 of 2 holds experts 4..7, from per-expert tensors (the released layout) and from
    fused [E, ...] expert tensors alike."""
    from safetensors.torch import load_file

    from tandem.models.deepseek_v3 import DeepseekV3ForCausalLM
    from tandem.models.loader import check_complete, load_hf_config
    from tandem.models.parallel import ParallelMapping

    folder = ckpts["q-lora-default-rope"]
    config = load_hf_config(folder)
    state = load_file(str(folder / "model.safetensors"))
    prefix = "model.layers.1.mlp.experts"
    fused = {n: v for n, v in state.items() if not n.startswith(prefix + ".")}
    gate, up, down = (
        torch.stack([state[f"{prefix}.{e}.{p}_proj.weight"] for e in range(8)])
        for p in ("gate", "up", "down")
    )
    fused[f"{prefix}.gate_up_proj"] = torch.cat([gate, up], dim=1)  # [E, 2I, H]
    fused[f"{prefix}.down_proj"] = down  # [E, H, I]
    for weights in (state, fused):
        model = DeepseekV3ForCausalLM(config, ParallelMapping(tp_size=2, tp_rank=1))
        check_complete(model, model.load_weights(weights.items()), folder)
        experts = model.model.layers[1].mlp.experts
        assert experts.first_expert == 4
        torch.testing.assert_close(experts.w13.data, torch.cat([gate, up], dim=1)[4:])
        torch.testing.assert_close(experts.w2.data, down[4:])
