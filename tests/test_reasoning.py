"""Reasoning output (server/reasoning.py), chat template arguments and prompt cache usage.

Parser tests split realistic outputs into deltas every way (all token groupings, all cuts into
two or three pieces, every fixed step size): the streamed concatenations must equal the
finished split. End to end, one server runs a scripted model (tests/scripted.py) with a perfect
MTP head and three speculative tokens, so each step emits four tokens and ``</think>`` falls
inside a step (Qwen3 script) and across a step boundary (the newer R1 template's script writes
it as two tokens, the first ending a step); the official ``openai`` client reads it.
"""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import openai
import pytest
from pydantic import ValidationError
from scripted import (
    OPEN_THINK_TOKENS,
    QWEN3_TEMPLATE,
    R1_ASSISTANT,
    REASONING_SCRIPT,
    THINK_TOKENS,
    build_scripted_model,
    r1_template,
)

from server_utils import RemoteServer
from tandem.server.chat import ChatRenderer, parse_template_kwargs
from tandem.server.errors import APIError, validation_error_to_api_error
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.reasoning import ReasoningParser, resolve_parser
from tandem.server.serving import cached_prompt_tokens, usage

R1 = ReasoningParser("deepseek_r1")
QWEN3 = ReasoningParser("qwen3")
GLM45 = ReasoningParser("glm45")
KIMI = resolve_parser("kimi_k2", None)
KIMI_SECTION = (
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    "functions.get_weather:0",
    "<|tool_call_argument_begin|>",
    '{"city": "Paris"}',
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
)
CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'

# (parser, the prompt's end, the output as the model's tokens, reasoning, content)
CASES = [
    pytest.param(
        R1,
        "<｜User｜>2+2?<｜Assistant｜><think>\n",
        ["Okay", ",", " 2", "+2", " is", " 4", ".\n", "</think>", "\n\n", "**", "4", "**"],
        "Okay, 2+2 is 4.\n",
        "**4**",
        id="r1-opened-in-prompt",
    ),
    pytest.param(
        R1,
        "<｜User｜>2+2?<｜Assistant｜>",
        ["<think>", "\n", "Sum", " is", " 4", ".\n", "</", "think", ">", "\n\n", "4"],
        "\nSum is 4.\n",
        "4",
        id="r1-first-template-end-tag-in-three-tokens",
    ),
    pytest.param(
        R1,
        "<｜User｜>hi<｜Assistant｜></think>",  # DeepSeek-V3.1 with thinking false
        ["Hello", "!", " How", " can", " I", " help", "?"],
        None,
        "Hello! How can I help?",
        id="v31-thinking-off",
    ),
    pytest.param(
        QWEN3,
        "<|im_start|>user\nweather?<|im_end|>\n<|im_start|>assistant\n",
        ["<think>", "\nI", " could", " call", " " + CALL, ".\n", "</think>", "\n\n", "Sunny", "."],
        f"\nI could call {CALL}.\n",
        "Sunny.",
        id="qwen3-thinking-with-a-call-inside",
    ),
    pytest.param(
        QWEN3,
        "<|im_start|>assistant\n<think>\n\n</think>\n\n",  # enable_thinking false
        ["Sunny", ".", " <think>", "x", "</think>"],
        None,
        "Sunny. <think>x</think>",
        id="qwen3-thinking-off-tags-later-are-content",
    ),
    pytest.param(
        QWEN3,
        "<|im_start|>assistant\n",
        ["<think>", "\nLet", " me", " see", " wh"],  # cut by max_tokens
        "\nLet me see wh",
        None,
        id="qwen3-cut-inside-thinking",
    ),
    pytest.param(
        QWEN3,
        "<|im_start|>assistant\n",
        ["<think>", "\nLet", " me", "</th"],  # cut inside the end tag
        "\nLet me</th",
        None,
        id="qwen3-cut-inside-end-tag",
    ),
    pytest.param(
        QWEN3,
        "<|im_start|>assistant\n",
        ["<th"],  # cut inside the start tag: what the model wrote
        None,
        "<th",
        id="qwen3-cut-inside-start-tag",
    ),
    pytest.param(
        GLM45,
        "[gMASK]<sop><|user|>\nhi<|assistant|>",
        ["\n", "<think>", "Greet", " back", ".", "</think>", "\n", "Hi", " there", "."],
        "Greet back.",
        "Hi there.",
        id="glm45-thinking",
    ),
    pytest.param(
        GLM45,
        "[gMASK]<sop><|user|>\nhi/nothink<|assistant|>\n<think></think>",
        ["\n", "Hi", " there", "."],
        None,
        "\nHi there.",
        id="glm45-nothink",
    ),
    pytest.param(
        R1,
        "<｜Assistant｜><think>\n",
        ["\n", "<think>", "Again", "</think>", "Done"],  # a repeated start tag is dropped
        "Again",
        "Done",
        id="r1-repeated-start-tag",
    ),
    pytest.param(QWEN3, "<|im_start|>assistant\n", [], None, None, id="empty"),
    pytest.param(
        KIMI,
        "<|im_assistant|>assistant<|im_middle|>",
        ["<think>", "Paris", " weather", ".", "</think>", "\n", "Sunny", "."],
        "Paris weather.",
        "Sunny.",
        id="kimi-thinking",
    ),
    pytest.param(
        KIMI,
        "<|im_assistant|>assistant<|im_middle|>",
        ["<think>", "Need", " the", " tool", ".\n", *KIMI_SECTION],
        "Need the tool.\n",
        "".join(KIMI_SECTION),
        id="kimi-call-ends-the-thinking",
    ),
    pytest.param(
        R1, "<｜Assistant｜><think>\n", ["</think>", "\n\n"], None, None, id="nothing-inside"
    ),
]


