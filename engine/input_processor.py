"""Turns a user's prompt and parameters into a validated ``Request``.

Runs wherever requests enter: inside the engine for the offline API, and in the API process
for the server (so bad input is answered with a 400 before it reaches a rank)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tandem.engine.request import Request
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import GrammarCompiler


class ContextLengthExceededError(ValueError):
    """The prompt plus the requested output does not fit in ``max_model_len``."""


class InputProcessor:
    def __init__(
        self,
        tokenizer: Any,
        vocab_size: int,
        max_model_len: int,
        eos_token_ids: frozenset[int],
        block_size: int,
        num_blocks: int,
        lookahead: int = 0,
    ) -> None:
        self.lookahead = lookahead
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_model_len = max_model_len
        self.eos_token_ids = eos_token_ids
        self.block_size = block_size
        self.num_blocks = num_blocks
        self._grammars: GrammarCompiler | None = None  # built at the first constrained request
        self._make_grammars: Callable[[], GrammarCompiler] | None = None

    def share_grammars(self, make: Callable[[], GrammarCompiler]) -> None:
        """Check grammars with the compiler ``make`` returns (the engine's own, when this
        processor runs in the engine's process: each grammar is then compiled once)."""
        self._make_grammars = make

    def __getstate__(self) -> dict[str, Any]:
        # Travels to the API process without the grammar compiler (built there on first use).
        return {**self.__dict__, "_grammars": None, "_make_grammars": None}

    def check_structured(self, params: SamplingParams) -> None:
        """Raise ``StructuredOutputError`` if the request's grammar cannot be served (cached by
        (kind, text), so a schema is compiled once here)."""
        spec = params.structured
        if spec is None:
            return
        if self._grammars is None:
            if self._make_grammars is not None:
                self._grammars = self._make_grammars()
            else:
                self._grammars = GrammarCompiler(
                    self.tokenizer, self.vocab_size, self.eos_token_ids
                )
        self._grammars.validate(spec)

    def tokenize(self, prompt: str | list[int]) -> list[int]:
        if isinstance(prompt, str):
            return self.tokenizer.encode(prompt, add_special_tokens=True)
        return list(prompt)

    def process(self, request_id: str, prompt: str | list[int], params: SamplingParams) -> Request:
        """Validate and build a request (raises ValueError with a message a user can act on)."""
        if params.n != 1:
            raise ValueError("the engine takes n=1 requests; fan out n>1 before submitting")
        ids = self.tokenize(prompt)
        if not ids:
            raise ValueError("the prompt is empty")
        bad = [t for t in ids if isinstance(t, bool) or not isinstance(t, int)]
        bad += [t for t in ids if isinstance(t, int) and not 0 <= t < self.vocab_size]
        if bad:
            raise ValueError(f"prompt token ids out of range [0, {self.vocab_size}): {bad[:5]}")
        room = self.max_model_len - len(ids)
        if room < 1:
            raise ContextLengthExceededError(
                f"the prompt has {len(ids)} tokens; this model's maximum context length is "
                f"{self.max_model_len} tokens, which leaves no room for output"
            )
        if params.max_tokens is not None and params.max_tokens > room:
            raise ContextLengthExceededError(
                f"this model's maximum context length is {self.max_model_len} tokens; the prompt "
                f"has {len(ids)} tokens and max_tokens={params.max_tokens} asks for more than the "
                f"{room} that remain"
            )
        max_tokens = room if params.max_tokens is None else params.max_tokens
        if params.min_tokens > max_tokens:  # an explicit max_tokens was checked already
            raise ValueError(
                f"min_tokens={params.min_tokens!r} is invalid: must be in [0, max_tokens], and "
                f"max_tokens left out is {max_tokens} here (the maximum context length "
                f"{self.max_model_len} less the prompt's {len(ids)} tokens)"
            )
        bad_bias = [t for t in params.logit_bias or {} if t >= self.vocab_size]
        if bad_bias:
            raise ValueError(
                f"logit_bias={params.logit_bias!r} is invalid: token id {bad_bias[0]} is out of "
                f"range [0, {self.vocab_size})"
            )
        self.check_structured(params)
        blocks = -(-(len(ids) + max_tokens + self.lookahead) // self.block_size)
        if blocks > self.num_blocks:
            raise ValueError(
                f"the request needs {blocks} KV blocks but the whole cache has "
                f"{self.num_blocks}; lower max_tokens or the prompt length"
            )
        return Request(
            request_id=request_id,
            prompt_token_ids=ids,
            params=params,
            eos_token_ids=self.eos_token_ids,
            max_tokens=max_tokens,
            prompt=prompt if isinstance(prompt, str) else None,
        )
