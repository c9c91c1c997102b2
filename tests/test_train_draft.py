"""`tandem train-draft`: tiny Eagle3 and MTP runs on a tiny Llama (self-distillation with our
engine), their heads served by the engine, the training forward against the engine's own draft
loop, resume, the shipped prompt sets and the shipped heads of the built-in model."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from checkpoints import build_llama
from tandem import LLM, SamplingParams
from tandem.training import data as D
from tandem.training.trainer import STATE_FILE, TrainArgs, train_draft

PROMPTS = ["Hello world!", "Paris is the capital", "tokens, blocks, caches", "How are you?"]
METHODS = ("eagle3", "mtp")


def _args(method: str, out: Path, target: Path, **kw: object) -> TrainArgs:
    base = dict(
        method=method,
        out=str(out),
        target=str(target),
        max_response_tokens=32,
        batch_tokens=96,
        max_steps=24,
        lr=3e-3,
        warmup_steps=2,
        draft_vocab_size=200,
        log_every=4,
        save_every=8,
        threads=1,
        progress=False,
    )
    base.update(kw)
    return TrainArgs(**base)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("train")
    folder = build_llama(root / "target", layers=4)
    (root / "prompts.jsonl").write_text("".join(json.dumps({"prompt": p}) + "\n" for p in PROMPTS))
    return folder


@pytest.fixture(scope="module")
def prompt_ids(target: Path) -> list[list[int]]:
    """The training prompts through the chat template, plus one the head never saw."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(target))
    return [D.chat_prompt_ids(tok, p) for p in PROMPTS] + [list(range(40, 70))]


@pytest.fixture(scope="module")
def trained(target: Path) -> dict[str, Path]:
    heads = {}
    prompts = target.parent / "prompts.jsonl"
    for method in METHODS:
        out = target.parent / method
        # The first run distills; the second reuses its responses (read only).
        data = {"prompts": str(prompts)}
        if heads:
            data = {"responses": str(heads["eagle3"] / "responses.jsonl")}
        train_draft(_args(method, out, target, **data))
        heads[method] = out
    return heads


def _spec(heads: dict[str, Path], method: str) -> dict:
    # Heads are saved in bf16; run as the fp32 training forward computes.
    return {
        "method": method,
        "model": str(heads[method]),
        "num_speculative_tokens": 3,
        "draft_dtype": "float32",
    }


@pytest.mark.parametrize("method", METHODS)
def test_loss_falls(trained: dict[str, Path], method: str) -> None:
    log = [
        json.loads(line) for line in (trained[method] / "train_log.jsonl").read_text().splitlines()
    ]
    assert [r["step"] for r in log] == [4, 8, 12, 16, 20, 24]
    for j in range(3):
        assert log[-1][f"loss{j}"] < 0.7 * log[0][f"loss{j}"], (j, log)
    assert log[-1]["acc0"] > log[0]["acc0"]


def test_self_distillation_cache_is_the_engines_greedy_output(
    target: Path, trained: dict[str, Path]
) -> None:
    rows = D.read_responses(trained["eagle3"] / "responses.jsonl")
    assert [r["prompt"] for r in rows] == PROMPTS
    with LLM(str(target)) as llm:
        ids = [D.chat_prompt_ids(llm.tokenizer, p) for p in PROMPTS]
        outs = llm.generate(ids, SamplingParams(temperature=0, max_tokens=32))
    assert [r["prompt_ids"] for r in rows] == ids
    assert [r["response_ids"] for r in rows] == [list(o.outputs[0].token_ids) for o in outs]


def test_distillation_resumes_after_a_partial_line(target: Path, tmp_path: Path) -> None:
    out = tmp_path / "responses.jsonl"
    first = D.distill(target, PROMPTS[:2], out, max_tokens=8)
    with open(out, "a") as f:
        f.write('{"prompt": "cut sh')  # a writer killed mid-line
    assert D.read_responses(out) == first
    rows = D.distill(target, PROMPTS, out, max_tokens=8)
    assert rows[:2] == first and len(rows) == len(PROMPTS)
    assert D.read_responses(out) == rows
    import gzip

    packed = tmp_path / "responses.jsonl.gz"
    packed.write_bytes(gzip.compress(out.read_bytes()))
    assert D.read_responses(packed) == rows


