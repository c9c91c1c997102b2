"""Speculative decoding end to end: exactness, acceptance statistics, configuration errors."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import (
    add_mtp_layers,
    build_eagle3_draft,
    build_llama,
    make_echo_target,
    mtp_head_with_vocab,
    perfect_eagle3_draft,
    zero_residual_writes,
)
from tandem import LLM, SamplingParams

PROMPTS = [[5, 6, 7], list(range(40, 90)), [100, 101], list(range(120, 139))]


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec")
    target = build_llama(root / "target", layers=4)
    add_mtp_layers(target, 1)
    vanilla = root / "target3"
    shutil.copytree(target, vanilla)
    add_mtp_layers(vanilla, 3, seed=5)  # replaces the one-layer MTP with three layers
    draft = build_eagle3_draft(root / "eagle3", target, draft_vocab=160)
    perfect = build_llama(root / "perfect", layers=2, seed=3)
    zero_residual_writes(perfect)
    add_mtp_layers(perfect, 1, perfect=True)
    return {"target": target, "vanilla": vanilla, "eagle3": draft, "perfect": perfect}


def _spec(models: dict[str, Path], method: str, k: int) -> dict:
    if method == "eagle3":
        return {"method": "eagle3", "model": str(models["eagle3"]), "num_speculative_tokens": k}
    if method == "mtp-vanilla":
        return {"method": "mtp", "mtp_mode": "vanilla", "num_speculative_tokens": k}
    if method == "eagle3-tree":  # a draft tree: 2 children per node, 6 nodes verified
        tree = {"topk": 2, "num_draft_tokens": 6}
        return {
            **tree,
            "method": "eagle3",
            "model": str(models["eagle3"]),
            "num_speculative_tokens": k,
        }
    return {"method": "mtp", "num_speculative_tokens": k}


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def baseline(models: dict[str, Path]) -> dict[str, list[list[int]]]:
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    out = {}
    for name in ("target", "vanilla"):
        with LLM(str(models[name])) as llm:
            out[name] = _tokens(llm.generate(PROMPTS, params))
    return out


@pytest.mark.parametrize("k", [1, 3, 5])
@pytest.mark.parametrize("method", ["eagle3", "mtp-eagle", "mtp-vanilla"])
def test_greedy_speculation_is_exact(models, baseline, method: str, k: int, monkeypatch) -> None:
    target = "vanilla" if method == "mtp-vanilla" else "target"
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    # A 16-token budget forces the 50-token prompt into chunks that share steps with decodes.
    with LLM(
        str(models[target]), speculative_config=_spec(models, method, k), max_num_batched_tokens=16
    ) as llm:
        outs = llm.generate(PROMPTS, params)
        assert _tokens(outs) == baseline[target]
        assert all(o.spec_stats.num_drafts > 0 for o in outs)
        assert llm.engine.get_stats().num_used_kv_blocks == 0
    if k == 3:
        monkeypatch.setenv("TLLM_SPEC_DISABLE_DRAFT_ROW_PICK", "1")
        with LLM(str(models[target]), speculative_config=_spec(models, method, k)) as llm:
            unpicked = llm.generate(PROMPTS, params)
        assert _tokens(unpicked) == baseline[target]
        # Same drafts with and without row picking: identical acceptance, position by position.
        assert [o.spec_stats.accepted_per_pos for o in unpicked] == [
            o.spec_stats.accepted_per_pos for o in outs
        ]


@pytest.mark.parametrize("method", ["eagle3", "mtp-eagle"])
def test_stops_and_max_tokens_mid_draft(models, baseline, method: str) -> None:
    ref = baseline["target"][1]
    with LLM(str(models["target"]), speculative_config=_spec(models, method, 5)) as llm:
        for max_tokens in (1, 2, 7, 11):
            (out,) = llm.generate(
                [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
            )
            assert out.outputs[0].token_ids == ref[:max_tokens]
        stop_tok = ref[9]
        (out,) = llm.generate(
            [PROMPTS[1]], SamplingParams(temperature=0, max_tokens=23, stop_token_ids=[stop_tok])
        )
        assert out.outputs[0].token_ids == ref[: ref.index(stop_tok) + 1]
        text = llm.tokenizer.decode(ref, skip_special_tokens=True)
        stop = text[len(text) // 2 : len(text) // 2 + 2]
        if stop.strip():
            (out,) = llm.generate(
                [PROMPTS[1]],
                SamplingParams(temperature=0, max_tokens=23, ignore_eos=True, stop=stop),
            )
            assert out.outputs[0].text == text[: text.index(stop)]
            assert out.outputs[0].finish_reason == "stop"
        assert llm.engine.get_stats().num_used_kv_blocks == 0


@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
@pytest.mark.parametrize("k", [1, 3])
def test_perfect_draft_reaches_k_plus_one(models, k: int, mode: str) -> None:
    steps = 5
    max_tokens = 1 + steps * (k + 1)  # the prefill samples one token, each step k + 1
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    with LLM(str(models["perfect"])) as llm:
        base = _tokens(llm.generate(PROMPTS, params))
    spec = {"method": "mtp", "num_speculative_tokens": k, "mtp_mode": mode}
    # Vanilla: the one-layer checkpoint backs all K layers; each must see the right tokens.
    with LLM(str(models["perfect"]), speculative_config=spec, max_num_batched_tokens=16) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.spec_stats
    assert _tokens(outs) == base
    for o in outs:
        s = o.spec_stats
        assert s.mean_tokens_per_step == k + 1
        assert s.acceptance_rate == 1.0
        assert s.num_drafts == steps and s.num_draft_tokens == steps * k
        assert s.accepted_per_pos == [steps] * k
    # Global counters move by exactly the per-request counts.
    assert stats.num_drafts == steps * len(PROMPTS)
    assert stats.num_draft_tokens == stats.num_accepted_tokens == steps * k * len(PROMPTS)


def _step_through(
    llm: LLM, prompts: list[list[int]], params: SamplingParams
) -> tuple[list[list[int]], dict[str, list[list[int]]]]:
    """Run ``prompts`` engine step by engine step: (each prompt's tokens, the drafts every step
    left on each request)."""
    engine = llm.engine
    reqs = {f"r{i}": engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)}
    tokens: dict[str, list[int]] = {}
    drafts: dict[str, list[list[int]]] = {rid: [] for rid in reqs}
    while engine.has_unfinished_requests():
        for out in engine.step():
            drafts[out.request_id].append(list(reqs[out.request_id].spec_token_ids))
            tokens[out.request_id] = list(out.outputs[0].token_ids)
    return [tokens[rid] for rid in reqs], drafts


def _all_drafts(drafts: dict[str, list[list[int]]]) -> list[int]:
    return [t for steps in drafts.values() for d in steps for t in d]


def test_mtp_draft_vocabulary(models, tmp_path: Path) -> None:
    """An MTP checkpoint with a ``d2t`` drafts from that vocabulary only (a draft LM head of the
    target's rows of those tokens): with the perfect draft, every step still takes k + 1 tokens
    while the vocabulary holds what the target says; without one of those tokens it is never
    drafted and acceptance falls, the output unchanged; ``draft_vocab: "full"`` ignores it."""
    k, steps = 3, 5
    params = SamplingParams(temperature=0, max_tokens=1 + steps * (k + 1), ignore_eos=True)
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(str(models["perfect"])) as llm:
        base = _tokens(llm.generate(PROMPTS, params))
    # The checkpoint's rows (the engine holds the LM head packed for the CPU fast path only).
    state = load_file(str(models["perfect"] / "model.safetensors"))
    target_head = state.get("lm_head.weight", state["model.embed_tokens.weight"])
    said = sorted({t for out in base for t in out})
    counts = {t: sum(out.count(t) for out in base) for t in said}
    dropped = max(said, key=lambda t: counts[t])
    vocab_size = int(json.loads((models["perfect"] / "config.json").read_text())["vocab_size"])
    extra = [t for t in range(0, vocab_size, 7) if t not in said]
    ids = sorted(said + extra)
    full_vocab = mtp_head_with_vocab(models["perfect"], tmp_path / "all", ids)
    short = sorted(set(ids) - {dropped})
    short_vocab = mtp_head_with_vocab(models["perfect"], tmp_path / "short", short)

    def run(head: Path, **extra_spec: str) -> tuple:
        extra_spec["model"] = str(head)
        with LLM(str(models["perfect"]), speculative_config={**spec, **extra_spec}) as llm:
            tokens, drafts = _step_through(llm, PROMPTS, params)
            draft = llm.engine.executor.worker.runner.spec.draft
            return tokens, _all_drafts(drafts), llm.engine.spec_stats, draft

    out, drafted, stats, draft = run(full_vocab)
    assert out == base and stats.mean_tokens_per_step == k + 1
    assert draft.draft_vocab_size == len(ids) and set(drafted) <= set(ids) and drafted
    rows, head = target_head[ids], draft.draft_lm_head or draft.lm_head  # the target's own rows
    if head.weight.is_meta:  # freed: the CPU fast path's packed copy holds them
        from tandem.kernels import cpu_decode

        assert torch.equal(head.fast_weight, cpu_decode.pack(rows.to(head.weight.dtype)))
    else:
        assert torch.equal(draft.lm_head_weight, rows)
    assert torch.equal(draft.to_target_ids(torch.arange(len(ids))), torch.tensor(ids))

    out, drafted, stats, _ = run(short_vocab)
    assert out == base and dropped not in drafted and drafted
    assert stats.mean_tokens_per_step < k + 1
    assert set(drafted) <= set(short)

    out, _, stats, draft = run(full_vocab, draft_vocab="full")
    assert out == base and stats.mean_tokens_per_step == k + 1
    assert draft.draft_lm_head is None and draft.draft_vocab_size == vocab_size

    # Sampled drafts: q puts no mass outside the vocabulary; the run completes.
    sampled = SamplingParams(temperature=0.8, max_tokens=12, ignore_eos=True, seed=3)
    with LLM(str(models["perfect"]), speculative_config={**spec, "model": str(short_vocab)}) as llm:
        engine = llm.engine
        decoder = engine.executor.worker.runner.spec
        engine.add_request("s", PROMPTS[1], sampled)
        seen = 0
        while engine.has_unfinished_requests():
            engine.step()
            for q in decoder.draft_q.values():
                outside = torch.ones(q.shape[-1], dtype=torch.bool)
                outside[short] = False
                assert torch.allclose(q.sum(-1), torch.ones(q.shape[0]), atol=1e-4)
                assert float(q[:, outside].abs().max()) == 0.0
                seen += 1
        assert seen > 0

    for name, vocab, why in (
        ("out", [0, vocab_size], "maps outside"),
        ("desc", [5, 3], "ascending"),
    ):
        bad = mtp_head_with_vocab(models["perfect"], tmp_path / name, vocab)
        with pytest.raises(ValueError, match=why):
            LLM(str(models["perfect"]), speculative_config={**spec, "model": str(bad)})


def test_random_draft_is_near_one_token_per_step(models, baseline) -> None:
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    with LLM(str(models["target"]), speculative_config=_spec(models, "eagle3", 3)) as llm:
        outs = llm.generate(PROMPTS, params)
        stats = llm.engine.spec_stats
    assert _tokens(outs) == baseline["target"]
    assert 1.0 <= stats.mean_tokens_per_step < 1.5
    assert 1 <= stats.num_drafts <= stats.num_draft_tokens <= 3 * stats.num_drafts


def test_configuration_errors(models, tmp_path: Path) -> None:
    t = str(models["target"])
    with pytest.raises(ValueError, match="speculative_config.method"):
        LLM(t, speculative_config={"method": "medusa"})
    with pytest.raises(ValueError, match="num_speculative_tokens"):
        LLM(t, speculative_config={"method": "mtp", "num_speculative_tokens": 0})
    with pytest.raises(ValueError, match="speculative_config.model is required"):
        LLM(t, speculative_config={"method": "eagle3"})
    with pytest.raises(ValueError, match="unknown speculative_config keys"):
        LLM(t, speculative_config={"method": "mtp", "draft_len": 3})
    with pytest.raises(ValueError, match="mtp_mode"):
        LLM(t, speculative_config={"method": "mtp", "mtp_mode": "parallel"})
    for bad_size in (0, -2, 1.5, "4", True):
        with pytest.raises(ValueError, match="disable_by_batch_size"):
            LLM(t, speculative_config={"method": "mtp", "disable_by_batch_size": bad_size})
    with pytest.raises(ValueError, match="disable_by_batch_size is not supported"):
        LLM(
            t,
            speculative_config={"method": "mtp", "mtp_mode": "vanilla", "disable_by_batch_size": 4},
        )
    with pytest.raises(ValueError, match="speculative_config.draft_dtype"):
        LLM(t, speculative_config={"method": "eagle3", "model": "x", "draft_dtype": "int8"})
    with pytest.raises(ValueError, match="speculative_config.draft_vocab"):
        LLM(t, speculative_config={"method": "mtp", "draft_vocab": "small"})
    with pytest.raises(ValueError, match="draft_vocab applies to method 'mtp' only"):
        LLM(t, speculative_config={"method": "eagle3", "model": "x", "draft_vocab": "full"})
    # A target without MTP layers.
    plain = build_llama(tmp_path / "plain")
    with pytest.raises(ValueError, match="no MTP layers"):
        LLM(str(plain), speculative_config={"method": "mtp"})
    # An Eagle3 draft whose hidden size does not fit the target.
    bad = tmp_path / "bad"
    shutil.copytree(models["eagle3"], bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["hidden_size"] = 32
    (bad / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="hidden_size"):
        LLM(t, speculative_config={"method": "eagle3", "model": str(bad)})
    with LLM(t, speculative_config={"method": "mtp"}) as llm:  # a bias past the vocabulary
        with pytest.raises(ValueError, match="logit_bias=.* token id 1000000 is out of range"):
            llm.generate([[1, 2]], SamplingParams(logit_bias={10**6: 1.0}))


def test_eagle3_without_lm_head_borrows_the_targets(models, baseline, tmp_path: Path) -> None:
    draft = build_eagle3_draft(tmp_path / "d", models["target"], with_lm_head=False)
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    with LLM(
        str(models["target"]), speculative_config={"method": "eagle3", "model": str(draft)}
    ) as llm:
        assert _tokens(llm.generate(PROMPTS, params)) == baseline["target"]
    with pytest.raises(ValueError, match="no lm_head"):
        d2 = build_eagle3_draft(
            tmp_path / "d2", models["target"], draft_vocab=100, with_lm_head=False
        )
        LLM(str(models["target"]), speculative_config={"method": "eagle3", "model": str(d2)})


def _check_head_dtypes(
    models: dict[str, Path], baseline: dict, spec: dict, borrowed_head: bool
) -> None:
    """``spec``'s head, stored in bfloat16, runs in bfloat16 with draft_dtype "auto" and in fp32
    with "float32" (weights, draft KV cache, its LM head unless ``borrowed_head``: then the
    target's fp32 one); the target's caches stay fp32 and the output the target's."""
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    for choice, expected in (("auto", torch.bfloat16), ("float32", torch.float32)):
        with LLM(str(models["target"]), speculative_config={**spec, "draft_dtype": choice}) as llm:
            runner = llm.engine.executor.worker.runner
            draft = runner.spec.draft
            assert draft.dtype == expected
            assert draft.lm_head_weight.dtype == (torch.float32 if borrowed_head else expected)
            caches = [c.dtype for layer in runner.kv_caches for c in layer]
            num_draft = 2 * len(draft.attention_layers())
            assert set(caches[-num_draft:]) == {expected}
            assert set(caches[:-num_draft]) == {torch.float32}  # the target's
            outs = llm.generate(PROMPTS, params)
        assert _tokens(outs) == baseline["target"]
        assert all(o.spec_stats.num_drafts > 0 for o in outs)


def _bf16_eagle3_head(models: dict[str, Path], folder: Path, with_lm_head: bool) -> Path:
    """A bf16-stored Eagle3 head with its own 160-token LM head, or borrowing the target's."""
    return build_eagle3_draft(
        folder,
        models["target"],
        draft_vocab=160 if with_lm_head else None,
        with_lm_head=with_lm_head,
        dtype=torch.bfloat16,
    )


@pytest.mark.parametrize("with_lm_head", [True, False])
def test_eagle3_head_dtype(models, baseline, tmp_path: Path, with_lm_head: bool) -> None:
    """An Eagle3 head stored in bfloat16, with its own LM head or the target's borrowed (a copy
    in the head's dtype)."""
    head = _bf16_eagle3_head(models, tmp_path / "bf16", with_lm_head)
    _check_head_dtypes(models, baseline, {"method": "eagle3", "model": str(head)}, False)


@pytest.mark.parametrize("with_vocab", [True, False])
def test_mtp_head_dtype(models, baseline, tmp_path: Path, with_vocab: bool) -> None:
    """An MTP head stored in bfloat16: with a draft vocabulary its own LM head runs in the
    head's dtype; the whole-vocabulary LM head stays the target's fp32 one."""
    vocab = list(range(0, 320, 2)) if with_vocab else None
    head = mtp_head_with_vocab(models["target"], tmp_path / "bf16", vocab, torch.bfloat16)
    _check_head_dtypes(models, baseline, {"method": "mtp", "model": str(head)}, not with_vocab)


@pytest.mark.parametrize(
    ("head_dtype", "target_dtype"),
    [(torch.float32, "float32"), (torch.bfloat16, "float32"), (torch.bfloat16, "bfloat16")],
)
def test_fast_draft_chain_proposes_the_loops_drafts(
    models, tmp_path: Path, head_dtype: torch.dtype, target_dtype: str, monkeypatch
) -> None:
    """On CPU, greedy Eagle3 draft steps after the first run as one extension call
    (``cpu_decode.eagle3_chain``): after every engine step, the same drafts as the step-by-step
    loop, and the same output."""
    from tandem.kernels import cpu_decode

    if cpu_decode.unavailable_reason() is not None:
        pytest.skip(f"no CPU fast path: {cpu_decode.unavailable_reason()}")
    head = build_eagle3_draft(tmp_path / "h", models["target"], draft_vocab=160, dtype=head_dtype)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    calls: list[int] = []
    chain = cpu_decode.eagle3_chain
    monkeypatch.setattr(cpu_decode, "eagle3_chain", lambda *a: calls.append(1) or chain(*a))
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    runs = []
    for fast in (True, False):
        with LLM(str(models["target"]), dtype=target_dtype, speculative_config=spec) as llm:
            engine = llm.engine
            engine.executor.worker.runner.spec.fast_chain = fast
            runs.append(_step_through(llm, PROMPTS, params))
            if fast:  # a draft token outside the vocabulary: an error, nothing written
                draft = engine.executor.worker.runner.spec.draft
                hidden = torch.zeros(1, draft.config.hidden_size, dtype=draft.dtype)
                blocks = torch.zeros(1, 2, dtype=torch.int32)
                with pytest.raises(RuntimeError, match="draft token .* is out of range"):
                    draft.greedy_chain(hidden, torch.tensor([10**6]), torch.tensor([0]), blocks, 2)
        if fast:
            assert len(calls) > 1, "the chain did not run"
            calls.clear()
    assert not calls
    assert runs[0] == runs[1]
    assert _all_drafts(runs[0][1])


@pytest.mark.parametrize("method", ["mtp-eagle", "mtp-vanilla"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fast_mtp_layers_propose_the_eager_drafts(models, method: str, dtype: str, monkeypatch):
    """On CPU, MTP layers on a Llama block run through the extension (``eh_proj``, then the
    block as a one-layer ``llama_stack``): after every engine step, the drafts of the eager
    layers (fp32; bf16: all but a few rounding flips), and the same output."""
    from tandem.kernels import cpu_decode

    if cpu_decode.unavailable_reason() is not None:
        pytest.skip(f"no CPU fast path: {cpu_decode.unavailable_reason()}")
    one_layer: list[int] = []
    stack = cpu_decode.llama_stack
    monkeypatch.setattr(
        cpu_decode,
        "llama_stack",
        lambda x, rows, w, caches, *a: (
            (len(caches) == 2 and one_layer.append(1)) or stack(x, rows, w, caches, *a)
        ),
    )
    target = models["vanilla" if method == "mtp-vanilla" else "target"]
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    runs = []
    for fast in (True, False):
        with LLM(str(target), dtype=dtype, speculative_config=_spec(models, method, 3)) as llm:
            engine = llm.engine
            layers = engine.executor.worker.runner.spec.draft.layers
            assert all(layer.fast_path is not None for layer in layers)
            if not fast:
                for layer in layers:
                    layer.fast_path = None
            runs.append(_step_through(llm, PROMPTS, params))
        if fast:
            assert len(one_layer) > 1, "the MTP fast path did not run"
            one_layer.clear()
    assert not one_layer
    assert runs[0][0] == runs[1][0]  # the output: the target's, whatever was drafted
    assert _all_drafts(runs[0][1])
    if dtype == "float32":
        assert runs[0][1] == runs[1][1]
    else:  # bf16: the extension rounds less often than the eager ops; a rare draft may differ
        fast_drafts, eager_drafts = (_all_drafts(r[1]) for r in runs)
        same = sum(a == b for a, b in zip(fast_drafts, eager_drafts, strict=False))
        assert same >= 0.95 * max(len(fast_drafts), len(eager_drafts))


def test_logprobs_under_speculation_are_the_targets(models) -> None:
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logprobs=3)
    with LLM(str(models["target"])) as llm:
        (base,) = llm.generate([PROMPTS[1]], params)
    with LLM(str(models["target"]), speculative_config=_spec(models, "mtp-eagle", 3)) as llm:
        (spec,) = llm.generate([PROMPTS[1]], params)
    a, b = base.outputs[0].logprobs, spec.outputs[0].logprobs
    assert len(a) == len(b) == 12
    for x, y in zip(a, b, strict=True):
        assert x.token_id == y.token_id and x.top_token_ids == y.top_token_ids
        assert abs(x.logprob - y.logprob) < 1e-4


@pytest.mark.parametrize("method", ["eagle3", "mtp-eagle"])
def test_speculation_under_preemption_and_prefix_caching(models, baseline, method: str) -> None:
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    # 9 blocks of 16 tokens (with the draft lookahead) cannot hold all four requests at once.
    with LLM(
        str(models["target"]),
        speculative_config=_spec(models, method, 3),
        num_kv_blocks=9,
        max_model_len=96,
    ) as llm:
        assert _tokens(llm.generate(PROMPTS, params)) == baseline["target"]
        assert llm.engine.get_stats().num_preemptions > 0
        # Again, now with the prompts' full blocks in the prefix cache.
        hits = llm.engine.get_stats().prefix_cache_hits
        assert _tokens(llm.generate(PROMPTS, params)) == baseline["target"]
        stats = llm.engine.get_stats()
        assert stats.prefix_cache_hits > hits
        assert stats.num_used_kv_blocks == 0


@pytest.mark.parametrize("method", ["mtp-vanilla", "eagle3"])
def test_drafts_do_not_depend_on_chunking(models, method: str) -> None:
    """Every draft proposed after every step is the same with whole and chunked prefill: the
    draft KV written for prompt rows (for vanilla MTP, by every layer, with the prompt tokens
    that follow a chunk) does not depend on where chunks end."""
    target = "vanilla" if method == "mtp-vanilla" else "target"
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for budget in (None, 16, 7):
        with LLM(
            str(models[target]),
            speculative_config=_spec(models, method, 3),
            max_num_batched_tokens=budget,
        ) as llm:
            runs.append(_step_through(llm, PROMPTS, params)[1])
    assert runs[1] == runs[0] and runs[2] == runs[0]
    assert any(d for steps in runs[0].values() for d in steps)


@pytest.mark.parametrize("method", ["eagle3", "mtp-eagle", "eagle3-tree"])
def test_speculation_pauses_at_the_batch_size_limit(models, baseline, method: str) -> None:
    """``disable_by_batch_size``: a step of at least that many requests proposes no drafts (the
    next step decodes one token per request), speculation resumes once the batch shrinks, greedy
    output is unchanged, and the first drafts after the pause equal those a fresh prefill of the
    same text proposes: the paused steps kept writing the draft KV."""
    spec = {**_spec(models, method, 3), "disable_by_batch_size": 2}
    long = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    short = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    with LLM(str(models["target"]), speculative_config=spec) as llm:
        a = llm.engine.add_request("a", PROMPTS[1], long)
        b = llm.engine.add_request("b", PROMPTS[0], short)
        steps = []  # per step: the requests it ran, a's output length and drafts after it
        while llm.engine.has_unfinished_requests():
            ran = [out.request_id for out in llm.engine.step()]
            steps.append((ran, len(a.output_token_ids), list(a.spec_token_ids)))
        assert a.output_token_ids == baseline["target"][1]
        assert b.output_token_ids == baseline["target"][0][:6]
        both = [s for s in steps if len(s[0]) == 2]
        assert both and all(drafts == [] for _, _, drafts in both)
        alone = [s for s in steps if s[0] == ["a"] and s[2]]
        assert alone, "speculation did not resume"
        # Every step after one that left drafts verified them (and only those).
        verified = sum(
            1 for prev, cur in zip(steps, steps[1:], strict=False) if prev[2] and "a" in cur[0]
        )
        assert a.spec_stats is not None and a.spec_stats.num_drafts == verified > 0
        n, resumed = alone[0][1], alone[0][2]
    with LLM(str(models["target"]), speculative_config=_spec(models, method, 3)) as llm:
        ref = llm.engine.add_request("ref", PROMPTS[1] + a.output_token_ids[: n - 1], long)
        llm.engine.step()
        assert ref.output_token_ids == a.output_token_ids[n - 1 : n]
        assert list(ref.spec_token_ids) == resumed


def _dequantized_copy(head: Path, folder: Path, lm_head: torch.Tensor | None) -> Path:
    """``head`` with every matrix replaced by its Q8_0 blocks' dequantized values (what
    ``draft_quantization: "int8"`` computes with), stored in the head's dtype; ``lm_head``: the
    LM head it borrows (saved as its own, in the head's dtype)."""
    from safetensors.torch import load_file, save_file

    from tandem.kernels import cpu_decode

    shutil.copytree(head, folder)
    state = load_file(str(head / "model.safetensors"))
    if lm_head is not None:
        state["lm_head.weight"] = lm_head.to(state["fc.weight"].dtype)
    for name, t in state.items():
        if t.dim() == 2 and t.is_floating_point() and t.shape[1] % cpu_decode.QBLOCK == 0:
            q, d = cpu_decode.quantize_q8_0(t)
            state[name] = cpu_decode.dequantize_blocks(q, d, None, t.dtype)
    save_file(state, str(folder / "model.safetensors"))
    return folder


@pytest.mark.parametrize(
    ("with_lm_head", "tree"),
    [(True, False), (False, False), (True, True)],
    ids=["own-lm-head", "borrowed-lm-head", "tree"],
)
def test_int8_draft_quantization(
    models, baseline, tmp_path: Path, with_lm_head: bool, tree: bool
) -> None:
    """``draft_quantization: "int8"``: the head's matrices (layers, fc, its LM head) reach the
    CPU fast path as Q8_0 blocks; its drafts after every step (a chain's, or a draft tree's
    nodes) are those of the same head stored with the dequantized values (rounding aside), the
    output is the target's, and a borrowed LM head leaves the target's own untouched."""
    from tandem.kernels import cpu_decode

    if cpu_decode.unavailable_reason() is not None:
        pytest.skip(f"no CPU fast path: {cpu_decode.unavailable_reason()}")
    head = _bf16_eagle3_head(models, tmp_path / "h", with_lm_head)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 3}
    if tree:
        spec |= {"topk": 2, "num_draft_tokens": 6}
    params = SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)
    runs = []
    borrowed = None
    for quantized in (True, False):
        if quantized:
            config = {**spec, "draft_quantization": "int8"}
        else:
            config = {**spec, "model": str(_dequantized_copy(head, tmp_path / "deq", borrowed))}
        with LLM(str(models["target"]), speculative_config=config) as llm:
            worker = llm.engine.executor.worker
            draft = worker.runner.spec.draft
            packed = [w for w in draft.midlayer.fast_path.weights if w.dim() == 2]
            packed += [draft.lm_head.fast_weight, draft.fc.fast_weight]
            assert {w.dtype for w in packed} == {torch.uint8 if quantized else torch.bfloat16}
            target_head = worker.model.lm_head.weight
            assert target_head.dtype == torch.float32 and draft.lm_head.weight is not target_head
            if not with_lm_head and quantized:  # the target's rows, from its checkpoint
                state = load_file(str(models["target"] / "model.safetensors"))
                borrowed = state.get("lm_head.weight", state["model.embed_tokens.weight"])
            runs.append(_step_through(llm, PROMPTS, params))
    assert runs[0][0] == runs[1][0] == baseline["target"]
    got, ref = _all_drafts(runs[0][1]), _all_drafts(runs[1][1])
    assert len(got) == len(ref) > 0
    assert sum(a == b for a, b in zip(got, ref, strict=True)) >= 0.95 * len(ref)


def test_int8_draft_quantization_needs_the_cpu_fast_path(models, monkeypatch) -> None:
    from tandem.engine.config import EngineArgs

    spec = {**_spec(models, "eagle3", 3), "draft_quantization": "int8"}
    with pytest.raises(ValueError, match="draft_quantization.*one rank"):
        EngineArgs(
            model=str(models["target"]),
            device="cpu",
            tensor_parallel_size=2,
            speculative_config=spec,
        ).create_engine_config()
    with pytest.raises(ValueError, match="draft_quantization.*one of"):
        LLM(str(models["target"]), speculative_config={**spec, "draft_quantization": "int4"})
    monkeypatch.setenv("TANDEM_CPU_FAST_DECODE", "0")
    with pytest.raises(ValueError, match="needs the CPU decode fast path.*TANDEM_CPU_FAST_DECODE"):
        LLM(str(models["target"]), speculative_config=spec)


@pytest.mark.parametrize("row_pick", [True, False], ids=["row-pick", "no-row-pick"])
def test_perfect_eagle3_draft_is_always_accepted(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, row_pick: bool
) -> None:
    """A head that drafts exactly what the target generates (an echo target and a head built to
    match it): every draft is accepted, K + 1 tokens per step. A head misloaded anywhere on the
    draft side (fc, the captured layers, its LM head, the draft loop) still passes the greedy
    equality tests, but not this."""
    from tandem.engine.speculative.interface import DISABLE_ROW_PICK_ENV

    monkeypatch.setenv(DISABLE_ROW_PICK_ENV, "0" if row_pick else "1")
    target = build_llama(tmp_path / "echo", layers=4, seed=5)
    make_echo_target(target)
    head = perfect_eagle3_draft(tmp_path / "head", target)
    k = 3
    prompts = [[5, 6, 7], list(range(40, 59)), [100], list(range(60, 97))]
    params = SamplingParams(temperature=0, max_tokens=1 + 4 * (k + 1), ignore_eos=True)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k}
    with LLM(str(target), dtype="float32", speculative_config=spec, max_num_seqs=4) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.engine.get_stats()
    for prompt, out in zip(prompts, outs, strict=True):
        assert out.outputs[0].token_ids == [prompt[-1]] * params.max_tokens  # the echo
    assert stats.spec_num_drafts == 4 * len(prompts), stats  # four steps of K + 1 each
    assert stats.spec_num_draft_tokens == k * stats.spec_num_drafts
    assert stats.spec_num_accepted_tokens == stats.spec_num_draft_tokens
    assert stats.spec_accepted_per_pos == [stats.spec_num_drafts] * k