def _stream(parser: ReasoningParser, opened: bool, pieces: list[str]) -> tuple[str, str]:
    s = parser.stream(opened)
    reasoning, content = "", ""
    for piece in pieces:
        r, c = s.feed(piece)
        reasoning, content = reasoning + r, content + c
    r, c = s.finish()
    return reasoning + r, content + c


def _groupings(tokens: list[str]) -> list[list[str]]:
    """Every way to cut the token list into runs of consecutive tokens."""
    out = []
    for cuts in itertools.product([False, True], repeat=max(0, len(tokens) - 1)):
        pieces, current = [], tokens[:1]
        for tok, cut in zip(tokens[1:], cuts, strict=True):
            if cut:
                pieces.append("".join(current))
                current = []
            current.append(tok)
        pieces.append("".join(current))
        out.append(pieces)
    return out


def _char_cuts(text: str) -> list[list[str]]:
    """Every cut of the text into two or three pieces (empty pieces included)."""
    n = len(text)
    out = [[text[:i], text[i:]] for i in range(n + 1)]
    out += [[text[:i], text[i:j], text[j:]] for i in range(n + 1) for j in range(i, n + 1)]
    return out


def _steps(tokens: list[str], k: int) -> list[str]:
    return ["".join(tokens[i : i + k]) for i in range(0, len(tokens), k)]


def _check_every_split(
    parser: ReasoningParser,
    opened: bool,
    tokens: list[str],
    reasoning: str | None,
    content: str | None,
) -> None:
    text = "".join(tokens)
    got = parser.split(text, opened)
    assert (got.reasoning, got.content) == (reasoning, content)
    want = (reasoning or "", content or "")
    splits = _char_cuts(text) + [_steps(tokens, k) for k in range(1, len(tokens) + 1)]
    if len(tokens) <= 13:
        splits += _groupings(tokens)
    for pieces in splits:
        assert _stream(parser, opened, pieces) == want, pieces


