"""Tool calls in generated text, in the formats chat templates teach models to write them
(server/tool_formats.py lists them).

A parser turns a finished text into content plus calls (``parse``), or follows a stream
(``stream()``: feed text deltas, get content deltas as soon as they cannot start a call and the
calls of each block once it is complete; server/tool_stream.py). A call that does not parse, or
names a function the request did not offer, stays content: the client sees what the model
wrote. A block of several calls (DeepSeek's) is taken whole or stays content whole.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any

from tandem.server.tool_formats import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_SEP,
    GLM_KEY,
    HERMES_CLOSE,
    HERMES_OPEN,
    KIMI_ARGS,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    KIMI_CALLS_BEGIN,
    KIMI_CALLS_END,
    PYTHON_TAG,
    QWEN_FUNCTION,
    QWEN_PARAM,
    Parsed,
    ToolCall,
    typed_value,
)
from tandem.server.tool_stream import ToolStream

__all__ = [
    "HERMES_CLOSE",
    "HERMES_OPEN",
    "PARSERS",
    "Parsed",
    "ToolCall",
    "ToolParser",
    "ToolStream",
    "make_parser",
    "parser_name_for_template",
]


def _arguments(text: str) -> dict[str, Any] | None:
    """A call's arguments from JSON text: an object, or a string holding one (some models write
    the arguments as a JSON string); None otherwise."""
    try:
        args = json.loads(text)
        if isinstance(args, str):
            args = json.loads(args)
    except json.JSONDecodeError:
        return None
    return args if isinstance(args, dict) else None


def _skip_space(text: str, pos: int) -> int:
    return len(text) - len(text[pos:].lstrip()) if text[pos:].strip() else len(text)


def _call(name: str, args: dict[str, Any] | None, names: set[str]) -> list[ToolCall] | None:
    if name not in names or args is None:
        return None
    return [ToolCall(name, json.dumps(args, ensure_ascii=False))]


def _call_from_json(text: str, names: set[str], keys: tuple[str, ...]) -> list[ToolCall] | None:
    """The call in one JSON object's text (``{"name": ..., keys[0] or keys[1]: {...}}``)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = next((obj[k] for k in keys if k in obj), {})
    if isinstance(args, str):
        args = _arguments(args)
    return _call(obj["name"], args if isinstance(args, dict) else None, names)


class ToolParser:
    """Base. ``names`` are the functions the request offers, ``schemas`` their parameters (by
    name; the per-argument formats type values with them). Block formats set the markers and
    ``block_calls``; ``parse`` is the stream fed the whole text, so both always agree."""

    name = ""
    whole_message = False
    open_tag = ""
    close_tag = ""
    close_at_end = False

    def __init__(self, names: set[str], schemas: dict[str, Any] | None = None) -> None:
        self.names = names
        self.schemas = schemas or {}

    def parse(self, text: str) -> Parsed:
        stream = self.stream()
        content, calls = stream.feed(text)
        rest, more = stream.finish()
        return Parsed(content + rest, calls + more)

    def stream(self) -> ToolStream:
        return ToolStream(self)

    def block_calls(self, body: str) -> list[ToolCall] | None:
        raise NotImplementedError

    def _properties(self, name: str) -> dict[str, Any]:
        props = (self.schemas.get(name) or {}).get("properties")
        return props if isinstance(props, dict) else {}


class HermesParser(ToolParser):
    """``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``."""

    name = "hermes"
    open_tag, close_tag = HERMES_OPEN, HERMES_CLOSE

    def block_calls(self, body: str) -> list[ToolCall] | None:
        return _call_from_json(body, self.names, ("arguments", "parameters"))


class Llama3JsonParser(ToolParser):
    """The whole message is ``{"name": ..., "parameters": {...}}`` (or ``"arguments"``),
    optionally after ``<|python_tag|>``, several joined by ``;``; all or nothing."""

    name = "llama3_json"
    whole_message = True

    def parse(self, text: str) -> Parsed:
        body = text.strip().removeprefix(PYTHON_TAG).strip()
        if not body.startswith("{"):
            return Parsed(text, [])
        calls: list[ToolCall] = []
        for part in _split_top_level(body, ";"):
            call = _call_from_json(part, self.names, ("parameters", "arguments"))
            if call is None:
                return Parsed(text, [])  # a half-parsed message is content
            calls += call
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


class _DeepSeekParser(ToolParser):
    """One ``<｜tool▁calls▁begin｜>`` block of ``<｜tool▁call▁begin｜>…<｜tool▁call▁end｜>``
    calls (whitespace between them; Kimi-K2's section likewise, with its markers); a block the
    text ends in without its closing marker counts when it holds only complete calls."""

    open_tag, close_tag = DS_CALLS_BEGIN, DS_CALLS_END
    call_begin, call_end = DS_CALL_BEGIN, DS_CALL_END
    close_at_end = True

    def block_calls(self, body: str) -> list[ToolCall] | None:
        calls: list[ToolCall] = []
        pos = 0
        while (start := _skip_space(body, pos)) < len(body):
            end = body.find(self.call_end, start)
            if not body.startswith(self.call_begin, start) or end < 0:
                return None
            call = self._call(body[start + len(self.call_begin) : end])
            if call is None:
                return None
            calls += call
            pos = end + len(self.call_end)
        return calls or None

    def _call(self, inner: str) -> list[ToolCall] | None:
        raise NotImplementedError


class DeepSeekV3Parser(_DeepSeekParser):
    """``function<｜tool▁sep｜>NAME\\n```json\\n{...}\\n```"`` (the fence may be missing)."""

    name = "deepseek_v3"

    def _call(self, inner: str) -> list[ToolCall] | None:
        _, sep, rest = inner.partition(DS_SEP)
        name, _, args = rest.partition("\n")
        args = args.strip()
        if args.startswith("```"):
            args = args.removeprefix("```json").removeprefix("```").removesuffix("```")
        return _call(name.strip(), _arguments(args), self.names) if sep else None


