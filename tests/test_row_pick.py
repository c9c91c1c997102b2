"""Draft row picking: the post-attention part runs only on the rows the draft loop reads."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints import add_mtp_layers, build_eagle3_draft, build_llama, eagle3_tree_spec
from tandem import LLM, SamplingParams
from tandem.engine.speculative.interface import DraftRowPick, draft_layer_picks_rows
from tandem.kernels.attention_torch import build_attention_plan
from tandem.models.attention import AttentionMetadata
from tandem.models.eagle3 import Eagle3MidLayer
from tandem.models.loader import load_hf_config
from tandem.models.mtp import MTPLayer
from tandem.models.parallel import ParallelMapping

BS = 4


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("rowpick")
    target = build_llama(root / "t", layers=4)
    add_mtp_layers(target, 1)
    return target, build_eagle3_draft(root / "d", target)


def _meta(seq_rows: list[int], num_blocks: int = 32) -> tuple[AttentionMetadata, torch.Tensor]:
    """Fresh sequences (no context) with the given row counts, contiguous blocks."""
    qsl = [0]
    slots, tables, positions = [], [], []
    next_block = 0
    for n in seq_rows:
        nb = -(-n // BS)
        blocks = list(range(next_block, next_block + nb))
        next_block += nb
        tables.append(blocks + [0] * (8 - nb))
        slots += [blocks[p // BS] * BS + p % BS for p in range(n)]
        positions += list(range(n))
        qsl.append(qsl[-1] + n)
    bt = torch.tensor(tables, dtype=torch.int32)
    sl = torch.tensor(seq_rows, dtype=torch.int32)
    q = torch.tensor(qsl, dtype=torch.int32)
    plan = build_attention_plan(bt, sl, q, BS, max(seq_rows), max(seq_rows), num_tokens=qsl[-1])
    meta = AttentionMetadata(torch.tensor(slots), bt, sl, q, max(seq_rows), max(seq_rows), plan)
    return meta, torch.tensor(positions)


def _bind_cache(layer: torch.nn.Module) -> None:
    attn = layer.self_attn.attn
    shape = (32, BS, attn.num_kv_heads, attn.head_dim)
    attn.k_cache, attn.v_cache = torch.zeros(shape), torch.zeros(shape)


def _layers(folders: tuple[Path, Path]) -> list[torch.nn.Module]:
    target, draft = folders
    torch.manual_seed(0)
    eagle = Eagle3MidLayer(load_hf_config(draft), ParallelMapping())
    mtp = MTPLayer(load_hf_config(target), ParallelMapping(), False, False)
    for layer in (eagle, mtp):
        for p in layer.parameters():
            p.data.normal_(0, 0.1)
    return [eagle, mtp]


@pytest.mark.parametrize("which", [0, 1], ids=["eagle3-midlayer", "mtp-layer"])
def test_picked_rows_equal_unpicked_and_every_row_writes_kv(folders, which: int) -> None:
    layer = _layers(folders)[which]
    rows = [5, 3, 7]  # unequal rows per request
    meta, positions = _meta(rows)
    t, h = sum(rows), layer.post_attention_layernorm.weight.shape[0]
    embeds, hidden = torch.randn(t, h), torch.randn(t, h)
    pick = torch.tensor([2, 5 + 2, 8 + 6])  # one row per request

    _bind_cache(layer)
    full = layer(positions, embeds, hidden, meta)
    k_full = layer.self_attn.attn.k_cache.clone()

    seen: list[tuple[int, ...]] = []
    hook = layer.post_attention_layernorm.register_forward_hook(
        lambda m, args, out: seen.append(tuple(args[0].shape))
    )
    _bind_cache(layer)
    picked = layer(positions, embeds, hidden, meta, pick_rows=pick)
    hook.remove()

    assert picked.shape == (3, h)
    assert seen == [(3, h)]  # the post-attention part saw one row per request
    torch.testing.assert_close(picked, full[pick], rtol=1e-5, atol=1e-6)
    # Attention ran on every row: the draft KV of all rows is written, identically.
    k_picked = layer.self_attn.attn.k_cache
    written = meta.slot_mapping
    flat_full, flat_picked = (
        k_full.view(-1, *k_full.shape[2:]),
        k_picked.view(-1, *k_picked.shape[2:]),
    )
    assert flat_picked[written].abs().sum(dim=(1, 2)).gt(0).all()
    torch.testing.assert_close(flat_picked[written], flat_full[written])


@pytest.mark.parametrize("which", [0, 1], ids=["eagle3-midlayer", "mtp-layer"])
def test_kv_only_writes_the_full_layers_kv_and_runs_nothing_after_it(folders, which: int) -> None:
    """A step that reads no draft output (paused, or prompt chunks that sample nothing) writes
    the draft KV alone: the same bytes the whole layer writes, and no attention, ``o_proj`` or
    MLP runs (draft-side: verification would hide a wrong draft KV)."""
    layer = _layers(folders)[which]
    meta, positions = _meta([5, 3, 7])
    t, h = int(positions.shape[0]), layer.post_attention_layernorm.weight.shape[0]
    embeds, hidden = torch.randn(t, h), torch.randn(t, h)
    _bind_cache(layer)
    layer(positions, embeds, hidden, meta)
    attn = layer.self_attn.attn
    want = attn.k_cache.clone(), attn.v_cache.clone()

    _bind_cache(layer)
    ran: list[str] = []
    hooks = [
        m.register_forward_hook(lambda m, a, o, name=name: ran.append(name))
        for name, m in (("o_proj", layer.self_attn.o_proj), ("mlp", layer.mlp), ("attn", attn))
    ]
    layer.write_kv(positions, embeds, hidden, meta)
    for hk in hooks:
        hk.remove()
    assert ran == []
    written = meta.slot_mapping
    for got, full in zip((attn.k_cache, attn.v_cache), want, strict=True):
        flat_got, flat_full = got.view(-1, *got.shape[2:]), full.view(-1, *full.shape[2:])
        assert flat_got[written].abs().sum(dim=(1, 2)).gt(0).all()
        assert torch.equal(flat_got, flat_full)  # every slot: the written ones and the rest


def test_decision_capability_signature_switch_and_declines(folders, monkeypatch) -> None:
    eagle, mtp = _layers(folders)
    m = ParallelMapping()
    assert draft_layer_picks_rows(eagle, m) and draft_layer_picks_rows(mtp, m)

    class NoPickForward(Eagle3MidLayer):
        def forward(self, positions, embeds, hidden, meta):  # type: ignore[override]
            return super().forward(positions, embeds, hidden, meta)

    class NoCapability(torch.nn.Module):
        def forward(self, x, pick_rows=None):
            return x

    sub = NoPickForward.__new__(NoPickForward)
    assert not draft_layer_picks_rows(sub, m)  # overriding forward without pick_rows falls back
    assert not draft_layer_picks_rows(NoCapability(), m)
    assert not draft_layer_picks_rows(eagle, m, num_draft_layers=2)  # multi-layer Eagle3 declines
    assert not draft_layer_picks_rows(
        mtp, ParallelMapping(enable_attention_dp=True), vanilla_mtp=True
    )
    assert draft_layer_picks_rows(mtp, ParallelMapping(enable_attention_dp=True))
    assert not draft_layer_picks_rows(eagle, m, disabled=True)  # the config switch
    monkeypatch.setenv("TLLM_SPEC_DISABLE_DRAFT_ROW_PICK", "1")
    assert not draft_layer_picks_rows(eagle, m)


def test_resolver_caches_and_reevaluates(folders, monkeypatch) -> None:
    eagle, mtp = _layers(folders)
    m = ParallelMapping()
    r = DraftRowPick()
    assert r.resolve(eagle, m) is True and r.evaluations == 1
    assert r.resolve(eagle, m) is True and r.evaluations == 1  # cached
    assert r.resolve(eagle, m, num_draft_layers=2) is False and r.evaluations == 2  # eligibility
    assert r.resolve(mtp, m) is True and r.evaluations == 3  # another class
    assert r.resolve(mtp, m, disabled=True) is False and r.evaluations == 4  # the config switch
    assert r.resolve(mtp, m) is True and r.evaluations == 5
    monkeypatch.setenv("TLLM_SPEC_DISABLE_DRAFT_ROW_PICK", "1")
    assert r.resolve(mtp, m) is False and r.evaluations == 6  # the environment switch


@pytest.mark.parametrize("disable", [False, "env", "config"])
def test_engine_step0_post_attention_rows(folders, monkeypatch, disable: bool | str) -> None:
    """The environment variable and the speculative config's ``disable_draft_row_pick`` both
    turn row picking off."""
    if disable == "env":
        monkeypatch.setenv("TLLM_SPEC_DISABLE_DRAFT_ROW_PICK", "1")
    # The hook watches the eager modules; the CPU fast path (which picks the same rows, see
    # tests/test_cpu_decode.py) would bypass them.
    monkeypatch.setenv("TANDEM_CPU_FAST_DECODE", "0")
    target, draft = folders
    spec = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    if disable == "config":
        spec["disable_draft_row_pick"] = True
    with LLM(str(target), speculative_config=spec) as llm:
        midlayer = llm.engine.executor.worker.runner.spec.draft.midlayer
        seen: list[int] = []
        midlayer.post_attention_layernorm.register_forward_hook(
            lambda m, args, out: seen.append(args[0].shape[0])
        )
        prompts = [list(range(10, 30)), [5, 6, 7]]
        llm.generate(prompts, SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))
    # Step 0 of the first step: 23 prompt rows, 2 requests. Picked: 2 rows; unpicked: all 23.
    assert seen[0] == (23 if disable else 2)
    # Later steps: one row per request either way (draft steps 1..K-1, and picked step 0).
    if not disable:
        assert max(seen) == 2


def test_tree_passes_pick_the_rows_expanded_next(folders, monkeypatch) -> None:
    """Draft trees: step 0's post-attention part runs on one row per request and each frontier
    pass's on the topk rows whose children are taken next (not on every frontier row); the
    trees drafted, and the output, equal those with row picking off."""
    monkeypatch.setenv("TANDEM_CPU_FAST_DECODE", "0")  # the hook watches the eager modules
    target, draft = folders
    spec = eagle3_tree_spec(draft, 2, 6)
    prompts = [list(range(10, 30)), [5, 6, 7]]
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for disable in (False, True):
        with LLM(
            str(target), speculative_config={**spec, "disable_draft_row_pick": disable}
        ) as llm:
            engine = llm.engine
            midlayer = engine.executor.worker.runner.spec.draft.midlayer
            seen: list[int] = []
            midlayer.post_attention_layernorm.register_forward_hook(
                lambda m, args, out, seen=seen: seen.append(args[0].shape[0])
            )
            reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
            trees = []
            while engine.has_unfinished_requests():
                engine.step()
                trees.append([list(r.spec_token_ids) for r in reqs])
            runs[disable] = ([r.output_token_ids for r in reqs], trees, seen)
    assert runs[False][:2] == runs[True][:2]  # the same tokens and the same trees every step
    picked, unpicked = runs[False][2], runs[True][2]
    # Picked: 2 rows (step 0), then 2 requests x topk 2 per frontier pass. Unpicked: every
    # prompt row at first (23), and the frontier passes' depth x topk rows per request (8).
    assert max(picked) == 4 and 2 in picked
    assert unpicked[0] == 23 and 8 in unpicked


@pytest.mark.parametrize("method", ["eagle3", "mtp"])
@pytest.mark.parametrize("fast", ["1", "0"], ids=["cpu-fast-path", "eager"])
def test_chain_drafts_equal_those_without_row_pick(folders, monkeypatch, method, fast) -> None:
    """Chains (K = 3, greedy): every step's drafts, and the output, equal those with row
    picking off, for prompts of different lengths (which rows step 0 picks, not only how
    many: an off-by-one in the picked rows passed the row counts)."""
    monkeypatch.setenv("TANDEM_CPU_FAST_DECODE", fast)
    target, draft = folders
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "eagle3":
        spec["model"] = str(draft)
    prompts = [list(range(10, 30)), [5, 6, 7], list(range(40, 77)), [9]]
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    runs = {}
    for disable in (False, True):
        with LLM(
            str(target), speculative_config={**spec, "disable_draft_row_pick": disable}
        ) as llm:
            engine = llm.engine
            reqs = [engine.add_request(f"r{i}", p, params) for i, p in enumerate(prompts)]
            drafts = []
            while engine.has_unfinished_requests():
                engine.step()
                drafts.append([list(r.spec_token_ids) for r in reqs])
            runs[disable] = ([r.output_token_ids for r in reqs], drafts)
    assert runs[False] == runs[True]
    assert sum(len(d) for step in runs[False][1] for d in step) > 0
