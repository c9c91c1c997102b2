"""GLM-4.5 / 4.6 (``Glm4MoeForCausalLM``): greedy tokens and log-probs equal transformers' on tiny
configs; partial rotary equals transformers'; the MTP layer at ``model.layers.{L}`` loads with and
without the embedding / LM-head copies; its drafts are the argmax of transformers' own MTP module
(``MtpModel``) over the target's hidden states; greedy MTP speculation (eagle and vanilla, K = 1
and 3, with and without draft row picking) equals plain decoding; TP = 2 and attention DP = 2 with
LM-head TP equal one rank."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from checkpoints import assert_matches_hf, build_tokenizer, hf_greedy, scale_residual_writes
from tandem import LLM, SamplingParams

PARITY_PROMPTS = [
    [5, 6, 7],
    [40, 41, 42, 43, 44, 45, 46, 47, 48, 49, 50],
    [100],
    list(range(60, 97)),
]
NEW_TOKENS = 32
# Each case: attention bias, one dense layer then two MoE layers, grouped routing (n_group > 1).
CASES: dict[str, dict[str, Any]] = {
    # q/k norms, head_dim 32 (not hidden / heads = 16), half the head rotates.
    "qk-norm": {"use_qk_norm": True, "head_dim": 32},
    # No q/k norms, MQA, a quarter of the head rotates, unnormalized top-k, two shared experts.
    "no-qk-norm": {
        "use_qk_norm": False,
        "kv_heads": 1,
        "partial_rotary_factor": 0.25,
        "n_group": 2,
        "topk_group": 1,
        "top_k": 2,
        "norm_topk_prob": False,
        "routed_scaling_factor": 1.0,
        "shared_experts": 2,
    },
}
SPEC_PROMPTS = [[5, 6, 7], list(range(40, 90)), [100, 101], list(range(120, 139))]
SPEC_PARAMS = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True)


# ----------------------------------------------------------------------------- checkpoints


def build_glm4_moe(
    folder: Path,
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    layers: int = 3,
    first_k_dense_replace: int = 1,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 96,
    moe_intermediate: int = 32,
    experts: int = 8,
    shared_experts: int = 1,
    n_group: int = 4,
    topk_group: int = 2,
    top_k: int = 3,
    routed_scaling_factor: float = 2.5,
    norm_topk_prob: bool = True,
    use_qk_norm: bool = False,
    attention_bias: bool = True,
    partial_rotary_factor: float = 0.5,
    seed: int = 0,
    init_std: float = 0.08,
) -> Path:
    """Save a random ``Glm4MoeForCausalLM`` + tokenizer into ``folder``. The norms, q/k/v biases
    and the router's score-correction bias are random too (transformers starts them at ones and
    zeros), so loading each of them matters."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    kw: dict[str, Any] = {"head_dim": head_dim} if head_dim else {}
    config = tf.Glm4MoeConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        first_k_dense_replace=first_k_dense_replace,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        n_routed_experts=experts,
        n_shared_experts=shared_experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=norm_topk_prob,
        use_qk_norm=use_qk_norm,
        attention_bias=attention_bias,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 10000.0,
            "partial_rotary_factor": partial_rotary_factor,
        },
        max_position_embeddings=512,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_nextn_predict_layers=0,
        **kw,
    )
    torch.manual_seed(seed)
    model = tf.Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, t in [*model.named_parameters(), *model.named_buffers()]:
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn(t.shape) * 0.05)
            elif "norm" in name:
                t.copy_(1 + torch.randn(t.shape) * 0.2)
            elif name.endswith("proj.bias"):
                t.copy_(torch.randn(t.shape) * 0.1)
    model.save_pretrained(str(folder))
    gen = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


def read_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(folder.glob("*.safetensors")) for k, v in load_file(f).items()}


