"""Tool-call parsers, one per format: a corpus of texts as the models write them (rewritten from
the model cards' and templates' examples: text before the calls, several calls, unicode, nested
JSON, typed per-argument values) parses to the expected calls; what is not a valid call to an
offered function stays content; a stream gives the same content and calls as the finished text
for every way of cutting it into deltas; each format is told from the real chat templates
(tests/data/chat_templates), and a template that renders tools in no known format is a 400."""

from __future__ import annotations

import json
import random
from pathlib import Path
from types import SimpleNamespace

import pytest

from tandem.server.chat import ChatRenderer
from tandem.server.errors import APIError
from tandem.server.tool_formats import FORMATS, typed_value
from tandem.server.tool_parsers import (
    PARSERS,
    HermesParser,
    Llama3JsonParser,
    make_parser,
    parser_name_for_template,
)
from tandem.server.tool_stream import ContentTidy
from tandem.server.tools import call_format, calls_text, plan_tools

TEMPLATES = Path(__file__).parent / "data" / "chat_templates"
NAMES = {"get_weather", "add", "run_query", "get_time"}
SCHEMAS = {
    "get_weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string"},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "days": {"type": "integer"},
        },
        "required": ["city"],
    },
    "add": {
        "type": "object",
        "properties": {"a": {"type": "number"}, "b": {"type": "number"}},
        "required": ["a", "b"],
    },
    "run_query": {
        "type": "object",
        "properties": {
            "sql": {"type": "string"},
            "params": {"type": "array"},
            "dry_run": {"type": "boolean"},
            "limit": {"type": ["integer", "null"]},
            "label": {"type": ["string", "null"]},
        },
    },
    "get_time": {"type": "object", "properties": {}},
}
WEATHER = {"city": "Paris", "unit": "celsius", "note": 'a; b } { "q"'}
QUERY = {
    "sql": "SELECT *\nFROM t WHERE a < 3 AND b = '{\"x\": 1}'",
    "params": [{"id": 1, "tags": ["ü", "ß"]}, None],
    "dry_run": True,
    "limit": None,
}
DS = {
    "calls": "<｜tool▁calls▁begin｜>",
    "end": "<｜tool▁calls▁end｜>",
    "call": "<｜tool▁call▁begin｜>",
    "/call": "<｜tool▁call▁end｜>",
    "sep": "<｜tool▁sep｜>",
}


def _hermes(name: str, args: dict) -> str:
    body = json.dumps({"name": name, "arguments": args}, ensure_ascii=False)
    return f"<tool_call>\n{body}\n</tool_call>"


def _v3(name: str, args: dict | str) -> str:
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f"{DS['call']}function{DS['sep']}{name}\n```json\n{text}\n```{DS['/call']}"


def _v31(name: str, args: dict | str) -> str:
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f"{DS['call']}{name}{DS['sep']}{text}{DS['/call']}"


KIMI = {
    "calls": "<|tool_calls_section_begin|>",
    "end": "<|tool_calls_section_end|>",
    "call": "<|tool_call_begin|>",
    "args": "<|tool_call_argument_begin|>",
    "/call": "<|tool_call_end|>",
}


def _kimi(ident: str, args: dict | str) -> str:
    text = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return f"{KIMI['call']}{ident}{KIMI['args']}{text}{KIMI['/call']}"


def _glm(name: str, *pairs: tuple[str, str], newlines: bool = True) -> str:
    nl = "\n" if newlines else ""
    args = "".join(f"<arg_key>{k}</arg_key>{nl}<arg_value>{v}</arg_value>{nl}" for k, v in pairs)
    return f"<tool_call>{name}{nl}{args}</tool_call>"


def _qwen(name: str, *pairs: tuple[str, str]) -> str:
    args = "".join(f"<parameter={k}>\n{v}\n</parameter>\n" for k, v in pairs)
    return f"<tool_call>\n<function={name}>\n{args}</function>\n</tool_call>"


