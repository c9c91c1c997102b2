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


def hf_greedy(folder: Path, prompts: list[list[int]], max_new_tokens: int) -> list[dict[str, Any]]:
    """transformers' own greedy generate (one prompt at a time): tokens and chosen logprobs."""
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).eval()
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
