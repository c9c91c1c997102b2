"""The model's tokenizer and the token ids that end its sequences, for the engine, the ranks
(their grammar compilers) and the API process alike."""

from __future__ import annotations

import json
import os
from typing import Any


def load_tokenizer(path: str) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path, trust_remote_code=False)


def load_generation_config(path: str) -> dict[str, Any]:
    f = os.path.join(path, "generation_config.json")
    if not os.path.isfile(f):
        return {}
    with open(f) as fh:
        return json.load(fh)


def as_id_set(value: Any) -> set[int]:
    """A config's token id field (None, one id or a list of ids) as a set."""
    if value is None:
        return set()
    if isinstance(value, int):
        return {value}
    return {int(v) for v in value}


def model_eos_token_ids(model_config: Any, tokenizer: Any) -> frozenset[int]:
    """The ids that end a sequence: the generation config's, the model config's and the
    tokenizer's."""
    generation_config = load_generation_config(model_config.model)
    return frozenset(
        as_id_set(generation_config.get("eos_token_id"))
        | as_id_set(getattr(model_config.hf_config, "eos_token_id", None))
        | as_id_set(tokenizer.eos_token_id)
    )
