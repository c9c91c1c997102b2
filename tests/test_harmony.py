"""The harmony format (gpt-oss, issue #48 item 2; server/harmony.py): outputs as gpt-oss writes
them split into reasoning (``analysis``), content (``final`` and preambles) and tool calls
(messages to ``functions.NAME``), the same streamed, for every way to cut the text into two
and three deltas; over HTTP with the official ``openai`` client on a scripted tiny model with a
harmony chat template whose markers are special tokens (so the server must keep them in the
text): a call with its reasoning, streamed and not, the round trip of its result, the
reasoning effort reaching the template, and what the format does not take yet refused; a forced
call written under harmony's own grammar (tokens as gpt-oss's, markers special) through the
engine."""

from __future__ import annotations

import json
from itertools import combinations
from typing import Any

import openai
import pytest
from scripted import GPT_OSS_TEMPLATE, Script, build_scripted_model

from server_utils import RemoteServer
from tandem.server import harmony
from tandem.server.tool_formats import ToolCall

ANALYSIS = "<|channel|>analysis<|message|>The user asks for Rome's weather. Use the tool.<|end|>"
CALL = (
    "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json"
    '<|message|>{"city": "Rome"}'
)
FINAL = "<|start|>assistant<|channel|>final<|message|>It is sunny in Rome."
CASES: dict[str, tuple[str, tuple[str, str, list[tuple[str, str]]]]] = {
    "answer": (
        ANALYSIS + FINAL,
        ("The user asks for Rome's weather. Use the tool.", "It is sunny in Rome.", []),
    ),
    "call": (
        ANALYSIS + CALL,
        (
            "The user asks for Rome's weather. Use the tool.",
            "",
            [("get_weather", '{"city": "Rome"}')],
        ),
    ),
    # The recipient in the role header (as the template writes earlier calls), a preamble on
    # commentary, two calls, the first ended by <|call|> as a tool-calling turn would be.
    "preamble-two-calls": (
        "<|channel|>commentary<|message|>Checking both.<|end|>"
        '<|start|>assistant to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|call|>'
        '<|start|>assistant to=functions.b<|channel|>commentary json<|message|> {"y": 2} ',
        ("", "Checking both.", [("a", '{"x": 1}'), ("b", '{"y": 2}')]),
    ),
    "two-thoughts": (
        "<|channel|>analysis<|message|>one<|end|><|start|>assistant<|channel|>analysis"
        "<|message|>two<|end|><|start|>assistant<|channel|>final<|message|>done",
        ("one\ntwo", "done", []),
    ),
    "not-the-format": ("Just text, <| and all.", ("", "Just text, <| and all.", [])),
    "cut-in-the-thinking": ("<|channel|>analysis<|message|>Still thin", ("Still thin", "", [])),
}


def _calls(calls: list[ToolCall]) -> list[tuple[str, str]]:
    return [(c.name, c.arguments) for c in calls]


def _fields(h: harmony.Harmony) -> tuple[str, str, list[tuple[str, str]]]:
    return h.reasoning, h.content, _calls(h.calls)


@pytest.mark.parametrize("name", list(CASES))
def test_finished_and_streamed_outputs_split_the_same(name: str) -> None:
    text, want = CASES[name]
    assert _fields(harmony.parse(text)) == want
    cuts = range(1, len(text))
    splits = [(c,) for c in cuts] + list(combinations(range(1, len(text), 7), 2))
    for split in splits:
        bounds = [0, *split, len(text)]
        stream = harmony.HarmonyStream()
        reasoning, content, calls = "", "", []
        for a, b in zip(bounds, bounds[1:], strict=False):
            r, c, k = stream.feed(text[a:b])
            reasoning, content, calls = reasoning + r, content + c, calls + k
        r, c, k = stream.finish()
        got = (reasoning + r, content + c, _calls(calls + k))
        assert got == want, (name, split)


def test_without_parsing_calls_a_call_is_content() -> None:
    text = ANALYSIS + CALL
    got = harmony.parse(text, parse_calls=False)
    assert (got.content, got.calls) == ('{"city": "Rome"}', [])


def test_markers_the_tokenizer_skips_count_as_special(tmp_path: Any) -> None:
    """The scripted tokenizer holds the markers as special tokens without listing them in
    ``all_special_tokens`` (as a tokenizer.json's added tokens can): they still count, since
    decoding with ``skip_special_tokens`` would drop them."""
    from scripted import build_tokenizer

    from tandem.server.state import is_special_token

    script = Script(sequences=(("assistant", *OUTPUT),), extra=PROMPT_WORDS, special=MARKERS)
    tok = build_tokenizer(tmp_path, script, GPT_OSS_TEMPLATE)
    assert "<|end|>" not in tok.all_special_tokens
    assert is_special_token(tok, "<|end|>") and is_special_token(tok, "<|im_end|>")
    assert not is_special_token(tok, "assistant")  # a word
    assert not is_special_token(tok, "<|end|><|start|>")  # two tokens


