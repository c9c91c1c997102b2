"""Tool calls in generated text, in the formats chat templates teach models to write them.

- ``hermes`` (Hermes, Qwen 2.5/3, and what our tools system message teaches): each call is
  ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``; text outside the tags is content.
- ``llama3_json`` (Llama 3.1-3.3): the whole message is ``{"name": ..., "parameters": {...}}``
  (or ``"arguments"``), optionally after ``<|python_tag|>``, several joined by ``;``.

A parser turns a finished text into content plus calls (``parse``), or follows a stream
(``stream()``: feed text deltas, get content deltas as soon as they cannot start a call and each
call once it is complete). A call that does not parse, or names a function the request did not
offer, stays content: the client sees what the model wrote.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@dataclass
class Parsed:
    content: str
    tool_calls: list[ToolCall]


def _call_from_json(text: str, names: set[str], args_keys: tuple[str, ...]) -> ToolCall | None:
    """A call from one JSON object's text, or None when it is not a call to one of ``names``."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if obj["name"] not in names:
        return None
    args = next((obj[k] for k in args_keys if k in obj), {})
    if isinstance(args, str):  # some models write the arguments as a JSON string already
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], json.dumps(args, ensure_ascii=False))


class ToolParser:
    """Base: ``names`` are the functions the request offers."""

    name = ""
    whole_message = False  # a call is the whole message (decided by its first characters)

    def __init__(self, names: set[str]) -> None:
        self.names = names

    def parse(self, text: str) -> Parsed:
        raise NotImplementedError

    def stream(self) -> ToolStream:
        return ToolStream(self)


class HermesParser(ToolParser):
    name = "hermes"
    _CALL = re.compile(re.escape(HERMES_OPEN) + r"(.*?)" + re.escape(HERMES_CLOSE), re.DOTALL)

    def parse(self, text: str) -> Parsed:
        calls: list[ToolCall] = []
        content: list[str] = []
        last = 0
        for m in self._CALL.finditer(text):
            call = _call_from_json(m.group(1).strip(), self.names, ("arguments", "parameters"))
            if call is None:
                continue  # stays in the content
            content.append(text[last : m.start()])
            calls.append(call)
            last = m.end()
        content.append(text[last:])
        return Parsed("".join(content).strip() if calls else text, calls)


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    whole_message = True

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return Parsed(text, [])
        calls = []
        for part in _split_top_level(body, ";"):
            call = _call_from_json(part, self.names, ("parameters", "arguments"))
            if call is None:
                return Parsed(text, [])  # all or nothing: a half-parsed message is content
            calls.append(call)
        return Parsed("", calls)


def _split_top_level(text: str, sep: str) -> list[str]:
    """``text`` split at ``sep`` outside JSON strings and brackets."""
    parts, depth, start, in_str, escaped = [], 0, 0, False, False
    for i, ch in enumerate(text):
        if in_str:
            if escaped:
                escaped = False
            elif ch == "\\":
                escaped = True
            elif ch == '"':
                in_str = False
        elif ch == '"':
            in_str = True
        elif ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        elif ch == sep and depth == 0:
            parts.append(text[start:i].strip())
            start = i + 1
    parts.append(text[start:].strip())
    return [p for p in parts if p]


class ToolStream:
    """Follows one choice's text deltas. ``feed`` returns ``(content_delta, calls)`` for what
    became certain; ``finish`` returns the rest. Content that may still be the start of a call
    (a prefix of ``<tool_call>``, or a Llama message that starts with ``{``) is held back."""

    def __init__(self, parser: ToolParser) -> None:
        self.parser = parser
        self.buffer = ""  # text not yet given out
        self.whole_message = parser.whole_message
        self.passthrough = False  # a Llama message that is not a call: all of it is content
        self.calls = 0

    def feed(self, delta: str) -> tuple[str, list[ToolCall]]:
        self.buffer += delta
        if self.whole_message and not self.passthrough:
            head = self.buffer.lstrip()
            if not head or head.startswith("{") or PYTHON_TAG.startswith(head[: len(PYTHON_TAG)]):
                return "", []  # maybe a call: wait for the end
            self.passthrough = True
        if self.passthrough:
            out, self.buffer = self.buffer, ""
            return out, []
        return self._feed_tags()

    def _feed_tags(self) -> tuple[str, list[ToolCall]]:
        out: list[str] = []
        calls: list[ToolCall] = []
        while True:
            start = self.buffer.find(HERMES_OPEN)
            if start < 0:
                keep = _partial_suffix(self.buffer, HERMES_OPEN)
                out.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
                break
            end = self.buffer.find(HERMES_CLOSE, start)
            if end < 0:
                out.append(self.buffer[:start])
                self.buffer = self.buffer[start:]
                break
            block = self.buffer[start : end + len(HERMES_CLOSE)]
            parsed = self.parser.parse(block)
            out.append(self.buffer[:start])
            if parsed.tool_calls:
                calls += parsed.tool_calls
            else:
                out.append(block)
            self.buffer = self.buffer[end + len(HERMES_CLOSE) :]
        self.calls += len(calls)
        text = "".join(out)
        if self.calls and not text.strip():
            text = ""  # whitespace between calls is not content
        return text, calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self.buffer = self.buffer, ""
        if self.whole_message and not self.passthrough:
            parsed = self.parser.parse(rest)
            self.calls += len(parsed.tool_calls)
            return parsed.content, parsed.tool_calls
        return rest, []  # an unclosed <tool_call> or a partial tag: what the model wrote


def _partial_suffix(text: str, tag: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``tag``."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesParser, Llama3JsonParser)}


def parser_name_for_template(template: str | None) -> str:
    """The format a chat template teaches: Llama 3's when it mentions ``<|python_tag|>`` or
    ``"parameters"`` with ``ipython``, else Hermes."""
    t = template or ""
    if PYTHON_TAG in t or ("ipython" in t and "parameters" in t):
        return "llama3_json"
    return "hermes"


def make_parser(name: str, names: set[str]) -> ToolParser:
    try:
        return PARSERS[name](names)
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}"
        ) from None