@pytest.mark.parametrize(("parser", "prompt", "tokens", "reasoning", "content"), CASES)
def test_streamed_split_equals_finished_split_for_every_split(
    parser: ReasoningParser,
    prompt: str,
    tokens: list[str],
    reasoning: str | None,
    content: str | None,
) -> None:
    _check_every_split(parser, parser.opens_in_prompt(prompt), tokens, reasoning, content)


@pytest.mark.parametrize(
    ("last", "tokens"),
    [("assistant\n", THINK_TOKENS), (R1_ASSISTANT, THINK_TOKENS), ("<think>\n", OPEN_THINK_TOKENS)],
)
def test_scripted_outputs_split_every_way(last: str, tokens: tuple[str, ...]) -> None:
    """The scripted model's greedy outputs, 1, 2, ... tokens per step and every grouping of
    the newer R1 script (its end tag comes in two tokens)."""
    assert REASONING_SCRIPT.continuation(last) == list(tokens)
    text = "".join(tokens)
    opened = last == "<think>\n"
    split = R1.split(text, opened)
    assert split.reasoning is not None and split.content is not None
    assert "</think>" not in split.reasoning + split.content
    _check_every_split(R1, opened, list(tokens), split.reasoning, split.content)


@pytest.mark.parametrize(
    ("prompt", "opened"),
    [
        ("<｜Assistant｜><think>\n", True),
        ("<｜Assistant｜><think>", True),  # DeepSeek-V3.1, thinking true
        ("<｜Assistant｜></think>", False),  # DeepSeek-V3.1, thinking false
        ("<｜Assistant｜>", False),
        ("<|im_start|>assistant\n<think>\n\n</think>\n\n", False),
        ("<|im_start|>assistant\n<think>\nold</think>\n\nx<|im_start|>assistant\n", False),
        ("<|assistant|>\n<think></think>", False),
        ("", False),
    ],
)
def test_the_prompt_decides_where_the_output_starts(prompt: str, opened: bool) -> None:
    assert QWEN3.opens_in_prompt(prompt) is opened


def test_reasoning_tokens_count_through_the_end_tag() -> None:
    """The end tag counts as thinking; with it as one token (an id) or in pieces (the shortest
    decoded prefix that holds it); all tokens when the thinking is not closed; 0 without it."""
    vocab = ["<think>", "a", "b", "</think>", "\n\n", "c", "</", "think>"]

    def decode(ids: list[int]) -> str:
        return "".join(vocab[i] for i in ids)

    def count(ids: list[int], opened: bool = False, end_id: int | None = 3) -> int:
        return QWEN3.count_tokens(ids, decode(ids), opened, decode, end_id)

    assert count([0, 1, 2, 3, 4, 5]) == 4
    assert count([0, 1, 2, 3, 4, 5], end_id=None) == 4
    assert count([1, 2, 6, 7, 4, 5], opened=True) == 4  # end tag in two tokens
    assert count([1, 2, 6, 7, 4, 5], opened=False) == 0  # no thinking: all answer
    assert count([0, 1, 2]) == 3
    assert count([1, 3, 5], opened=True) == 2
    # Kimi's tool-call section ends the thinking and is not part of it.
    vocab.append("<|tool_calls_section_begin|>")
    ids = [0, 1, 2, len(vocab) - 1, 5]
    assert KIMI.count_tokens(ids, decode(ids), False, decode, 3) == 3


def test_auto_picks_the_templates_family_and_never_guesses() -> None:
    glm = "[gMASK]<sop>{% if add_generation_prompt %}<|assistant|>{{ '\\n<think></think>' }}"
    v31 = "{{ '<｜Assistant｜>' }}{% if thinking %}{{ '<think>' }}{% else %}{{ '</think>' }}"
    plain = "{% for m in messages %}<|im_start|>{{ m.content }}{% endfor %}"
    assert resolve_parser("auto", r1_template(True)) == R1
    assert resolve_parser("auto", r1_template(False)) == R1  # it only strips </think>
    assert resolve_parser("auto", v31) == R1
    assert resolve_parser("auto", QWEN3_TEMPLATE) == QWEN3
    assert resolve_parser("auto", glm) == GLM45
    kimi = "{% if add_generation_prompt %}<|im_assistant|>assistant<|im_middle|>{% endif %}<think>"
    assert resolve_parser("auto", kimi) == KIMI and KIMI.answer_starts
    assert resolve_parser("auto", plain) is None
    assert resolve_parser("auto", None) is None
    assert resolve_parser("glm45", plain) == GLM45  # named: used as asked
    assert resolve_parser("none", QWEN3_TEMPLATE) is None
    with pytest.raises(ValueError, match="unknown reasoning parser 'r1'"):
        resolve_parser("r1", QWEN3_TEMPLATE)


