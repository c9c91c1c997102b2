"""Tiny real checkpoints for tests: built with ``transformers``, saved with ``safetensors``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

CORPUS = (
    "The quick brown fox jumps over the lazy dog. Paris is the capital of France. "
    "Speculative decoding drafts tokens and verifies them in one forward pass. "
    "Hello world! How are you today? I am fine, thank you. 0123456789 "
    "user assistant system: tokens, blocks, caches; prefill and decode."
)
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def build_tokenizer(folder: Path, vocab_size: int = 256) -> Any:
    """A byte-level BPE tokenizer trained on a small corpus, with a chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator([CORPUS] * 4, trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<|im_start|>",
        eos_token="<|endoftext|>",
        pad_token="<|endoftext|>",
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(str(folder))
    return fast


def build_llama(
    folder: Path,
    *,
    arch: str = "llama",
    vocab_size: int = 320,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 4,
    kv_heads: int = 2,
    head_dim: int | None = None,
    intermediate: int = 128,
    tie: bool = False,
    rope: dict[str, Any] | None = None,
    dtype: torch.dtype = torch.float32,
    max_shard_size: str | None = None,
    seed: int = 0,
    init_std: float = 0.08,
    max_position_embeddings: int = 512,
) -> Path:
    """Save a random ``arch`` (llama | qwen2 | qwen3) model + tokenizer into ``folder``."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    cfg_cls, model_cls = {
        "llama": (tf.LlamaConfig, tf.LlamaForCausalLM),
        "qwen2": (tf.Qwen2Config, tf.Qwen2ForCausalLM),
        "qwen3": (tf.Qwen3Config, tf.Qwen3ForCausalLM),
    }[arch]
    kw: dict[str, Any] = dict(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        intermediate_size=intermediate,
        tie_word_embeddings=tie,
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    if head_dim is not None:
        kw["head_dim"] = head_dim
    if rope is not None:
        kw["rope_parameters"] = rope
    config = cfg_cls(**kw)
    torch.manual_seed(seed)
    model = model_cls(config).to(dtype).eval()
    save_kw: dict[str, Any] = {}
    if max_shard_size:
        save_kw["max_shard_size"] = max_shard_size
    model.save_pretrained(str(folder), **save_kw)
    gen = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


def hf_greedy(
    folder: Path, prompts: list[list[int]], max_new_tokens: int, **load: Any
) -> list[dict[str, Any]]:
    """transformers' own greedy generate (one prompt at a time): tokens and chosen logprobs.
    ``load``: more arguments of ``from_pretrained`` (a quantization config)."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32, **load)
    model.eval()
    model.generation_config.eos_token_id = None  # run the full length, like ignore_eos
    results = []
    for ids in prompts:
        with torch.no_grad():
            out = model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=max_new_tokens,
                output_scores=True,
                output_logits=True,
                return_dict_in_generate=True,
                pad_token_id=0,
            )
        tokens = out.sequences[0, len(ids) :].tolist()
        logprobs = [
            torch.log_softmax(step_logits[0].float(), -1)[t].item()
            for step_logits, t in zip(out.logits, tokens, strict=True)
        ]
        results.append({"tokens": tokens, "logprobs": logprobs})
    return results


def assert_matches_hf(outs: list[Any], ref: list[dict[str, Any]], tol: float = 1e-4) -> None:
    """Our greedy outputs (with ``logprobs=0``) against ``hf_greedy``'s: the same tokens, the
    chosen log-probs within ``tol``, and a continuation varied enough to mean something (more
    than 10 distinct tokens over the prompts)."""
    diffs = []
    for out, expected in zip(outs, ref, strict=True):
        got = out.outputs[0]
        assert got.token_ids == expected["tokens"]
        diffs += [
            abs(a.logprob - b) for a, b in zip(got.logprobs, expected["logprobs"], strict=True)
        ]
    assert max(diffs) < tol
    assert len({t for e in ref for t in e["tokens"]}) > 10


def _read_state(folder: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    state: dict[str, torch.Tensor] = {}
    for f in sorted(folder.glob("*.safetensors")):
        state.update(load_file(str(f)))
    return state


def _write_state(folder: Path, state: dict[str, torch.Tensor]) -> None:
    from safetensors.torch import save_file

    for f in folder.glob("*.safetensors"):
        f.unlink()
    index = folder / "model.safetensors.index.json"
    if index.exists():
        index.unlink()
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / "model.safetensors"))


