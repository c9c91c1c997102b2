"""Output text and stop-string handling for one request."""

from __future__ import annotations

from typing import Any


def fast_decode(tokenizer: Any) -> Any:
    """``tokenizer.decode``, or for a fast tokenizer that does no clean-up its Rust backend's
    decode: the same text without the Python wrapper's per-call conversions (a quarter of a
    short request's engine time went to them)."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None or getattr(tokenizer, "clean_up_tokenization_spaces", True):
        return tokenizer.decode
    return backend.decode


class Detokenizer:
    """Keeps a request's output text; ``visible`` holds back what a stop string might still cut.

    Decoded incrementally: each update decodes only a window of the newest tokens (the text of
    the window minus that of its already-shown first part), so a step costs the same at the
    10th token and the 10000th (re-decoding the whole output took 576 us per request per step
    at 2048 tokens). Tokens whose text ends in the middle of a character wait in ``pending``
    until the character completes; the text is the whole output's decode, appended to only."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""  # settled text: the decode of output tokens [0, read_offset)
        self.pending = ""  # text of the tokens after read_offset, ending mid-character
        self.prefix_offset = 0  # the decode window starts here ...
        self.read_offset = 0  # ... and its text up to here is already in self.text
        self.stopped_on: str | None = None
        self._decode_ids = fast_decode(tokenizer)

    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, skip_special_tokens=self.skip_special_tokens)

    def _advance(self, ids: list[int]) -> None:
        if len(ids) <= self.read_offset:
            return
        prefix = self._decode(ids[self.prefix_offset : self.read_offset])
        window = self._decode(ids[self.prefix_offset :])
        if not window.startswith(prefix):  # a tokenizer whose window text is not additive
            self.text, self.pending = self._decode(ids), ""
            # The next window keeps a few tokens of context (a leading space stays a space).
            self.prefix_offset, self.read_offset = max(0, len(ids) - 4), len(ids)
            return
        new = window[len(prefix) :]
        if new.endswith("\ufffd"):  # a character still incomplete: wait for its next bytes
            self.pending = new
            return
        self.text += new
        self.pending = ""
        self.prefix_offset, self.read_offset = self.read_offset, len(ids)

    def update(
        self, output_token_ids: list[int], include_stop: bool, can_stop: bool = True
    ) -> str | None:
        """Decode the new tokens; returns the stop string if one now appears (text truncated).
        ``can_stop`` False (``min_tokens`` not reached): the text is only decoded, never cut,
        since generation goes on after it."""
        prev_len = len(self.text) + len(self.pending)
        self._advance(output_token_ids)
        if not self.stop or not can_stop:
            return None
        full = self.text + self.pending
        start = max(0, prev_len - self.hold - 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = full.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = full[: i + len(s)] if include_stop else full[:i]
        self.pending = ""
        self.stopped_on = s
        return s

    def visible(self, finished: bool) -> str:
        """Text safe to show now: all of it once finished; while running, without a trailing
        partial character or a tail that could still become a stop string."""
        text = self.text + self.pending
        if finished:
            return text
        if self.hold:
            text = text[: max(0, len(text) - self.hold)]
        return text.rstrip("\ufffd")
