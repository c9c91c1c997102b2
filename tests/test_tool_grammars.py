"""Forced tool calls (``tool_choice`` "required" or a named function) are written in the format
the output is parsed in, for every parser: the Lark grammar accepts the format's calls (checked
byte by byte with llguidance), which parse back to the same calls with arguments valid against
the parameters; it rejects other formats, values outside the schema, a missing required
argument and a raw value holding its closing tag; a tiny random model sampling under each
grammar writes calls that always parse and validate."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jsonschema
import llguidance
import pytest

from tandem.engine.structured_output import to_grammar
from tandem.server.errors import APIError
from tandem.server.tool_formats import FORMATS, is_string_schema
from tandem.server.tool_parsers import make_parser
from tandem.server.tools import ToolPlan

CITIES = ["Paris", "Zürich", "東京", "New York"]
WEATHER = {
    "name": "get_weather",
    "parameters": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "enum": CITIES},
            "days": {"type": "integer", "minimum": 1, "maximum": 14},
            "note": {"type": "string", "maxLength": 12},
            "units": {"type": "object", "properties": {"metric": {"type": "boolean"}}},
        },
        "required": ["city", "days"],
        "additionalProperties": False,
    },
}
QUERY = {
    "name": "run_query",
    "parameters": {
        "type": "object",
        "properties": {
            "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]+$"},
            "ids": {"type": "array", "items": {"type": "integer"}, "maxItems": 3},
            "dry_run": {"type": "boolean"},
            "limit": {"anyOf": [{"type": "integer"}, {"type": "null"}]},
            "unit": {"$ref": "#/$defs/unit"},
        },
        "required": ["code"],
        "$defs": {"unit": {"enum": ["ms", "s"]}},
    },
}
FUNCS = [WEATHER, QUERY]
PARAMS = {f["name"]: f["parameters"] for f in FUNCS}
GOOD = [
    ("get_weather", {"city": "Zürich", "days": 3}),
    (
        "get_weather",
        {"city": "東京", "days": 14, "note": 'a <b> "c"\nd', "units": {"metric": True}},
    ),
    ("run_query", {"code": "ABC-42", "ids": [1, 2], "dry_run": False, "limit": None, "unit": "ms"}),
    ("run_query", {"code": "XYZ-0"}),
]


def _json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))  # as forced JSON is


def _value(value: Any, schema: dict) -> str:
    """A per-argument value: a string parameter's raw text, else JSON (as the grammar has it)."""
    return value if is_string_schema(schema) else _json(value)


def write(fmt: str, calls: list[tuple[str, dict]]) -> str:
    """Calls as a model writes them in ``fmt`` under the forced grammar."""
    b, e, cb, ce, sep = (
        "<｜tool▁calls▁begin｜>",
        "<｜tool▁calls▁end｜>",
        "<｜tool▁call▁begin｜>",
        "<｜tool▁call▁end｜>",
        "<｜tool▁sep｜>",
    )
    if fmt == "hermes":
        return "\n".join(
            f"<tool_call>\n{_json({'name': n, 'arguments': a})}\n</tool_call>" for n, a in calls
        )
    if fmt == "llama3_json":
        return "; ".join(_json({"name": n, "parameters": a}) for n, a in calls)
    if fmt == "deepseek_v3":
        body = "\n".join(f"{cb}function{sep}{n}\n```json\n{_json(a)}\n```{ce}" for n, a in calls)
        return f"{b}{body}{e}"
    if fmt == "deepseek_v31":
        return b + "".join(f"{cb}{n}{sep}{_json(a)}{ce}" for n, a in calls) + e
    if fmt == "kimi_k2":
        body = "".join(
            f"<|tool_call_begin|>functions.{n}:{i}<|tool_call_argument_begin|>{_json(a)}"
            "<|tool_call_end|>"
            for i, (n, a) in enumerate(calls)
        )
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    props = {f["name"]: f["parameters"]["properties"] for f in FUNCS}
    if fmt == "glm45":
        return "\n".join(
            f"<tool_call>{n}\n"
            + "".join(
                f"<arg_key>{k}</arg_key>\n<arg_value>{_value(a[k], s)}</arg_value>\n"
                for k, s in props.get(n, {}).items()
                if k in a
            )
            + "</tool_call>"
            for n, a in calls
        )
    return "\n".join(
        f"<tool_call>\n<function={n}>\n"
        + "".join(
            f"<parameter={k}>\n{_value(a[k], s)}\n</parameter>\n"
            for k, s in props.get(n, {}).items()
            if k in a
        )
        + "</function>\n</tool_call>"
        for n, a in calls
    )