# ----------------------------------------------------------------------------- over HTTP

MARKERS = ("<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>")
# The output, token by token (the headers as words: the script's successor map cannot fork at
# a repeated marker); <|end|> and <|start|> are the special tokens the server must keep.
OUTPUT = (
    "<|channel|>analysis<|message|>",
    "Rome's weather: use the tool.",
    "<|end|>",
    "<|start|>",
    "assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>",
    '{"city": "Rome"}',
)
PROMPT_WORDS = ("assistant", "Reasoning: ", "high", "medium", "low", "Weather in Rome?")
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    script = Script(sequences=(("assistant", *OUTPUT),), extra=PROMPT_WORDS, special=MARKERS)
    folder = build_scripted_model(
        tmp_path_factory.mktemp("harmony") / "model", script, GPT_OSS_TEMPLATE, mtp=True
    )
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
    with RemoteServer(folder, ["--served-model-name", "m", "--speculative-config", spec]) as s:
        yield s


def test_a_call_with_its_reasoning_reaches_the_client(server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [TOOL],
        "temperature": 0,
    }
    full = client.chat.completions.create(**body)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    assert choice.message.reasoning_content == "Rome's weather: use the tool."  # type: ignore[attr-defined]
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Rome"}

    reasoning, content, calls, finish = "", "", [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        reasoning += getattr(delta, "reasoning_content", None) or ""
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert (reasoning, content, finish) == ("Rome's weather: use the tool.", "", "tool_calls")
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Rome"}

    # Without tools the message to functions is content (nothing read as a call).
    plain = client.chat.completions.create(**{k: v for k, v in body.items() if k != "tools"})
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content == '{"city": "Rome"}'

    # The round trip: the call and its result go back through the template.
    body["messages"] += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
    ]
    again = client.chat.completions.create(**body)
    assert again.choices[0].finish_reason == "tool_calls"


def test_reasoning_effort_reaches_the_template(server: RemoteServer) -> None:
    import httpx

    texts = {}
    for effort in ("low", "high"):
        ids = httpx.post(
            server.url("/tokenize"),
            json={
                "model": "m",
                "messages": [{"role": "user", "content": "Weather in Rome?"}],
                "chat_template_kwargs": {"reasoning_effort": effort},
            },
        ).json()["tokens"]
        texts[effort] = httpx.post(
            server.url("/detokenize"), json={"model": "m", "tokens": ids}
        ).json()["prompt"]
    assert "Reasoning: low" in texts["low"] and "Reasoning: high" in texts["high"]


def test_what_the_format_does_not_take_yet_is_a_400(server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    with pytest.raises(openai.BadRequestError, match="structured outputs"):
        client.chat.completions.create(
            model="m", messages=messages, response_format={"type": "json_object"}
        )


# The forced call's tokens as gpt-oss writes them: every marker its special token, the JSON in
# pieces (llguidance's masks never allow a token that runs from a nested JSON grammar's opening
# brace into its next lexeme, such as '{"', although the grammar accepts it).
FORCED = (
    "<|channel|>",
    "commentary to=functions.get_weather ",
    "<|constrain|>",
    "json",
    "<|message|>",
    "{",
    '"city',
    '":"',
    "Rome",
    '"}',
    "<|call|>",
)


def test_a_forced_call_is_written_in_harmony(tmp_path_factory: pytest.TempPathFactory) -> None:
    """tool_choice "required" and a named function on a harmony model: the grammar in
    harmony's syntax (server/tool_grammar.py), the markers as the tokenizer's special tokens,
    over HTTP on a scripted model that writes a call to get_weather as gpt-oss's tokens would:
    "required" keeps its call; naming get_time makes it call get_time (the grammar, not the
    model, chose the name), with finish_reason "tool_calls" and no content."""
    other = "commentary to=functions.get_time "
    script = Script(
        sequences=(("assistant", *FORCED),), extra=(*PROMPT_WORDS, other), special=MARKERS
    )
    folder = build_scripted_model(
        tmp_path_factory.mktemp("forced") / "model", script, GPT_OSS_TEMPLATE
    )
    time_tool = {"type": "function", "function": {**TOOL["function"], "name": "get_time"}}
    messages = [{"role": "user", "content": "Weather in Rome?"}]
    named = {"type": "function", "function": {"name": "get_time"}}
    with RemoteServer(folder, ["--served-model-name", "m"]) as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
        for choice, name in (("required", "get_weather"), (named, "get_time")):
            out = client.chat.completions.create(
                model="m",
                messages=messages,
                tools=[TOOL, time_tool],
                tool_choice=choice,
                temperature=0,
            )
            answer = out.choices[0]
            assert answer.finish_reason == "tool_calls" and not answer.message.content
            (call,) = answer.message.tool_calls
            assert call.function.name == name
            assert json.loads(call.function.arguments) == {"city": "Rome"}
