"""Tool-call parsers: finished texts and streams give the same content and calls, for every way
of cutting the stream into deltas; what is not a valid call to an offered function stays
content."""

from __future__ import annotations

import json

import pytest

from tandem.server.tool_parsers import (
    HermesParser,
    Llama3JsonParser,
    ToolParser,
    make_parser,
    parser_name_for_template,
)

NAMES = {"get_weather", "add"}
WEATHER = {"city": "Paris", "unit": "celsius", "note": 'a; b } { "q"'}


def _hermes(name: str, args: dict) -> str:
    return "<tool_call>\n" + json.dumps({"name": name, "arguments": args}) + "\n</tool_call>"


CASES = [
    # (parser, text, content, [(name, args)])
    (HermesParser, "Just text, no call.", "Just text, no call.", []),
    (HermesParser, _hermes("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    (
        HermesParser,
        "Let me check. " + _hermes("get_weather", WEATHER) + "\n" + _hermes("add", {"a": 1}),
        "Let me check.",
        [("get_weather", WEATHER), ("add", {"a": 1})],
    ),
    # An unknown function or broken JSON is what the model wrote: content.
    (HermesParser, _hermes("rm_rf", {}), _hermes("rm_rf", {}), []),
    (HermesParser, "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    (HermesParser, "a < b and <tool", "a < b and <tool", []),  # a partial tag at the end
    (HermesParser, '<tool_call>{"name": "add"', '<tool_call>{"name": "add"', []),
    (
        Llama3JsonParser,
        '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        Llama3JsonParser,
        '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "arguments": "{\\"a\\": 2}"}',
        "",
        [("add", {"a": 1}), ("add", {"a": 2})],
    ),
    (Llama3JsonParser, "The weather is fine.", "The weather is fine.", []),
    (
        Llama3JsonParser,
        '{"name": "nope", "parameters": {}}',
        '{"name": "nope", "parameters": {}}',
        [],
    ),
]


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


@pytest.mark.parametrize(("cls", "text", "content", "calls"), CASES)
def test_parse_and_every_stream_split_agree(
    cls: type[ToolParser], text: str, content: str, calls: list
) -> None:
    parser = cls(NAMES)
    parsed = parser.parse(text)
    assert (parsed.content, _calls(parsed.tool_calls)) == (content, calls)
    for step in (1, 2, 3, 7, len(text)):
        stream = parser.stream()
        got_content, got_calls = "", []
        for i in range(0, len(text), step):
            delta, new = stream.feed(text[i : i + step])
            got_content += delta
            got_calls += new
        delta, new = stream.finish()
        got_content += delta
        got_calls += new
        assert _calls(got_calls) == calls, step
        # A stream gives content out before it knows whether calls follow: surrounding spaces
        # may stay, the text may not change.
        assert got_content.strip() == content, step


def test_content_streams_before_the_message_ends() -> None:
    stream = HermesParser(NAMES).stream()
    assert stream.feed("Hello wor") == ("Hello wor", [])
    assert stream.feed("ld <tool") == ("ld ", [])  # may be the start of a call: held
    assert stream.feed("bar>") == ("<toolbar>", [])
    llama = Llama3JsonParser(NAMES).stream()
    assert llama.feed("  Sure") == ("  Sure", [])  # not a call: content at once
    assert Llama3JsonParser(NAMES).stream().feed('{"name"') == ("", [])


def test_each_call_gets_an_id_and_the_openai_shape() -> None:
    calls = HermesParser(NAMES).parse(_hermes("add", {"a": 1}) + _hermes("add", {"a": 2}))
    a, b = (c.to_openai(i) for i, c in enumerate(calls.tool_calls))
    assert a["id"] != b["id"] and a["id"].startswith("call_")
    assert a == {
        "id": a["id"],
        "type": "function",
        "index": 0,
        "function": {"name": "add", "arguments": '{"a": 1}'},
    }


def test_the_parser_follows_the_template() -> None:
    assert parser_name_for_template("{{ '<|python_tag|>' }}") == "llama3_json"
    assert parser_name_for_template("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert parser_name_for_template(None) == "hermes"
    assert isinstance(make_parser("llama3_json", NAMES), Llama3JsonParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; known: hermes"):
        make_parser("mistral", NAMES)