def test_eagle3_capture_layers_are_refused_not_clamped() -> None:
    from types import SimpleNamespace

    from tandem.engine.worker import eagle3_capture_layers

    def layers(given: list[int] | None, ckpt: list[int] | None = None, n: int = 4):
        spec = SimpleNamespace(eagle3_layers_to_capture=given)
        draft = SimpleNamespace(eagle_config={"eagle_aux_hidden_state_layer_ids": ckpt})
        return eagle3_capture_layers(spec, draft, n)

    assert layers([0, 2, 3]) == (0, 2, 3)
    assert layers(None, [1, 2, 3]) == (1, 2, 3)
    assert layers(None, None, 32) == (1, 15, 28)  # the default
    assert layers(None, None, 4) == (1, 1, 0)  # clamped into a shallow target
    assert layers(None, [1, 1, 0]) == (1, 1, 0)  # what a head trained on that target carries
    for bad in ([1, 50, 99], [1, 3, 4], [0, 1], [-1, 1, 2], [0, 1, 2, 3]):
        with pytest.raises(ValueError, match=r"3 target layers in \[0, 4\)"):
            layers(bad)
    with pytest.raises(ValueError, match="draft checkpoint's eagle_config"):
        layers(None, [1, 2, 7])


SPEC_METHODS = ["eagle3", "mtp-eagle", "mtp-vanilla"]