def test_sampled_distillation_is_seeded_per_answer(target: Path, tmp_path: Path) -> None:
    """Answer i is sampled with seed + i: a run and a resumed run write the same answers, and
    they are not the greedy ones."""
    sampled = D.distill(target, PROMPTS, tmp_path / "a.jsonl", 16, temperature=1.0, seed=3)
    D.distill(target, PROMPTS[:1], tmp_path / "b.jsonl", 16, temperature=1.0, seed=3)
    assert D.distill(target, PROMPTS, tmp_path / "b.jsonl", 16, temperature=1.0, seed=3) == sampled
    other = D.distill(target, PROMPTS, tmp_path / "c.jsonl", 16, temperature=1.0, seed=4)
    greedy = D.distill(target, PROMPTS, tmp_path / "g.jsonl", 16)
    answers = [[r["response_ids"] for r in rows] for rows in (sampled, other, greedy)]
    assert answers[0] != answers[1] and answers[0] != answers[2]
    assert {r.get("temperature") for r in sampled} == {1.0}
    assert {r.get("temperature") for r in greedy} == {None}
    with pytest.raises(ValueError, match="temperature 1.0, not 0.5"):
        D.distill(target, PROMPTS, tmp_path / "a.jsonl", 16, temperature=0.5, seed=3)
    hard = _args("mtp", tmp_path / "h", target, responses=str(tmp_path / "a.jsonl"), labels="hard")
    with pytest.raises(ValueError, match="labels='soft'"):
        train_draft(hard)


def test_training_reads_several_response_files(
    target: Path, trained: dict[str, Path], tmp_path: Path
) -> None:
    one = trained["eagle3"] / "responses.jsonl"
    rows = D.read_responses(one)
    two = tmp_path / "more.jsonl"
    two.write_text("".join(json.dumps(r) + "\n" for r in rows[:2]))
    args = _args("mtp", tmp_path / "h", target, responses=(str(one), str(two)), max_steps=1)
    assert train_draft(args).num_sequences == len(rows) + 2
    for bad in (-0.5, 2.5, True, "0.7"):
        with pytest.raises(ValueError, match="distill_temperature"):
            _args("mtp", tmp_path / "x", target, distill_temperature=bad)
    with pytest.raises(ValueError, match="labels='soft'"):
        _args("mtp", tmp_path / "x", target, distill_temperature=0.7, labels="hard")


@pytest.mark.parametrize("method", METHODS)
def test_head_serves_with_greedy_output_unchanged(
    target: Path, trained: dict[str, Path], prompt_ids: list[list[int]], method: str
) -> None:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    with LLM(str(target)) as llm:
        base = [o.outputs[0].token_ids for o in llm.generate(prompt_ids, params)]
    with LLM(str(target), speculative_config=_spec(trained, method)) as llm:
        outs = llm.generate(prompt_ids, params)
        stats = llm.engine.spec_stats
    assert [o.outputs[0].token_ids for o in outs] == base
    assert stats.num_drafts > 0
    # Mostly the prompts it was trained on: the head is accepted often.
    assert stats.mean_tokens_per_step > 1.2  # an untrained head: about 1.0


def _engine_drafts(
    target: Path, spec: dict, prompt_ids: list[list[int]]
) -> list[tuple[list[int], list[int], list[int]]]:
    """(final tokens, tokens so far, proposed drafts) after every engine step with drafts."""
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    seen = []
    with LLM(str(target), speculative_config=spec) as llm:
        reqs = {
            f"r{i}": llm.engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompt_ids)
        }
        while llm.engine.has_unfinished_requests():
            for out in llm.engine.step():
                r = reqs[out.request_id]
                tokens = list(r.prompt_token_ids) + list(r.output_token_ids)
                seen.append((out.request_id, tokens, list(r.spec_token_ids)))
    final = {rid: tokens for rid, tokens, _ in seen}
    # A finishing step's drafts are never used (its output may be cut at max_tokens).
    return [
        (final[rid], tokens, drafts)
        for rid, tokens, drafts in seen
        if drafts and len(tokens) < len(final[rid])
    ]


@pytest.mark.parametrize("method", METHODS)
def test_training_forward_drafts_what_the_engine_drafts(
    target: Path, trained: dict[str, Path], prompt_ids: list[list[int]], method: str
) -> None:
    """The training unroll, fed its own argmax, proposes exactly the engine's drafts at every
    step: same capture layers, hidden inputs, positions and draft attention pattern."""
    from tandem.models.loader import load_model
    from tandem.training.evaluate import load_trained_head
    from tandem.training.features import compute_features
    from tandem.training.ttt import dense_attention, unroll_draft

    model = load_model(str(target), dtype=torch.float32)
    head = load_trained_head(method, str(trained[method]), model, str(target))
    steps = _engine_drafts(target, _spec(trained, method), prompt_ids)
    assert len(steps) > 10
    preds: dict[tuple[int, ...], torch.Tensor] = {}
    for full, tokens, drafts in steps:
        key = tuple(full)
        if key not in preds:
            batch = D.collate([D.TrainSequence(key, 0)])
            f = compute_features(
                model, batch, getattr(head, "capture_layers", (1, 2, 3)), torch.float32
            )
            with torch.no_grad(), dense_attention(head.draft):
                outs = unroll_draft(
                    head.draft, f.tokens, head.hidden0(f), 3, lambda j, h: head.predict(h)
                )
            preds[key] = torch.stack([head.predict(o) for o in outs], -1)[0]  # [T, 3]
        root = len(tokens) - 2  # the last accepted token; its successor fed at step 0
        assert preds[key][root, : len(drafts)].tolist() == drafts, (root, drafts)