def mtp_head_with_vocab(
    src: Path, dst: Path, vocab: list[int] | None, dtype: torch.dtype | None = None
) -> Path:
    """The MTP layers of checkpoint ``src`` as a head folder at ``dst`` (the target's config,
    only ``model.layers.{L + i}.*``, in ``dtype`` when given) that drafts from ``vocab`` (target
    ids, as listed): a ``d2t`` tensor, target id = draft id + d2t[draft id]; None: no ``d2t``."""
    dst.mkdir(parents=True)
    config = (src / "config.json").read_text()
    (dst / "config.json").write_text(config)
    first = json.loads(config)["num_hidden_layers"]
    state = {
        k: v
        for k, v in _read_state(src).items()
        if k.startswith("model.layers.") and int(k.split(".")[2]) >= first
    }
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    if vocab is not None:
        ids = torch.tensor(vocab, dtype=torch.int64)
        state["d2t"] = ids - torch.arange(len(ids))
    _write_state(dst, state)
    return dst


def zero_residual_writes(folder: Path) -> None:
    """Make every target layer add nothing to the residual stream (o_proj = down_proj = 0):
    the next token then depends only on the current one."""
    state = _read_state(folder)
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = torch.zeros_like(state[name])
        if name == "model.norm.weight":
            state[name] = torch.ones_like(state[name])
    _write_state(folder, state)