# ------------------------------------------------------------------ protocol and templates


def _chat(**fields: Any) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def _api_error(**fields: Any) -> APIError:
    try:
        _chat(**fields).check_supported()
    except ValidationError as e:
        return validation_error_to_api_error(e.errors())
    except APIError as e:
        return e
    raise AssertionError("accepted")


def test_template_arguments_are_validated() -> None:
    _chat(chat_template_kwargs={"enable_thinking": False}, reasoning_effort="low").check_supported()
    for bad in ([1], "enable_thinking", 3):
        err = _api_error(chat_template_kwargs=bad)
        assert err.status == 400 and err.param == "chat_template_kwargs", err.message
    err = _api_error(chat_template_kwargs={"messages": []})
    assert err.param == "chat_template_kwargs.messages" and "server sets" in err.message
    err = _api_error(reasoning_effort="max")
    assert err.param == "reasoning_effort" and "'low', 'medium', 'high'" in err.message


def test_earlier_thinking_reaches_the_template() -> None:
    thought = {"role": "assistant", "content": "4", "reasoning_content": "2+2"}
    req = _chat(messages=[{"role": "user", "content": "2+2?"}, thought])
    req.check_supported()
    same = {"role": "assistant", "content": "4", "reasoning": "2+2", "reasoning_content": "2+2"}
    _chat(messages=[same]).check_supported()
    err = _api_error(messages=[{"role": "assistant", "reasoning": "a", "reasoning_content": "b"}])
    assert err.param == "messages[0].reasoning"
    err = _api_error(messages=[{"role": "user", "content": "x", "reasoning_content": "y"}])
    assert err.param == "messages[0].reasoning_content"

    from tandem.server.serving_chat import render_chat_text

    text = SimpleNamespace(encode=lambda t, add_special_tokens: t)
    state = SimpleNamespace(
        renderer=ChatRenderer(QWEN3_TEMPLATE, text),
        tokenizer=text,
        settings=SimpleNamespace(tool_call_parser=None),
    )
    messages = [*req.messages, _chat().messages[0]]
    prompt = render_chat_text(state, req.messages, False)
    assert prompt.endswith("<|im_start|>assistant\n<think>\n2+2\n</think>\n\n4<|im_end|>\n")
    # Before the last user turn, Qwen3's template drops it.
    prompt = render_chat_text(state, messages, True, template_kwargs={"enable_thinking": False})
    assert "2+2\n</think>" not in prompt
    assert prompt.endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    effort = "{{ reasoning_effort }}|{{ enable_thinking }}"
    state.renderer = ChatRenderer(effort, text)
    kwargs = {"reasoning_effort": "high", "enable_thinking": True}
    assert render_chat_text(state, messages, True, template_kwargs=kwargs) == "high|True"
    state.renderer = ChatRenderer(QWEN3_TEMPLATE, text)
    with pytest.raises(APIError) as e:
        render_chat_text(state, messages, True, template_kwargs={"enable_thinking": "yes"})
    assert e.value.status == 400 and "enable_thinking must be true or false" in str(e.value)


