"""Output text and stop-string handling for one request."""

from __future__ import annotations

from typing import Any


class Detokenizer:
    """Keeps a request's output text; ``visible`` holds back what a stop string might still cut."""

    def __init__(self, tokenizer: Any, skip_special_tokens: bool, stop: list[str]) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop
        self.hold = max((len(s) for s in stop), default=1) - 1
        self.text = ""
        self.stopped_on: str | None = None

    def update(self, output_token_ids: list[int], include_stop: bool) -> str | None:
        """Re-decode the output; returns the stop string if one now appears (text truncated)."""
        prev_len = len(self.text)
        self.text = self.tokenizer.decode(
            output_token_ids, skip_special_tokens=self.skip_special_tokens
        )
        if not self.stop:
            return None
        start = max(0, prev_len - self.hold - 1)
        best: tuple[int, str] | None = None
        for s in self.stop:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s)] if include_stop else self.text[:i]
        self.stopped_on = s
        return s

    def visible(self, finished: bool) -> str:
        """Text safe to show now: all of it once finished; while running, without a trailing
        partial character or a tail that could still become a stop string."""
        if finished:
            return self.text
        text = self.text
        if self.hold:
            text = text[: max(0, len(text) - self.hold)]
        return text.rstrip("\ufffd")