def add_mtp_layers(
    folder: Path, num_layers: int = 1, *, perfect: bool = False, seed: int = 1
) -> None:
    """Append MTP layers in the DeepSeek layout at ``model.layers.{L + i}``.

    ``perfect``: eh_proj passes the next token's (normed) embedding through and the block adds
    nothing, so with a zero-residual target the draft predicts exactly what the target will."""
    cfg = json.loads((folder / "config.json").read_text())
    h, inter, L = cfg["hidden_size"], cfg["intermediate_size"], cfg["num_hidden_layers"]
    heads, kv = cfg["num_attention_heads"], cfg["num_key_value_heads"]
    hd = cfg.get("head_dim") or h // heads
    state = _read_state(folder)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    dtype = next(iter(state.values())).dtype
    for i in range(num_layers):
        p = f"model.layers.{L + i}."
        layer = {
            "enorm.weight": torch.ones(h),
            "hnorm.weight": torch.ones(h),
            "eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
            if perfect
            else rnd(h, 2 * h),
            "input_layernorm.weight": torch.ones(h),
            "self_attn.q_proj.weight": rnd(heads * hd, h),
            "self_attn.k_proj.weight": rnd(kv * hd, h),
            "self_attn.v_proj.weight": rnd(kv * hd, h),
            "self_attn.o_proj.weight": torch.zeros(h, heads * hd)
            if perfect
            else rnd(h, heads * hd),
            "post_attention_layernorm.weight": torch.ones(h),
            "mlp.gate_proj.weight": rnd(inter, h),
            "mlp.up_proj.weight": rnd(inter, h),
            "mlp.down_proj.weight": torch.zeros(h, inter) if perfect else rnd(h, inter),
            "shared_head.norm.weight": torch.ones(h),
        }
        if cfg.get("model_type") == "qwen2":
            layer.update(
                {
                    "self_attn.q_proj.bias": rnd(heads * hd),
                    "self_attn.k_proj.bias": rnd(kv * hd),
                    "self_attn.v_proj.bias": rnd(kv * hd),
                }
            )
        if cfg.get("model_type") == "qwen3":
            layer.update(
                {
                    "self_attn.q_norm.weight": torch.ones(hd),
                    "self_attn.k_norm.weight": torch.ones(hd),
                }
            )
        state.update({p + k: v.to(dtype) for k, v in layer.items()})
    _write_state(folder, state)
    cfg["num_nextn_predict_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def build_eagle3_draft(
    folder: Path,
    target: Path,
    *,
    draft_vocab: int | None = None,
    seed: int = 2,
    with_lm_head: bool = True,
    dtype: torch.dtype = torch.float32,
    max_position_embeddings: int | None = None,
) -> Path:
    """A random Eagle3 draft head for ``target`` in the public checkpoint layout, its floating
    tensors stored in ``dtype``. ``max_position_embeddings``: default a quarter of the
    target's, as the public Llama 3.1 head says 2048 behind an 8192 target."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    t = json.loads((target / "config.json").read_text())
    h, heads, kv, inter = (
        t["hidden_size"],
        t["num_attention_heads"],
        t["num_key_value_heads"],
        t["intermediate_size"],
    )
    hd = t.get("head_dim") or h // heads
    vocab = t["vocab_size"]
    dv = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    # Draft vocabulary: dv target ids (here: every other id first, then the rest), sorted.
    chosen = sorted(torch.randperm(vocab, generator=g)[:dv].tolist())
    d2t = torch.tensor([tid - i for i, tid in enumerate(chosen)], dtype=torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[chosen] = True
    state = {
        "fc.weight": rnd(h, 3 * h),
        "midlayer.input_layernorm.weight": torch.ones(h),
        "midlayer.hidden_norm.weight": torch.ones(h),
        "midlayer.self_attn.q_proj.weight": rnd(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rnd(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": rnd(h, heads * hd),
        "midlayer.post_attention_layernorm.weight": torch.ones(h),
        "midlayer.mlp.gate_proj.weight": rnd(inter, h),
        "midlayer.mlp.up_proj.weight": rnd(inter, h),
        "midlayer.mlp.down_proj.weight": rnd(h, inter),
        "norm.weight": torch.ones(h),
        "d2t": d2t,
        "t2d": t2d,
    }
    if with_lm_head:
        state["lm_head.weight"] = rnd(dv, h)
    state = {k: v.to(dtype) if v.is_floating_point() else v for k, v in state.items()}
    save_file(state, str(folder / "model.safetensors"))
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "llama",
        "hidden_size": h,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_hidden_layers": 1,
        "vocab_size": vocab,
        "draft_vocab_size": dv,
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        "max_position_embeddings": max_position_embeddings or t["max_position_embeddings"] // 4,
        "rope_theta": (t.get("rope_parameters") or {}).get(
            "rope_theta", t.get("rope_theta", 10000.0)
        ),
        "tie_word_embeddings": False,
    }
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    return folder


def make_echo_target(folder: Path, residual_scale: float = 0.0) -> None:
    """Turn a Llama checkpoint into one whose greedy next token is always the current one: no
    layer writes to the residual stream, the embedding rows have equal norms and the LM head is
    the embedding (Cauchy-Schwarz: a row's logit is largest against itself).

    ``residual_scale`` > 0 keeps the layers' writes, scaled by it: a near-echo target whose
    attention and MLPs still change some next tokens."""
    if residual_scale:
        scale_residual_writes(folder, residual_scale)
    else:
        zero_residual_writes(folder)
    state = _read_state(folder)
    embed = state["model.embed_tokens.weight"].float()
    norms = embed.norm(dim=1, keepdim=True).clamp_min(1e-6)  # a padding row stays zero
    embed = (embed / norms).to(state["model.embed_tokens.weight"].dtype)
    state["model.embed_tokens.weight"] = embed
    if "lm_head.weight" in state:
        state["lm_head.weight"] = embed.clone()
    _write_state(folder, state)


def perfect_eagle3_draft(folder: Path, target: Path, residual_scale: float = 0.0) -> Path:
    """An Eagle3 head that drafts exactly what an echo target (``make_echo_target``) generates:
    ``fc`` passes the first captured hidden state (the current token's embedding) through, the
    midlayer adds nothing, and its LM head is the target's embedding. Every draft is accepted.

    ``residual_scale`` > 0: the midlayer adds its random attention and MLP outputs scaled by it
    (a head that is nearly perfect, whose attention and MLP still change some drafts)."""
    build_eagle3_draft(folder, target)
    state = _read_state(folder)
    h = state["norm.weight"].shape[0]
    state["fc.weight"] = torch.cat([torch.eye(h), torch.zeros(h, 2 * h)], 1)
    for name in ("midlayer.self_attn.o_proj.weight", "midlayer.mlp.down_proj.weight"):
        state[name] = (
            state[name] * residual_scale if residual_scale else torch.zeros_like(state[name])
        )
    state["lm_head.weight"] = _read_state(target)["model.embed_tokens.weight"].float().clone()
    _write_state(folder, state)
    return folder


def build_deepseek_v3(
    folder: Path,
    *,
    vocab_size: int = 320,
    hidden_size: int = 64,
    layers: int = 3,
    first_k_dense_replace: int = 1,
    heads: int = 4,
    q_lora_rank: int | None = 48,
    kv_lora_rank: int = 32,
    qk_nope_head_dim: int = 16,
    qk_rope_head_dim: int = 8,
    v_head_dim: int = 24,
    intermediate: int = 96,
    moe_intermediate: int = 32,
    experts: int = 8,
    shared_experts: int = 1,
    n_group: int = 4,
    topk_group: int = 2,
    top_k: int = 3,
    routed_scaling_factor: float = 2.5,
    norm_topk_prob: bool = True,
    rope: dict[str, Any] | None = None,
    max_position_embeddings: int = 512,
    seed: int = 0,
    init_std: float = 0.08,
) -> Path:
    """Save a random ``DeepseekV3ForCausalLM`` (MLA + grouped-top-k MoE) + tokenizer into
    ``folder``; the router's score-correction bias is random too (transformers zeroes it)."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = tf.DeepseekV3Config(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate,
        moe_intermediate_size=moe_intermediate,
        num_hidden_layers=layers,
        first_k_dense_replace=first_k_dense_replace,
        num_attention_heads=heads,
        num_key_value_heads=heads,
        q_lora_rank=q_lora_rank,
        kv_lora_rank=kv_lora_rank,
        qk_nope_head_dim=qk_nope_head_dim,
        qk_rope_head_dim=qk_rope_head_dim,
        v_head_dim=v_head_dim,
        n_routed_experts=experts,
        n_shared_experts=shared_experts,
        n_group=n_group,
        topk_group=topk_group,
        num_experts_per_tok=top_k,
        routed_scaling_factor=routed_scaling_factor,
        norm_topk_prob=norm_topk_prob,
        rope_parameters=rope or {"rope_type": "default", "rope_theta": 10000.0},
        max_position_embeddings=max_position_embeddings,
        initializer_range=init_std,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        num_nextn_predict_layers=0,
    )
    torch.manual_seed(seed)
    model = tf.DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, buf in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buf.copy_(torch.randn(buf.shape) * 0.05)
    model.save_pretrained(str(folder))
    gen = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


def scale_residual_writes(folder: Path, factor: float) -> None:
    """Scale what every layer writes to the residual stream (``o_proj`` and every
    ``down_proj``, experts included) by ``factor`` and set the final norm to ones: with a small
    factor the next token depends mostly on the current one (MTP layers then predict it well)."""
    state = _read_state(folder)
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = state[name] * factor
        if name == "model.norm.weight":
            state[name] = torch.ones_like(state[name])
    _write_state(folder, state)


def build_deepseek_mtp_target(folder: Path, num_mtp_layers: int = 1) -> Path:
    """A 2-layer DeepSeek-V3 (322 tokens) whose layers write little to the residual stream, with
    near-echo MTP layers: drafts mostly right, acceptance that varies by position."""
    build_deepseek_v3(folder, layers=2, vocab_size=322)
    scale_residual_writes(folder, 0.05)
    add_deepseek_mtp_layers(folder, num_mtp_layers, echo=True)
    return folder


def add_deepseek_mtp_layers(
    folder: Path, num_layers: int = 1, *, seed: int = 1, echo: bool = False
) -> None:
    """Append DeepSeek-V3 MTP layers at ``model.layers.{L + i}`` in the released layout: the
    shared ``embed_tokens`` and ``shared_head.head`` copies, ``enorm``, ``hnorm``, ``eh_proj``,
    an MLA + MoE decoder block (per-expert tensors) and ``shared_head.norm``.

    ``echo``: eh_proj passes the next token's normed embedding through and the block writes
    little (random, scaled by 0.1), so with ``scale_residual_writes`` on the target the drafts
    are mostly right while attention and MoE still change them."""
    cfg = json.loads((folder / "config.json").read_text())
    h, L = cfg["hidden_size"], cfg["num_hidden_layers"]
    heads, inter = cfg["num_attention_heads"], cfg["moe_intermediate_size"]
    nope, rope, v = cfg["qk_nope_head_dim"], cfg["qk_rope_head_dim"], cfg["v_head_dim"]
    kv_lora, q_lora = cfg["kv_lora_rank"], cfg.get("q_lora_rank")
    state = _read_state(folder)
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    for i in range(num_layers):
        layer = {
            "embed_tokens.weight": state["model.embed_tokens.weight"].clone(),
            "shared_head.head.weight": state["lm_head.weight"].clone(),
            "enorm.weight": torch.ones(h),
            "hnorm.weight": torch.ones(h),
            "eh_proj.weight": torch.cat([torch.eye(h), torch.zeros(h, h)], 1)
            if echo
            else rnd(h, 2 * h),
            "input_layernorm.weight": torch.ones(h),
            "self_attn.kv_a_proj_with_mqa.weight": rnd(kv_lora + rope, h),
            "self_attn.kv_a_layernorm.weight": torch.ones(kv_lora),
            "self_attn.kv_b_proj.weight": rnd(heads * (nope + v), kv_lora),
            "self_attn.o_proj.weight": rnd(h, heads * v),
            "post_attention_layernorm.weight": torch.ones(h),
            "mlp.gate.weight": rnd(cfg["n_routed_experts"], h),
            "mlp.gate.e_score_correction_bias": rnd(cfg["n_routed_experts"]),
            "shared_head.norm.weight": torch.ones(h),
        }
        if q_lora is None:
            layer["self_attn.q_proj.weight"] = rnd(heads * (nope + rope), h)
        else:
            layer["self_attn.q_a_proj.weight"] = rnd(q_lora, h)
            layer["self_attn.q_a_layernorm.weight"] = torch.ones(q_lora)
            layer["self_attn.q_b_proj.weight"] = rnd(heads * (nope + rope), q_lora)
        for e in range(cfg["n_routed_experts"]):
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
        state.update({f"model.layers.{L + i}.{k}": val for k, val in layer.items()})
    _write_state(folder, state)
    cfg["num_nextn_predict_layers"] = num_layers
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))