def _target(models: dict[str, Path], method: str) -> str:
    return str(models["vanilla" if method == "mtp-vanilla" else "target"])


@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("method", SPEC_METHODS)
def test_generated_tokens_become_reusable_under_speculation(models, method: str, k: int) -> None:
    """A follow-up made of a prompt and its answer hits as many cached tokens with speculation
    as without: generated blocks are hashed after the KV rewind and the accepted tokens (they
    were hashed while the draft rows still counted, on a shorter slice of tokens). A block is
    keyed with the tokens its draft KV reads after it (one; vanilla MTP's K layers: K), so the
    follow-up matches up to its last block with those in the prompt."""
    prompt = list(range(40, 77))  # 37 tokens
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    hits = {}
    for spec in (None, _spec(models, method, k)):
        with LLM(_target(models, method), speculative_config=spec) as llm:
            (answer,) = _tokens(llm.generate([prompt], params))
            follow_up = prompt + answer
            (out,) = llm.generate([follow_up], SamplingParams(temperature=0, max_tokens=1))
            hits[spec is None] = out.num_cached_tokens
    follow = k if method == "mtp-vanilla" else 1
    expected = min(hits[True], (len(follow_up) - follow) // 16 * 16)
    assert hits[True] == (len(follow_up) - 1) // 16 * 16 == 64
    assert hits[False] == expected


@pytest.mark.parametrize("method", SPEC_METHODS)
def test_shared_prefix_drafts_equal_the_uncached_run(models, method: str) -> None:
    """Two prompts share 32 tokens (two blocks) and then differ: the second reuses the first's
    blocks, but not a block whose last slot's draft KV was computed from the first prompt's next
    token. Every draft after every step equals the run without prefix caching."""
    shared = list(range(40, 72))
    prompts = [shared + [5, 6, 7, 8], shared + [100, 101, 102]]
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    runs = []
    for caching in (False, True):
        with LLM(
            _target(models, method),
            speculative_config=_spec(models, method, 3),
            enable_prefix_caching=caching,
        ) as llm:
            first = _step_through(llm, prompts[:1], params)
            second = _step_through(llm, prompts[1:], params)
            runs.append((first, second, llm.engine.get_stats().prefix_cache_hits))
    assert runs[1][:2] == runs[0][:2]
    assert _all_drafts(runs[0][1][1])
    assert runs[1][2] == 16  # the first block matched; the second's draft KV is the first's


@pytest.mark.parametrize("method", ["eagle3", "mtp-eagle"])
def test_min_tokens_with_a_stop_string_under_speculation(models, method: str) -> None:
    """Several tokens arrive per step: the text still equals the decoded tokens, cut only at a
    stop string found once min_tokens is reached."""
    from text_checks import check_text_against_tokens

    prompt = [5, 6, 7]
    free = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(models["target"]), speculative_config=_spec(models, method, 3)) as llm:
        text, _, tokens = check_text_against_tokens(llm, prompt, free)
        early = llm.tokenizer.decode(tokens[:3], skip_special_tokens=True)
        stop = early[-2:]
        assert stop and stop in text
        for min_tokens in (0, 7, 24):
            params = SamplingParams(
                temperature=0, max_tokens=24, ignore_eos=True, min_tokens=min_tokens, stop=[stop]
            )
            _, reason, ids = check_text_against_tokens(llm, prompt, params)
            assert ids == tokens[: len(ids)] and len(ids) >= min_tokens
            assert reason == stop or len(ids) == 24
            assert (reason == stop) if min_tokens == 0 else True
            assert (reason is None) if min_tokens == 24 else True