def test_default_template_kwargs_flag() -> None:
    assert parse_template_kwargs('{"enable_thinking": false}') == {"enable_thinking": False}
    assert parse_template_kwargs({"thinking": True}) == {"thinking": True}
    assert parse_template_kwargs(None) == {}
    for bad, why in [("[1]", "must be a JSON object"), ("{", "not valid JSON")]:
        with pytest.raises(ValueError, match=why):
            parse_template_kwargs(bad)
    with pytest.raises(ValueError, match="may not set tools"):
        parse_template_kwargs('{"tools": []}')


def test_usage_reports_cached_and_reasoning_tokens() -> None:
    outs = [SimpleNamespace(num_cached_tokens=n, spec_stats=None) for n in (32, 16)]
    body = usage(40, 10, outs, cached_tokens=cached_prompt_tokens(outs), reasoning_tokens=7)  # type: ignore[arg-type]
    assert body["prompt_tokens_details"] == {"cached_tokens": 16}
    assert body["completion_tokens_details"] == {"reasoning_tokens": 7}
    plain = usage(40, 10)
    assert plain["prompt_tokens_details"] == {"cached_tokens": 0}
    assert "completion_tokens_details" not in plain


# ------------------------------------------------------------------ the scripted model


@pytest.fixture(scope="module")
def scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("scripted") / "model"
    return build_scripted_model(folder, REASONING_SCRIPT, QWEN3_TEMPLATE, mtp=True)


def test_a_repeated_prompt_reports_its_cached_blocks(scripted: Path) -> None:
    """The engine's per-request prefix-cache hits (RequestOutput.num_cached_tokens): none the
    first time, every full block but the one holding the last prompt token the second."""
    from tandem import LLM, SamplingParams

    with LLM(str(scripted), max_model_len=256) as llm:
        prompt = llm.tokenizer.encode(" the user wants the weather." * 8 + "\n")
        assert len(prompt) == 41
        params = SamplingParams(temperature=0.0, max_tokens=2)
        first, second = (llm.generate([prompt], params)[0] for _ in range(2))
    assert (first.num_cached_tokens, second.num_cached_tokens) == (0, 32)


@pytest.fixture(scope="module")
def server(scripted: Path) -> Any:
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
    args = [
        "--speculative-config",
        spec,
        "--trust-request-chat-template",
        "--served-model-name",
        "m",
    ]
    args += ["--default-chat-template-kwargs", '{"enable_thinking": true}']
    with RemoteServer(scripted, args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)


WEATHER = "What is the weather?"
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def _both(client: openai.OpenAI, **kw: Any) -> tuple[Any, dict[str, Any]]:
    """The non-streamed response, and the stream's concatenated fields, chunks and usage."""
    body = {"model": "m", "messages": [{"role": "user", "content": WEATHER}], "temperature": 0}
    body.update(kw)
    extra = body.pop("extra_body", {})
    extra |= {k: body.pop(k) for k in ("chat_template", "chat_template_kwargs") if k in body}
    full = client.chat.completions.create(**body, extra_body=extra)
    chunks = list(
        client.chat.completions.create(
            **body, extra_body=extra, stream=True, stream_options={"include_usage": True}
        )
    )
    streamed: dict[str, Any] = {"reasoning": "", "reasoning_content": "", "content": ""}
    streamed["deltas"] = []
    streamed["calls"] = []
    for chunk in chunks[:-1]:
        delta = chunk.choices[0].delta
        fields = {k: getattr(delta, k, None) for k in ("reasoning", "reasoning_content", "content")}
        for k, v in fields.items():
            streamed[k] += v or ""
        streamed["deltas"].append(fields)
        streamed["calls"] += delta.tool_calls or []
    streamed["usage"] = chunks[-1].usage
    return full, streamed


def _expect(tokens: tuple[str, ...], opened: bool) -> tuple[str | None, str | None]:
    split = R1.split("".join(tokens), opened)
    return split.reasoning, split.content


