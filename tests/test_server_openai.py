"""`tandem serve` against the official openai client (sync and async).

The client validates every response against OpenAI's own types (strict response validation),
so a shape we get wrong fails here. Text is checked against the offline ``LLM`` and
transformers' own greedy generate.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from checkpoints import hf_greedy
from server_utils import RemoteServer, tiny_model

API_KEY = "sk-tandem-test"
PROMPT = "Hello world! How are you today?"
MESSAGES = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is the capital of France?"},
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


@pytest.fixture(scope="module")
def server(model_dir):
    with RemoteServer(model_dir, ["--max-num-seqs", "16"], api_key=API_KEY) as s:
        yield s


@pytest.fixture(scope="module")
def model_name(server):
    return server.model.name


@pytest.fixture(scope="module")
def client(server):
    c = openai.OpenAI(
        base_url=server.url("/v1"),
        api_key=API_KEY,
        max_retries=0,
        timeout=60,
        _strict_response_validation=True,
    )
    yield c
    c.close()


@pytest.fixture(scope="module")
def loose_client(server):
    """Without strict validation: the SDK types a streamed legacy completion chunk as a
    ``Completion`` whose finish_reason may not be null, which OpenAI itself sends mid-stream."""
    c = openai.OpenAI(base_url=server.url("/v1"), api_key=API_KEY, max_retries=0, timeout=60)
    yield c
    c.close()


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(
        base_url=server.url("/v1"),
        api_key=API_KEY,
        max_retries=0,
        timeout=60,
        _strict_response_validation=True,
    )


@pytest.fixture(scope="module")
def offline_llm(model_dir):
    from tandem import LLM

    llm = LLM(str(model_dir), max_model_len=256)
    yield llm
    llm.shutdown()


def tokenize(server, **body) -> list[int]:
    r = httpx.post(server.url("/tokenize"), json=body, headers=server.headers, timeout=30)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ------------------------------------------------------------------ basics


def test_models_list(client, model_name):
    models = client.models.list()
    assert [m.id for m in models.data] == [model_name]


def test_completion_shape_and_usage(client, model_name, server):
    r = client.completions.create(
        model=model_name,
        prompt=PROMPT,
        max_tokens=7,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert r.object == "text_completion"
    assert r.id.startswith("cmpl-")
    assert r.model == model_name
    assert len(r.choices) == 1 and r.choices[0].index == 0
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 7
    assert r.usage.prompt_tokens == len(tokenize(server, prompt=PROMPT))
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


def test_chat_shape_and_usage(client, model_name, server):
    r = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_completion_tokens=6, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert r.object == "chat.completion"
    assert r.id.startswith("chatcmpl-")
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    assert choice.finish_reason == "length"
    assert r.usage.completion_tokens == 6
    assert r.usage.prompt_tokens == len(tokenize(server, messages=MESSAGES))


# ------------------------------------------------------------------ oracles


def test_greedy_completion_equals_offline_llm(client, model_name, offline_llm):
    from tandem import SamplingParams

    want = offline_llm.generate(
        [PROMPT], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)
    )[0].outputs[0]
    got = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=12, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.choices[0].text == want.text
    assert got.usage.completion_tokens == len(want.token_ids)


def test_greedy_chat_equals_offline_llm(client, model_name, offline_llm, server):
    from tandem import SamplingParams

    prompt_ids = tokenize(server, messages=MESSAGES)
    want = offline_llm.generate(
        [prompt_ids], SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    )[0].outputs[0]
    got = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=10, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert got.choices[0].message.content == want.text


def test_greedy_tokens_and_logprobs_match_transformers(client, model_name, server, model_dir):
    prompt_ids = tokenize(server, prompt=PROMPT)
    ref = hf_greedy(model_dir, [prompt_ids], max_new_tokens=6)[0]
    r = client.completions.create(
        model=model_name, prompt=prompt_ids, max_tokens=6, temperature=0, logprobs=2,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert lp.token_logprobs == pytest.approx(ref["logprobs"], abs=1e-3)
    # Greedy: the chosen token is the most likely one, so it leads every top list.
    for chosen, top in zip(lp.token_logprobs, lp.top_logprobs, strict=True):
        assert chosen == pytest.approx(max(top.values()), abs=1e-6)
    ids = [t for t in ref["tokens"]]
    detok = httpx.post(server.url("/detokenize"), json={"tokens": ids}, headers=server.headers)
    assert r.choices[0].text == detok.json()["prompt"]


# ------------------------------------------------------------------ streaming


def test_chat_stream_include_usage(client, model_name):
    full = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=9, temperature=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    stream = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=9, temperature=0, stream=True,
        stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == full.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == "length" and all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage is not None
    assert last.usage.completion_tokens == 9
    assert last.usage.prompt_tokens == full.usage.prompt_tokens
    assert all(c.usage is None for c in chunks[:-1])


def test_completion_stream_without_usage(loose_client, model_name):
    stream = loose_client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=5, temperature=0, stream=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    chunks = list(stream)
    assert all(c.usage is None for c in chunks)
    assert chunks[-1].choices[0].finish_reason == "length"


def test_async_client_streams_and_completes(server, model_name):
    async def run():
        async with async_client(server) as c:
            stream = await c.chat.completions.create(
                model=model_name, messages=MESSAGES, max_tokens=5, temperature=0, stream=True,
                stream_options={"include_usage": True}, extra_body={"ignore_eos": True},
            )  # fmt: skip
            usage = None
            async for chunk in stream:
                usage = chunk.usage or usage
            r = await c.completions.create(model=model_name, prompt=PROMPT, max_tokens=3)
            return usage, r

    usage, r = asyncio.run(run())
    assert usage.completion_tokens == 5
    assert 1 <= r.usage.completion_tokens <= 3


# ------------------------------------------------------------------ sampling options


def test_n2_choices(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=MESSAGES, n=2, max_tokens=8, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.index for c in r.choices] == [0, 1]
    assert r.usage.completion_tokens == 16
    assert r.choices[0].message.content != r.choices[1].message.content
    again = client.chat.completions.create(
        model=model_name, messages=MESSAGES, n=2, max_tokens=8, temperature=1.0, seed=7,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert [c.message.content for c in again.choices] == [c.message.content for c in r.choices]


def test_n2_streaming_completions(loose_client, model_name):
    stream = loose_client.completions.create(
        model=model_name, prompt=[PROMPT, "Paris is"], n=2, max_tokens=4, temperature=1.0,
        seed=3, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    texts: dict[int, str] = {}
    finish: dict[int, str] = {}
    usage = None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + c.text
            if c.finish_reason:
                finish[c.index] = c.finish_reason
    assert sorted(finish) == [0, 1, 2, 3]
    assert set(finish.values()) == {"length"}
    assert usage.completion_tokens == 16


def test_seed_reproducible(client, model_name):
    def run(seed):
        return client.completions.create(
            model=model_name, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=seed,
            extra_body={"ignore_eos": True},
        ).choices[0].text  # fmt: skip

    assert run(1234) == run(1234)
    assert run(1234) != run(4321)


def test_chat_logprobs(client, model_name):
    r = client.chat.completions.create(
        model=model_name, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = r.choices[0].logprobs.content
    assert len(content) == 5
    for entry in content:
        assert len(entry.top_logprobs) == 3
        values = [t.logprob for t in entry.top_logprobs]
        assert values == sorted(values, reverse=True)
        assert entry.logprob == pytest.approx(values[0], abs=1e-6)  # greedy
        assert entry.logprob <= 0
        assert isinstance(entry.bytes, list)


def test_completion_logprobs_zero_and_echo(client, model_name):
    r = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, logprobs=0,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == 4
    assert all(len(t) == 1 for t in lp.top_logprobs)  # only the chosen token
    assert lp.text_offset[0] == 0
    echo = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=4, temperature=0, echo=True,
        extra_body={"ignore_eos": True},
    )  # fmt: skip
    assert echo.choices[0].text == PROMPT + r.choices[0].text


def test_stop_string_is_cut_and_reported(client, loose_client, model_name):
    base = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=24, temperature=0,
        extra_body={"ignore_eos": True},
    ).choices[0].text  # fmt: skip
    # A clean two-character piece from the middle of the greedy text.
    start = next(
        i
        for i in range(3, len(base) - 2)
        if "\ufffd" not in base[i : i + 2] and base[i : i + 2].strip()
    )
    stop = base[start : start + 2]
    expected = base[: base.index(stop)]
    for stream in (False, True):
        r = (loose_client if stream else client).completions.create(
            model=model_name, prompt=PROMPT, max_tokens=24, temperature=0, stop=[stop],
            stream=stream, extra_body={"ignore_eos": True},
        )  # fmt: skip
        if stream:
            chunks = list(r)
            text = "".join(c.choices[0].text for c in chunks)
            finish = chunks[-1].choices[0].finish_reason
        else:
            text, finish = r.choices[0].text, r.choices[0].finish_reason
        assert text == expected
        assert stop not in text
        assert finish == "stop"


def test_stop_token_ids(client, model_name, offline_llm, server):
    from tandem import SamplingParams

    ids = (
        offline_llm.generate(
            [PROMPT], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )[0]
        .outputs[0]
        .token_ids
    )
    r = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=8, temperature=0,
        extra_body={"ignore_eos": True, "stop_token_ids": [ids[2]]},
    )  # fmt: skip
    assert r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == ids.index(ids[2]) + 1


def test_penalties_and_filters_accepted(client, model_name):
    r = client.completions.create(
        model=model_name, prompt=PROMPT, max_tokens=6, temperature=0.8, top_p=0.9,
        presence_penalty=0.5, frequency_penalty=0.5, seed=1, user="tester",
        extra_body={"top_k": 20, "min_p": 0.01, "repetition_penalty": 1.2, "ignore_eos": True},
    )  # fmt: skip
    assert r.usage.completion_tokens == 6


# ------------------------------------------------------------------ errors


def test_errors_raise_the_sdk_exceptions(client, model_name, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.completions.create(model=model_name, prompt=PROMPT, max_tokens=10_000)
    assert e.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(
            model=model_name,
            messages=MESSAGES,
            tools=[{"type": "function", "function": {"name": "f"}}],
            tool_choice={"type": "function", "function": {"name": "g"}},
        )
    assert e.value.param == "tool_choice"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt=PROMPT)
    bad = openai.OpenAI(base_url=server.url("/v1"), api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()
    bad.close()
    # The server keeps serving.
    assert client.completions.create(model=model_name, prompt=PROMPT, max_tokens=2).choices


def test_async_errors(server, model_name):
    async def run():
        async with async_client(server) as c:
            with pytest.raises(openai.BadRequestError):
                await c.chat.completions.create(model=model_name, messages=[], max_tokens=2)
            with pytest.raises(openai.NotFoundError):
                await c.chat.completions.create(model="nope", messages=MESSAGES)
        async with openai.AsyncOpenAI(base_url=server.url("/v1"), api_key="x", max_retries=0) as c:
            with pytest.raises(openai.AuthenticationError):
                await c.completions.create(model=model_name, prompt=PROMPT)

    asyncio.run(run())