def test_start_up_kv_check_counts_the_draft_look_ahead(models) -> None:
    """A KV budget of exactly max_model_len's blocks started, then refused long requests with a
    400 about max_tokens: a request also holds the draft loop's 2K look-ahead slots. Start-up
    now refuses it and says how much memory to add; with that added, a max_model_len request
    runs."""
    import re

    def start(budget: int) -> LLM:
        return LLM(
            str(models["target"]),
            speculative_config=_spec(models, "eagle3", 3),
            max_model_len=64,  # 4 blocks of 16; with 6 look-ahead slots a request holds 5
            kv_cache_memory_bytes=budget,
        )

    def missing(budget: int) -> int:
        with pytest.raises(ValueError, match="max_model_len=64 needs 5") as e:
            start(budget)
        return int(re.search(r"add (\d+) bytes", str(e.value))[1])

    per_block = missing(1) // 5
    assert missing(4 * per_block) == per_block  # max_model_len's own blocks are not enough
    with start(5 * per_block) as llm:
        params = SamplingParams(temperature=0, max_tokens=61, ignore_eos=True)
        (out,) = llm.generate([[5, 6, 7]], params)
        assert len(out.outputs[0].token_ids) == 61


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
def test_strict_acceptance_serves_seeded_requests(models, method: str) -> None:
    """``use_rejection_sampling: false`` (a draft is kept iff it equals the target's own sample)
    with seeded requests, several at once: the same seed gives the same tokens again, and
    different seeds differ."""
    spec = {**_spec(models, method, 3), "use_rejection_sampling": False}
    params = [
        SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True, seed=s) for s in (1, 1, 2)
    ]
    with LLM(str(models["target"]), speculative_config=spec) as llm:
        first = _tokens(llm.generate(PROMPTS[:3], params))
        again = _tokens(llm.generate(PROMPTS[:3], params))
        seeds = _tokens(llm.generate([PROMPTS[0]] * 2, params[1:]))
    assert first == again
    assert all(len(t) == 16 for t in first)
    assert seeds[0] == first[0] and seeds[0] != seeds[1]