def write_state(folder: Path, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    for f in folder.glob("*.safetensors"):
        f.unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


def add_glm_mtp_layer(
    folder: Path, *, seed: int = 1, echo: bool = False, copies: bool = True
) -> None:
    """Append GLM's MTP layer at ``model.layers.{L}`` in the released layout: ``enorm``,
    ``hnorm``, ``eh_proj``, the attention + MoE decoder block (per-expert tensors),
    ``shared_head.norm``, and with ``copies`` the embedding and LM-head copies GLM-4.5 ships
    (``embed_tokens``, ``shared_head.head``; GLM-4.6 leaves them out).

    Random: every weight random, norms included (enorm and hnorm differ, so swapping them
    changes the drafts). ``echo``: eh_proj passes the next token's normed embedding through and
    the block writes little, so with ``scale_residual_writes`` on the target the drafts are
    mostly right."""
    cfg = json.loads((folder / "config.json").read_text())
    h, L, inter = cfg["hidden_size"], cfg["num_hidden_layers"], cfg["moe_intermediate_size"]
    heads, kv, experts = (
        cfg["num_attention_heads"],
        cfg["num_key_value_heads"],
        cfg["n_routed_experts"],
    )
    hd = cfg.get("head_dim") or h // heads
    state = read_state(folder)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    def norm(n: int) -> torch.Tensor:
        return torch.ones(n) if echo else 1 + torch.randn(n, generator=g) * 0.3

    layer = {
        "enorm.weight": norm(h),
        "hnorm.weight": norm(h),
        "eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
        if echo
        else rnd(h, 2 * h),
        "input_layernorm.weight": norm(h),
        "self_attn.q_proj.weight": rnd(heads * hd, h),
        "self_attn.k_proj.weight": rnd(kv * hd, h),
        "self_attn.v_proj.weight": rnd(kv * hd, h),
        "self_attn.o_proj.weight": rnd(h, heads * hd),
        "post_attention_layernorm.weight": norm(h),
        "mlp.gate.weight": rnd(experts, h),
        "mlp.gate.e_score_correction_bias": rnd(experts),
        "shared_head.norm.weight": norm(h),
    }
    if cfg["attention_bias"]:
        layer["self_attn.q_proj.bias"] = rnd(heads * hd)
        layer["self_attn.k_proj.bias"] = rnd(kv * hd)
        layer["self_attn.v_proj.bias"] = rnd(kv * hd)
    if cfg["use_qk_norm"]:
        layer["self_attn.q_norm.weight"] = norm(hd)
        layer["self_attn.k_norm.weight"] = norm(hd)
    for e in range(experts):
        layer[f"mlp.experts.{e}.gate_proj.weight"] = rnd(inter, h)
        layer[f"mlp.experts.{e}.up_proj.weight"] = rnd(inter, h)
        layer[f"mlp.experts.{e}.down_proj.weight"] = rnd(h, inter)
    shared = inter * cfg["n_shared_experts"]
    layer["mlp.shared_experts.gate_proj.weight"] = rnd(shared, h)
    layer["mlp.shared_experts.up_proj.weight"] = rnd(shared, h)
    layer["mlp.shared_experts.down_proj.weight"] = rnd(h, shared)
    if echo:
        for k in layer:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                layer[k] = layer[k] * 0.1
    if copies:
        layer["embed_tokens.weight"] = state["model.embed_tokens.weight"].clone()
        layer["shared_head.head.weight"] = state["lm_head.weight"].clone()
    state.update({f"model.layers.{L}.{k}": v for k, v in layer.items()})
    write_state(folder, state)
    cfg["num_nextn_predict_layers"] = 1
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("glm4moe")
    out = {name: build_glm4_moe(root / name, **kw) for name, kw in CASES.items()}
    # Drafts mostly right (speculation runs accepted drafts and rewinds): an echo MTP layer over
    # a target whose layers write little.
    echo = build_glm4_moe(root / "echo", seed=3, use_qk_norm=True)
    scale_residual_writes(echo, 0.05)
    add_glm_mtp_layer(echo, echo=True)
    out["echo"] = echo
    # Every MTP weight random (the draft-side check against transformers' MTP module).
    rand = build_glm4_moe(root / "random", seed=4, use_qk_norm=True, head_dim=32)
    add_glm_mtp_layer(rand, seed=5, copies=False)
    out["random"] = rand
    return out


# ----------------------------------------------------------------------------- target


@pytest.mark.timeout(180)
@pytest.mark.parametrize("name", sorted(CASES))
def test_greedy_matches_transformers(ckpts: dict[str, Path], name: str) -> None:
    folder = ckpts[name]
    ref = hf_greedy(folder, PARITY_PROMPTS, NEW_TOKENS)
    params = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(folder), dtype="float32", max_num_seqs=8) as llm:
        model = llm.engine.executor.worker.model
        outs = llm.generate(PARITY_PROMPTS, params)
    assert type(model).__name__ == "Glm4MoeForCausalLM"
    assert [type(layer.mlp).__name__ for layer in model.model.layers] == [
        "LlamaMLP",
        "DeepseekV3MoE",
        "DeepseekV3MoE",
    ]
    assert_matches_hf(outs, ref)