BLOCK = DS["calls"] + _v3("get_weather", {"city": "Hangzhou"}) + DS["end"]
# (parser, text, content, [(name, args)])
CORPUS = [
    # Hermes (Qwen 2.5/3): tags around JSON, text before, several calls.
    ("hermes", "Just text, no call.", "Just text, no call.", []),
    ("hermes", _hermes("get_weather", WEATHER), "", [("get_weather", WEATHER)]),
    (
        "hermes",
        "Let me check. " + _hermes("get_weather", WEATHER) + "\n" + _hermes("add", {"a": 1}),
        "Let me check.",
        [("get_weather", WEATHER), ("add", {"a": 1})],
    ),
    (
        "hermes",
        "Checking both.\n\n"
        + _hermes("get_weather", {"city": "Zürich"})
        + "\n"
        + _hermes("get_weather", {"city": "東京", "unit": "celsius"}),
        "Checking both.",
        [("get_weather", {"city": "Zürich"}), ("get_weather", {"city": "東京", "unit": "celsius"})],
    ),
    ("hermes", _hermes("run_query", QUERY), "", [("run_query", QUERY)]),
    (  # arguments as a JSON string
        "hermes",
        '<tool_call>\n{"name": "add", "arguments": "{\\"a\\": 2}"}\n</tool_call>',
        "",
        [("add", {"a": 2})],
    ),
    ("hermes", _hermes("rm_rf", {}), _hermes("rm_rf", {}), []),
    ("hermes", "<tool_call>{not json</tool_call>", "<tool_call>{not json</tool_call>", []),
    ("hermes", "a < b and <tool", "a < b and <tool", []),
    ("hermes", '<tool_call>{"name": "add"', '<tool_call>{"name": "add"', []),
    (
        "hermes",
        "Text " + _hermes("nope", {}) + " then " + _hermes("add", {"a": 1}) + "\nbye",
        "Text " + _hermes("nope", {}) + " then bye",
        [("add", {"a": 1})],
    ),
    # Llama 3: the whole message is the call(s).
    (
        "llama3_json",
        '<|python_tag|>{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}",
        "",
        [("get_weather", WEATHER)],
    ),
    (
        "llama3_json",
        '{"name": "add", "parameters": {"a": 1}}; {"name": "add", "arguments": "{\\"a\\": 2}"}',
        "",
        [("add", {"a": 1}), ("add", {"a": 2})],
    ),
    ("llama3_json", "The weather is fine.", "The weather is fine.", []),
    ("llama3_json", '{"name": "nope", "parameters": {}}', '{"name": "nope", "parameters": {}}', []),
    # DeepSeek-V3 / R1: a block of calls, each a fenced JSON object after the name.
    ("deepseek_v3", BLOCK, "", [("get_weather", {"city": "Hangzhou"})]),
    (
        "deepseek_v3",
        "I'll look both up.\n\n"
        + DS["calls"]
        + _v3("get_weather", {"city": "北京", "unit": "celsius"})
        + "\n"
        + _v3("run_query", QUERY)
        + DS["end"],
        "I'll look both up.",
        [("get_weather", {"city": "北京", "unit": "celsius"}), ("run_query", QUERY)],
    ),
    (  # the message ends without the block's closing marker; a fence left out
        "deepseek_v3",
        DS["calls"]
        + _v3("add", {"a": 1, "b": 2})
        + "\n"
        + _v3("add", '{"a": 3}').replace("```json\n", "").replace("\n```", ""),
        "",
        [("add", {"a": 1, "b": 2}), ("add", {"a": 3})],
    ),
    (  # an unknown function: the whole block is what the model wrote
        "deepseek_v3",
        DS["calls"] + _v3("add", {"a": 1}) + _v3("rm_rf", {}) + DS["end"],
        DS["calls"] + _v3("add", {"a": 1}) + _v3("rm_rf", {}) + DS["end"],
        [],
    ),
    ("deepseek_v3", BLOCK.replace('"}', '"'), BLOCK.replace('"}', '"'), []),  # broken JSON
    (
        "deepseek_v3",
        DS["calls"] + _v3("add", "{'a': 1}") + DS["end"],
        DS["calls"] + _v3("add", "{'a': 1}") + DS["end"],
        [],
    ),
    (  # V3.1's layout is not V3's
        "deepseek_v3",
        DS["calls"] + _v31("add", {"a": 1}) + DS["end"],
        DS["calls"] + _v31("add", {"a": 1}) + DS["end"],
        [],
    ),
    ("deepseek_v3", "Hi <｜tool▁ca", "Hi <｜tool▁ca", []),
    # DeepSeek-V3.1: name, separator, bare JSON; calls back to back.
    (
        "deepseek_v31",
        "Sure.\n"
        + DS["calls"]
        + _v31("get_weather", {"city": "San Francisco, CA"})
        + _v31("add", {"a": 2, "b": 3.5})
        + DS["end"]
        + " Done.",
        "Sure.\nDone.",
        [("get_weather", {"city": "San Francisco, CA"}), ("add", {"a": 2, "b": 3.5})],
    ),
    (
        "deepseek_v31",
        DS["calls"] + _v31("run_query", QUERY) + DS["end"],
        "",
        [("run_query", QUERY)],
    ),
    (
        "deepseek_v31",
        DS["calls"] + _v31("nope", {}) + DS["end"],
        DS["calls"] + _v31("nope", {}) + DS["end"],
        [],
    ),
    (
        "deepseek_v31",
        DS["calls"] + _v3("add", {"a": 1}) + DS["end"],
        DS["calls"] + _v3("add", {"a": 1}) + DS["end"],
        [],
    ),
    (
        "deepseek_v31",
        DS["calls"] + _v31("add", '{"a": 1') + DS["end"],
        DS["calls"] + _v31("add", '{"a": 1') + DS["end"],
        [],
    ),
    # Kimi-K2: a section of calls named functions.NAME:INDEX, bare JSON arguments.
    ("kimi_k2", "No call here: functions.add:0", "No call here: functions.add:0", []),
    (
        "kimi_k2",
        "Sure.\n"
        + KIMI["calls"]
        + _kimi("functions.get_weather:0", {"city": "北京", "unit": "celsius"})
        + _kimi("functions.add:1", {"a": 2, "b": 3.5})
        + KIMI["end"]
        + " Done.",
        "Sure.\nDone.",
        [("get_weather", {"city": "北京", "unit": "celsius"}), ("add", {"a": 2, "b": 3.5})],
    ),
    (  # whitespace between the calls, nested JSON
        "kimi_k2",
        KIMI["calls"] + " " + _kimi(" functions.run_query:0 ", QUERY) + "\n" + KIMI["end"],
        "",
        [("run_query", QUERY)],
    ),
    (  # a function not offered: the whole section stays content
        "kimi_k2",
        KIMI["calls"]
        + _kimi("functions.add:0", {"a": 1})
        + _kimi("functions.nope:1", {})
        + KIMI["end"],
        KIMI["calls"]
        + _kimi("functions.add:0", {"a": 1})
        + _kimi("functions.nope:1", {})
        + KIMI["end"],
        [],
    ),
    (  # an id without its index
        "kimi_k2",
        KIMI["calls"] + _kimi("functions.add", {"a": 1}) + KIMI["end"],
        KIMI["calls"] + _kimi("functions.add", {"a": 1}) + KIMI["end"],
        [],
    ),
    (  # the name follows the id's last dot, or is the whole of it before the index
        "kimi_k2",
        KIMI["calls"] + _kimi("add:0", {"a": 1}) + _kimi("tools.v2.add:1", {"a": 2}) + KIMI["end"],
        "",
        [("add", {"a": 1}), ("add", {"a": 2})],
    ),
    (  # the text ends in the section, its calls complete
        "kimi_k2",
        "Ok " + KIMI["calls"] + _kimi("functions.add:0", '{"a": 1}'),
        "Ok",
        [("add", {"a": 1})],
    ),
    (
        "kimi_k2",
        KIMI["calls"] + _kimi("functions.add:0", '{"a": 1'),
        KIMI["calls"] + _kimi("functions.add:0", '{"a": 1'),
        [],
    ),
    # GLM-4.5/4.6: name, then key/value pairs; values typed from the schema.
    (
        "glm45",
        _glm("get_weather", ("city", "Beijing"), ("days", "3")),
        "",
        [("get_weather", {"city": "Beijing", "days": 3})],
    ),
    (  # a string parameter keeps its text as written, even when it looks like JSON
        "glm45",
        "I will check the weather first.\n\n"
        + _glm("get_weather", ("city", "2025"), ("unit", "celsius"))
        + "\n\nMeanwhile, a sum.\n\n"
        + _glm("add", ("a", "1.5"), ("b", "-2")),
        "I will check the weather first.\n\nMeanwhile, a sum.",
        [("get_weather", {"city": "2025", "unit": "celsius"}), ("add", {"a": 1.5, "b": -2})],
    ),
    (
        "glm45",
        _glm(
            "run_query",
            ("sql", QUERY["sql"]),
            ("params", json.dumps(QUERY["params"], ensure_ascii=False)),
            ("dry_run", "true"),
            ("limit", "null"),
            ("label", " spaced "),
        ),
        "",
        [("run_query", {**QUERY, "label": " spaced "})],
    ),
    ("glm45", "<tool_call>get_time\n</tool_call>", "", [("get_time", {})]),
    (  # GLM-4.7 writes no newlines between the tags
        "glm45",
        _glm("add", ("a", "1"), ("b", "2"), newlines=False),
        "",
        [("add", {"a": 1, "b": 2})],
    ),
    (  # a value that is not JSON stays the text the model wrote
        "glm45",
        _glm("add", ("a", "one"), ("b", "2")),
        "",
        [("add", {"a": "one", "b": 2})],
    ),
    ("glm45", _glm("rm_rf", ("path", "/")), _glm("rm_rf", ("path", "/")), []),
    (
        "glm45",
        "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b\n</tool_call>",
        "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1</arg_value>\n<arg_key>b\n</tool_call>",
        [],
    ),
    (
        "glm45",
        _glm("add", ("a", "1"), ("a", "2")),
        _glm("add", ("a", "1"), ("a", "2")),
        [],
    ),
    (
        "glm45",
        "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1",
        "<tool_call>add\n<arg_key>a</arg_key>\n<arg_value>1",
        [],
    ),
    # Qwen3-Coder: <function=...> with <parameter=...> blocks, one newline around each value.
    (
        "qwen3_coder",
        _qwen("get_weather", ("city", "Dallas"), ("unit", "fahrenheit")),
        "",
        [("get_weather", {"city": "Dallas", "unit": "fahrenheit"})],
    ),
    (
        "qwen3_coder",
        "Sure! Let me run that.\n"
        + _qwen(
            "run_query",
            ("sql", QUERY["sql"]),
            ("params", json.dumps(QUERY["params"], ensure_ascii=False)),
            ("dry_run", "True"),  # Python's spelling, as the template's `| string` writes it
            ("limit", "None"),
        )
        + "\n"
        + _qwen("add", ("a", "3"), ("b", "4e2")),
        "Sure! Let me run that.",
        [("run_query", QUERY), ("add", {"a": 3, "b": 400.0})],
    ),
    (  # a value keeps its inner and trailing newlines but one
        "qwen3_coder",
        _qwen("get_weather", ("city", "Saint-Étienne\n")),
        "",
        [("get_weather", {"city": "Saint-Étienne\n"})],
    ),
    ("qwen3_coder", _qwen("nope", ("x", "1")), _qwen("nope", ("x", "1")), []),
    (
        "qwen3_coder",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\n</tool_call>",
        [],
    ),
    (
        "qwen3_coder",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\njunk</function>\n</tool_call>",
        "<tool_call>\n<function=add>\n<parameter=a>\n1\n</parameter>\njunk</function>\n</tool_call>",
        [],
    ),
]


