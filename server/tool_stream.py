"""Tool calls out of a stream of text deltas, equal to parsing the whole text for every way the
text is cut into deltas.

A ``ToolStream`` gives out content as soon as it cannot start a call (a suffix that may be the
start of a call's opening marker is held back; a call block is held until it closes) and each
block's calls once it is complete. ``ContentTidy`` decides what whitespace next to a call is
content, the same for a stream and a finished text.
"""

from __future__ import annotations

import re
from typing import Protocol

from tandem.server.tool_formats import PYTHON_TAG, Parsed, ToolCall

_RUNS = re.compile(r"\s+|\S+")


class CallSyntax(Protocol):
    """What a stream needs of a parser (server/tool_parsers.py)."""

    whole_message: bool  # a call is the whole message (Llama 3's bare JSON)
    open_tag: str  # a call block's markers (formats with blocks)
    close_tag: str
    close_at_end: bool  # the end of the text closes an open block (DeepSeek's)

    def parse(self, text: str) -> Parsed: ...

    def block_calls(self, body: str) -> list[ToolCall] | None:
        """The calls a block holds (the text between its markers), or None when it is not a
        block of valid calls to offered functions (it stays content)."""
        ...


class ContentTidy:
    """Whitespace that touches a call is not content: a run of whitespace between two pieces of
    text keeps its first run around the calls in between (``"a\\n<call> b"`` -> ``"a\\nb"``),
    and whitespace between a call and the start or end of the message goes. Text without calls
    stays as written. Works on any cutting of the text: a whitespace run is held until what
    follows it is known."""

    def __init__(self) -> None:
        self.pending = ""  # whitespace held back
        self.closed = False  # a call followed the held run: later runs of this gap are dropped
        self.gap_call = False  # a call lies in the current gap between pieces of text
        self.started = False  # text has been given out

    def text(self, delta: str) -> str:
        out = []
        for run in _RUNS.findall(delta):
            if run[0].isspace():
                if not self.closed:
                    self.pending += run
                continue
            if self.started or not self.gap_call:
                out.append(self.pending)
            out.append(run)
            self.pending, self.closed, self.gap_call, self.started = "", False, False, True
        return "".join(out)

    def call(self) -> None:
        self.gap_call = True
        self.closed = self.closed or bool(self.pending)

    def finish(self) -> str:
        rest = "" if self.gap_call else self.pending
        self.pending = ""
        return rest


class ToolStream:
    """Follows one choice's text deltas. ``feed`` returns ``(content_delta, calls)`` for what
    became certain; ``finish`` returns the rest (an unclosed block, a partial marker: what the
    model wrote)."""

    def __init__(self, parser: CallSyntax) -> None:
        self.parser = parser
        self.tidy = ContentTidy()
        self.buffer = ""  # text not yet given out
        self.in_block = False  # the buffer starts with an opening marker
        self.scan = 0  # where the search for the closing marker goes on
        self.passthrough = False  # a whole-message format whose message is not a call
        self.calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        if self.parser.whole_message:
            return self._feed_whole()
        out: list[str] = []
        calls: list[ToolCall] = []
        p = self.parser
        while True:
            if self.in_block:
                end = self.buffer.find(p.close_tag, max(self.scan, len(p.open_tag)))
                if end < 0:
                    self.scan = max(len(p.open_tag), len(self.buffer) - len(p.close_tag) + 1)
                    break
                stop = end + len(p.close_tag)
                self._block(self.buffer[:stop], self.buffer[len(p.open_tag) : end], out, calls)
                self.buffer, self.in_block = self.buffer[stop:], False
                continue
            start = self.buffer.find(p.open_tag)
            if start < 0:
                keep = _partial_suffix(self.buffer, p.open_tag)
                out.append(self.tidy.text(self.buffer[: len(self.buffer) - keep]))
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            out.append(self.tidy.text(self.buffer[:start]))
            self.buffer, self.in_block, self.scan = self.buffer[start:], True, 0
        return "".join(out), calls

    def _block(self, block: str, body: str, out: list[str], calls: list[ToolCall]) -> None:
        found = self.parser.block_calls(body)
        if not found:
            out.append(self.tidy.text(block))  # not a valid call: what the model wrote
            return
        for _ in found:
            self.tidy.call()
        calls += found
        self.calls += len(found)

    def _feed_whole(self) -> tuple[str, list[ToolCall]]:
        if not self.passthrough:
            head = self.buffer.lstrip()
            if not head or head.startswith("{") or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)]):
                return "", []  # maybe a call: wait for the end
            self.passthrough = True
        out, self.buffer = self.buffer, ""
        return self.tidy.text(out), []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        out: list[str] = []
        calls: list[ToolCall] = []
        p = self.parser
        if p.whole_message and not self.passthrough:
            parsed = p.parse(rest)
            for _ in parsed.tool_calls:
                self.tidy.call()
            out.append(self.tidy.text(parsed.content))
            calls = parsed.tool_calls
            self.calls += len(calls)
        elif self.in_block and p.close_at_end:
            self._block(rest, rest[len(p.open_tag) :], out, calls)
        else:
            out.append(self.tidy.text(rest))
        self.in_block = False
        out.append(self.tidy.finish())
        return "".join(out), calls


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0