@pytest.mark.parametrize("factor", [0.5, 0.25, 1.0])
def test_partial_rotary_matches_transformers(factor: float) -> None:
    """The first ``head_dim * factor`` dims of each head rotate, neox style (halves of that
    slice, not interleaved pairs), as transformers' glm4_moe applies them; the rest pass."""
    import transformers as tf
    from transformers.models.glm4_moe import modeling_glm4_moe as hf

    from tandem.models.glm4_moe import Glm4MoeAttention
    from tandem.models.parallel import ParallelMapping

    cfg = tf.Glm4MoeConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=256,
        rope_parameters={
            "rope_type": "default",
            "rope_theta": 500.0,
            "partial_rotary_factor": factor,
        },
    )
    attn = Glm4MoeAttention(cfg, ParallelMapping())
    assert attn.rotary_emb.rotary_dim == int(32 * factor)
    gen = torch.Generator().manual_seed(0)
    positions = torch.tensor([0, 1, 7, 100, 255])
    q, k = torch.randn(5, 4, 32, generator=gen), torch.randn(5, 2, 32, generator=gen)
    got_q, got_k = attn.rotary_emb(positions, q, k)
    cos, sin = hf.Glm4MoeRotaryEmbedding(cfg)(q, positions[None])
    ref_q, ref_k = hf.apply_rotary_pos_emb(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], cos, sin
    )
    torch.testing.assert_close(got_q, ref_q[0].transpose(0, 1))
    torch.testing.assert_close(got_k, ref_k[0].transpose(0, 1))
    # The path without q/k norms rotates q and k heads side by side in one call.
    both = attn.rotary_emb.rotate(positions, torch.cat([q, k], dim=1))
    torch.testing.assert_close(both, torch.cat([got_q, got_k], dim=1))
    if factor < 1:
        assert torch.equal(
            got_q[..., attn.rotary_emb.rotary_dim :], q[..., attn.rotary_emb.rotary_dim :]
        )


def test_partial_rotary_factor_spellings_and_errors() -> None:
    from tandem.models.glm4_moe import rotary_dim_of

    base = {"hidden_size": 64, "num_attention_heads": 4, "head_dim": 32}
    # transformers 5 keeps the factor in rope_parameters; older config.json files at the top.
    assert (
        rotary_dim_of(SimpleNamespace(**base, rope_parameters={"partial_rotary_factor": 0.25})) == 8
    )
    assert rotary_dim_of(SimpleNamespace(**base, partial_rotary_factor=0.75)) == 24
    assert rotary_dim_of(SimpleNamespace(**base)) == 16  # transformers' GLM default: 0.5
    with pytest.raises(ValueError, match="partial_rotary_factor"):
        rotary_dim_of(SimpleNamespace(**base, partial_rotary_factor=0.03))


# ----------------------------------------------------------------------------- MTP loading


def _load(folder: Path) -> tuple[Any, Any]:
    from tandem.models.loader import load_draft, load_model

    target = load_model(str(folder), torch.float32)
    spec = SimpleNamespace(
        method="mtp", mtp_mode="eagle", num_speculative_tokens=1, model=None, draft_dtype="auto"
    )
    return target, load_draft(spec, target, str(folder), torch.float32, "cpu")