def _calls(calls: list) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


def _streamed(fmt: str, pieces: list[str]) -> tuple[str, list]:
    stream = make_parser(fmt, NAMES, SCHEMAS).stream()
    content, calls = "", []
    for piece in pieces:
        delta, new = stream.feed(piece)
        content, calls = content + delta, calls + new
    delta, new = stream.finish()
    return content + delta, _calls(calls + new)


def _cuts(text: str, rng: random.Random) -> list[list[str]]:
    """Every 2-way split, and random k-way splits (cuts fall inside markers too)."""
    out = [[text[:i], text[i:]] for i in range(len(text) + 1)]
    for _ in range(40):
        points = sorted(rng.sample(range(len(text) + 1), min(len(text), rng.randint(2, 24))))
        out.append([text[a:b] for a, b in zip([0, *points], [*points, len(text)], strict=True)])
    out.append(list(text))  # one character at a time
    return out


@pytest.mark.parametrize(("fmt", "text", "content", "calls"), CORPUS)
def test_parse_and_every_stream_split_agree(fmt: str, text: str, content: str, calls: list) -> None:
    parsed = make_parser(fmt, NAMES, SCHEMAS).parse(text)
    assert (parsed.content, _calls(parsed.tool_calls)) == (content, calls)
    for pieces in _cuts(text, random.Random(len(text))):
        assert _streamed(fmt, pieces) == (content, calls), pieces