class _Bytes:
    """A tokenizer whose tokens are the 256 bytes (and an end token): a grammar checked with
    it accepts exactly the texts it accepts."""

    eos_token_id = 256
    bos_token_id = None
    tokens = [bytes([i]) for i in range(256)] + [b"<eos>"]
    special_token_ids = [256]

    def __call__(self, text: str | bytes) -> list[int]:
        return list(text.encode() if isinstance(text, str) else text)


@pytest.fixture(scope="module")
def bytes_tokenizer() -> Any:
    return llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Bytes()))


def plan(parallel: bool = True, name: str | None = None, funcs: list | None = None) -> ToolPlan:
    tools = [{"type": "function", "function": f} for f in funcs or FUNCS]
    return ToolPlan(tools, "function" if name else "required", name, parallel)


def accepts_tokens(ll: Any, spec: Any, tokens: list[int]) -> bool:
    """Whether ``spec``'s grammar takes exactly ``tokens`` (a whole output)."""
    assert spec is not None
    matcher = llguidance.LLMatcher(ll, to_grammar(spec), log_level=0)
    assert not matcher.is_error(), matcher.get_error()
    return (
        matcher.validate_tokens(tokens) == len(tokens)
        and matcher.consume_tokens(tokens)
        and matcher.is_accepting()
    )


def accepts(ll: Any, grammar_plan: ToolPlan, fmt: str, text: str) -> bool:
    return accepts_tokens(ll, grammar_plan.grammar(fmt), list(text.encode()))


def parsed(fmt: str, text: str) -> list[tuple[str, dict]]:
    result = make_parser(fmt, set(PARAMS), PARAMS).parse(text)
    assert result.content == ""
    return [(c.name, json.loads(c.arguments)) for c in result.tool_calls]


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_grammar_writes_the_formats_calls_and_they_parse_back(bytes_tokenizer, fmt) -> None:
    for name, args in GOOD:
        jsonschema.validate(args, PARAMS[name])
        text = write(fmt, [(name, args)])
        assert accepts(bytes_tokenizer, plan(False), fmt, text), text
        assert accepts(bytes_tokenizer, plan(False, name), fmt, text), text
        assert parsed(fmt, text) == [(name, args)]
    two = write(fmt, GOOD[:2])
    assert accepts(bytes_tokenizer, plan(True), fmt, two)
    assert not accepts(bytes_tokenizer, plan(False), fmt, two)  # one call only
    assert not accepts(bytes_tokenizer, plan(True, "run_query"), fmt, write(fmt, GOOD[:1]))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_grammar_rejects_what_is_not_a_valid_call(bytes_tokenizer, fmt) -> None:
    good = GOOD[1]
    for other in FORMATS:
        if other != fmt:
            assert not accepts(bytes_tokenizer, plan(), fmt, write(other, [good])), other
    bad_args = [
        {**good[1], "city": "Rome"},  # not in the enum
        {k: v for k, v in good[1].items() if k != "days"},  # a required argument left out
        {**good[1], "days": 15},  # above the maximum
        {**good[1], "note": "far too long a note"},  # longer than maxLength
    ]
    for args in bad_args:
        assert not accepts(bytes_tokenizer, plan(), fmt, write(fmt, [("get_weather", args)]))
    for code in ("ab-1", "xABC-1", "ABC-1x"):  # the pattern, anchored at both ends
        assert not accepts(
            bytes_tokenizer, plan(), fmt, write(fmt, [("run_query", {"code": code})])
        )
    assert not accepts(bytes_tokenizer, plan(), fmt, write(fmt, [("nope", {})]))  # not offered


