"""Every public Eagle3 head layout loads and drafts what it should.

Greedy output under speculation equals the target's alone whatever the head drafts
(verification corrects wrong drafts), so each layout is also checked on the draft side: a head
re-saved from the original EAGLE3 layout drafts exactly the original's tokens at every engine
step, and a head no original-layout checkpoint can express (several layers, missing norms,
``norm_before_residual``, its own narrower embedding, q/k norms, a Llama-4 MLP width) drafts
exactly the tokens of a plain-torch reference of the Eagle3 head over the target's hidden
states from ``transformers``.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import build_llama, random_eagle3_head, write_eagle3_layout
from tandem import LLM, SamplingParams

PROMPTS = [[5, 6, 7, 8, 9], list(range(40, 58)), [100, 101, 102, 103, 104, 105, 106]]
K = 3
CAPTURE = (2, 0, 1)  # output-of-layer ids (default for 4 layers would be (1, 1, 0))
PARAMS = SamplingParams(temperature=0, max_tokens=14, ignore_eos=True)
Head = tuple[dict[str, torch.Tensor], dict[str, Any]]


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("e3") / "target", layers=4, seed=4)


@pytest.fixture(scope="module")
def baseline(target: Path) -> list[list[int]]:
    with LLM(str(target)) as llm:
        return [o.outputs[0].token_ids for o in llm.generate(PROMPTS, PARAMS)]


@pytest.fixture(scope="module")
def hf_target(target: Path) -> Any:
    import transformers as tf

    return tf.AutoModelForCausalLM.from_pretrained(str(target), dtype=torch.float64).eval()


def _run(target: Path, head: Path) -> dict[str, Any]:
    """Step the engine through ``PROMPTS`` with ``head``: the tokens, the drafts each step left
    on each request, and what the loaded head looks like."""
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K}
    with LLM(str(target), speculative_config=spec) as llm:
        engine = llm.engine
        runner = engine.executor.worker.runner
        draft = runner.spec.draft
        reqs = {f"r{i}": engine.add_request(f"r{i}", p, PARAMS) for i, p in enumerate(PROMPTS)}
        tokens: dict[str, list[int]] = {}
        drafts: dict[str, list[list[int]]] = {rid: [] for rid in reqs}
        while engine.has_unfinished_requests():
            for out in engine.step():
                drafts[out.request_id].append(list(reqs[out.request_id].spec_token_ids))
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        return {
            "tokens": [tokens[rid] for rid in reqs],
            "drafts": [drafts[rid] for rid in reqs],
            "capture": runner.capture_layers,
            "num_draft_caches": len(draft.attention_layers()),
            "own_embedding": "own_embed_tokens" in draft._modules,
            "num_drafts": engine.spec_stats.num_drafts,
        }


# ---------------------------------------------------------------------------- reference


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _rope(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    """Neox rotary on [n, heads, d]."""
    d = x.shape[-1]
    inv = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float64) / d)
    f = pos[:, None].double() * inv[None]
    cos, sin = torch.cat([f, f], -1).cos()[:, None], torch.cat([f, f], -1).sin()[:, None]
    return x * cos + torch.cat([-x[..., d // 2 :], x[..., : d // 2]], -1) * sin


def _attention(
    w: dict[str, torch.Tensor], p: str, cfg: dict[str, Any], x: torch.Tensor, pos: torch.Tensor
) -> torch.Tensor:
    """Causal GQA attention of the layer with prefix ``p`` over rows ``x`` [n, in]."""
    n, heads, kv = x.shape[0], cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg["head_dim"]
    eps, theta = cfg["rms_norm_eps"], cfg["rope_theta"]
    q = (x @ w[p + "self_attn.q_proj.weight"].T).view(n, heads, hd)
    k = (x @ w[p + "self_attn.k_proj.weight"].T).view(n, kv, hd)
    v = (x @ w[p + "self_attn.v_proj.weight"].T).view(n, kv, hd)
    if p + "self_attn.q_norm.weight" in w:
        q = _rms(q, w[p + "self_attn.q_norm.weight"], eps)
        k = _rms(k, w[p + "self_attn.k_norm.weight"], eps)
    q, k = _rope(q, pos, theta), _rope(k, pos, theta)
    k, v = k.repeat_interleave(heads // kv, 1), v.repeat_interleave(heads // kv, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * hd**-0.5
    scores = scores.masked_fill(torch.ones(n, n).triu(1).bool(), float("-inf"))
    out = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(n, heads * hd)
    return out @ w[p + "self_attn.o_proj.weight"].T


def _mlp(w: dict[str, torch.Tensor], p: str, x: torch.Tensor) -> torch.Tensor:
    gate = torch.nn.functional.silu(x @ w[p + "mlp.gate_proj.weight"].T)
    return (gate * (x @ w[p + "mlp.up_proj.weight"].T)) @ w[p + "mlp.down_proj.weight"].T


@torch.no_grad()
def reference_drafts(
    hf: Any,
    head: Head,
    prompt: list[int],
    first_token: int,
    *,
    norm_before_residual: bool = False,
) -> list[int]:
    """The K greedy drafts an Eagle3 head makes after the prefill of ``prompt`` (whose sampled
    token is ``first_token``), recomputed over the whole sequence at every step in float64:
    row p reads token p + 1 and fc(the captured target layers at p); each draft step appends
    a row (the draft, the last row's pre-norm output, the next position). Layers are
    ``layers.{i}.*``; a norm ``state`` lacks is an identity."""
    state, cfg = head
    w = {k: v.double() for k, v in state.items()}
    eps = cfg["rms_norm_eps"]
    hs = hf(torch.tensor([prompt]), output_hidden_states=True).hidden_states
    # hidden_states[i + 1]: the output of layer i (the last entry is normed: not captured here)
    ids = cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"]
    assert max(ids) + 2 < len(hs)
    hidden = torch.cat([hs[i + 1][0] for i in ids], -1) @ w["fc.weight"].T
    embed = w.get("embed_tokens.weight", hf.model.embed_tokens.weight.double())
    lm_head = w.get("lm_head.weight")
    if lm_head is None:  # the target's, unless only the head's own (tied) embedding fits
        narrow = cfg["hidden_size"] != hf.config.hidden_size
        own = cfg.get("tie_word_embeddings") and narrow and "embed_tokens.weight" in w
        lm_head = embed if own else hf.lm_head.weight.double()
    d2t = w.get("d2t", torch.zeros(lm_head.shape[0])).long()
    tokens, positions = [*prompt[1:], first_token], list(range(len(prompt)))
    drafts: list[int] = []
    for _ in range(K):
        pos = torch.tensor(positions)
        e = embed[torch.tensor(tokens)]
        if "layers.0.input_layernorm.weight" in w:
            e = _rms(e, w["layers.0.input_layernorm.weight"], eps)
        normed = hidden
        if "layers.0.hidden_norm.weight" in w:
            normed = _rms(hidden, w["layers.0.hidden_norm.weight"], eps)
        attn = _attention(w, "layers.0.", cfg, torch.cat([e, normed], -1), pos)
        s = (normed if norm_before_residual else hidden) + attn
        s = s + _mlp(w, "layers.0.", _rms(s, w["layers.0.post_attention_layernorm.weight"], eps))
        for i in range(1, cfg["num_hidden_layers"]):
            p = f"layers.{i}."
            attn = _attention(w, p, cfg, _rms(s, w[p + "input_layernorm.weight"], eps), pos)
            s = s + attn
            s = s + _mlp(w, p, _rms(s, w[p + "post_attention_layernorm.weight"], eps))
        last = s[-1]
        logits = (_rms(last, w["norm.weight"], eps) if "norm.weight" in w else last) @ lm_head.T
        top = logits.topk(2)
        # A clear argmax: the float32 engine cannot tie-break differently.
        assert float(top.values[0] - top.values[1]) > 1e-4 * float(logits.abs().max())
        draft = int(top.indices[0]) + int(d2t[top.indices[0]])
        drafts.append(draft)
        tokens.append(draft)
        positions.append(positions[-1] + 1)
        hidden = torch.cat([hidden, last[None]])
    return drafts


# ---------------------------------------------------------------------------- layouts


@pytest.fixture(scope="module")
def original(target: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """The reference head in the original EAGLE3 layout (160-token draft vocabulary) and its
    run."""
    head = random_eagle3_head(target, draft_vocab=160)
    folder = write_eagle3_layout(tmp_path_factory.mktemp("orig") / "h", *head, "eagle3")
    return {"head": head, "run": _run(target, folder)}


def _int32_d2t(head: Head) -> Head:
    state, cfg = head
    return {**state, "d2t": state["d2t"].to(torch.int32)}, cfg


def _with_target_embedding(head: Head, target: Path) -> Head:
    """The head carrying a copy of the target's embedding (as speculators heads save it)."""
    embed = load_file(str(target / "model.safetensors"))["model.embed_tokens.weight"]
    return {**head[0], "embed_tokens.weight": embed.clone()}, head[1]


@pytest.mark.parametrize("layout", ["layers", "modelopt", "speculators", "int32-d2t"])
def test_layout_drafts_what_the_original_drafts(
    target: Path, baseline, original: dict[str, Any], tmp_path: Path, layout: str
) -> None:
    """The original head's tensors and config re-saved in another layout: the same output (the
    target's), the same drafts at every engine step, the same capture layers (read from where
    the layout keeps them)."""
    head = original["head"]
    if layout == "int32-d2t":
        folder = write_eagle3_layout(tmp_path / "h", *_int32_d2t(head), "eagle3")
    elif layout == "speculators":
        folder = write_eagle3_layout(
            tmp_path / "h", *_with_target_embedding(head, target), "speculators"
        )
    else:
        folder = write_eagle3_layout(tmp_path / "h", *head, layout)
    run, ref = _run(target, folder), original["run"]
    assert run["tokens"] == ref["tokens"] == baseline
    assert run["drafts"] == ref["drafts"]
    assert run["capture"] == ref["capture"] == CAPTURE
    assert run["num_drafts"] > 0
    # A head's copy of the target's embedding is dropped for the target's (one copy).
    assert not run["own_embedding"]


def test_original_drafts_match_the_reference(
    target: Path, hf_target, baseline, original: dict[str, Any]
) -> None:
    """The original layout itself against the plain-torch reference (the anchor of the
    layout-equivalence test above)."""
    first = [d[0] for d in original["run"]["drafts"]]
    for prompt, base, drafts in zip(PROMPTS, baseline, first, strict=True):
        assert drafts == reference_drafts(hf_target, original["head"], prompt, base[0])


def _drop(head: Head, *names: str, **config: Any) -> Head:
    state, cfg = head
    return {k: v for k, v in state.items() if k not in names}, {**cfg, **config}


def _case(name: str, target: Path) -> tuple[Head, str, bool]:
    """(head, layout, norm_before_residual) of a layout the original cannot express."""
    if name == "layers-2":
        return random_eagle3_head(target, layers=2, draft_vocab=160, seed=11), "layers", False
    if name == "modelopt-3":
        return random_eagle3_head(target, layers=3, seed=12), "modelopt", False
    if name == "speculators-2-norm-before-residual":
        return random_eagle3_head(target, layers=2, seed=13), "speculators", True
    if name == "modelopt-no-last-norm-no-hidden-norm":
        head = random_eagle3_head(target, seed=14)  # the target's vocabulary: no d2t
        dropped = ("norm.weight", "layers.0.hidden_norm.weight", "lm_head.weight")
        return _drop(head, *dropped), "modelopt", False
    if name == "modelopt-no-embedding-norm":
        head = random_eagle3_head(target, seed=15, draft_vocab=100)
        return _drop(head, "layers.0.input_layernorm.weight"), "modelopt", False
    if name == "narrow-own-embedding-tied":
        head = random_eagle3_head(target, seed=16, hidden=32, own_embedding=True)
        return _drop(head, "lm_head.weight", tie_word_embeddings=True), "speculators", False
    if name == "tied-config-no-lm-head":
        # The flag is the (tied) target's config copied; the head was trained with an LM head
        # of its own, equal to the target's: never the embedding (it read the embedding).
        head = random_eagle3_head(target, seed=19)
        return _drop(head, "lm_head.weight", tie_word_embeddings=True), "eagle3", False
    if name == "qwen3-qk-norm":
        return random_eagle3_head(target, seed=17, qk_norm=True, draft_vocab=200), "eagle3", False
    if name == "llama4-intermediate-size-mlp":
        # Llama 4: intermediate_size is an expert's width, intermediate_size_mlp the dense one.
        state, cfg = random_eagle3_head(target, seed=18, intermediate=96)
        cfg = {**cfg, "intermediate_size": 160, "intermediate_size_mlp": 96}
        return (state, cfg), "eagle3", False
    raise AssertionError(name)


@pytest.mark.parametrize(
    "name",
    [
        "layers-2",
        "modelopt-3",
        "speculators-2-norm-before-residual",
        "modelopt-no-last-norm-no-hidden-norm",
        "modelopt-no-embedding-norm",
        "narrow-own-embedding-tied",
        "tied-config-no-lm-head",
        "qwen3-qk-norm",
        "llama4-intermediate-size-mlp",
    ],
)
def test_layout_drafts_what_the_reference_drafts(
    target: Path, hf_target, baseline, tmp_path: Path, name: str
) -> None:
    """After the prefill, each request's K drafts are the reference's; the output is the
    target's; a multi-layer head has a draft KV cache per layer."""
    head, layout, nbr = _case(name, target)
    folder = write_eagle3_layout(tmp_path / "h", *head, layout, norm_before_residual=nbr)
    run = _run(target, folder)
    assert run["tokens"] == baseline
    assert run["capture"] == CAPTURE
    assert run["num_draft_caches"] == head[1]["num_hidden_layers"]
    assert run["own_embedding"] == ("embed_tokens.weight" in head[0])
    for prompt, base, drafts in zip(PROMPTS, baseline, run["drafts"], strict=True):
        expected = reference_drafts(hf_target, head, prompt, base[0], norm_before_residual=nbr)
        assert drafts[0] == expected


# ---------------------------------------------------------------------------- capture layers


def _capture(folder: Path, configured: list[int] | None = None) -> tuple[int, ...]:
    from tandem.engine.worker import eagle3_capture_layers
    from tandem.models.eagle3_layout import read_eagle3_config

    spec = SimpleNamespace(eagle3_layers_to_capture=configured)
    return eagle3_capture_layers(spec, read_eagle3_config(folder), 4)


def test_capture_layers_come_from_the_checkpoint(target: Path, tmp_path: Path) -> None:
    """Each layout's ids, where it keeps them: ``eagle_config`` (the output of layer i),
    speculators' top-level ids (vLLM's count: the input of layer i); none: the default; an
    ambiguous top-level list outside speculators is refused unless configured."""
    head = random_eagle3_head(target, capture=(3, 1, 2))
    for layout in ("eagle3", "layers", "modelopt", "speculators"):
        folder = write_eagle3_layout(tmp_path / layout, *head, layout)
        assert _capture(folder) == (3, 1, 2), layout
        assert _capture(folder, [0, 1, 2]) == (0, 1, 2)  # the configured ones win
    spec_cfg = json.loads((tmp_path / "speculators" / "config.json").read_text())
    assert spec_cfg["eagle_aux_hidden_state_layer_ids"] == [4, 2, 3]
    spec_cfg["eagle_aux_hidden_state_layer_ids"] = [0, 2, 3]  # the embeddings: not capturable
    (tmp_path / "speculators" / "config.json").write_text(json.dumps(spec_cfg))
    with pytest.raises(ValueError, match=r"speculators: hidden state i is the output of layer"):
        _capture(tmp_path / "speculators")
    spec_cfg.pop("eagle_aux_hidden_state_layer_ids")
    (tmp_path / "speculators" / "config.json").write_text(json.dumps(spec_cfg))
    assert _capture(tmp_path / "speculators") == (1, 1, 0)  # the default for 4 layers
    plain = tmp_path / "eagle3" / "config.json"
    cfg = json.loads(plain.read_text())
    cfg["eagle_aux_hidden_state_layer_ids"] = cfg.pop("eagle_config")[
        "eagle_aux_hidden_state_layer_ids"
    ]
    plain.write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="top-level eagle_aux_hidden_state_layer_ids"):
        _capture(tmp_path / "eagle3")
    assert _capture(tmp_path / "eagle3", [3, 1, 2]) == (3, 1, 2)