@pytest.mark.parametrize(
    ("template", "tokens", "opened"),
    [
        pytest.param(None, THINK_TOKENS, False, id="qwen3-end-tag-inside-a-step"),
        pytest.param(r1_template(False), THINK_TOKENS, False, id="r1-first-template"),
        pytest.param(r1_template(True), OPEN_THINK_TOKENS, True, id="r1-end-tag-across-steps"),
    ],
)
def test_reasoning_output_streamed_equals_full(
    client: openai.OpenAI, template: str | None, tokens: tuple[str, ...], opened: bool
) -> None:
    kw = {"chat_template": template} if template else {}
    full, streamed = _both(client, **kw)
    message = full.choices[0].message
    reasoning, content = _expect(tokens, opened)
    assert (message.reasoning_content, message.content) == (reasoning, content)
    assert message.reasoning == reasoning and "<think>" not in (reasoning or "")
    assert (streamed["reasoning_content"], streamed["content"]) == (reasoning, content)
    assert streamed["reasoning"] == reasoning
    # Four tokens per step: a perfect MTP head with three speculative tokens.
    spec = full.usage.model_extra["spec_decode"]
    assert spec["mean_tokens_per_step"] == 4.0
    end = tokens.index("</think>" if "</think>" in tokens else "</")
    details = full.usage.completion_tokens_details
    # Thinking tokens through the end tag (two tokens in the newer R1 script).
    want = end + 1 + (tokens[end] == "</")
    assert details.reasoning_tokens == streamed["usage"].completion_tokens_details.reasoning_tokens
    assert details.reasoning_tokens == want
    deltas = streamed["deltas"]
    if opened:  # "</" ends a step: held back, never shown as thinking
        assert not any("<" in (d["reasoning_content"] or "") for d in deltas)
    else:  # the step holding </think> has thinking and answer
        assert any(d["reasoning_content"] and d["content"] for d in deltas)


def test_thinking_off_is_all_content(client: openai.OpenAI) -> None:
    """The request's enable_thinking beats the server's default (true): the prompt closes the
    thinking, the output is all answer."""
    full, streamed = _both(client, chat_template_kwargs={"enable_thinking": False})
    message = full.choices[0].message
    want = "".join(THINK_TOKENS[THINK_TOKENS.index("\n\n") + 1 :])
    assert (message.content, message.reasoning_content, message.reasoning) == (want, None, None)
    assert (streamed["content"], streamed["reasoning_content"]) == (want, "")
    assert full.usage.completion_tokens_details.reasoning_tokens == 0


def test_tokenize_renders_with_the_template_arguments(server: RemoteServer) -> None:
    """/tokenize counts the prompt /v1/chat/completions sends: the server's default
    (enable_thinking true) unless the request's chat_template_kwargs say otherwise."""
    import httpx

    def count(**extra: Any) -> int:
        body = {"model": "m", "messages": [{"role": "user", "content": WEATHER}], **extra}
        r = httpx.post(server.url("/tokenize"), json=body, timeout=30)
        assert r.status_code == 200, r.text
        return r.json()["count"]

    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    for kwargs in ({}, {"enable_thinking": False}):
        extra = {"chat_template_kwargs": kwargs} if kwargs else {}
        out = client.chat.completions.create(
            model="m", messages=[{"role": "user", "content": WEATHER}], max_tokens=1,
            extra_body=extra,
        )  # fmt: skip
        assert count(**extra) == out.usage.prompt_tokens
    assert count(chat_template_kwargs={"enable_thinking": False}) > count()  # the closed block
    bad = httpx.post(
        server.url("/tokenize"),
        json={"prompt": "x", "chat_template_kwargs": {"enable_thinking": False}},
        timeout=30,
    )
    assert bad.status_code == 400 and "apply to messages" in bad.text