@pytest.mark.parametrize(
    ("fmt", "close"), [("glm45", "</arg_value>"), ("qwen3_coder", "</parameter>")]
)
def test_a_raw_value_cannot_hold_its_closing_tag(bytes_tokenizer, fmt, close) -> None:
    """The parser reads a value up to the first closing tag, so the grammar allows none inside
    it (while a string parameter's text is otherwise free: markup, quotes, newlines)."""
    free = {
        "name": "say",
        "parameters": {"type": "object", "properties": {"t": {"type": "string"}}},
    }
    say = plan(funcs=[free])
    for text in ('<b>"x"</b>\n{', "", "a\n\nb", "ü\\n"):
        assert accepts(bytes_tokenizer, say, fmt, _say(fmt, text)), text
        result = make_parser(fmt, {"say"}, {"say": free["parameters"]}).parse(_say(fmt, text))
        assert [json.loads(c.arguments) for c in result.tool_calls] == [{"t": text}]
    assert not accepts(bytes_tokenizer, say, fmt, _say(fmt, f"a{close}b"))


def _say(fmt: str, text: str) -> str:
    if fmt == "glm45":
        return f"<tool_call>say\n<arg_key>t</arg_key>\n<arg_value>{text}</arg_value>\n</tool_call>"
    return f"<tool_call>\n<function=say>\n<parameter=t>\n{text}\n</parameter>\n</function>\n</tool_call>"


@pytest.mark.parametrize("fmt", FORMATS)
def test_random_valid_calls_are_accepted_and_read_back(bytes_tokenizer, fmt) -> None:
    rng = random.Random(7)
    alphabet = "aZ9 <>/\"'\\{}[]:,\n\tü東€"
    grammar_plan = plan(True)
    for _ in range(8):
        calls = []
        for _ in range(rng.randint(1, 3)):
            if rng.random() < 0.5:
                args: dict[str, Any] = {"city": rng.choice(CITIES), "days": rng.randint(1, 14)}
                if rng.random() < 0.7:
                    args["note"] = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 12)))
                if rng.random() < 0.5:
                    args["units"] = {"metric": rng.random() < 0.5}
                calls.append(("get_weather", args))
            else:
                args = {"code": f"QRS-{rng.randint(0, 10**6)}"}
                if rng.random() < 0.5:
                    args["ids"] = [rng.randint(-5, 5) for _ in range(rng.randint(0, 3))]
                if rng.random() < 0.5:
                    args["limit"] = rng.choice([None, rng.randint(0, 99)])
                calls.append(("run_query", args))
        text = write(fmt, calls)
        assert accepts(bytes_tokenizer, grammar_plan, fmt, text), text
        assert parsed(fmt, text) == calls
        for name, args in calls:
            jsonschema.validate(args, PARAMS[name])


def test_a_schema_a_per_argument_format_cannot_write_is_a_400() -> None:
    either = {"name": "pick", "parameters": {"type": "object", "anyOf": [{"required": ["a"]}]}}
    odd_name = {
        "name": "odd",
        "parameters": {"type": "object", "properties": {"a>b": {"type": "string"}}},
    }
    for fmt in ("glm45", "qwen3_coder"):
        with pytest.raises(APIError, match="can use only") as e:
            plan(funcs=[WEATHER, either]).grammar(fmt)
        assert (e.value.status, e.value.param) == (400, "tools[1].function.parameters")
    with pytest.raises(APIError, match="'a>b' cannot be written in the qwen3_coder format"):
        plan(funcs=[odd_name]).grammar("qwen3_coder")
    # The JSON formats take any parameters schema; a named function's grammar ignores others.
    assert plan(funcs=[either]).grammar("deepseek_v31") is not None
    assert plan(name="get_weather", funcs=[WEATHER, either]).grammar("glm45") is not None


def test_the_server_flag_offers_every_format() -> None:
    import argparse

    from tandem.server.cli import add_serve_arguments

    parser = argparse.ArgumentParser()
    add_serve_arguments(parser)
    (action,) = [a for a in parser._actions if "--tool-call-parser" in a.option_strings]
    assert tuple(action.choices) == FORMATS


# ----------------------------------------------------------------- sampled under the grammar


@pytest.fixture(scope="module")
def llm(tmp_path_factory: pytest.TempPathFactory):
    from server_utils import tiny_model
    from tandem import LLM

    with LLM(str(tiny_model(tmp_path_factory)), max_model_len=512) as llm:
        yield llm