@pytest.mark.parametrize("method", ["eagle3", "eagle3-tree"])
def test_draft_serves_past_its_configs_positions(models, tmp_path: Path, method: str) -> None:
    """A public Eagle3 head's config says fewer positions than its target serves (2048 behind
    8192): the draft's rotary table follows the serving length, not the head's config. A head
    that says 64 serves a 300-token conversation exactly."""
    head = build_eagle3_draft(
        tmp_path / "short", models["target"], draft_vocab=160, max_position_embeddings=64
    )
    spec = {**_spec(models, method, 3), "model": str(head)}
    prompt = [(7 * i) % 250 + 3 for i in range(280)]
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    with LLM(str(models["target"])) as llm:
        (want,) = _tokens(llm.generate([prompt], params))
    with LLM(str(models["target"]), speculative_config=spec) as llm:
        (out,) = llm.generate([prompt], params)
    assert out.outputs[0].token_ids == want
    assert out.spec_stats.num_drafts > 0


def _early_drafts(
    llm: LLM, prompts: list[list[int]], params: list[SamplingParams], before: int
) -> tuple[list[list[int]], list[set[int]]]:
    """Step ``prompts`` through ``llm``: (each output, the draft tokens proposed for its output
    indices below ``before``). A tree node's index is n_out + its depth - 1."""
    engine = llm.engine
    reqs = [
        engine.add_request(f"r{i}", p, sp)
        for i, (p, sp) in enumerate(zip(prompts, params, strict=True))
    ]
    early: list[set[int]] = [set() for _ in prompts]
    while engine.has_unfinished_requests():
        engine.step()
        for i, r in enumerate(reqs):
            depths: list[int] = []
            for parent in r.spec_parents or range(-1, len(r.spec_token_ids) - 1):
                depths.append(1 if parent < 0 else depths[parent] + 1)
            n_out = len(r.output_token_ids)
            early[i] |= {
                t for t, d in zip(r.spec_token_ids, depths, strict=True) if n_out + d - 1 < before
            }
    return [list(r.output_token_ids) for r in reqs], early