# ---------------------------------------------------------------------------- refusals


@pytest.fixture(scope="module")
def target_model(target: Path) -> Any:
    from tandem.models.loader import load_model

    return load_model(target)


def _load(target: Path, target_model: Any, folder: Path) -> Any:
    from tandem.models.loader import load_draft

    spec = SimpleNamespace(method="eagle3", model=str(folder), draft_dtype="auto")
    return load_draft(spec, target_model, target, torch.float32, "cpu")


def test_missing_fc_and_mismatched_hidden_size_are_refused_at_load(
    target: Path, tmp_path: Path
) -> None:
    """Through the engine: a ``ValueError`` naming what the folder holds, not a misload."""
    head = random_eagle3_head(target)
    no_fc = write_eagle3_layout(tmp_path / "no_fc", *_drop(head, "fc.weight"), "eagle3")
    with pytest.raises(ValueError, match=r"has no fc\.weight.*found: .*supported: EAGLE3"):
        LLM(str(target), speculative_config={"method": "eagle3", "model": str(no_fc)})
    narrow = random_eagle3_head(target, hidden=32)  # no embedding of its own
    folder = write_eagle3_layout(tmp_path / "narrow", *narrow, "layers")
    with pytest.raises(
        ValueError, match=r"hidden_size \(32\) differs from the target's \(64\).*embed_tokens"
    ):
        LLM(str(target), speculative_config={"method": "eagle3", "model": str(folder)})