def test_every_format_has_a_corpus() -> None:
    assert set(PARSERS) == set(FORMATS) == {fmt for fmt, *_ in CORPUS}
    for fmt in FORMATS:
        rows = [row for row in CORPUS if row[0] == fmt]
        assert any(calls for *_, calls in rows) and any(not calls for *_, calls in rows)


def test_content_streams_before_the_message_ends() -> None:
    stream = HermesParser(NAMES).stream()
    assert stream.feed("Hello wor") == ("Hello wor", [])
    assert stream.feed("ld <tool") == ("ld", [])  # " <tool" may start a call: held
    assert stream.feed("bar>") == (" <toolbar>", [])
    assert stream.finish() == ("", [])
    llama = Llama3JsonParser(NAMES).stream()
    assert llama.feed("  Sure") == ("  Sure", [])  # not a call: content at once
    assert Llama3JsonParser(NAMES).stream().feed('{"name"') == ("", [])
    ds = make_parser("deepseek_v3", NAMES).stream()
    assert ds.feed("Looking <｜tool▁") == ("Looking", [])
    assert ds.feed("calls▁begin｜>" + _v3("add", {"a": 1})) == ("", [])  # the block is open
    content, calls = ds.feed(DS["end"] + " done ")
    assert (content, _calls(calls)) == (" done", [("add", {"a": 1})])
    assert ds.finish() == (" ", [])


