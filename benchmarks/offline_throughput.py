"""Offline decode throughput: Tandem's LLM against transformers ``generate`` in one run.

Builds a small random Llama checkpoint (or takes ``--model``), then measures
  - single-request decode tokens/s (greedy, fixed output length), and
  - aggregate tokens/s for N requests (ours batched, transformers one after another),
and prints a table with the ratios.

    python benchmarks/offline_throughput.py [--model PATH] [--requests 16] [--tokens 64]
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))


def build_model(folder: Path, hidden: int, layers: int, vocab: int) -> Path:
    from checkpoints import build_llama

    return build_llama(
        folder,
        vocab_size=vocab,
        hidden_size=hidden,
        layers=layers,
        heads=hidden // 64,
        kv_heads=max(1, hidden // 256),
        intermediate=hidden * 3,
        max_position_embeddings=2048,
    )


def run_transformers(
    model_path: str, prompts: list[list[int]], tokens: int, dtype: torch.dtype
) -> float:
    import transformers as tf

    model = tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).eval()
    model.generation_config.eos_token_id = None
    start = time.perf_counter()
    with torch.inference_mode():
        for ids in prompts:
            model.generate(
                torch.tensor([ids]),
                attention_mask=torch.ones(1, len(ids), dtype=torch.long),
                do_sample=False,
                max_new_tokens=tokens,
                pad_token_id=0,
            )
    return len(prompts) * tokens / (time.perf_counter() - start)


def run_tandem(model_path: str, prompts: list[list[int]], tokens: int, dtype: str) -> float:
    from engine import LLM, SamplingParams

    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    with LLM(model_path, dtype=dtype, max_num_seqs=max(len(prompts), 1)) as llm:
        llm.generate(prompts[:1], SamplingParams(temperature=0, max_tokens=4))  # warm-up
        start = time.perf_counter()
        outs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
    assert all(len(o.outputs[0].token_ids) == tokens for o in outs)
    return len(prompts) * tokens / elapsed


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--model", help="model folder (default: a random Llama built here)")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--requests", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--prompt-len", type=int, default=32)
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    args = ap.parse_args()
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory() as tmp:
        path = args.model or str(build_model(Path(tmp) / "m", args.hidden, args.layers, args.vocab))
        vocab = args.vocab if not args.model else 1000
        prompts = [
            torch.randint(10, vocab, (args.prompt_len,)).tolist() for _ in range(args.requests)
        ]
        tdtype = getattr(torch, args.dtype)
        rows = []
        hf1 = run_transformers(path, prompts[:1], args.tokens, tdtype)
        ours1 = run_tandem(path, prompts[:1], args.tokens, args.dtype)
        rows.append(("batch 1 decode", hf1, ours1))
        hfn = run_transformers(path, prompts, args.tokens, tdtype)
        oursn = run_tandem(path, prompts, args.tokens, args.dtype)
        rows.append((f"{args.requests} requests (aggregate)", hfn, oursn))
    print(
        f"\nmodel: {args.model or f'random Llama h={args.hidden} L={args.layers} V={args.vocab}'}"
        f", dtype {args.dtype}, {args.tokens} new tokens, prompt {args.prompt_len}, "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'workload':<28}{'transformers tok/s':>20}{'tandem tok/s':>16}{'ratio':>10}")
    for name, hf, ours in rows:
        print(f"{name:<28}{hf:>20.1f}{ours:>16.1f}{ours / hf:>9.2f}x")


if __name__ == "__main__":
    main()