@pytest.mark.parametrize("method", METHODS)
def test_offline_simulation_agrees_with_the_engine(
    target: Path, trained: dict[str, Path], prompt_ids: list[list[int]], method: str
) -> None:
    """Walking the engine's own greedy outputs with the training forward's drafts gives the
    engine's tokens per step (up to how the last step before max_tokens is counted)."""
    from tandem.models.loader import load_model
    from tandem.training.evaluate import load_trained_head, simulate_greedy_speculation

    params = SamplingParams(temperature=0, max_tokens=30)
    with LLM(str(target), speculative_config=_spec(trained, method)) as llm:
        outs = llm.generate(prompt_ids, params)
        stats = llm.engine.spec_stats
    rows = [
        {"prompt_ids": p, "response_ids": list(o.outputs[0].token_ids)}
        for p, o in zip(prompt_ids, outs, strict=True)
    ]
    model = load_model(str(target), dtype=torch.float32)
    head = load_trained_head(method, str(trained[method]), model, str(target))
    sim = simulate_greedy_speculation(head, rows, 3)
    assert abs(sim.tokens_per_step - stats.mean_tokens_per_step) < 0.1
    assert abs(sim.num_steps - stats.num_drafts) <= len(prompt_ids)


def test_eagle3_input_scale_folds_into_fc(target: Path, tmp_path: Path) -> None:
    """fc trains on unit-scale inputs; the saved fc applies the scale itself: same map."""
    from tandem.models.loader import load_model
    from tandem.training.eagle3 import Eagle3Head
    from tandem.training.evaluate import load_trained_head
    from tandem.training.features import Features

    model = load_model(str(target), dtype=torch.float32)
    head = Eagle3Head(model, torch.arange(0, 320, 2), (1, 2, 3))
    aux = torch.randn(2, 5, 3 * 64)
    aux[..., 7] *= 1000.0  # a massive dimension
    head.set_input_scale(aux)
    assert head.input_scale[7] < 1e-2 and head.input_scale.max() <= 1.0
    head.export(tmp_path)
    loaded = load_trained_head("eagle3", str(tmp_path), model, str(target))
    f = Features(torch.zeros(2, 5, dtype=torch.long), torch.zeros(2, 5), aux, aux[..., :64])
    with torch.no_grad():
        a, b = head.hidden0(f), loaded.hidden0(f)
    torch.testing.assert_close(b, a, rtol=2e-2, atol=2e-2)  # bf16 weights on disk