def test_whitespace_next_to_calls_is_not_content() -> None:
    """Any cutting of the text gives the same content: the first whitespace run of a gap
    between two pieces of text stays, whitespace between a call and either end goes."""
    parts = [" ", "  lead", " \n", "CALL", "\n\n", "CALL", " ", "mid\t", "CALL", " \n "]
    for cut in range(1, 4):
        tidy, out = ContentTidy(), []
        for part in parts:
            if part == "CALL":
                tidy.call()
            else:
                out += [tidy.text(part[i : i + cut]) for i in range(0, len(part), cut)]
        out.append(tidy.finish())
        assert "".join(out) == "   lead \nmid", cut
    tidy = ContentTidy()
    assert (tidy.text(" a  b "), tidy.finish()) == (" a  b", " ")  # no call: unchanged


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


@pytest.mark.parametrize(
    ("text", "schema", "value"),
    [
        ("42", {"type": "integer"}, 42),
        ("42", {"type": "string"}, "42"),
        ("42", {"type": ["string", "null"]}, "42"),
        ("42", {"enum": ["42", "7"]}, "42"),
        (" true ", {"type": "boolean"}, True),
        ("False", {"type": "boolean"}, False),
        ("None", {"type": ["integer", "null"]}, None),
        ("None", {"type": "integer"}, "None"),
        ("NaN", {"type": "number"}, "NaN"),
        ('{"a": [1]}', {"type": "object"}, {"a": [1]}),
        ("{not json", {"type": "object"}, "{not json"),
        ("12", None, 12),
    ],
)
def test_argument_values_are_typed_from_the_schema(text: str, schema: dict, value: object) -> None:
    assert typed_value(text, schema) == value


