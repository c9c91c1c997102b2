"""`tandem bench compare`'s workloads: the run's configuration, the prompt set (tokenized with the
model's chat template), and which speculative rows it runs (heads, trees)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tandem.bench.serve_requests import EVAL_PROMPTS, read_jsonl_prompts
from tandem.bench.support import BenchError

REPO = Path(__file__).resolve().parent.parent


SHIPPED_HEADS = REPO / "models" / "heads"


NONE = "none"  # --eagle3 none / --mtp none: skip that row
# --workload: chat questions, or tasks whose answer copies the prompt's text (what n-gram and
# suffix drafting are for).
WORKLOADS = {
    "chat": REPO / "training" / "data" / "eval_prompts.jsonl",
    "grounded": REPO / "training" / "data" / "grounded_prompts.jsonl",
}


@dataclass
class BenchConfig:
    dtype: str
    device: str
    max_tokens: int
    concurrency: list[int]
    batch1_prompts: int
    rounds: int = 1
    stop_at_eos: bool = False
    json_schema: str | None = None  # the text of a schema every Tandem request must match


def load_prompts(path: str | None, model: str, num: int) -> list[list[int]]:
    """The prompts as chat (the model's template) token ids, ``num`` of them (cycled)."""
    from transformers import AutoTokenizer

    texts = [p for p, _ in read_jsonl_prompts(path or EVAL_PROMPTS)]
    tok = AutoTokenizer.from_pretrained(model, trust_remote_code=False)
    out = []
    for text in cycle_prompts(texts, num):  # type: ignore[arg-type]
        if getattr(tok, "chat_template", None):
            ids = tok.apply_chat_template(
                [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=True
            )
            ids = ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids
        else:
            ids = tok.encode(text)
        out.append([int(i) for i in ids])
    return out


def same_tokenizer(a: str, b: str) -> bool:
    from transformers import AutoTokenizer

    ta = AutoTokenizer.from_pretrained(a, trust_remote_code=False)
    tb = AutoTokenizer.from_pretrained(b, trust_remote_code=False)
    return ta.get_vocab() == tb.get_vocab()


def parse_trees(value: str, k: int) -> list[tuple[int, int]]:
    """``--trees``: (topk, num_draft_tokens) pairs, each a valid tree of depth ``k``."""
    from tandem.engine.speculative.tree import check_tree_shape

    trees = []
    for item in filter(None, value.split(",")):
        try:
            topk, n = (int(x) for x in item.split(":"))
            check_tree_shape(k, topk, n)
        except ValueError as e:
            raise BenchError(f"--trees {item!r}: expected TOPK:N with a valid tree ({e})") from None
        if topk < 2:
            raise BenchError(f"--trees {item!r}: topk must be >= 2 (topk 1 is the chain row)")
        trees.append((topk, n))
    return trees


def spec_choice(
    given: str | None, default: Path | None, method: str, k: int
) -> tuple[dict[str, Any] | None, str]:
    """(speculative config or None, why not)."""
    if given == NONE:
        return None, f"skipped (--{method} {NONE})"
    if given is not None:
        if not Path(given).is_dir():
            raise BenchError(f"--{method} {given!r} is not a folder")
        return {"method": method, "model": given, "num_speculative_tokens": k}, ""
    if default is not None and default.is_dir():
        return {"method": method, "model": str(default), "num_speculative_tokens": k}, ""
    where = f"no head at {default.relative_to(REPO)}" if default is not None else "no head given"
    return None, f"{where}; pass --{method} PATH"


def cycle_prompts(prompts: list[list[int]], n: int) -> list[list[int]]:
    return [prompts[i % len(prompts)] for i in range(n)]
