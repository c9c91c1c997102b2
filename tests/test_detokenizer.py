"""Incremental detokenization: the text after every token equals a full decode of the output
so far (trailing partial characters held back until they complete), on random byte-level
token sequences full of split and invalid UTF-8, with and without special tokens and stop
strings."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest

from checkpoints import build_tokenizer
from tandem.engine.detokenizer import Detokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def full_visible(tokenizer: Any, ids: list[int], skip: bool, hold: int, finished: bool) -> str:
    """What the detokenizer showed when it re-decoded the whole output every token."""
    text = tokenizer.decode(ids, skip_special_tokens=skip)
    if finished:
        return text
    return text[: max(0, len(text) - hold)].rstrip("\ufffd") if hold else text.rstrip("\ufffd")


@pytest.mark.parametrize("skip", [True, False])
def test_incremental_text_equals_a_full_decode_after_every_token(
    tokenizer: Any, skip: bool
) -> None:
    rng = random.Random(0)
    vocab = len(tokenizer)
    words = tokenizer.encode("héllo wörld, 世界 🙂 ünïcode ok", add_special_tokens=False)
    multibyte_checked = 0
    for trial in range(300):
        n = rng.randint(1, 40)
        if trial % 3 == 0:  # real text, split anywhere
            ids = [words[rng.randrange(len(words))] for _ in range(n)]
        else:  # random ids: byte tokens that split or break UTF-8, merges, special tokens
            ids = [rng.randrange(vocab) for _ in range(n)]
        d = Detokenizer(tokenizer, skip, [])
        for k in range(1, n + 1):
            assert d.update(ids[:k], False) is None
            assert d.visible(False) == full_visible(tokenizer, ids[:k], skip, 0, False), (ids, k)
        assert d.visible(True) == tokenizer.decode(ids, skip_special_tokens=skip), ids
        multibyte_checked += any(ord(c) > 127 for c in d.visible(True))
    assert multibyte_checked > 50


def test_stop_strings_cut_where_a_full_decode_would(tokenizer: Any) -> None:
    """A stop string is found at the first token whose full decode contains it (even when it
    ends next to a character still incomplete), and the text is cut as a full decode's."""
    text = "abc héllo wörld, 世界 🙂 the end. abc again 世界"
    ids = tokenizer.encode(text, add_special_tokens=False)
    hold = len("never") - 1
    for stop, include in [("wörld", False), ("界", True), ("🙂 the", False), ("again", True)]:
        d = Detokenizer(tokenizer, True, [stop, "never"])
        found, k = None, 0
        while found is None:
            k += 1
            found = d.update(ids[:k], include)
            if found is None:
                assert d.visible(False) == full_visible(tokenizer, ids[:k], True, hold, False)
        full = tokenizer.decode(ids[:k], skip_special_tokens=True)
        assert found == stop and stop in full
        assert stop not in tokenizer.decode(ids[: k - 1], skip_special_tokens=True)
        cut = full.index(stop) + (len(stop) if include else 0)
        assert d.visible(True) == full[:cut]


class _NonAdditive:
    """A tokenizer whose text for a window is not a continuation of its prefix's text (the
    words come out in reverse), so every update takes the full-decode fallback."""

    def __init__(self, words: list[str]) -> None:
        self.words = words

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return " ".join(self.words[i] for i in reversed(ids))


def test_non_additive_tokenizers_fall_back_to_a_full_decode() -> None:
    tok = _NonAdditive(["alpha", "beta", "gamma", "delta"])
    ids = [0, 1, 2, 3, 1, 0, 2]
    d = Detokenizer(tok, True, [])
    for k in range(1, len(ids) + 1):
        d.update(ids[:k], False)
        assert d.visible(False) == tok.decode(ids[:k]), k
    assert d.visible(True) == "gamma alpha beta delta gamma beta alpha"