def test_a_call_inside_the_thinking_is_not_a_call(client: openai.OpenAI) -> None:
    full, streamed = _both(client, tools=[TOOL])
    message = full.choices[0].message
    assert full.choices[0].finish_reason == "tool_calls"
    assert [json.loads(c.function.arguments) for c in message.tool_calls] == [{"city": "Rome"}]
    assert message.content == "The answer is sunny."
    assert '"city": "Paris"' in message.reasoning_content
    assert [json.loads(c.function.arguments) for c in streamed["calls"]] == [{"city": "Rome"}]
    assert streamed["reasoning_content"] == message.reasoning_content
    assert streamed["content"] == message.content


def test_cut_inside_the_thinking_is_all_reasoning(client: openai.OpenAI) -> None:
    full, streamed = _both(client, max_tokens=6)
    message = full.choices[0].message
    want = "".join(THINK_TOKENS[1:6])
    assert (message.reasoning_content, message.content) == (want, None)
    assert (streamed["reasoning_content"], streamed["content"]) == (want, "")
    assert full.choices[0].finish_reason == "length"
    assert full.usage.completion_tokens_details.reasoning_tokens == 6


def test_bad_template_arguments_get_400_and_the_server_keeps_serving(
    client: openai.OpenAI, server: RemoteServer
) -> None:
    import httpx

    messages = [{"role": "user", "content": "hi"}]
    for extra, param in [
        ({"chat_template_kwargs": ["enable_thinking"]}, "chat_template_kwargs"),
        ({"chat_template_kwargs": {"enable_thinking": "yes"}}, "messages"),
        ({"reasoning_effort": "max"}, "reasoning_effort"),
    ]:
        r = httpx.post(
            server.url("/v1/chat/completions"), json={"messages": messages, **extra}, timeout=30
        )
        assert r.status_code == 400, r.text
        assert r.json()["error"]["param"] == param
    ok = client.chat.completions.create(model="m", messages=messages, reasoning_effort="low")
    message = ok.choices[0].message
    assert (message.reasoning_content, message.content) == _expect(THINK_TOKENS, False)


def test_usage_counts_cached_prompt_tokens_and_completions_are_not_parsed(
    client: openai.OpenAI,
) -> None:
    system = {"role": "system", "content": " the user wants the weather." * 8}
    messages = [system, {"role": "user", "content": WEATHER}]
    cached = [
        client.chat.completions.create(
            model="m", messages=messages, max_tokens=2
        ).usage.prompt_tokens_details.cached_tokens
        for _ in range(2)
    ]
    assert cached[0] == 0 and cached[1] > 0 and cached[1] % 16 == 0
    r = client.completions.create(model="m", prompt=R1_ASSISTANT, max_tokens=3, temperature=0)
    assert r.choices[0].text == "".join(THINK_TOKENS[:3])  # raw text: /v1/completions
    assert r.usage.prompt_tokens_details.cached_tokens == 0
    assert r.usage.completion_tokens_details is None


@pytest.mark.parametrize("opened", [False, True], ids=["qwen3", "r1-open-think"])
def test_a_constraint_holds_only_what_follows_the_thinking(client: openai.OpenAI, opened) -> None:
    """structured_outputs with a reasoning parser: the thinking is free text (here with a
    tool-call-like block in it), the answer after ``</think>`` is held to the choice; under
    speculation (4 tokens per step), streamed and full alike. Constrained from the first
    token (before), the output had no thinking at all."""
    tokens = OPEN_THINK_TOKENS if opened else THINK_TOKENS
    answer = "Hello there!" if opened else "The answer is sunny."
    kw = {"chat_template": r1_template(True)} if opened else {}
    choice = {"structured_outputs": {"choice": [answer, "Maybe"]}}
    full, streamed = _both(client, extra_body=choice, **kw)
    message = full.choices[0].message
    reasoning, _ = _expect(tokens, opened)
    assert (message.reasoning_content, message.content) == (reasoning, answer)
    assert (streamed["reasoning_content"], streamed["content"]) == (reasoning, answer)
    assert full.choices[0].finish_reason == "stop"
    if opened:
        return
    # Thinking off: the prompt closes the thinking, so the constraint holds from the first token.
    off, _ = _both(client, extra_body=choice, chat_template_kwargs={"enable_thinking": False})
    assert (off.choices[0].message.content, off.choices[0].message.reasoning_content) == (
        "The answer is sunny.",
        None,
    )