def test_new_vocab_carries_the_shared_lm_head_rows(
    target: Path, trained: dict[str, Path], tmp_path: Path
) -> None:
    """``new_vocab``: a saved Eagle3 head under another draft vocabulary keeps its rows for the
    tokens both hold, new tokens start from the target's rows through the map fitted on the
    carried ones, the rest of the head loads as saved; a run with it trains and writes the
    re-chosen vocabulary."""
    import shutil

    from safetensors.torch import load_file, save_file

    from tandem.models.loader import load_model
    from tandem.training.eagle3 import Eagle3Head, head_vocab_ids

    old = head_vocab_ids(trained["eagle3"])
    model = load_model(str(target), dtype=torch.float32)
    # The saved head's rows: the target's through a known linear map, which the fit recovers.
    folder = Path(shutil.copytree(trained["eagle3"], tmp_path / "saved"))
    saved = load_file(str(folder / "model.safetensors"))
    hidden = saved["lm_head.weight"].shape[1]
    moved = torch.randn(hidden, hidden, generator=torch.Generator().manual_seed(0)) / hidden**0.5
    saved["lm_head.weight"] = (model.lm_head.weight[old].detach() @ moved).contiguous()
    save_file(saved, str(folder / "model.safetensors"))
    new = torch.cat([old[::2], torch.arange(200, 320)]).unique()  # drops half, adds others
    shared = new[torch.isin(new, old)]
    fresh = new[~torch.isin(new, old)]
    assert len(shared) > hidden and len(fresh) >= 50
    head = Eagle3Head(model, new, (1, 2, 3))
    with pytest.raises(ValueError, match="differs"):
        head.load_head(folder)
    head.load_head(folder, new_vocab=True)
    w = head.draft.lm_head.weight.detach()
    rows = {int(t): i for i, t in enumerate(old)}
    want = saved["lm_head.weight"][[rows[int(t)] for t in shared]].float()
    torch.testing.assert_close(w[head.t2d_index[shared]], want, rtol=0, atol=0)
    want = model.lm_head.weight[fresh].detach() @ moved
    torch.testing.assert_close(w[head.t2d_index[fresh]], want, rtol=0, atol=1e-3 * want.abs().max())
    for name in ("fc.weight", "midlayer.mlp.down_proj.weight", "norm.weight"):
        assert name in saved
    torch.testing.assert_close(head.draft.norm.weight.detach(), saved["norm.weight"].float())
    assert torch.equal(head.draft.to_target_ids(torch.arange(len(new))), new)

    responses = str(folder / "responses.jsonl")
    for method, init_from in (("mtp", str(folder)), ("eagle3", None)):
        with pytest.raises(ValueError, match="new_vocab"):
            _args(method, tmp_path / "bad", target, init_from=init_from, new_vocab=True)
    out = tmp_path / "revocab"
    kw = dict(responses=responses, init_from=str(folder), new_vocab=True, draft_vocab_size=300)
    train_draft(_args("eagle3", out, target, max_steps=2, **kw))
    counts = D.token_counts(D.response_sequences(D.read_responses(responses), 1024), 320)
    chosen = head_vocab_ids(out)
    assert len(chosen) == len(set(chosen.tolist())) >= 300
    top = counts.argsort(descending=True)[:250]  # clear of ties at the cut
    assert set(top[counts[top] > 0].tolist()) <= set(chosen.tolist())
    assert not torch.equal(chosen, old)


def test_training_gives_the_callers_threads_back(
    target: Path, trained: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """train_draft runs on args.threads, else $OMP_NUM_THREADS, else every core, and leaves the
    caller's torch threads as they were (it set them for the rest of the process, so a test
    process sharing 2 cores with others spun twice the threads in every later test)."""
    seen: list[int] = []
    real = D.read_responses

    def reading(*args: object, **kwargs: object) -> object:
        seen.append(torch.get_num_threads())
        return real(*args, **kwargs)

    monkeypatch.setattr(D, "read_responses", reading)
    responses = str(trained["eagle3"] / "responses.jsonl")
    before = torch.get_num_threads()
    other = 1 if before > 1 else 2
    train_draft(_args("eagle3", tmp_path / "a", target, responses=responses, max_steps=1,
                      threads=other))  # fmt: skip
    assert torch.get_num_threads() == before
    monkeypatch.setenv("OMP_NUM_THREADS", str(other))
    train_draft(_args("eagle3", tmp_path / "b", target, responses=responses, max_steps=1,
                      threads=None))  # fmt: skip
    assert torch.get_num_threads() == before
    assert seen and set(seen) == {other}, seen


def test_resume_continues_the_same_run(target: Path, trained: dict[str, Path], tmp_path: Path):
    responses = trained["eagle3"] / "responses.jsonl"
    whole = train_draft(
        _args("eagle3", tmp_path / "whole", target, responses=str(responses), max_steps=8)
    )
    part = _args("eagle3", tmp_path / "part", target, responses=str(responses), max_steps=8)
    part.time_limit_s = 0.0  # stops (and checkpoints) after its first step
    assert train_draft(part).steps == 1
    with pytest.raises(ValueError, match="--resume"):
        train_draft(part)
    part.time_limit_s = None
    part.resume = True
    resumed = train_draft(part)
    assert (whole.steps, resumed.steps) == (8, 8)
    a = torch.load(tmp_path / "whole" / STATE_FILE, weights_only=False)["draft"]
    b = torch.load(tmp_path / "part" / STATE_FILE, weights_only=False)["draft"]
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=1e-5, atol=1e-6, msg=name)
    # --max-steps on resume moves the schedule's end; not to a step the run has passed.
    part.max_steps = 6
    with pytest.raises(ValueError, match="at step 8 already"):
        train_draft(part)
    part.max_steps = 11
    assert train_draft(part).steps == 11
    assert torch.load(tmp_path / "part" / STATE_FILE, weights_only=False)["total_steps"] == 11