def random_eagle3_head(
    target: Path,
    *,
    layers: int = 1,
    hidden: int | None = None,
    draft_vocab: int | None = None,
    intermediate: int | None = None,
    qk_norm: bool = False,
    own_embedding: bool = False,
    capture: tuple[int, ...] = (2, 0, 1),
    seed: int = 7,
) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    """A random Eagle3 head for ``target``, as (tensors named ``layers.{i}.*``, ``fc``,
    ``norm``, ``lm_head``, ``d2t``/``t2d`` for a reduced vocabulary, ``embed_tokens`` when
    ``own_embedding``; the original-layout config fields). Norm weights are random too, so a
    swapped or skipped tensor changes what the head drafts. ``write_eagle3_layout`` saves it
    in any public layout."""
    t = json.loads((target / "config.json").read_text())
    th, vocab = t["hidden_size"], t["vocab_size"]
    h = hidden or th
    heads, kv = t["num_attention_heads"], t["num_key_value_heads"]
    hd = t.get("head_dim") or th // heads
    inter = intermediate or t["intermediate_size"]
    dv = draft_vocab or vocab
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=g) * 0.08

    def norm(n: int) -> torch.Tensor:
        return 1.0 + 0.2 * torch.randn(n, generator=g)

    state: dict[str, torch.Tensor] = {"fc.weight": rnd(h, 3 * th)}
    for i in range(layers):
        p, width = f"layers.{i}.", 2 * h if i == 0 else h
        state[p + "input_layernorm.weight"] = norm(h)
        if i == 0:
            state[p + "hidden_norm.weight"] = norm(h)
        state[p + "self_attn.q_proj.weight"] = rnd(heads * hd, width)
        state[p + "self_attn.k_proj.weight"] = rnd(kv * hd, width)
        state[p + "self_attn.v_proj.weight"] = rnd(kv * hd, width)
        state[p + "self_attn.o_proj.weight"] = rnd(h, heads * hd)
        if qk_norm:
            state[p + "self_attn.q_norm.weight"] = norm(hd)
            state[p + "self_attn.k_norm.weight"] = norm(hd)
        state[p + "post_attention_layernorm.weight"] = norm(h)
        state[p + "mlp.gate_proj.weight"] = rnd(inter, h)
        state[p + "mlp.up_proj.weight"] = rnd(inter, h)
        state[p + "mlp.down_proj.weight"] = rnd(h, inter)
    state["norm.weight"] = norm(h)
    state["lm_head.weight"] = rnd(dv, h)
    if dv < vocab:
        chosen = sorted(torch.randperm(vocab, generator=g)[:dv].tolist())
        state["d2t"] = torch.tensor(chosen) - torch.arange(dv)
        t2d = torch.zeros(vocab, dtype=torch.bool)
        t2d[chosen] = True
        state["t2d"] = t2d
    if own_embedding:
        state["embed_tokens.weight"] = rnd(vocab, h) * 4
    cfg = {
        "architectures": ["LlamaForCausalLMEagle3"],
        "model_type": "qwen3" if qk_norm else "llama",
        "hidden_size": h,
        "target_hidden_size": th,
        "intermediate_size": inter,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "num_hidden_layers": layers,
        "vocab_size": vocab,
        "draft_vocab_size": dv,
        "rms_norm_eps": t.get("rms_norm_eps", 1e-6),
        # A quarter of the target's, as public heads say (2048 behind an 8192 target).
        "max_position_embeddings": t["max_position_embeddings"] // 4,
        "rope_theta": (t.get("rope_parameters") or {}).get(
            "rope_theta", t.get("rope_theta", 10000.0)
        ),
        "tie_word_embeddings": False,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(capture)},
    }
    return state, cfg