@pytest.mark.parametrize("method", ["eagle3", "mtp-eagle", "mtp-vanilla", "eagle3-tree"])
def test_min_tokens_bans_stops_in_verification_and_drafts(models, baseline, method: str) -> None:
    """min_tokens under speculation: the stop tokens are banned at every verified position
    before min_tokens (greedy output equal to no speculation) and from the drafts for those
    positions (the draft-side check: verification would hide a banned draft). The stop tokens
    are each prompt's first greedy tokens and the drafts a free run proposed early."""
    target = "vanilla" if method == "mtp-vanilla" else "target"
    ref = baseline[target]
    m = 6
    spec = _spec(models, method, 3)
    free = [SamplingParams(temperature=0, max_tokens=23, ignore_eos=True)] * len(PROMPTS)
    with LLM(str(models[target]), speculative_config=spec) as llm:
        _, drafted = _early_drafts(llm, PROMPTS, free, m)
    stops = [sorted({*r[:2], *d}) for r, d in zip(ref, drafted, strict=True)]
    params = [
        SamplingParams(temperature=0, max_tokens=23, min_tokens=m, stop_token_ids=s) for s in stops
    ]
    with LLM(str(models[target])) as llm:
        want = _tokens(llm.generate(PROMPTS, params))
    with LLM(str(models[target]), speculative_config=spec) as llm:
        got, early = _early_drafts(llm, PROMPTS, params, m)
        sampled = [
            SamplingParams(
                temperature=1.0, max_tokens=m + 2, min_tokens=m, stop_token_ids=s, seed=i
            )
            for i, s in enumerate(stops)
        ]
        hot = _tokens(llm.generate(PROMPTS, sampled))
    assert got == want
    assert all(
        out[0] != r[0] for out, r in zip(got, ref, strict=True)
    )  # the ban changed the output
    assert all(not (d & set(s)) for d, s in zip(early, stops, strict=True)), (early, stops)
    assert sum(map(len, drafted)) > 0 and sum(map(len, early)) > 0
    assert all(not set(out[:m]) & set(s) for out, s in zip(hot, stops, strict=True))
