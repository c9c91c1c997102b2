"""Tool calling over the official openai client, on the built-in model (its ChatML template does
not render tools: the server describes them in a system message and writes earlier calls into the
assistant's text). Forced calls (``required``, a named function) are grammar-constrained, so they
always parse and their arguments validate against the function's parameters; ``auto`` reads
whatever the model wrote in the Hermes format; a full round trip (call -> tool message -> answer)
works; bad tool requests are 400s."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import jsonschema
import openai
import pytest

from server_utils import RemoteServer, metric, scrape_metrics
from tandem.models.builtin import builtin_model_path
from tandem.models.heads import builtin_head_path
from tandem.server.protocol import ChatCompletionRequest

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "enum": ["Paris", "Berlin", "Tokyo"]},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
ADD = {
    "type": "function",
    "function": {
        "name": "add",
        "parameters": {
            "type": "object",
            "properties": {
                "a": {"type": "integer", "minimum": 0, "maximum": 99},
                "b": {"type": "integer", "minimum": 0, "maximum": 99},
            },
            "required": ["a", "b"],
            "additionalProperties": False,
        },
    },
}
ASK = [{"role": "user", "content": "What is the weather like in Paris today?"}]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, ADD)}


ARGS = ["--max-num-seqs", "4", "--served-model-name", "m", "--max-model-len", "1024"]


@pytest.fixture(scope="module")
def folder() -> Path:
    """The built-in model from the user's cache, which the suite's other users share (its
    conversion through a fresh cache is test_builtin_model's)."""
    return Path(builtin_model_path())


@pytest.fixture(scope="module")
def server(folder: Path):
    with RemoteServer(folder, ["--speculative-config", "none", *ARGS]) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)


def _check_calls(calls: list, allowed: set[str]) -> None:
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), PARAMS[call.function.name])


def test_required_call_parses_and_validates_then_the_round_trip_answers(client) -> None:
    first = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER, ADD], tool_choice="required",
        temperature=0.8, seed=1, max_tokens=80,
    )  # fmt: skip
    choice = first.choices[0]
    assert choice.finish_reason == "tool_calls", choice
    assert choice.message.tool_calls and choice.message.content is None
    _check_calls(choice.message.tool_calls, {"get_weather", "add"})

    call = choice.message.tool_calls[0]
    messages = [
        *ASK,
        choice.message,  # the client sends the assistant's message back as it came
        {"role": "tool", "tool_call_id": call.id, "content": '{"temperature": 21, "sky": "sun"}'},
    ]
    final = client.chat.completions.create(
        model="m", messages=messages, tools=[WEATHER, ADD], temperature=0, max_tokens=24
    )
    answer = final.choices[0]
    assert answer.message.content and not answer.message.tool_calls, answer
    assert answer.finish_reason in ("stop", "length")


def test_a_named_function_without_parallel_calls_is_exactly_one_call(client) -> None:
    for seed in range(3):
        reply = client.chat.completions.create(
            model="m", messages=ASK, tools=[WEATHER, ADD], seed=seed, temperature=1.0,
            tool_choice={"type": "function", "function": {"name": "add"}},
            parallel_tool_calls=False, max_tokens=60,
        )  # fmt: skip
        calls = reply.choices[0].message.tool_calls
        assert calls is not None and len(calls) == 1, reply
        _check_calls(calls, {"add"})
        assert reply.choices[0].finish_reason == "tool_calls"


def test_streamed_calls_arrive_in_openai_shape(client) -> None:
    stream = client.chat.completions.create(
        model="m", messages=ASK, tools=[WEATHER], tool_choice="required", stream=True,
        temperature=0.8, seed=2, max_tokens=80,
    )  # fmt: skip
    calls: dict[int, dict] = {}
    finish = None
    for chunk in stream:
        delta = chunk.choices[0].delta
        for tc in delta.tool_calls or []:
            entry = calls.setdefault(tc.index, {"id": None, "name": "", "arguments": ""})
            entry["id"] = tc.id or entry["id"]
            entry["name"] += (tc.function.name or "") if tc.function else ""
            entry["arguments"] += (tc.function.arguments or "") if tc.function else ""
        finish = chunk.choices[0].finish_reason or finish
    assert finish == "tool_calls" and calls, calls
    for entry in calls.values():
        assert entry["id"].startswith("call_") and entry["name"] == "get_weather"
        jsonschema.validate(json.loads(entry["arguments"]), PARAMS["get_weather"])