def test_mtp_layer_loads_with_and_without_the_copies(
    ckpts: dict[str, Path], tmp_path: Path
) -> None:
    """GLM-4.5 ships embedding and LM-head copies in the MTP layer, GLM-4.6 does not: both load
    (the draft shares the target's); a missing MTP tensor is named."""
    import shutil

    from tandem.models.glm4_moe import Glm4MoeMTPDraft

    with_copies = ckpts["echo"]
    assert "model.layers.3.shared_head.head.weight" in read_state(with_copies)
    for folder in (with_copies, ckpts["random"]):
        target, draft = _load(folder)
        assert isinstance(draft, Glm4MoeMTPDraft)
        assert draft.embed_tokens is target.model.embed_tokens
        assert draft.lm_head is target.lm_head
        state = read_state(folder)
        layer = draft.mtp_layers[0]
        torch.testing.assert_close(layer.enorm.weight.data, state["model.layers.3.enorm.weight"])
        torch.testing.assert_close(layer.hnorm.weight.data, state["model.layers.3.hnorm.weight"])
        experts = layer.mlp.experts
        torch.testing.assert_close(
            experts.w2.data[5], state["model.layers.3.mlp.experts.5.down_proj.weight"]
        )
        q = state["model.layers.3.self_attn.q_proj.bias"]
        torch.testing.assert_close(layer.self_attn.qkv_proj.bias.data[: q.numel()], q)
    broken = tmp_path / "broken"
    shutil.copytree(ckpts["random"], broken)
    state = read_state(broken)
    del state["model.layers.3.hnorm.weight"]
    write_state(broken, state)
    with pytest.raises(ValueError, match=r"missing tensors: .*hnorm"):
        _load(broken)


# ----------------------------------------------------------------------------- MTP drafts


def _spec(mode: str, k: int) -> dict[str, Any]:
    return {"method": "mtp", "mtp_mode": mode, "num_speculative_tokens": k}


def _run_steps(llm: LLM) -> tuple[list[list[int]], list[list[tuple[int, list[int]]]], list[Any]]:
    """Tokens per prompt, (sequence length, drafts) after every unfinished step per request,
    and each request's acceptance per position."""
    engine = llm.engine
    requests = {
        f"r{i}": engine.add_request(f"r{i}", p, SPEC_PARAMS) for i, p in enumerate(SPEC_PROMPTS)
    }
    drafts: dict[str, list[tuple[int, list[int]]]] = {rid: [] for rid in requests}
    final: dict[str, Any] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            req = requests[out.request_id]
            if out.finished:
                final[out.request_id] = out
            elif req.spec_token_ids:
                drafts[out.request_id].append((req.num_tokens, list(req.spec_token_ids)))
    return (
        [final[r].outputs[0].token_ids for r in requests],
        [drafts[r] for r in requests],
        [final[r].spec_stats.accepted_per_pos for r in requests],
    )


def hf_mtp_logits(folder: Path, sequences: list[list[int]]) -> list[torch.Tensor]:
    """transformers' own MTP module (``MtpModel``, the GLM decoder block behind enorm / hnorm /
    eh_proj and ``post_norm`` = shared_head.norm) over each whole sequence: row i holds the
    logits that draft token i + 2 from the target's final (normed) hidden state at i and token
    i + 1."""
    import transformers as tf
    from transformers.modeling_layers import MtpModel

    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
    # transformers finds MTP tensors by the layer numbers of the released GLM checkpoints.
    num_layers = model.config.num_hidden_layers
    model._keys_to_ignore_on_load_unexpected = [rf"model\.layers\.{num_layers}\..*"]
    mtp = MtpModel.from_pretrained(model).eval()
    out = []
    with torch.no_grad():
        for seq in sequences:
            ids = torch.tensor([seq])
            res = model(ids, output_hidden_states=True)
            hidden = res.hidden_states[-1]  # after the final norm (the LM head's input)
            torch.testing.assert_close(model.lm_head(hidden), res.logits)
            x = mtp.forward_layer(
                0,
                hidden[:, :-1],
                position_ids=torch.arange(1, len(seq))[None],
                mtp_cache=None,
                input_ids=ids[:, 1:],
            )
            out.append(mtp.shared_head(x)[0])
    return out