BOUNDED = {  # values a random walk finishes: every string and number is bounded
    "name": "set_alarm",
    "parameters": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "maxLength": 6},
            "hour": {"type": "integer", "minimum": 0, "maximum": 23},
            "days": {"type": "array", "items": {"enum": ["mo", "tu"]}, "maxItems": 2},
            "loud": {"type": "boolean"},
            "tone": {"type": "string", "enum": ["bell", "beep"]},
        },
        "required": ["label", "hour", "tone"],
        "additionalProperties": False,
    },
}


def _check_forced(fmt: str, out: Any) -> None:
    """A forced call's output: it ended, parses with the format's parser, and validates."""
    text = out.outputs[0].text
    assert out.outputs[0].finish_reason == "stop", (fmt, text)
    parameters = BOUNDED["parameters"]
    result = make_parser(fmt, {"set_alarm"}, {"set_alarm": parameters}).parse(text)
    assert len(result.tool_calls) == 1 and result.content == "", (fmt, text)
    jsonschema.validate(json.loads(result.tool_calls[0].arguments), parameters)


def test_a_random_model_forced_to_call_always_writes_calls_that_parse(llm, tmp_path: Path) -> None:
    """A tiny random model at temperature 1 is a random walk through each grammar: every
    sample ends, parses with the format's parser, and its arguments validate."""
    from tandem import SamplingParams

    bounded = BOUNDED
    forced = plan(False, funcs=[bounded])
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=300, structured=forced.grammar(fmt))
        for fmt in FORMATS
        for s in range(3)
    ]
    outs = llm.generate(["Set an alarm."] * len(params), params)
    for i, out in enumerate(outs):
        _check_forced(FORMATS[i // 3], out)


def test_forced_calls_under_speculation_parse_and_equal_greedy_without(
    llm, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """The same target with an MTP head (three drafts a step, verified against the masked
    target): greedy forced calls equal those without speculation in every format, and sampled
    ones parse and validate too."""
    from server_utils import tiny_mtp_model
    from tandem import LLM, SamplingParams

    forced = plan(False, funcs=[BOUNDED])
    greedy = [
        SamplingParams(temperature=0, max_tokens=400, structured=forced.grammar(fmt))
        for fmt in FORMATS
    ]
    sampled = [
        SamplingParams(temperature=1.0, seed=11, max_tokens=400, structured=forced.grammar(fmt))
        for fmt in FORMATS
    ]
    prompts = ["Set an alarm."] * len(FORMATS)
    plain = llm.generate(prompts, greedy)
    spec = {"method": "mtp", "num_speculative_tokens": 3}
    mtp = str(tiny_mtp_model(tmp_path_factory))
    with LLM(mtp, speculative_config=spec, max_model_len=512) as spec_llm:
        outs = spec_llm.generate(prompts * 2, greedy + sampled)
        assert spec_llm.engine.spec_stats.num_draft_tokens > 0
    for fmt, base, out in zip(FORMATS, plain, outs, strict=False):
        assert out.outputs[0].text == base.outputs[0].text, fmt
    for i, out in enumerate(outs):
        _check_forced(FORMATS[i % len(FORMATS)], out)


GLM_SPECIAL = (
    "<tool_call>",
    "</tool_call>",
    "<arg_key>",
    "</arg_key>",
    "<arg_value>",
    "</arg_value>",
)


class _BytesAndMarkers(_Bytes):
    """The byte tokenizer plus a format's markers as special tokens (as its tokenizer has
    them): ids 257 on, in ``markers``' order."""

    def __init__(self, markers: tuple[str, ...]) -> None:
        self.markers = markers
        self.tokens = [*_Bytes.tokens, *(m.encode() for m in markers)]
        self.special_token_ids = [256, *range(257, 257 + len(markers))]

    def ids(self, text: str) -> list[int]:
        """``text`` as that tokenizer's ids: the markers as their tokens, the rest as bytes."""
        out: list[int] = []
        while text:
            marker = next((m for m in self.markers if text.startswith(m)), None)
            out += [257 + self.markers.index(marker)] if marker else list(text[0].encode())
            text = text[len(marker) :] if marker else text[1:]
        return out


def test_markers_the_tokenizer_holds_as_special_tokens_are_written_as_those_tokens() -> None:
    """GLM-4.5's tokenizer holds <tool_call>, <arg_key>, ... as special tokens: the forced
    grammar takes each marker as its token (the model's way of writing it), never spelled out
    in bytes; the values between them stay free text."""
    glm = _BytesAndMarkers(GLM_SPECIAL)
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(glm))
    spec = plan(False).grammar("glm45", frozenset(GLM_SPECIAL))
    for name, args in GOOD:
        text = write("glm45", [(name, args)])
        assert accepts_tokens(ll, spec, glm.ids(text)), text
        assert not accepts_tokens(ll, spec, list(text.encode())), text  # markers spelled in bytes
        assert parsed("glm45", text) == [(name, args)]
    # Without the special set the grammar is the byte-spelled one (a tokenizer without them).
    plain = plan(False).grammar("glm45")
    assert plain is not None and "<tool_call>" not in plain.text.replace('"<tool_call>', "")


HARMONY_SPECIAL = (
    "<|start|>",
    "<|end|>",
    "<|message|>",
    "<|channel|>",
    "<|constrain|>",
    "<|call|>",
)


def _harmony_call(name: str, args: dict, reasoning: str | None = None) -> str:
    """A forced call as gpt-oss writes it after the prompt's ``<|start|>assistant``."""
    head = "" if reasoning is None else (
        f"<|channel|>analysis<|message|>{reasoning}<|end|><|start|>assistant"
    )  # fmt: skip
    return (
        f"{head}<|channel|>commentary to=functions.{name} <|constrain|>json<|message|>"
        f"{_json(args)}<|call|>"
    )


def test_harmony_forced_calls_are_written_in_harmony(bytes_tokenizer) -> None:
    """gpt-oss's forced call: an optional analysis message, then the commentary message to
    functions.NAME with the arguments' JSON, ended by <|call|> (which ends the turn: one call),
    the markers as their special tokens; it parses back with the harmony reader. Not a final
    answer, another function, arguments outside the schema, two calls, nor the markers spelled
    out in bytes; with markers the tokenizer does not hold as special, the byte-spelled form,
    whose reasoning cannot hold <|end|>."""
    from tandem.server import harmony

    markers = _BytesAndMarkers(HARMONY_SPECIAL)
    ll = llguidance.LLTokenizer(llguidance.TokenizerWrapper(markers))
    ids = markers.ids

    def accepted(p: ToolPlan, tokens: list[int], tokenizer: Any = ll, special: bool = True) -> bool:
        spec = p.grammar("harmony", frozenset(HARMONY_SPECIAL) if special else frozenset())
        return accepts_tokens(tokenizer, spec, tokens)

    for name, args in GOOD:
        for reasoning in (None, "", 'They want <b>"weather"</b>.\nCall it.'):
            text = _harmony_call(name, args, reasoning)
            assert accepted(plan(), ids(text)), text
            assert accepted(plan(name=name), ids(text)), text
            assert not accepted(plan(), list(text.encode())), text  # markers spelled in bytes
            assert accepted(plan(), list(text.encode()), bytes_tokenizer, special=False), text
            read = harmony.parse(text.removesuffix("<|call|>"))
            assert [(c.name, json.loads(c.arguments)) for c in read.calls] == [(name, args)]
            assert read.reasoning == (reasoning or "") and read.content == ""
    other = "run_query" if GOOD[0][0] == "get_weather" else "get_weather"
    assert not accepted(plan(name=other), ids(_harmony_call(*GOOD[0])))
    final = "<|channel|>final<|message|>It is sunny.<|return|>"
    assert not accepted(plan(), ids(final) + [256])
    assert not accepted(plan(), ids(_harmony_call("get_weather", {"city": "Rome", "days": 2})))
    two = _harmony_call(*GOOD[0]) + "<|start|>assistant" + _harmony_call(*GOOD[1])
    assert not accepted(plan(), ids(two))
    spelled = _harmony_call(*GOOD[0], reasoning="a <|end|> b")
    assert not accepted(plan(), list(spelled.encode()), bytes_tokenizer, special=False)