def test_mtp_fine_tune_keeps_the_heads_draft_vocabulary(
    target: Path, trained: dict[str, Path], tmp_path: Path
) -> None:
    """An MTP head with a draft vocabulary (``d2t``) fine-tuned, stopped and resumed: every
    export carries the same ``d2t``."""
    from safetensors.torch import load_file, save_file

    init = tmp_path / "init"
    shutil.copytree(trained["mtp"], init)
    state = load_file(str(init / "model.safetensors"))
    ids = torch.arange(0, 300, 3)
    state["d2t"] = ids - torch.arange(len(ids))
    save_file(state, str(init / "model.safetensors"))
    responses = str(trained["eagle3"] / "responses.jsonl")
    args = _args("mtp", tmp_path / "ft", target, responses=responses, init_from=str(init))
    args.max_steps, args.time_limit_s = 3, 0.0  # stops after its first step
    assert train_draft(args).steps == 1
    assert torch.equal(load_file(str(tmp_path / "ft" / "model.safetensors"))["d2t"], state["d2t"])
    args.time_limit_s, args.resume = None, True
    assert train_draft(args).steps == 3
    assert torch.equal(load_file(str(tmp_path / "ft" / "model.safetensors"))["d2t"], state["d2t"])


def test_feature_cache_is_per_sequence_and_survives_more_data(
    target: Path, trained: dict[str, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import tandem.training.features as F
    from tandem.models.loader import load_model

    model = load_model(str(target), dtype=torch.float32)
    rows = D.read_responses(trained["eagle3"] / "responses.jsonl")
    seqs = D.response_sequences(rows, 1024)
    small = F.FeatureStore(model, seqs[:2], [[0, 1]], (1, 2, 3), tmp_path)
    first = small.get(0)
    calls = []
    real = F.compute_features
    monkeypatch.setattr(F, "compute_features", lambda *a, **k: calls.append(1) or real(*a, **k))
    again = F.FeatureStore(model, seqs, [[1, 0], [2, 3]], (1, 2, 3), tmp_path)
    cached = again.get(0)  # the same two sequences, in another order: from the cache
    assert calls == []
    n = len(seqs[0].tokens)
    assert cached.tokens[1, :n].tolist() == list(seqs[0].tokens)
    assert torch.equal(cached.labels[1, :n], first.labels[0, :n])
    torch.testing.assert_close(cached.aux[1, :n], first.aux[0, :n])
    again.get(1)  # new sequences: computed once, then cached
    assert calls == [1]
    other = F.FeatureStore(model, seqs, [[2, 3]], (0, 1, 2), tmp_path)  # other capture layers
    other.get(0)
    assert calls == [1, 1]


@pytest.mark.parametrize("method", METHODS)
def test_soft_labels_are_the_targets_distribution_for_each_label(
    target: Path, trained: dict[str, Path], tmp_path: Path, method: str
) -> None:
    """Each draft step's teacher row is the target state that predicted that step's label: the
    target's argmax over it is the distilled greedy token; the soft loss is the KL divergence
    from the target's softmax (0 for a draft that reproduces it), and hard labels still train."""
    from unittest import mock

    from tandem.models.loader import load_model
    from tandem.training import trainer as T

    seen: list[tuple] = []
    responses = str(trained["eagle3"] / "responses.jsonl")
    real = T.train_step

    def spy(head, feats, a, opt, params):  # noqa: ANN001, ANN202
        loss = head.loss
        head.loss = lambda h, lab, t: seen.append((head, h.detach(), lab, t)) or loss(h, lab, t)
        try:
            return real(head, feats, a, opt, params)
        finally:
            del head.loss

    with mock.patch.object(T, "train_step", spy):
        train_draft(_args(method, tmp_path / "soft", target, responses=responses, max_steps=2))
    assert len(seen) == 2 * 3  # two optimizer steps of three draft steps, each with a teacher
    model = load_model(str(target), dtype=torch.float32)
    for _, _, labels, teacher in seen:
        assert teacher is not None and teacher.shape[0] == labels.shape[0]
        pred = model.compute_logits(teacher.float()).argmax(-1)
        assert (pred == labels).float().mean() > 0.97
    head, hidden, labels, teacher = seen[-1]
    full = model.compute_logits(teacher.float())
    same = full if method == "mtp" else full[:, head.vocab_ids]
    with mock.patch.object(head.draft, "compute_logits", lambda i, x: same):
        assert abs(float(head.loss(hidden, labels, teacher)[0])) < 1e-4
    with mock.patch.object(head.draft, "compute_logits", lambda i, x: same * 0.5):
        assert float(head.loss(hidden, labels, teacher)[0]) > 1e-3
    # Hard labels, under bf16 autocast: trains, and the weights stay fp32.
    hard = _args(method, tmp_path / "hard", target, responses=responses, labels="hard", bf16=True)
    hard.max_steps, hard.log_every = 2, 1
    done = train_draft(hard)
    assert done.steps == 2 and all(done.last[f"loss{j}"] > 0 for j in range(3)), done.last
    state = torch.load(tmp_path / "hard" / STATE_FILE, weights_only=False)["draft"]
    assert {v.dtype for v in state.values() if v.is_floating_point()} == {torch.float32}
    with pytest.raises(ValueError, match="labels"):
        _args(method, tmp_path / "bad", target, labels="fuzzy")


def test_text_file_training_uses_the_targets_predictions(target: Path, tmp_path: Path) -> None:
    text = tmp_path / "corpus.txt"
    text.write_text("The quick brown fox jumps over the lazy dog. " * 30)
    out = tmp_path / "text"
    result = train_draft(
        _args("mtp", out, target, text_files=(str(text),), distill=False, max_steps=4)
    )
    assert result.num_sequences >= 1 and not (out / "responses.jsonl").exists()
    assert (out / "model.safetensors").is_file()


def test_bf16_on_a_cpu_without_bf16_instructions_warns(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, tmp_path: Path
) -> None:
    """bf16 autocast on an AVX2-only CPU was measured 11x slower than fp32 (26.7 vs 2.3 s per
    Eagle3 step): the trainer says so before it starts."""
    from tandem.training import trainer

    missing = str(tmp_path / "no-such-model")
    for has_bf16, warned in ((False, True), (True, False)):
        caplog.clear()
        monkeypatch.setattr(trainer, "_cpu_has_bf16", lambda v=has_bf16: v)
        args = TrainArgs(method="eagle3", out=str(tmp_path / "o"), target=missing, bf16=True)
        with caplog.at_level("WARNING"), pytest.raises(ValueError, match="not a model folder"):
            train_draft(args)
        assert ("--bf16 on a CPU without" in caplog.text) is warned


def test_shipped_prompt_sets_are_disjoint() -> None:
    train = D.load_prompts(name="train")
    evals = D.load_prompts(name="eval")
    assert len(evals) >= 50 and len(train) >= 1000
    assert len(set(evals)) == len(evals)
    norm = {p.strip().lower() for p in train}
    assert not [p for p in evals if p.strip().lower() in norm]
    # Both ship in the wheel, with the built-in model's answers and heads.
    import tomllib

    root = Path(__file__).resolve().parents[1]
    setup = tomllib.loads((root / "pyproject.toml").read_text())["tool"]["setuptools"]
    assert {"tandem.training", "tandem.models.heads"} <= set(setup["packages"])
    assert setup["package-data"]["tandem.training"] == ["data/*.jsonl", "data/*.jsonl.gz"]
    data = root / "training" / "data"
    assert len(list(data.glob("*.jsonl.gz"))) >= 4, "the shipped answer files match the globs"
    assert "*/model.safetensors" in setup["package-data"]["tandem.models.heads"]


def test_synthesized_prompts_are_the_targets_own_and_resume(tmp_path: Path) -> None:
    """The built-in chat model continues its template's user turn: complete, distinct messages
    of 3+ words, none of the excluded ones; seeded (a rerun and a resumed run write the same),
    and an excluded prompt is skipped while the rest stay the same."""
    from transformers import AutoTokenizer

    from tandem.models.builtin import builtin_model_path

    model = builtin_model_path()
    tok = AutoTokenizer.from_pretrained(model)
    prefix, stop = D.user_turn_prefix(tok)
    assert tok.decode(prefix).endswith("<|im_start|>user\n")
    assert stop == [tok.convert_tokens_to_ids("<|im_end|>")]

    asked: list[int] = []
    generate = LLM.generate

    def counting(self: LLM, prompts: list[object], *args: object, **kwargs: object) -> object:
        asked.append(len(prompts))
        return generate(self, prompts, *args, **kwargs)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(LLM, "generate", counting)
        first = D.synthesize_prompts(model, 4, tmp_path / "a.jsonl", seed=5, chunk=8)
    # No more attempts than prompts still wanted at first, then sized by the kept share.
    assert asked[0] == 4 and sum(asked) < 4 * 4, asked
    assert len(first) == 4 and len({D.prompt_key(p) for p in first}) == 4
    assert all(len(p.split()) >= 3 and "<|im" not in p for p in first)
    rows = D.read_responses(tmp_path / "a.jsonl")
    assert [r["prompt"] for r in rows] == first
    attempts = [r["attempt"] for r in rows]
    assert attempts == sorted(set(attempts))
    # Resumed from the file: the first four kept, two more after them.
    more = D.synthesize_prompts(model, 6, tmp_path / "a.jsonl", seed=5, chunk=8)
    assert more[:4] == first and len(more) == 6
    # A fresh file, the same seed: the same attempts, the excluded one skipped.
    skipped = D.synthesize_prompts(
        model, 3, tmp_path / "c.jsonl", exclude=[f"  {first[0].upper()} "], seed=5, chunk=8
    )
    assert skipped[:2] == first[1:3] and first[0] not in skipped
    with pytest.raises(ValueError, match="num=0"):
        D.synthesize_prompts(model, 0, tmp_path / "d.jsonl")


def test_training_on_synthesized_prompts_distills_them(
    target: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``synthesize_prompts``: OUT/prompts.jsonl from the target, the eval prompts (the shipped
    set, or the run's own) excluded, then those prompts answered and trained on; refused with
    ``prompts`` or ``responses``, and without distillation."""
    calls = []

    def fake(target_path: str, num: int, out: Path, **kw: object) -> list[str]:
        calls.append((target_path, num, Path(out), kw))
        return PROMPTS[:num]

    monkeypatch.setattr(D, "synthesize_prompts", fake)
    out = tmp_path / "h"
    args = _args("mtp", out, target, synthesize_prompts=3, max_steps=1, seed=7)
    result = train_draft(args)
    ((path, num, prompts_file, kw),) = calls
    assert (path, num, prompts_file) == (str(target), 3, out / "prompts.jsonl")
    assert kw["exclude"] == D.load_prompts(name="eval") and kw["seed"] == 7
    rows = D.read_responses(out / "responses.jsonl")
    assert [r["prompt"] for r in rows] == PROMPTS[:3] and result.num_sequences == 3
    for bad in (0, -2, True, 1.5):
        with pytest.raises(ValueError, match="synthesize_prompts"):
            _args("mtp", out, target, synthesize_prompts=bad)
    for other in ({"prompts": "p.jsonl"}, {"responses": "r.jsonl"}):
        with pytest.raises(ValueError, match="not both"):
            _args("mtp", out, target, synthesize_prompts=2, **other)
    with pytest.raises(ValueError, match="distill=True"):
        _args("mtp", out, target, synthesize_prompts=2, distill=False, text_files=("t.txt",))
    # A run's own eval prompts are the ones held out.
    held = tmp_path / "eval.jsonl"
    held.write_text(json.dumps({"prompt": "A held-out question?"}) + "\n")
    train_draft(
        _args(
            "mtp",
            tmp_path / "h2",
            target,
            synthesize_prompts=2,
            max_steps=1,
            eval_prompts=str(held),
        )
    )
    assert calls[-1][3]["exclude"] == ["A held-out question?"]


SYNTHESIZED = {
    "builtin_synthesized_answers": 2650,
    "builtin_synthesized_answers_2": 3000,
    "builtin_synthesized_answers_3": 3000,
}


@pytest.mark.parametrize(
    ("name", "temperature", "limit"),
    [
        ("builtin_answers", None, 320),
        ("builtin_sampled_answers", 0.8, 256),
        *((name, None, 256) for name in SYNTHESIZED),
    ],
)
def test_shipped_answers_are_the_train_prompts_through_the_chat_template(
    name: str, temperature: float | None, limit: int
) -> None:
    """The built-in model's distilled answers (the heads' training data: greedy, and sampled at
    0.8) answer the shipped train prompts in order, each prompt through the chat template; the
    synthesized sets answer distinct prompts the model wrote, none of them an eval prompt, a
    train prompt or one of the other synthesized set."""
    from transformers import AutoTokenizer

    from tandem.models.builtin import builtin_model_path

    def rows_of(name: str) -> list[dict]:
        return D.read_responses(D.shipped_prompts_path("train").parent / f"{name}.jsonl.gz")

    rows = rows_of(name)
    prompts = [r["prompt"] for r in rows]
    if name in SYNTHESIZED:
        keys = {D.prompt_key(p) for p in prompts}
        assert len(keys) == len(rows) == SYNTHESIZED[name]
        held = D.load_prompts(name="eval") + D.load_prompts(name="train")
        others = [r["prompt"] for n in SYNTHESIZED if n != name for r in rows_of(n)]
        assert not keys & {D.prompt_key(p) for p in held + others}
    else:
        assert prompts == D.load_prompts(name="train")
    assert {r.get("temperature") for r in rows} == {temperature}
    tok = AutoTokenizer.from_pretrained(builtin_model_path())
    for r in rows[::400]:
        assert r["prompt_ids"] == D.chat_prompt_ids(tok, r["prompt"])
        assert 2 <= len(r["response_ids"]) <= limit
        assert r["finish_reason"] in ("stop", "length")


@pytest.mark.parametrize("method", METHODS)
def test_shipped_heads_load_for_the_builtin_model(method: str) -> None:
    """Real loader, meta tensors: every tensor present with the right shape, no compute."""
    from types import SimpleNamespace

    from tandem.models.heads import builtin_head_path
    from tandem.models.llama import LlamaForCausalLM
    from tandem.models.loader import load_draft, load_hf_config

    folder = Path(builtin_head_path(method))
    files = sorted(p.name for p in folder.iterdir())
    assert {"README.md", "config.json", "model.safetensors"} <= set(files)
    assert not [f for f in files if f.endswith((".pt", ".jsonl"))]
    assert (folder / "model.safetensors").stat().st_size <= 25 << 20
    if method == "eagle3":
        cfg = json.loads((folder / "config.json").read_text())
        assert cfg["num_hidden_layers"] == 1 and cfg["vocab_size"] == 49152
        assert cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [1, 14, 26]
        target_cfg = load_hf_config(folder)
        target_cfg.num_hidden_layers = 30
        target_cfg.tie_word_embeddings = True
    else:
        target_cfg = load_hf_config(folder)  # the target's own config
        assert target_cfg.num_hidden_layers == 30 and target_cfg.hidden_size == 576
    with torch.device("meta"):
        target = LlamaForCausalLM(target_cfg)
    spec = SimpleNamespace(
        method=method, model=str(folder), mtp_mode="eagle", num_speculative_tokens=3
    )
    draft = load_draft(spec, target, folder, torch.float32, "meta")
    assert all(p.dtype == torch.float32 for p in draft.parameters())
    # Both draft from the 12288 most frequent answer tokens (the MTP head: the Eagle3 head's).
    assert draft.lm_head_weight.shape == (12288, 576) and draft.draft_vocab_size == 12288


def test_builtin_serve_uses_the_shipped_heads_by_method(monkeypatch, tmp_path) -> None:
    import tandem.models.builtin
    from tandem.cli import build_parser
    from tandem.models.heads import builtin_head_path
    from tandem.server.cli import engine_args_from

    monkeypatch.setattr(tandem.models.builtin, "builtin_model_path", lambda: str(tmp_path))

    def spec(*argv: str) -> dict | None:
        return engine_args_from(build_parser().parse_args(["serve", *argv])).speculative_config

    # The default on dense weights: the shipped Eagle3 head, K by running requests, adaptive
    # (on the file's 4-bit blocks, the default where the CPU fast path runs, none).
    assert spec("--cpu-weights", "dtype") == {
        "method": "eagle3",
        "model": builtin_head_path("eagle3"),
        "num_speculative_tokens": {"1": 3, "4": 2, "8": 0},
        "adaptive": True,
    }
    assert spec("--cpu-weights", "q4") is None
    assert spec("--speculative-config", '{"method": "eagle3"}') == {
        "method": "eagle3",
        "model": builtin_head_path("eagle3"),
        "num_speculative_tokens": 3,
    }
    mtp = spec("--speculative-config", '{"method": "mtp", "num_speculative_tokens": 2}')
    assert mtp == {"method": "mtp", "model": builtin_head_path("mtp"), "num_speculative_tokens": 2}
    assert spec("--speculative-config", "none") is None
    assert spec("--speculative-config", "null") is None
    # A named model gets no default speculation.
    named = engine_args_from(build_parser().parse_args(["serve", str(tmp_path)]))
    assert named.speculative_config is None


def test_cli_trains_then_evaluates_with_the_engine(
    target: Path, trained: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    from tandem.cli import main

    out = tmp_path / "head"
    responses = str(trained["eagle3"] / "responses.jsonl")
    common = ["--method", "eagle3", "--target", str(target), "--out", str(out)]
    train = ["--responses", responses, "--max-steps", "2", "--threads", "1", "--no-progress"]
    assert main(["train-draft", *common, *train, "--draft-vocab-size", "100"]) == 0
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 100
    capsys.readouterr()
    report = tmp_path / "eval.json"
    evaluate = ["--eval-only", "--eval-prompts", str(target.parent / "prompts.jsonl")]
    evaluate += ["--eval-max-tokens", "12", "--eval-baseline", str(tmp_path / "base.jsonl")]
    evaluate += ["--eval-offline", "--eval-json", str(report)]
    assert main(["train-draft", *common, *evaluate]) == 0
    printed = capsys.readouterr().out
    assert "tokens per step" in printed and "per-position acceptance" in printed
    numbers = json.loads(report.read_text())
    assert numbers["engine"]["greedy_equal"] is True
    assert numbers["engine"]["num_prompts"] == len(PROMPTS)
    assert 1.0 <= numbers["engine"]["tokens_per_step"] <= 4.0
    assert len(D.read_responses(tmp_path / "base.jsonl")) == len(PROMPTS)  # kept for reuse
    # Errors a user can act on.
    assert main(["train-draft", *common, "--eval-only", "--out", str(tmp_path / "none")]) == 2