class DeepSeekV31Parser(_DeepSeekParser):
    """``NAME<｜tool▁sep｜>{...}``."""

    name = "deepseek_v31"

    def _call(self, inner: str) -> list[ToolCall] | None:
        name, sep, args = inner.partition(DS_SEP)
        return _call(name.strip(), _arguments(args), self.names) if sep else None


# functions.NAME:INDEX; as other servers read it, any dotted prefix (or none) before the name.
_KIMI_ID = re.compile(r"\s*(?:[^\s:]*\.)?([^\s.:]+):(\d+)\s*")


class KimiK2Parser(_DeepSeekParser):
    """``<|tool_calls_section_begin|>`` of ``<|tool_call_begin|>functions.NAME:I
    <|tool_call_argument_begin|>{...}<|tool_call_end|>`` calls; each call's id is the one the
    model wrote (``functions.NAME:I``: Kimi's template names tool results by it). The name is
    what follows the id's last dot (function names hold none); an id without ``:I`` is not a
    call."""

    name = "kimi_k2"
    open_tag, close_tag = KIMI_CALLS_BEGIN, KIMI_CALLS_END
    call_begin, call_end = KIMI_CALL_BEGIN, KIMI_CALL_END

    def _call(self, inner: str) -> list[ToolCall] | None:
        ident, sep, args = inner.partition(KIMI_ARGS)
        m = _KIMI_ID.fullmatch(ident)
        call = _call(m.group(1), _arguments(args), self.names) if sep and m else None
        return None if call is None else [dataclasses.replace(call[0], id=ident.strip())]


_GLM_ARG = re.compile(r"\s*<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)
_QWEN_FUNCTION = re.compile(r"\s*<function=([^>\n]*)>(.*)</function>\s*", re.DOTALL)
_QWEN_PARAM = re.compile(r"\s*<parameter=([^>\n]*)>(.*?)</parameter>", re.DOTALL)


class _PerArgumentParser(ToolParser):
    open_tag, close_tag = HERMES_OPEN, HERMES_CLOSE

    def _typed(self, name: str, pairs: re.Pattern[str], text: str) -> list[ToolCall] | None:
        """The call of ``name`` whose arguments are ``pairs`` matches covering ``text`` (up to
        whitespace); each value typed with its parameter's schema. A repeated key is a
        malformed call."""
        if name not in self.names:
            return None
        props = self._properties(name)
        args: dict[str, Any] = {}
        pos = 0
        while m := pairs.match(text, pos):
            key = m.group(1).strip()
            if not key or key in args:
                return None
            args[key] = typed_value(self._value(m.group(2)), props.get(key))
            pos = m.end()
        if text[pos:].strip():
            return None
        return [ToolCall(name, json.dumps(args, ensure_ascii=False))]

    def _value(self, text: str) -> str:
        return text


class Glm45Parser(_PerArgumentParser):
    """``<tool_call>NAME\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n…</tool_call>``;
    a value is exactly the text between its tags."""

    name = "glm45"

    def block_calls(self, body: str) -> list[ToolCall] | None:
        head = body.split(GLM_KEY, 1)[0]
        return self._typed(head.strip(), _GLM_ARG, body[len(head) :])


class Qwen3CoderParser(_PerArgumentParser):
    """``<tool_call>\\n<function=NAME>\\n<parameter=k>\\nv\\n</parameter>\\n…</function>\\n
    </tool_call>``; a value is the text between its tags less one newline at each end."""

    name = "qwen3_coder"

    def block_calls(self, body: str) -> list[ToolCall] | None:
        m = _QWEN_FUNCTION.fullmatch(body)
        return self._typed(m.group(1).strip(), _QWEN_PARAM, m.group(2)) if m else None

    def _value(self, text: str) -> str:
        return text.removeprefix("\n").removesuffix("\n")


PARSERS: dict[str, type[ToolParser]] = {
    p.name: p
    for p in (
        HermesParser,
        Llama3JsonParser,
        DeepSeekV3Parser,
        DeepSeekV31Parser,
        Glm45Parser,
        Qwen3CoderParser,
        KimiK2Parser,
    )
}


def parser_name_for_template(template: str | None) -> str | None:
    """The format a chat template writes calls in, told by its markers; None when it shows none
    of the known formats. Kimi-K2's is told by its ``<|tool_calls_section_begin|>``.
    DeepSeek's ``<｜tool▁sep｜>`` comes before the name in V3 (with a fenced JSON block) and
    after it in V3.1; GLM-4.5's ``<arg_key>`` and Qwen3-Coder's ``<function=`` sit inside
    ``<tool_call>``, so they are looked for before Hermes'."""
    t = template or ""
    if KIMI_CALLS_BEGIN in t:
        return "kimi_k2"
    if DS_SEP in t:
        return "deepseek_v3" if "```json" in t else "deepseek_v31"
    if GLM_KEY in t:
        return "glm45"
    if QWEN_FUNCTION in t and QWEN_PARAM in t:
        return "qwen3_coder"
    if PYTHON_TAG in t or ("ipython" in t and "parameters" in t):
        return "llama3_json"
    if HERMES_OPEN in t:
        return "hermes"
    return None


def make_parser(name: str, names: set[str], schemas: dict[str, Any] | None = None) -> ToolParser:
    try:
        return PARSERS[name](names, schemas)
    except KeyError:
        raise ValueError(
            f"unknown tool-call parser {name!r}; known: {', '.join(sorted(PARSERS))}"
        ) from None