# A thinking section with braces in it (not JSON), an end tag split over two tokens, then JSON
# whose tokens are the strings the grammar forces (a word-level tokenizer spells nothing else).
JSON_SCRIPT_TOKENS = (" Hmm,", " a", " {json}", " answer.", "</th", "ink>", '{"n":', "7", "}")
N_SCHEMA = {
    "type": "object",
    "properties": {"n": {"type": "integer"}},
    "required": ["n"],
    "additionalProperties": False,
}


@pytest.fixture(scope="module")
def json_scripted(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from scripted import Script, build_scripted_model

    script = Script(sequences=(("<json>", *JSON_SCRIPT_TOKENS),))
    folder = tmp_path_factory.mktemp("json_scripted") / "m"
    return build_scripted_model(folder, script, "{{ '<json>' }}", mtp=True)


def test_a_schema_after_the_thinking_is_exact_with_and_without_speculation(json_scripted) -> None:
    """Offline engine, greedy: a JSON schema that starts after ``</think>`` leaves the thinking
    free and holds the answer, with the same output with and without speculation (a perfect
    MTP head: the end tag and the answer arrive inside one step); constrained from the first
    token, the output is the bare JSON."""
    import jsonschema
    from transformers import AutoTokenizer

    from tandem import LLM, SamplingParams
    from tandem.engine.structured_output import StructuredSpec

    prompt = [AutoTokenizer.from_pretrained(json_scripted).convert_tokens_to_ids("<json>")]
    schema = json.dumps(N_SCHEMA)
    after = SamplingParams(
        temperature=0,
        max_tokens=16,
        structured=StructuredSpec("json_schema", schema, after="</think>"),
    )
    from_start = SamplingParams(
        temperature=0, max_tokens=16, structured=StructuredSpec("json_schema", schema)
    )
    texts = []
    for spec in (None, {"method": "mtp", "num_speculative_tokens": 3}):
        with LLM(str(json_scripted), speculative_config=spec, max_model_len=64) as llm:
            out, bare = llm.generate([prompt, prompt], [after, from_start])
            if spec is not None:
                assert out.spec_stats.num_accepted_tokens > 0
        texts.append(out.outputs[0].text)
        assert bare.outputs[0].text == '{"n":7}'
    assert texts[0] == texts[1] == "".join(JSON_SCRIPT_TOKENS)
    thinking, answer = texts[0].split("</think>")
    assert "{json}" in thinking
    jsonschema.validate(json.loads(answer), N_SCHEMA)


def test_markers_a_tokenizer_holds_as_special_tokens_are_decoded() -> None:
    """GLM's tokenizer holds ``</think>`` and ``<tool_call>`` as special tokens: decoding keeps
    special tokens for a request whose parsers read them, unless the request chose."""
    from tandem import SamplingParams
    from tandem.server.serving_chat import ChatHandler
    from tandem.server.state import ServerSettings

    def keeps(special: list[str], **fields: Any) -> bool:
        state = SimpleNamespace(
            response_model_name=lambda name: "m",
            special_tokens=lambda texts: frozenset(t for t in texts if t in special),
            settings=ServerSettings(),
            renderer=SimpleNamespace(source=QWEN3_TEMPLATE),
        )
        handler = ChatHandler(state, _chat(**fields))
        handler.reasoning = resolve_parser("auto", QWEN3_TEMPLATE)
        return not handler._keep_markers(SamplingParams()).skip_special_tokens

    tools = {"tools": [TOOL]}
    assert keeps(["</think>"]) and keeps(["<tool_call>"], **tools)
    assert not keeps(["<tool_call>"])  # no tools: no call is read
    assert not keeps([])  # plain text markers: the default stands
    assert not keeps(["</think>"], skip_special_tokens=True)  # the request's own choice
