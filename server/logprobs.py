"""Log-probabilities in OpenAI's two shapes (legacy completions and chat)."""

from __future__ import annotations

import json
import math
import re
from typing import Any

from tandem.engine.request import TokenLogprobs

_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback
# JSON has no -Infinity; a token the model rules out entirely is reported with this instead.
MIN_LOGPROB = -9999.0


def _finite(x: float) -> float:
    return x if math.isfinite(x) else MIN_LOGPROB


def _byte_level_decoder_map() -> dict[str, int]:
    """Inverse of the GPT-2 byte-level alphabet: printable bytes map to themselves, the rest
    to code points from 256 up, in byte order."""
    keep = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    mapping = {chr(b): b for b in keep}
    extra = 0
    for b in range(256):
        if b not in keep:
            mapping[chr(256 + extra)] = b
            extra += 1
    return mapping


def _uses_byte_level(tokenizer: Any) -> bool:
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        return False
    try:
        decoder = json.loads(backend.to_str()).get("decoder")
    except (ValueError, AttributeError):
        return False
    return '"ByteLevel"' in json.dumps(decoder)


class TokenText:
    """Token id -> (text, UTF-8 bytes) as OpenAI reports them, cached."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.byte_map = _byte_level_decoder_map() if _uses_byte_level(tokenizer) else None
        self._cache: dict[int, tuple[str, list[int]]] = {}

    def __call__(self, token_id: int) -> tuple[str, list[int]]:
        hit = self._cache.get(token_id)
        if hit is not None:
            return hit
        text = self.tokenizer.decode([token_id], skip_special_tokens=False)
        raw: bytes | None = None
        piece = self.tokenizer.convert_ids_to_tokens(token_id)
        if isinstance(piece, str):
            m = _BYTE_TOKEN.match(piece)
            if m:
                raw = bytes([int(m.group(1), 16)])
            elif self.byte_map is not None and all(c in self.byte_map for c in piece):
                raw = bytes(self.byte_map[c] for c in piece)
        if raw is None or (raw.decode("utf-8", "replace") != text and "\ufffd" not in text):
            raw = text.encode("utf-8")
        out = (text, list(raw))
        self._cache[token_id] = out
        return out

    def text(self, token_id: int) -> str:
        return self(token_id)[0]


def completion_logprobs(
    lps: list[TokenLogprobs], token_text: TokenText, text_offset: int
) -> tuple[dict[str, Any], int]:
    """Legacy shape: tokens, token_logprobs, top_logprobs (dicts that include the chosen token),
    text_offset. Returns it and the offset after the last token."""
    tokens: list[str] = []
    token_logprobs: list[float] = []
    top: list[dict[str, float]] = []
    offsets: list[int] = []
    for lp in lps:
        text = token_text.text(lp.token_id)
        tokens.append(text)
        token_logprobs.append(_finite(lp.logprob))
        alts = {
            token_text.text(t): _finite(v)
            for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True)
        }
        alts.setdefault(text, _finite(lp.logprob))
        top.append(alts)
        offsets.append(text_offset)
        text_offset += len(text)
    body = {
        "tokens": tokens,
        "token_logprobs": token_logprobs,
        "top_logprobs": top,
        "text_offset": offsets,
    }
    return body, text_offset


def chat_logprobs(lps: list[TokenLogprobs], token_text: TokenText) -> dict[str, Any]:
    """Chat shape: {"content": [{token, logprob, bytes, top_logprobs: [{token, logprob,
    bytes}]}]}; top_logprobs lists exactly the requested number of alternatives."""
    content = []
    for lp in lps:
        text, raw = token_text(lp.token_id)
        alts = []
        for t, v in zip(lp.top_token_ids, lp.top_logprobs, strict=True):
            alt_text, alt_raw = token_text(t)
            alts.append({"token": alt_text, "logprob": _finite(v), "bytes": alt_raw})
        content.append(
            {"token": text, "logprob": _finite(lp.logprob), "bytes": raw, "top_logprobs": alts}
        )
    return {"content": content, "refusal": None}
