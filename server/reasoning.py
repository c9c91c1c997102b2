"""Reasoning output on /v1/chat/completions: a reasoning model's thinking, split from its answer.

DeepSeek-R1 (and V3.1 in thinking mode), Qwen3, GLM-4.5 and Kimi-K2-Thinking write their
thinking between ``<think>`` and ``</think>`` before the answer. Where the output starts is read from the rendered
prompt, not guessed from the output: when the prompt ends inside an unclosed ``<think>`` (the
newer R1 templates end the generation prompt with ``<think>\\n``) the output starts in the
thinking; otherwise it starts in the answer unless its first non-blank text is ``<think>``
(Qwen3, GLM-4.5, the first R1 template). A prompt that closes the thinking itself (Qwen3's and
GLM-4.5's ``enable_thinking: false``, V3.1's ``thinking: false``) therefore yields content only.

The thinking runs to the first ``</think>``; the output cut before it (``max_tokens``, a stop
string) is all thinking. The answer is the rest without its leading whitespace. Kimi-K2 may also
end its thinking by opening a tool-call section (``<|tool_calls_section_begin|>``, as vLLM's
``kimi_k2`` parser reads it): the section starts the answer (the tool parser reads it there).
The parser names are the templates' families (vLLM's names for ``--reasoning-parser``); they
share this one rule, since the tags and the prompt decide everything.

``ReasoningParser.split`` reads a finished text; ``ReasoningStream`` follows text deltas and gives
out what is certain, holding back only a possible partial tag, so that for every way a text is cut
into deltas the concatenated deltas equal ``split``'s fields.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

THINK_START, THINK_END = "<think>", "</think>"
PARSER_NAMES = ("deepseek_r1", "qwen3", "glm45", "kimi_k2")
# Markers that end a family's thinking and begin its answer (kept in the answer).
ANSWER_STARTS = {"kimi_k2": ("<|tool_calls_section_begin|>",)}
CHOICES = ("auto", *PARSER_NAMES, "none")  # --reasoning-parser


@dataclass(frozen=True)
class Reasoned:
    """A finished output split in two; None where a part is empty (as vLLM reports it)."""

    reasoning: str | None
    content: str | None


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = THINK_START
    end: str = THINK_END
    answer_starts: tuple[str, ...] = ()  # end the thinking, and stay in the answer

    def opens_in_prompt(self, prompt: str) -> bool:
        """The prompt ends inside an unclosed start tag: the output begins in the thinking."""
        i = prompt.rfind(self.start)
        return i >= 0 and prompt.find(self.end, i + len(self.start)) < 0

    def _phases(self, text: str, opened: bool) -> tuple[str | None, int, str]:
        """(the text after any leading start tag when the output thinks, else None; where the
        thinking ends in it, -1 when it is not closed; the tag that ends it, "" for an
        ``answer_starts`` marker, which stays in the answer)."""
        head = text.lstrip()
        if head.startswith(self.start):
            body = head[len(self.start) :]
        elif opened:
            body = text
        else:
            return None, -1, ""
        return (body, *self.thinking_end(body))

    def thinking_end(self, body: str) -> tuple[int, str]:
        """The first end of the thinking in ``body``: (offset, the end tag or "" for an answer
        marker); (-1, "") when there is none."""
        found = [(body.find(t), t) for t in (self.end,)] + [
            (body.find(t), "") for t in self.answer_starts
        ]
        found = [f for f in found if f[0] >= 0]
        return min(found, key=lambda f: f[0]) if found else (-1, "")

    def split(self, text: str, opened: bool) -> Reasoned:
        """``text`` (a whole output) -> thinking and answer. ``opened``: ``opens_in_prompt``."""
        body, end, tag = self._phases(text, opened)
        if body is None:
            return Reasoned(None, text or None)
        if end < 0:
            return Reasoned(body or None, None)
        content = body[end + len(tag) :].lstrip()
        return Reasoned(body[:end] or None, content or None)

    def stream(self, opened: bool) -> ReasoningStream:
        return ReasoningStream(self, opened)

    def count_tokens(
        self,
        token_ids: list[int],
        text: str,
        opened: bool,
        decode: Callable[[list[int]], str],
        end_id: int | None = None,
    ) -> int:
        """How many of the output's tokens are thinking: up to and including the one that
        completes the end tag (the tag is part of the thinking the model spent tokens on); all
        of them when the thinking is not closed; 0 for an output that does not think.
        ``end_id``: the end tag's id when the tokenizer has it as one token (found directly);
        otherwise the shortest decoded prefix that holds the tag is searched for."""
        body, end, tag = self._phases(text, opened)
        if body is None:
            return 0
        if end < 0:
            return len(token_ids)
        if tag and end_id is not None and end_id in token_ids:
            return token_ids.index(end_id) + 1
        marker = tag or next(m for m in self.answer_starts if body.find(m) == end)
        lo, hi = 1, len(token_ids)  # the tag is in decode(ids[:hi]), which is monotone in k
        while lo < hi:
            mid = (lo + hi) // 2
            if marker in decode(token_ids[:mid]):
                hi = mid
            else:
                lo = mid + 1
        # The end tag is thinking; an answer marker is not (nor the token it starts in).
        return lo if tag else lo - 1


class ReasoningStream:
    """Follows one choice's text deltas: ``feed`` returns ``(reasoning, content)`` deltas for
    what became certain, ``finish`` the rest."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser = parser
        self.opened = opened
        self.phase = "start"  # start -> reasoning -> after (blank held) -> content
        self.buffer = ""

    def feed(self, delta: str) -> tuple[str, str]:
        p = self.parser
        self.buffer += delta
        reasoning, content = [], []
        while self.buffer:
            if self.phase == "start":
                head = self.buffer.lstrip()
                if head.startswith(p.start):
                    self.buffer, self.phase = head[len(p.start) :], "reasoning"
                elif p.start.startswith(head):
                    break  # blank, or a partial start tag: wait
                else:
                    self.phase = "reasoning" if self.opened else "content"
            elif self.phase == "reasoning":
                i, tag = p.thinking_end(self.buffer)
                if i >= 0:
                    reasoning.append(self.buffer[:i])
                    self.buffer, self.phase = self.buffer[i + len(tag) :], "after"
                    continue
                keep = max(_partial_suffix(self.buffer, t) for t in (p.end, *p.answer_starts))
                reasoning.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            elif self.phase == "after":
                self.buffer = self.buffer.lstrip()  # the answer's leading blank is dropped
                if self.buffer:
                    self.phase = "content"
            else:
                content.append(self.buffer)
                self.buffer = ""
        return "".join(reasoning), "".join(content)

    def finish(self) -> tuple[str, str]:
        """The output ended: a held start or end tag prefix is text after all."""
        rest, self.buffer = self.buffer, ""
        if self.phase == "start":
            return (rest, "") if self.opened else ("", rest)
        if self.phase == "reasoning":
            return rest, ""
        return "", rest if self.phase == "content" else ""


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def template_thinks(template: str | None) -> bool:
    """The template has a thinking section (writes or strips ``<think>`` / ``</think>``)."""
    t = template or ""
    return THINK_START in t or THINK_END in t


def family_of(template: str) -> str:
    """The parser name of a thinking template's family, by its turn markers."""
    if "<｜Assistant｜>" in template:
        return "deepseek_r1"
    if "<|assistant|>" in template:
        return "glm45"
    if "<|im_assistant|>" in template:
        return "kimi_k2"
    return "qwen3"  # ChatML turns (<|im_start|>), and any other template with think tags


def resolve_parser(name: str, template: str | None) -> ReasoningParser | None:
    """``--reasoning-parser`` for a chat template: ``auto`` picks the template's family when it
    has a thinking section and none otherwise; ``none`` never parses."""
    if name not in CHOICES:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(CHOICES)}")
    if name == "none":
        return None
    if name == "auto":
        if not template_thinks(template):
            return None
        name = family_of(template or "")
    return ReasoningParser(name, answer_starts=ANSWER_STARTS.get(name, ()))


def single_token_id(tokenizer: Any, text: str) -> int | None:
    """The id of ``text`` when the tokenizer encodes it as exactly one token, else None."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    return ids[0] if len(ids) == 1 else None
