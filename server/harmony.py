"""The harmony format (gpt-oss): an output read as the messages it holds.

A chat template in this format ends the prompt with ``<|start|>assistant``; the model then writes
one or more messages, each a header, ``<|message|>`` and a body::

    <|channel|>analysis<|message|>The user asks for the weather...<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city":"Paris"}<|call|>

    <|channel|>analysis<|message|>...<|end|><|start|>assistant<|channel|>final<|message|>It is sunny.<|return|>

A header names its channel after ``<|channel|>`` and may name a recipient (``to=functions.NAME``,
before or after the channel); a body runs to ``<|end|>`` (another message follows), ``<|call|>``
or ``<|return|>`` (the end of the turn: the generation config stops on both, so they are not in
the text), or the end of the output. What the API returns, as vLLM does for gpt-oss:

- ``reasoning_content``: the bodies of the ``analysis`` messages;
- tool calls: the messages to ``functions.NAME`` (``commentary``), the body as the arguments;
- ``content``: the ``final`` messages and any other message without a recipient (``commentary``
  preambles); a message to another recipient (a built-in tool we do not run) is content too.

Bodies of one kind are joined with a newline. Text before the first header (a model that did not
write the format) is content. ``HarmonyStream`` follows text deltas and
gives out only what is certain (holding back a partial marker), so that for every way a text is
cut into deltas the concatenated deltas equal ``parse``'s fields, and each call comes out once,
whole, when its message has ended.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from tandem.server.tool_formats import Parsed, ToolCall

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL = "<|constrain|>", "<|return|>", "<|call|>"
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL)
_BODY_ENDS = (END, CALL, RETURN, START)
FUNCTIONS = "functions."
_RECIPIENT = re.compile(r"\bto=([^\s<]+)")
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")


def is_harmony_template(template: str | None) -> bool:
    """Whether a chat template writes the harmony format."""
    return bool(template) and CHANNEL in template and MESSAGE in template and START in template


@dataclass(frozen=True)
class Message:
    channel: str | None
    recipient: str | None
    body: str
    ended: bool  # its body's end marker is in the text


def _partial_marker(text: str) -> int:
    """Length of the longest suffix of ``text`` that could begin a marker."""
    for k in range(min(len(text), max(map(len, MARKERS)) - 1), 0, -1):
        if any(m.startswith(text[-k:]) for m in MARKERS):
            return k
    return 0


def split_messages(text: str, final: bool) -> tuple[str, list[Message]]:
    """(text before the first header, the messages). ``final``: the output is whole, so an
    unended body is complete and a partial marker at the end is text; otherwise the body of
    the last message stops before a possible partial marker."""
    starts = [i for m in (CHANNEL, START, MESSAGE) if (i := text.find(m)) >= 0]
    if not starts:
        keep = len(text) if final else len(text) - _partial_marker(text)
        return text[:keep], []
    lead, text = text[: min(starts)], text[min(starts) :]
    messages: list[Message] = []
    pos = 0
    while True:
        at = text.find(MESSAGE, pos)
        if at < 0:
            break
        header = text[pos:at]
        channel = _CHANNEL.search(header)
        recipient = _RECIPIENT.search(header)
        body_start = at + len(MESSAGE)
        ends = [(i, m) for m in _BODY_ENDS if (i := text.find(m, body_start)) >= 0]
        if not ends:
            body = text[body_start:]
            if not final:
                body = body[: len(body) - _partial_marker(body)]
            messages.append(
                Message(
                    channel.group(1) if channel else None,
                    recipient.group(1) if recipient else None,
                    body,
                    final,
                )
            )
            break
        end, marker = min(ends)
        messages.append(
            Message(
                channel.group(1) if channel else None,
                recipient.group(1) if recipient else None,
                text[body_start:end],
                True,
            )
        )
        pos = end if marker == START else end + len(marker)
    return lead, messages


@dataclass
class Harmony:
    """One output's fields."""

    reasoning: str = ""
    content: str = ""
    calls: list[ToolCall] = field(default_factory=list)


def _fields(text: str, final: bool, parse_calls: bool) -> tuple[Harmony, int]:
    """The fields of ``text`` and how many of its calls are whole (the last message may still
    be growing when not ``final``)."""
    lead, messages = split_messages(text, final)
    reasoning: list[str] = []
    content: list[str] = [lead] if lead else []
    out = Harmony()
    whole = 0
    for m in messages:
        is_call = parse_calls and m.recipient is not None and m.recipient.startswith(FUNCTIONS)
        if is_call:
            if m.ended:
                name = m.recipient[len(FUNCTIONS) :]
                out.calls.append(ToolCall(name, m.body.strip()))
                whole += 1
        elif m.channel == "analysis" and m.recipient is None:
            reasoning.append(m.body)
        else:
            content.append(m.body)
    out.reasoning, out.content = "\n".join(reasoning), "\n".join(content)
    return out, whole


def parse(text: str, parse_calls: bool = True) -> Harmony:
    """A whole output's reasoning, content and calls (``parse_calls`` False: the messages to
    functions are content, as with ``tool_choice: none``)."""
    return _fields(text, True, parse_calls)[0]


def to_parsed(h: Harmony) -> Parsed:
    return Parsed(h.content, h.calls)


class HarmonyStream:
    """Deltas of one streamed output: ``feed`` and ``finish`` return (reasoning, content,
    calls) that are certain by now."""

    def __init__(self, parse_calls: bool = True) -> None:
        self.parse_calls = parse_calls
        self.text = ""
        self.sent = Harmony()
        self.num_calls = 0

    def _emit(self, now: Harmony, whole: int) -> tuple[str, str, list[ToolCall]]:
        reasoning = now.reasoning[len(self.sent.reasoning) :]
        content = now.content[len(self.sent.content) :]
        calls = now.calls[self.num_calls : whole]
        if not (
            now.reasoning.startswith(self.sent.reasoning)
            and now.content.startswith(self.sent.content)
        ):
            raise RuntimeError("the harmony stream would take back text it has sent")
        self.sent = Harmony(now.reasoning, now.content)
        self.num_calls = whole
        return reasoning, content, calls

    def feed(self, delta: str) -> tuple[str, str, list[ToolCall]]:
        self.text += delta
        return self._emit(*_fields(self.text, False, self.parse_calls))

    def finish(self) -> tuple[str, str, list[ToolCall]]:
        return self._emit(*_fields(self.text, True, self.parse_calls))