@pytest.mark.parametrize("fmt", FORMATS)
def test_earlier_calls_are_written_in_each_format_and_read_back(fmt: str) -> None:
    """``calls_text`` (for templates that do not render ``tool_calls``) writes what the
    format's parser reads as the same calls."""
    calls = [
        ("get_weather", {"city": "Zürich", "unit": "celsius", "days": 2}),
        ("run_query", {**QUERY, "label": "a <b> c"}),
    ]
    if fmt == "llama3_json":
        calls = calls[:1] + [("add", {"a": 1, "b": 2})]
    openai = [
        {"id": f"c{i}", "type": "function", "function": {"name": n, "arguments": json.dumps(a)}}
        for i, (n, a) in enumerate(calls)
    ]
    parsed = make_parser(fmt, NAMES, SCHEMAS).parse(calls_text(openai, fmt))
    assert (parsed.content, _calls(parsed.tool_calls)) == ("", calls)


# ----------------------------------------------------------------- the format of a template

# tests/data/chat_templates: the template shipped with ...
#   deepseek_r1.jinja          deepseek-ai/DeepSeek-R1 (DeepSeek-V3's writes calls the same way)
#   deepseek_v31.jinja         deepseek-ai/DeepSeek-V3.1
#   glm45_excerpt.jinja        zai-org/GLM-4.5 (its tools block and tool-call block; the rest cut)
#   qwen3_coder.jinja          Qwen/Qwen3-Coder-30B-A3B-Instruct
#   qwen3.jinja                Qwen/Qwen3-8B
#   llama32_excerpt.jinja      meta-llama/Llama-3.2-1B-Instruct (system block and tool calls)
#   kimi_k2.jinja              moonshotai/Kimi-K2-Instruct
TEMPLATE_FORMATS = {
    "kimi_k2.jinja": "kimi_k2",
    "deepseek_r1.jinja": "deepseek_v3",
    "deepseek_v31.jinja": "deepseek_v31",
    "glm45_excerpt.jinja": "glm45",
    "qwen3_coder.jinja": "qwen3_coder",
    "qwen3.jinja": "hermes",
    "llama32_excerpt.jinja": "llama3_json",
}
# DeepSeek's own templates write earlier calls but do not render ``tools``; a server launched
# with a template that does (like this, in V3's layout) reads V3's calls.
DEEPSEEK_WITH_TOOLS = (
    "{% if tools %}{{ tools | tojson }}Call: <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>"
    "function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>"
    "{% endif %}{% for m in messages %}{{ m.content }}{% endfor %}"
)
UNKNOWN_WITH_TOOLS = (
    "{% if tools %}[AVAILABLE_TOOLS]{{ tools | tojson }}[/AVAILABLE_TOOLS]{% endif %}"
    "{% for m in messages %}[INST]{{ m.content }}[/INST]{% endfor %}"
)