@pytest.mark.timeout(180)
@pytest.mark.parametrize("k", [1, 3])
def test_mtp_drafts_match_transformers_mtp(ckpts: dict[str, Path], k: int) -> None:
    """Every step's first draft (row picking on) is the argmax of transformers' MTP module at
    that position. Verification would hide a misloaded MTP layer (wrong drafts are only
    rejected); this check does not."""
    folder = ckpts["random"]
    with LLM(str(folder), dtype="float32", speculative_config=_spec("eagle", k)) as llm:
        tokens, drafts, _ = _run_steps(llm)
    sequences = [p + t for p, t in zip(SPEC_PROMPTS, tokens, strict=True)]
    checked = 0
    for logits, steps in zip(hf_mtp_logits(folder, sequences), drafts, strict=True):
        for length, proposed in steps:
            assert 1 <= len(proposed) <= k  # fewer near the max_tokens limit
            row = logits[length - 2]  # hidden at the token before the last, the last token
            # The draft is an argmax (up to fp32 differences between the two computations).
            assert row[proposed[0]] >= row.max() - 1e-4, (length, proposed[0], int(row.argmax()))
            checked += 1
    assert checked >= 20
    # The random layer's drafts vary (not one token everywhere).
    assert len({p[0] for steps in drafts for _, p in steps}) > 5


# ----------------------------------------------------------------------------- MTP speculation


@pytest.fixture(scope="module")
def baseline(ckpts: dict[str, Path]) -> list[list[int]]:
    with LLM(str(ckpts["echo"]), dtype="float32") as llm:
        return [o.outputs[0].token_ids for o in llm.generate(SPEC_PROMPTS, SPEC_PARAMS)]


def _moe_row_counts(llm: LLM) -> list[tuple[int, int]]:
    """(attention rows, MoE rows) of every call of the last MTP layer, recorded by hooks."""
    layer = llm.engine.executor.worker.runner.spec.draft.mtp_layers[-1]
    calls: list[tuple[int, int]] = []
    layer.self_attn.register_forward_hook(lambda m, a, o: calls.append((o.shape[0], -1)))

    def on_mlp(m: Any, args: Any, out: Any) -> None:
        calls[-1] = (calls[-1][0], args[0].shape[0])

    layer.mlp.register_forward_hook(on_mlp)
    return calls


@pytest.mark.timeout(180)
@pytest.mark.parametrize("k", [1, 3])
@pytest.mark.parametrize("mode", ["eagle", "vanilla"])
def test_mtp_greedy_speculation_is_exact(
    ckpts: dict[str, Path], baseline: list[list[int]], mode: str, k: int, monkeypatch: Any
) -> None:
    # A 16-token budget chunks the 50-token prompt; chunks share steps with decodes.
    run = {"dtype": "float32", "speculative_config": _spec(mode, k), "max_num_batched_tokens": 16}
    with LLM(str(ckpts["echo"]), **run) as llm:
        draft = llm.engine.executor.worker.runner.spec.draft
        calls = _moe_row_counts(llm)
        tokens, _, accepted = _run_steps(llm)
        stats = llm.engine.get_stats()
    assert type(draft).__name__ == "Glm4MoeMTPDraft"
    assert len(draft.mtp_layers) == (1 if mode == "eagle" else k)
    assert tokens == baseline
    assert stats.num_used_kv_blocks == 0
    # The drafts are mostly right, so accepted drafts (and their rewinds) are exercised.
    assert sum(sum(a) for a in accepted) > 0
    # Row pick: on draft step 0 the MoE sees one row per request, attention every row.
    assert any(moe < attn for attn, moe in calls)
    if k != 3:
        return
    monkeypatch.setenv("TLLM_SPEC_DISABLE_DRAFT_ROW_PICK", "1")
    with LLM(str(ckpts["echo"]), **run) as llm:
        calls = _moe_row_counts(llm)
        unpicked, _, unpicked_accepted = _run_steps(llm)
    assert unpicked == baseline
    assert all(moe == attn for attn, moe in calls)
    assert unpicked_accepted == accepted  # the same drafts, position by position