def _edit_config(folder: Path, **changes: Any) -> Path:
    cfg = json.loads((folder / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            cfg.pop(key, None)
        elif isinstance(value, dict) and isinstance(cfg.get(key), dict):
            cfg[key] = {**cfg[key], **value}
        else:
            cfg[key] = value
    (folder / "config.json").write_text(json.dumps(cfg))
    return folder


def test_unsupported_layouts_are_refused_with_what_was_found(
    target: Path, target_model, tmp_path: Path
) -> None:
    """Each unsupported or self-contradicting checkpoint: a ``ValueError`` at load that names
    what was found (the loader alone, the target already loaded)."""
    head = random_eagle3_head(target, draft_vocab=160)

    def saved(name: str, layout: str = "eagle3", h: Head = head) -> Path:
        return write_eagle3_layout(tmp_path / name, *h, layout)

    cases: list[tuple[Path, str]] = [
        (_edit_config(saved("arch"), architectures=["MistralForCausalLM"]), "not an Eagle3"),
        (_edit_config(saved("llama4"), model_type="llama4_text"), "'llama4_text' decoder"),
        (_edit_config(saved("tgt"), target_hidden_size=96), r"target_hidden_size \(96\)"),
        (_edit_config(saved("n"), num_hidden_layers=2), "num_hidden_layers=2 but the checkpoint"),
        (
            _edit_config(saved("aux", "modelopt"), eagle_config={"use_aux_hidden_state": False}),
            "use_aux_hidden_state is false",
        ),
        (
            _edit_config(saved("last", "modelopt"), eagle_config={"use_last_layernorm": False}),
            "use_last_layernorm is false but the checkpoint has norm.weight",
        ),
        (
            _edit_config(
                saved("first", "modelopt"),
                eagle_config={"use_input_layernorm_in_first_layer": False},
            ),
            "one of the first layer's input norms .* has both",
        ),
        (_edit_config(saved("nbr", "speculators"), norm_before_residual=None), "does not say"),
        (_edit_config(saved("fcn", "speculators"), norm_before_fc=True), "norm_before_fc"),
        (
            _edit_config(saved("mlp"), intermediate_size_mlp=64, intermediate_size=96),
            "gate_proj has \\[128\\] rows, neither intermediate_size_mlp=64",
        ),
        (
            _edit_config(
                saved("qk", h=random_eagle3_head(target, qk_norm=True)), model_type="llama"
            ),
            r"has q/k norms \(self_attn.q_norm\) but its layers' model_type 'llama'",
        ),
    ]
    # Two layer key layouts in one checkpoint.
    mixed = write_eagle3_layout(tmp_path / "mixed", *head, "eagle3")
    state = load_file(str(mixed / "model.safetensors"))
    state["layers.1.input_layernorm.weight"] = torch.ones(64)
    save_file(state, str(mixed / "model.safetensors"))
    cases.append((mixed, r"mixes layer key layouts: layers\.\{i\}\.\*, midlayer\.\*"))
    # d2t holding target ids rather than offsets.
    absolute = {**head[0], "d2t": head[0]["d2t"] + torch.arange(160) + 200}
    cases.append((write_eagle3_layout(tmp_path / "abs", absolute, head[1], "eagle3"), "d2t maps"))
    # A reduced draft vocabulary with no LM head of its own.
    cases.append((saved("nolm", h=_drop(head, "lm_head.weight")), "has no lm_head.weight"))
    for folder, match in cases:
        with pytest.raises(ValueError, match=match):
            _load(target, target_model, folder)


def test_own_embedding_is_used_instead_of_the_targets(
    target: Path, target_model, tmp_path: Path
) -> None:
    """A head carrying an embedding other than the target's keeps it (registered, loaded);
    a head carrying the target's own embedding shares the target's."""
    head = random_eagle3_head(target, own_embedding=True, draft_vocab=160)
    draft = _load(target, target_model, write_eagle3_layout(tmp_path / "own", *head, "layers"))
    assert draft.embed_tokens is draft.own_embed_tokens
    assert torch.equal(draft.embed_tokens.weight, head[0]["embed_tokens.weight"])
    copy = _with_target_embedding(random_eagle3_head(target, draft_vocab=160), target)
    draft = _load(target, target_model, write_eagle3_layout(tmp_path / "copy", *copy, "layers"))
    assert draft.embed_tokens is target_model.model.embed_tokens
    assert "own_embed_tokens" not in draft._modules


def test_the_shipped_head_reads_as_the_plain_layout() -> None:
    """The built-in head (the original layout written by our trainer) reads as one plain
    midlayer with its checkpoint's capture layers."""
    from tandem.models.eagle3_layout import Eagle3Layout, read_eagle3_config
    from tandem.models.heads import builtin_speculative_config

    folder = builtin_speculative_config({"method": "eagle3"})["model"]
    layout = read_eagle3_config(folder).eagle3_layout
    assert layout == Eagle3Layout(intermediate_size=1536, capture_layers=(1, 14, 26))
    assert layout.fast_path_unsupported() is None