@pytest.mark.parametrize(("file", "fmt"), TEMPLATE_FORMATS.items())
def test_the_format_is_told_from_the_real_template(file: str, fmt: str) -> None:
    """Each template names its format, and its parser reads the calls the template writes
    for an earlier assistant message as the calls that message holds."""
    template = (TEMPLATES / file).read_text()
    assert parser_name_for_template(template) == fmt
    calls = [("get_weather", {"city": "Zürich", "days": 3}), ("add", {"a": 1, "b": [2, 3]})]
    if fmt == "llama3_json":
        calls = calls[:1]  # one call a message
    as_text = fmt.startswith("deepseek")  # these templates concatenate the arguments' text
    tool_calls = [
        {"type": "function", "function": {"name": n, "arguments": json.dumps(a) if as_text else a}}
        for n, a in calls
    ]
    if fmt == "kimi_k2":  # Kimi's template writes each call under its id
        for i, call in enumerate(tool_calls):
            call["id"] = f"functions.{call['function']['name']}:{i}"
    messages = [
        {"role": "user", "content": "Weather in Zürich, and 1 + [2, 3]?"},
        {"role": "assistant", "content": None if as_text else "", "tool_calls": tool_calls},
    ]
    tokens = SimpleNamespace(bos_token="<s>", eos_token="</s>")
    text = ChatRenderer(template, tokens).render(messages, False)
    if fmt == "llama3_json":  # the whole message: the assistant's turn alone
        text = text.split("assistant<|end_header_id|>\n\n")[1].split("<|eot_id|>")[0]
    parsed = make_parser(fmt, NAMES, SCHEMAS).parse(text).tool_calls
    assert _calls(parsed) == calls
    if fmt == "kimi_k2":  # the ids the model wrote, as the template will name the results
        assert [c.id for c in parsed] == [c["id"] for c in tool_calls]


def test_the_call_format_follows_the_template_or_the_flag() -> None:
    read = {file: (TEMPLATES / file).read_text() for file in TEMPLATE_FORMATS}
    for file in ("glm45_excerpt.jinja", "qwen3_coder.jinja", "qwen3.jinja"):
        assert call_format(read[file], None) == TEMPLATE_FORMATS[file]
    # DeepSeek's own templates do not render tools but write earlier calls: our system message
    # lists the tools and teaches that format, and the output is read in it.
    assert call_format(read["deepseek_r1.jinja"], None) == "deepseek_v3"
    assert call_format(read["deepseek_v31.jinja"], None) == "deepseek_v31"
    assert call_format(DEEPSEEK_WITH_TOOLS, None) == "deepseek_v3"
    assert call_format(read["qwen3.jinja"], "glm45") == "glm45"  # --tool-call-parser wins
    assert call_format(None, None) == "hermes"
    assert parser_name_for_template(None) is None
    assert isinstance(make_parser("llama3_json", NAMES), Llama3JsonParser)
    with pytest.raises(ValueError, match="unknown tool-call parser 'mistral'; known: deepseek_v3"):
        make_parser("mistral", NAMES)