# ----------------------------------------------------------------------------- parallel

# Unequal load under ADP: rank 1 gets the short requests and idles (dummy steps) while rank 0
# still decodes; a 16-token budget chunks the 30-token prompt.
PAR_PROMPTS = [list(range(40, 70)), [5, 6, 7], [100, 101], [9], list(range(10, 22))]
PAR_PARAMS = [
    SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0)
    for n in (16, 3, 12, 2, 9)
]
PAR_RUN: dict[str, Any] = {
    "dtype": "float32",
    "max_num_batched_tokens": 16,
    "speculative_config": {"method": "mtp", "num_speculative_tokens": 3},
}


@pytest.fixture(scope="module")
def par_target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_glm4_moe(
        tmp_path_factory.mktemp("glmtp") / "t", layers=2, vocab_size=322, use_qk_norm=True
    )
    scale_residual_writes(folder, 0.05)
    add_glm_mtp_layer(folder, echo=True)
    return folder


def _generate(llm: LLM) -> tuple[list[list[int]], list[list[float]], list[Any]]:
    outs = llm.generate(PAR_PROMPTS, PAR_PARAMS)
    return (
        [o.outputs[0].token_ids for o in outs],
        [[lp.logprob for lp in o.outputs[0].logprobs] for o in outs],
        [o.spec_stats.accepted_per_pos for o in outs],
    )


@pytest.fixture(scope="module")
def single(par_target: Path) -> tuple[list[list[int]], list[list[float]], list[Any]]:
    plain = {k: v for k, v in PAR_RUN.items() if k != "speculative_config"}
    with LLM(str(par_target), **plain) as llm:
        plain_tokens = [o.outputs[0].token_ids for o in llm.generate(PAR_PROMPTS, PAR_PARAMS)]
    with LLM(str(par_target), **PAR_RUN) as llm:
        ref = _generate(llm)
    assert ref[0] == plain_tokens
    assert sum(sum(a) for a in ref[2]) > 0
    return ref


def _close(a: list[list[float]], b: list[list[float]]) -> float:
    return max(abs(x - y) for ra, rb in zip(a, b, strict=True) for x, y in zip(ra, rb, strict=True))


@pytest.mark.timeout(300)
@pytest.mark.parametrize("adp", [False, True], ids=["tp2", "adp2-lm-head-tp"])
def test_two_ranks_equal_one(par_target: Path, single: tuple[Any, Any, Any], adp: bool) -> None:
    """TP = 2 (heads, KV heads and experts split) or attention DP = 2 with LM-head TP
    (attention replicated, MoE over both ranks' rows), with MTP K = 3: the same tokens,
    log-probs and drafts as one rank."""
    tokens, logprobs, accepted = single
    extra = {"enable_attention_dp": True, "enable_lm_head_tp_in_adp": True} if adp else {}
    with LLM(str(par_target), tensor_parallel_size=2, **extra, **PAR_RUN) as llm:
        engine = llm.engine
        assert engine.dp_size == (2 if adp else 1)
        layer = engine.executor.worker.model.model.layers[1]
        assert layer.self_attn.num_heads == (4 if adp else 2)
        assert layer.self_attn.num_kv_heads == (2 if adp else 1)
        assert layer.mlp.experts.w13.shape[0] == 4  # 8 experts over 2 ranks
        got_tokens, got_logprobs, got_accepted = _generate(llm)
        assert engine.get_stats().num_used_kv_blocks == 0
    assert got_tokens == tokens
    assert _close(got_logprobs, logprobs) < 1e-4
    assert got_accepted == accepted  # the same drafts, position by position