def write_eagle3_layout(
    folder: Path,
    state: dict[str, torch.Tensor],
    cfg: dict[str, Any],
    layout: str,
    *,
    norm_before_residual: bool = False,
) -> Path:
    """Save a ``random_eagle3_head`` (tensors, config) in one public layout:

    - ``eagle3``: EAGLE3 / SpecForge, ``midlayer.*`` (one layer);
    - ``layers``: ``layers.{i}.*``, LlamaForCausalLMEagle3 config;
    - ``modelopt``: NVIDIA ModelOpt export, ``architectures: ["LlamaForCausalLM"]``, nested
      ``eagle_config`` flags (from which norms ``state`` holds), ``midlayer.*`` for one layer,
      ``midlayer.{i}.*`` for several;
    - ``speculators``: ``Eagle3Speculator``, the layer config nested in
      ``transformer_layer_config``, top-level capture ids counted as vLLM does (+1)."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    n = int(cfg["num_hidden_layers"])
    ids = list(cfg["eagle_config"]["eagle_aux_hidden_state_layer_ids"])

    def layer_prefix(i: int) -> str:
        if layout == "eagle3" or (layout == "modelopt" and n == 1):
            return "midlayer."
        return f"midlayer.{i}." if layout == "modelopt" else f"layers.{i}."

    out: dict[str, torch.Tensor] = {}
    for name, value in state.items():
        if name.startswith("layers."):
            _, i, rest = name.split(".", 2)
            name = layer_prefix(int(i)) + rest
        out[name] = value.contiguous()
    if layout == "eagle3" and n != 1:
        raise ValueError("the midlayer layout holds one layer")
    config = dict(cfg)
    if layout == "modelopt":
        config["architectures"] = ["LlamaForCausalLM"]
        first = {k.split(".", 2)[2] for k in state if k.startswith("layers.0.")}
        config["eagle_config"] = {
            "eagle_aux_hidden_state_layer_ids": ids,
            "use_aux_hidden_state": True,
            "use_input_layernorm_in_first_layer": {
                "input_layernorm.weight",
                "hidden_norm.weight",
            }
            <= first,
            "use_last_layernorm": "norm.weight" in state,
            "use_mtp_layernorm": False,
            "next_layer_regular": True,
            "parallel_draft_step": 1,
            "parallel_draft_heads_num_layers": 1,
        }
    elif layout == "speculators":
        layer = {
            k: v
            for k, v in cfg.items()
            if k not in ("architectures", "draft_vocab_size", "target_hidden_size", "eagle_config")
        }
        config = {
            "architectures": ["Eagle3Speculator"],
            "speculators_model_type": "eagle3",
            "speculators_version": "0.3.0",
            "transformer_layer_config": layer,
            "draft_vocab_size": cfg["draft_vocab_size"],
            "target_hidden_size": cfg.get("target_hidden_size"),
            "norm_before_residual": norm_before_residual,
            "eagle_aux_hidden_state_layer_ids": [i + 1 for i in ids],
            "speculators_config": {
                "algorithm": "eagle3",
                "default_proposal_method": "greedy",
                "proposal_methods": [{"proposal_type": "greedy", "speculative_tokens": 3}],
                "verifier": {"name_or_path": "target", "architectures": ["LlamaForCausalLM"]},
            },
        }
    elif layout not in ("eagle3", "layers"):
        raise ValueError(f"unknown layout {layout!r}")
    save_file(out, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    return folder


def eagle3_tree_spec(head: Path, topk: int, n: int, k: int = 3) -> dict[str, Any]:
    """A speculative_config of Eagle3 draft trees: ``head``'s folder, ``topk`` children per
    node, ``n`` nodes verified, depth ``k``."""
    return {
        "method": "eagle3",
        "model": str(head),
        "num_speculative_tokens": k,
        "topk": topk,
        "num_draft_tokens": n,
    }


# gpt-oss-20b's config.json as released, but for the sizes (and the token ids, which must fit
# the tiny vocabulary): both spellings of top-k, YaRN without truncation, a 128-token window on
# every other layer, head_dim independent of hidden_size / heads (64 x 64 != 2880 there).
def build_qwen3_moe(
    folder: Path,
    *,
    layers: int = 3,
    experts: int = 8,
    top_k: int = 2,
    norm_topk_prob: bool = True,
    decoder_sparse_step: int = 1,
    mlp_only_layers: list[int] | None = None,
    seed: int = 0,
    vocab_size: int = 320,
) -> Path:
    """A random ``Qwen3MoeForCausalLM`` + tokenizer, its config.json in the released spelling
    (``num_experts``, top-level ``rope_theta``, ``rope_scaling: null``). The norms are random too
    (transformers starts them at ones), so loading q_norm / k_norm matters."""
    import transformers as tf

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder)
    config = tf.Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=96,
        moe_intermediate_size=32,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,  # 4 x 32 = 2 x hidden, as Qwen3-30B-A3B's 32 x 128 against 2048
        num_experts=experts,
        num_experts_per_tok=top_k,
        norm_topk_prob=norm_topk_prob,
        decoder_sparse_step=decoder_sparse_step,
        mlp_only_layers=mlp_only_layers or [],
        rope_parameters={"rope_type": "default", "rope_theta": 1000000.0},
        max_position_embeddings=40960,
        initializer_range=0.08,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    torch.manual_seed(seed)
    model = tf.Qwen3MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, t in model.named_parameters():
            if "norm" in name:
                t.copy_(1 + torch.randn(t.shape) * 0.2)
    model.save_pretrained(str(folder))
    cfg = json.loads((folder / "config.json").read_text())
    cfg["num_experts"] = cfg.pop("num_local_experts")
    cfg["rope_theta"] = cfg.pop("rope_parameters")["rope_theta"]
    cfg |= {"rope_scaling": None, "torch_dtype": "bfloat16", "max_window_layers": layers}
    cfg.pop("dtype", None)
    (folder / "config.json").write_text(json.dumps(cfg, indent=2))
    gen = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder


GPT_OSS_20B = {
    "architectures": ["GptOssForCausalLM"],
    "attention_bias": True,
    "attention_dropout": 0.0,
    "experts_per_token": 4,
    "hidden_act": "silu",
    "initial_context_length": 4096,
    "initializer_range": 0.02,
    "max_position_embeddings": 131072,
    "model_type": "gpt_oss",
    "num_experts_per_tok": 4,
    "output_router_logits": False,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "beta_fast": 32.0,
        "beta_slow": 1.0,
        "factor": 32.0,
        "original_max_position_embeddings": 4096,
        "rope_type": "yarn",
        "truncate": False,
    },
    "rope_theta": 150000,
    "router_aux_loss_coef": 0.9,
    "sliding_window": 128,
    "swiglu_limit": 7.0,
    "tie_word_embeddings": False,
    "use_cache": True,
}
GPT_OSS_MXFP4 = {
    "modules_to_not_convert": [
        "model.layers.*.self_attn",
        "model.layers.*.mlp.router",
        "model.embed_tokens",
        "lm_head",
    ],
    "quant_method": "mxfp4",
}


def quantize_mxfp4(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """[..., rows, cols] → (blocks [..., rows, cols/32, 16] uint8, scales [..., rows, cols/32]
    uint8): per 32 values a power-of-two scale putting the largest at most 6 (E2M1's largest),
    each value rounded to the nearest E2M1 (ties to the smaller magnitude)."""
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    blocks = w.float().reshape(*w.shape[:-1], w.shape[-1] // 32, 32)
    peak = blocks.abs().amax(-1).clamp(min=2.0**-126)
    exponent = torch.ceil(torch.log2(peak / 6.0)).clamp(-127, 127)
    scaled = blocks / torch.ldexp(torch.ones_like(exponent), exponent.int())[..., None]
    magnitude = (scaled.abs()[..., None] - grid).abs().argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).to(torch.uint8)
    packed = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return packed, (exponent + 127).to(torch.uint8)


def build_gpt_oss(
    folder: Path,
    *,
    mxfp4: bool = False,
    vocab_size: int = 256,
    hidden_size: int = 64,
    layers: int = 2,
    heads: int = 8,
    kv_heads: int = 2,
    head_dim: int = 16,
    experts: int = 8,
    seed: int = 0,
    sliding_window: int | None = None,
) -> Path:
    """Save a random ``GptOssForCausalLM`` + tokenizer into ``folder`` from gpt-oss-20b's
    released config values (``GPT_OSS_20B``), sinks and biases random (transformers' init
    zeroes some); with ``mxfp4`` the experts are stored as the release stores them
    (``*_blocks`` / ``*_scales``) and ``quantization_config`` says so. ``sliding_window``
    replaces the released 128."""
    import transformers as tf
    from safetensors.torch import load_file, save_file

    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(folder, vocab_size)
    values = {
        **GPT_OSS_20B,
        "vocab_size": vocab_size,
        "hidden_size": hidden_size,
        "intermediate_size": hidden_size,  # as released: 2880 and 2880
        "num_hidden_layers": layers,
        "layer_types": [("sliding_attention", "full_attention")[i % 2] for i in range(layers)],
        "num_attention_heads": heads,
        "num_key_value_heads": kv_heads,
        "head_dim": head_dim,
        "num_local_experts": experts,
        "sliding_window": sliding_window or GPT_OSS_20B["sliding_window"],
        "eos_token_id": tokenizer.eos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
    }
    config = tf.GptOssConfig(**values)
    torch.manual_seed(seed)
    model = tf.GptOssForCausalLM(config).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" not in name:
                # Sinks that matter, and expert gates past swiglu_limit on some rows.
                kind = name.rsplit(".", 1)[-1]
                std = {"sinks": 1.0, "gate_up_proj": 0.6}.get(
                    kind, 0.02 if "bias" in kind else 0.15
                )
                p.normal_(0.0, std)
    model.save_pretrained(str(folder))
    text = json.loads((folder / "config.json").read_text())
    text.update({k: v for k, v in values.items() if k not in text})  # release-only keys
    if mxfp4:
        text["quantization_config"] = GPT_OSS_MXFP4
        (path,) = folder.glob("*.safetensors")
        state = load_file(str(path))
        for name in [n for n in state if n.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
            # Released [E, out, in] blocks of the [E, in, out] parameter.
            blocks, scales = quantize_mxfp4(state.pop(name).transpose(1, 2))
            state[f"{name}_blocks"], state[f"{name}_scales"] = blocks, scales
        save_file(state, str(path), metadata={"format": "pt"})
    (folder / "config.json").write_text(json.dumps(text, indent=2))
    gen = {"eos_token_id": tokenizer.eos_token_id, "bos_token_id": tokenizer.bos_token_id}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    return folder