def test_auto_reads_calls_the_model_writes_and_leaves_other_text(server, client) -> None:
    """``auto`` parses the Hermes format out of the text (forced here with a regex, so the test
    does not depend on what a 135M model chooses to say)."""
    call = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'
    for stream in (False, True):
        body = {
            "model": "m", "messages": ASK, "tools": [ADD], "max_tokens": 60, "stream": stream,
            "structured_outputs": {"regex": "Sure\\. " + call.replace("{", "\\{").replace("}", "\\}")},
        }  # fmt: skip
        if not stream:
            msg = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60).json()
            choice = msg["choices"][0]
            assert choice["message"]["content"] == "Sure."
            [tc] = choice["message"]["tool_calls"]
            assert choice["finish_reason"] == "tool_calls"
        else:
            extra = {"structured_outputs": body.pop("structured_outputs")}
            parts = client.chat.completions.create(**body, extra_body=extra)
            content, tcs, finish = "", [], None
            for chunk in parts:
                content += chunk.choices[0].delta.content or ""
                tcs += [t.model_dump() for t in chunk.choices[0].delta.tool_calls or []]
                finish = chunk.choices[0].finish_reason or finish
            assert content.strip() == "Sure." and finish == "tool_calls"
            [tc] = tcs
        assert tc["function"]["name"] == "add"
        assert json.loads(tc["function"]["arguments"]) == {"a": 2, "b": 3}
    # A call to a function the request did not offer is the model's text, not a call.
    body = {
        "model": "m", "messages": ASK, "tools": [WEATHER], "max_tokens": 60,
        "structured_outputs": {"regex": call.replace("{", "\\{").replace("}", "\\}")},
    }  # fmt: skip
    msg = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60).json()
    assert "tool_calls" not in msg["choices"][0]["message"]
    assert msg["choices"][0]["message"]["content"] == call


@pytest.mark.parametrize(
    ("change", "param", "words"),
    [
        ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
         "not among the tools"),
        ({"tools": None, "tool_choice": "required"}, "tool_choice", "needs tools"),
        ({"tools": [WEATHER, WEATHER]}, "tools", "distinct"),
        ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None, "name"),
        ({"tool_choice": "required", "response_format": {"type": "json_object"}}, "tool_choice",
         "both constrain"),
        ({"tool_choice": "required", "tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": "object", "properties": {
                "a": {"type": "frobnicate"}}}}}]}, "tools", ""),
        # A call's arguments are an object: the grammar forced `"arguments": []` and the parser
        # dropped it, so the call came back as text (OpenAI answers such a tool with a 400).
        *[({"tool_choice": choice, "tools": [WEATHER, {"type": "function", "function": {
            "name": "add", "parameters": {"type": kind}}}]}, "tools[1].function.parameters",
            "function 'add': parameters must be a JSON Schema of type 'object'")
          for choice in ("required", "auto") for kind in ("array", "frobnicate")],
        ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {
            "properties": {"a": {"type": "integer"}}}}}]}, "tools[0].function.parameters",
         "got type None"),
        ({"messages": [*ASK, {"role": "tool", "content": "x"}]}, "messages[1].tool_call_id",
         "required"),
    ],
)  # fmt: skip
def test_bad_tool_requests_are_400s(server, change, param, words) -> None:
    body = {"model": "m", "messages": ASK, "tools": [WEATHER], "max_tokens": 4, **change}
    body = {k: v for k, v in body.items() if v is not None}
    r = httpx.post(server.url("/v1/chat/completions"), json=body, timeout=60)
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and words in error["message"], error
    if param is not None:
        assert error["param"] == param, error
    ok = {"model": "m", "messages": ASK, "tools": [WEATHER], "max_tokens": 2}
    assert httpx.post(server.url("/v1/chat/completions"), json=ok, timeout=60).status_code == 200