def test_tools_with_a_template_of_an_unknown_format_are_a_400() -> None:
    """Never a silent Hermes: the client is told to start the server with --tool-call-parser;
    a request whose calls are not read (no tools, or ``tool_choice`` none) still renders."""
    with pytest.raises(APIError) as e:
        call_format(UNKNOWN_WITH_TOOLS, None)
    assert (e.value.status, e.value.param) == (400, "tools")
    assert "--tool-call-parser NAME" in e.value.message and ", ".join(FORMATS) in e.value.message
    assert call_format(UNKNOWN_WITH_TOOLS, None, tools=False) == "hermes"
    assert call_format(UNKNOWN_WITH_TOOLS, "hermes") == "hermes"

    from tandem.server.protocol import ChatCompletionRequest
    from tandem.server.serving_chat import render_chat_prompt

    tool = {"type": "function", "function": {"name": "add", "parameters": SCHEMAS["add"]}}
    text = SimpleNamespace(encode=lambda t, add_special_tokens: t)  # the rendered text itself
    state = SimpleNamespace(
        renderer=ChatRenderer(UNKNOWN_WITH_TOOLS, text),
        tokenizer=text,
        settings=SimpleNamespace(tool_call_parser=None),
    )
    for choice, fails in (("auto", True), ("required", True), ("none", False), (None, False)):
        body = {"model": "m", "messages": [{"role": "user", "content": "1 + 2?"}]}
        if choice is not None:
            body |= {"tools": [tool], "tool_choice": choice}
        req = ChatCompletionRequest.model_validate(body)
        plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        if fails:
            with pytest.raises(APIError) as e:
                plan.call_format(UNKNOWN_WITH_TOOLS, None)
            assert e.value.param == "tools"
            with pytest.raises(APIError, match="--tool-call-parser NAME"):
                render_chat_prompt(state, req.messages, True, tools=plan)
        else:
            assert "[INST]1 + 2?[/INST]" in render_chat_prompt(
                state, req.messages, True, tools=plan
            )


def test_our_system_message_teaches_the_format_calls_are_read_in() -> None:
    """A template that does not render tools gets them in our system message, which teaches
    the format the output is read in: in words (Hermes, Llama 3) or by an example written in
    that format, which its parser reads back."""
    tool = {"type": "function", "function": {"name": "add", "parameters": SCHEMAS["add"]}}
    plan = plan_tools([SimpleNamespace(model_dump=lambda **_: tool)], None, None)
    assert "<tool_call>" in plan.system_prompt("hermes")
    for fmt in ("deepseek_v3", "deepseek_v31", "glm45", "qwen3_coder"):
        prompt = plan.system_prompt(fmt)
        assert '"name": "add"' in prompt  # the tools
        example = prompt.split("in exactly this format:\n", 1)[1]
        parsed = make_parser(fmt, {"function_name"}).parse(example).tool_calls
        assert [(c.name, json.loads(c.arguments)) for c in parsed] == [
            ("function_name", {"argument_name": "value"})
        ], fmt


@pytest.mark.parametrize("file", ["deepseek_r1.jinja", "deepseek_v31.jinja", "qwen3.jinja"])
def test_a_conversation_with_earlier_calls_renders_through_the_real_template(file: str) -> None:
    """DeepSeek's templates concatenate an earlier call's arguments as text, where Hugging
    Face's convention (Qwen3's template) passes them parsed: both render, and the tools come in
    a system message teaching the template's own format where the template does not render
    them."""
    from tandem.server.protocol import ChatCompletionRequest
    from tandem.server.serving_chat import render_chat_text

    template = (TEMPLATES / file).read_text()
    tokens = SimpleNamespace(bos_token="<s>", eos_token="</s>")
    state = SimpleNamespace(
        renderer=ChatRenderer(template, tokens), settings=SimpleNamespace(tool_call_parser=None)
    )
    call = {"id": "c1", "type": "function",
            "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}  # fmt: skip
    tool = {"type": "function", "function": {"name": "get_weather", "parameters": {}}}
    req = ChatCompletionRequest.model_validate(
        {"messages": [
            {"role": "user", "content": "Weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ], "tools": [tool]}
    )  # fmt: skip
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    text = render_chat_text(state, req.messages, True, None, plan)
    fmt = call_format(template, None)
    assert fmt == {"deepseek_r1.jinja": "deepseek_v3", "deepseek_v31.jinja": "deepseek_v31"}.get(
        file, "hermes"
    )
    assert "sunny" in text and '"get_weather"' in text  # the tool result; the tools listed
    (written,) = make_parser(fmt, {"get_weather"}).parse(text).tool_calls[:1]
    assert (written.name, json.loads(written.arguments)) == ("get_weather", {"city": "Paris"})