def test_forced_calls_under_speculation_equal_greedy_without(folder: Path, client) -> None:
    """With the built-in model's shipped Eagle3 head drafting, greedy forced calls are the same
    as without speculation (the grammar masks every verified position)."""
    kw = {"model": "m", "messages": ASK, "tools": [WEATHER, ADD], "temperature": 0,
          "max_tokens": 80, "tool_choice": "required"}  # fmt: skip
    plain = client.chat.completions.create(**kw).choices[0].message.tool_calls
    head = {"method": "eagle3", "model": builtin_head_path("eagle3")}  # the shipped head
    eagle3 = ["--speculative-config", json.dumps(head)]
    with RemoteServer(folder, [*eagle3, *ARGS]) as spec_server:
        spec = openai.OpenAI(base_url=spec_server.url("/v1"), api_key="none", max_retries=0)
        reply = spec.chat.completions.create(**kw)
        drafts = metric(scrape_metrics(spec_server), "tandem:spec_decode_num_drafts_total")
    calls = reply.choices[0].message.tool_calls
    assert drafts > 0  # it did speculate
    _check_calls(calls, {"get_weather", "add"})
    assert [(c.function.name, c.function.arguments) for c in calls] == [
        (c.function.name, c.function.arguments) for c in plain
    ]


@pytest.mark.parametrize("call_format", ["hermes", "llama3_json"])
def test_forced_calls_are_written_in_the_format_they_are_parsed_in(
    folder: Path, call_format: str
) -> None:
    """A forced call's grammar writes the parser's own format (Hermes tags, or Llama 3's bare
    JSON with "parameters"), so a server whose template or --tool-call-parser reads Llama 3 calls
    gets them in that format; the other parser finds no call in the text. With parallel calls
    the grammar takes two calls joined as the format joins them."""
    from transformers import AutoTokenizer

    from tandem import LLM, SamplingParams
    from tandem.engine.structured_output import build_ll_tokenizer, compile_matcher
    from tandem.server.tool_parsers import make_parser
    from tandem.server.tools import plan_tools

    def plan(parallel: bool):  # noqa: ANN202
        req = ChatCompletionRequest.model_validate(
            {
                "model": "m",
                "messages": ASK,
                "tools": [WEATHER, ADD],
                "tool_choice": "required",
                "parallel_tool_calls": parallel,
            }  # fmt: skip
        )
        return plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)

    single = plan(False)
    assert single.call_format(None, call_format) == call_format
    with LLM(str(folder), max_model_len=512) as llm:
        outs = llm.generate(
            ["Weather in Paris, then 2 + 3?"] * 3,
            [SamplingParams(temperature=1.0, seed=s, max_tokens=120,
                            structured=single.grammar(call_format)) for s in range(3)],
        )  # fmt: skip
    other = "hermes" if call_format == "llama3_json" else "llama3_json"
    texts = []
    for out in outs:
        text = out.outputs[0].text
        assert out.outputs[0].finish_reason == "stop", text
        assert text.startswith("<tool_call>" if call_format == "hermes" else '{"name"'), text
        (call,) = make_parser(call_format, single.names).parse(text).tool_calls
        jsonschema.validate(json.loads(call.arguments), PARAMS[call.name])
        assert not make_parser(other, single.names).parse(text).tool_calls, text
        texts.append(text)
    # Two calls joined ("\n" between Hermes blocks, "; " between Llama 3 objects): a whole
    # message of the parallel grammar, and not of the single-call one.
    two = ("\n" if call_format == "hermes" else "; ").join(texts[:2])
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ll = build_ll_tokenizer(tokenizer, len(tokenizer), frozenset([tokenizer.eos_token_id]))
    ids = tokenizer.encode(two, add_special_tokens=False)
    for parallel, whole in ((True, True), (False, False)):
        matcher = compile_matcher(ll, plan(parallel).grammar(call_format))
        accepted = matcher.validate_tokens(ids)
        assert (
            accepted == len(ids) and matcher.consume_tokens(ids) and matcher.is_accepting()
        ) == whole
    assert len(make_parser(call_format, single.names).parse(two).tool_calls) == 2
