"""Structured output (issue 34): a tiny random-weight model emits schema-valid JSON only because the
grammar is enforced. Every output is checked with ``jsonschema`` (an oracle no one here wrote), the
official ``openai`` client drives the server, and bad input gets OpenAI-shaped 400s."""

from __future__ import annotations

import json
import math
import re
import threading
from typing import Literal

import httpx
import jsonschema
import openai
import pydantic
import pytest
import torch

from checkpoints import build_eagle3_draft
from server_utils import RemoteServer, metric, scrape_metrics, tiny_model
from tandem import LLM, SamplingParams
from tandem.engine.sampler import apply_token_bitmask
from tandem.engine.structured_output import (
    MAX_SPEC_CHARS,
    GrammarFailure,
    StepMasks,
    StructuredOutputError,
    StructuredSpec,
)

LABEL = {"model_name": "tiny"}
MAX_TOKENS = 400


def obj(props: dict, required: list[str] | None = None) -> dict:
    """A closed object (strict mode: no properties beyond ``props``)."""
    return {
        "type": "object",
        "properties": props,
        "required": list(props) if required is None else required,
        "additionalProperties": False,
    }


SHORT = {"type": "string", "maxLength": 6}
# Strings are bounded: a random model inside free text rarely closes the quote.
SCHEMAS: list[dict] = [
    obj({"a": {"type": "integer"}}),
    obj({"name": SHORT, "age": {"type": "integer", "minimum": 0, "maximum": 120}}),
    obj({"flag": {"type": "boolean"}, "nothing": {"type": "null"}}),
    obj({"x": {"type": "number", "minimum": -1.5, "maximum": 2.5}}),
    obj({"n": {"type": "integer", "exclusiveMinimum": 10, "exclusiveMaximum": 20}}),
    obj({"color": {"enum": ["red", "green", "blue"]}, "size": {"enum": [1, 2, 3]}}),
    obj({"tags": {"type": "array", "items": SHORT, "minItems": 2, "maxItems": 4}}),
    obj(
        {
            "grid": {
                "type": "array",
                "items": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "maxItems": 3,
                },
                "minItems": 1,
                "maxItems": 3,
            }
        }
    ),  # fmt: skip
    obj({"inner": obj({"deeper": obj({"v": {"type": "boolean"}})})}),
    obj({"a": {"type": "integer"}, "b": SHORT, "c": {"type": "boolean"}}, required=["a"]),
    obj({"opt1": SHORT, "opt2": {"type": "integer"}}, required=[]),
    obj({"v": {"anyOf": [{"type": "integer", "minimum": 0}, {"type": "string", "maxLength": 3}]}}),
    obj(
        {
            "v": {
                "anyOf": [
                    obj({"kind": {"const": "a"}, "n": {"type": "integer"}}),
                    obj({"kind": {"const": "b"}, "s": SHORT}),
                ]
            }
        }
    ),  # fmt: skip
    obj({"code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2}$"}}),
    obj({"word": {"type": "string", "minLength": 2, "maxLength": 4}}),
    obj(
        {
            "items": {
                "type": "array",
                "items": obj(
                    {
                        "id": {"type": "integer", "minimum": 1},
                        "qty": {"type": "number", "minimum": 0, "maximum": 10},
                    }
                ),
                "maxItems": 3,
            }
        }
    ),  # fmt: skip
    {
        "type": "array",
        "items": {"type": "integer", "minimum": -5, "maximum": 5},
        "minItems": 1,
        "maxItems": 5,
    },  # fmt: skip
    obj({"maybe": {"anyOf": [{"type": "null"}, {"type": "boolean"}]}, "k": {"const": 7}}),
    {
        "$defs": {"pt": obj({"x": {"type": "integer"}, "y": {"type": "integer"}})},
        **obj({"a": {"$ref": "#/$defs/pt"}, "b": {"$ref": "#/$defs/pt"}}),
    },  # fmt: skip
    obj(
        {
            "id": {"type": "string", "pattern": "^[a-f0-9]{8}$"},
            "score": {"type": "number"},
            "level": {"enum": ["low", "high", None]},
            "list": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2},
        },
        required=["id", "level"],
    ),  # fmt: skip
]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    model = tiny_model(tmp_path_factory)
    args = ["--served-model-name", "tiny", "--max-model-len", "512", "--max-num-seqs", "8"]
    with RemoteServer(model, args) as s:
        yield s


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)


def chat(client, seed: int, stream: bool = False, **kw) -> tuple[str, str]:
    """(text, finish_reason) of one chat completion at temperature 1 (random tokens)."""
    args = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "Answer in JSON."}],
        "temperature": 1.0,
        "seed": seed,
        "max_tokens": MAX_TOKENS,
        **kw,
    }
    if not stream:
        choice = client.chat.completions.create(**args).choices[0]
        return choice.message.content, choice.finish_reason
    text, finish = "", None
    for chunk in client.chat.completions.create(stream=True, **args):
        for c in chunk.choices:
            text += c.delta.content or ""
            finish = c.finish_reason or finish
    return text, finish


def json_schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "out", "schema": schema, "strict": True}}


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_output_validates_against_its_schema(client, index):
    schema = SCHEMAS[index]
    text, finish = chat(
        client, seed=index, stream=index % 4 == 0, response_format=json_schema_format(schema)
    )
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


@pytest.fixture(scope="module")
def spec_server(tmp_path_factory):
    """The same model speculating 3 tokens with a random Eagle3 head whose draft vocabulary is
    half the target's (so some positions leave the masked draft none of its own tokens)."""
    model = tiny_model(tmp_path_factory)
    head = build_eagle3_draft(tmp_path_factory.mktemp("eagle3") / "head", model, draft_vocab=160)
    spec = json.dumps({"method": "eagle3", "model": str(head), "num_speculative_tokens": 3})
    args = ["--served-model-name", "tiny", "--max-model-len", "512", "--max-num-seqs", "8"]
    with RemoteServer(model, [*args, "--speculative-config", spec]) as s:
        yield s


@pytest.fixture(scope="module")
def spec_client(spec_server):
    return openai.OpenAI(
        base_url=spec_server.url("/v1"), api_key="none", max_retries=0, timeout=120
    )


@pytest.mark.parametrize("stream", [False, True])
@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_every_output_validates_under_speculation(spec_client, index, stream):
    """The 20 schemas again under Eagle3 speculation (drafts masked, every verified position
    masked), streaming and not."""
    schema = SCHEMAS[index]
    text, finish = chat(
        spec_client, seed=index, stream=stream, response_format=json_schema_format(schema)
    )
    assert finish == "stop", text
    jsonschema.validate(json.loads(text), schema)


def test_schemas_under_speculation_are_speculated(spec_server, spec_client):
    """Constrained requests under speculation verify drafts (the constrained draft counter
    grows by a schema's run), so the runs above test masked drafting, not plain decoding."""
    name = "tandem:spec_decode_constrained_num_draft_tokens_total"
    before = metric(scrape_metrics(spec_server), name, **LABEL)
    text, _ = chat(spec_client, seed=0, response_format=json_schema_format(SCHEMAS[0]))
    drafted = metric(scrape_metrics(spec_server), name, **LABEL) - before
    assert drafted >= 9, (drafted, text)  # at least three steps of K = 3 drafts


def test_unconstrained_output_is_not_json(client):
    """The oracle can fail: without a grammar the same model and seeds do not produce JSON."""
    parsed = 0
    for seed in range(4):
        text, _ = chat(client, seed=seed, max_tokens=32)
        try:
            json.loads(text)
            parsed += 1
        except ValueError:
            pass
    assert parsed == 0


def test_completions_endpoint_and_several_samples(client):
    schema = SCHEMAS[6]
    resp = client.completions.create(
        model="tiny",
        prompt="JSON:",
        temperature=1.0,
        seed=3,
        n=3,
        max_tokens=MAX_TOKENS,
        extra_body={"response_format": json_schema_format(schema)},
    )
    assert len(resp.choices) == 3
    for c in resp.choices:
        assert c.finish_reason == "stop"
        jsonschema.validate(json.loads(c.text), schema)


def test_json_object_mode(client):
    for seed in range(3):
        text, finish = chat(client, seed=seed, response_format={"type": "json_object"})
        assert finish == "stop"
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("stream", [False, True])
def test_structured_outputs_regex_choice_grammar(client, stream):
    for seed in range(3):
        text, finish = chat(
            client, seed, stream, extra_body={"structured_outputs": {"regex": "[a-c]{2}-[0-9]+"}}
        )
        assert finish == "stop" and re.fullmatch("[a-c]{2}-[0-9]+", text), text
        options = ["yes", "no", 'a "quoted" \\ one']
        text, finish = chat(
            client, seed, stream, extra_body={"structured_outputs": {"choice": options}}
        )
        assert finish == "stop" and text in options, text
        grammar = 'start: "(" num ("+" num)* ")"\nnum: /[0-9]{1,2}/'
        text, _ = chat(
            client, seed, stream, extra_body={"structured_outputs": {"grammar": grammar}}
        )
        assert re.fullmatch(r"\([0-9]{1,2}(\+[0-9]{1,2})*\)", text), text
        schema = SCHEMAS[1]
        text, _ = chat(client, seed, stream, extra_body={"structured_outputs": {"json": schema}})
        jsonschema.validate(json.loads(text), schema)


def test_logprobs_are_those_of_the_masked_distribution(client):
    options = ["yes", "no"]
    resp = client.chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "?"}],
        temperature=1.0,
        seed=0,
        max_tokens=8,
        logprobs=True,
        top_logprobs=5,
        extra_body={"structured_outputs": {"choice": options}},
    )
    choice = resp.choices[0]
    assert choice.message.content in options
    first = choice.logprobs.content[0]
    # Two tokens can start the output ("y", "n"): they share all the mass; the rest is ruled out.
    allowed = [t for t in first.top_logprobs if t.logprob > -9999]
    assert {t.token for t in allowed} == {"y", "n"}
    assert sum(math.exp(t.logprob) for t in allowed) == pytest.approx(1.0, abs=1e-4)


class Pet(pydantic.BaseModel):
    name: str = pydantic.Field(max_length=5)
    kind: Literal["cat", "dog"]
    legs: int = pydantic.Field(ge=0, le=4)


def test_openai_parse_returns_a_parsed_object(client):
    completion = client.chat.completions.parse(
        model="tiny",
        messages=[{"role": "user", "content": "A pet, please."}],
        response_format=Pet,
        temperature=1.0,
        seed=5,
        max_tokens=MAX_TOKENS,
    )
    pet = completion.choices[0].message.parsed
    assert isinstance(pet, Pet)
    assert pet.kind in ("cat", "dog") and 0 <= pet.legs <= 4


def bad(server, endpoint: str, body: dict) -> dict:
    r = httpx.post(server.url(endpoint), json=body, timeout=60)
    assert r.status_code == 400, (body, r.text)
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert err["type"] == "invalid_request_error"
    return err


def test_bad_input_is_a_400_and_the_server_keeps_serving(server, client):
    msgs = [{"role": "user", "content": "hi"}]
    cases = [
        # (body fields, parameter named, words the message holds)
        ({"response_format": json_schema_format({"type": "frobnicate"})}, "response_format", "frobnicate"),
        ({"response_format": json_schema_format(obj({"a": {"not": {"type": "string"}}}))}, "response_format", "not"),
        ({"response_format": json_schema_format({"type": "array", "uniqueItems": True})}, "response_format", "uniqueItems"),
        ({"response_format": json_schema_format({"description": "x" * MAX_SPEC_CHARS})}, "response_format", "too large"),
        ({"response_format": {"type": "json_schema"}}, "response_format", "schema"),
        ({"response_format": {"type": "yaml"}}, "response_format", "type"),
        ({"structured_outputs": {"regex": "[a-"}}, "structured_outputs.regex", "regex"),
        ({"structured_outputs": {"regex": "[^\\x00-\\U0010FFFF]"}}, "structured_outputs.regex", "cannot be used"),
        ({"structured_outputs": {"grammar": "start: foo"}}, "structured_outputs.grammar", "foo"),
        ({"structured_outputs": {"choice": []}}, "structured_outputs.choice", "strings"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs", "exactly one"),
        ({"structured_outputs": {"regex": "a"}, "response_format": {"type": "json_object"}}, "structured_outputs", "both"),
        ({"structured_outputs": {"xml": "a"}}, "structured_outputs.xml", ""),
    ]  # fmt: skip
    for fields, param, words in cases:
        for endpoint, body in (
            ("/v1/chat/completions", {"model": "tiny", "messages": msgs, **fields}),
            ("/v1/completions", {"model": "tiny", "prompt": "hi", **fields}),
        ):
            err = bad(server, endpoint, body)
            assert err["param"].startswith(param), (fields, err)
            assert words.lower() in err["message"].lower(), (fields, err)
    text, finish = chat(client, seed=0, response_format=json_schema_format(SCHEMAS[0]))
    assert finish == "stop"
    jsonschema.validate(json.loads(text), SCHEMAS[0])


# An object of 600 optional properties compiles and allows its first token ("{"); the parser
# passes its items-per-row limit (2,407 items of 2,000) when that token is consumed (or drafted
# past) mid-generation.
ROW_LIMIT_SCHEMA = {
    "type": "object",
    "properties": {f"p{i}": {"type": "string"} for i in range(600)},
}


@pytest.mark.parametrize("speculating", [False, True])
def test_a_grammar_that_passes_the_parsers_row_limit_mid_generation_is_a_400(request, speculating):
    """Caught by the fuzz driver's class of schemas: a grammar that compiles, then fails in the
    matcher once generation has started, failed the request as a server error (500, or a
    server_error event in a stream); it is the request's: a 400 naming response_format, an
    invalid_request_error event then [DONE] in a stream, and the server goes on serving."""
    server = request.getfixturevalue("spec_server" if speculating else "server")
    body = {
        "model": "tiny",
        "messages": [{"role": "user", "content": "hi"}],
        "max_tokens": 20,
        "response_format": json_schema_format(ROW_LIMIT_SCHEMA),
    }
    err = bad(server, "/v1/chat/completions", body)
    assert err["param"].startswith("response_format"), err
    assert "cannot be followed" in err["message"] and "items" in err["message"], err
    assert len(err["message"]) < 300, err  # not the matcher's dump of its state and grammar
    events = []
    with httpx.stream(
        "POST", server.url("/v1/chat/completions"), json={**body, "stream": True}, timeout=60
    ) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]", events
    error = json.loads(events[-2])["error"]
    assert error["type"] == "invalid_request_error", error
    assert error["param"].startswith("response_format"), error
    small = obj({f"p{i}": {"type": "string"} for i in range(3)})
    r = httpx.post(
        server.url("/v1/chat/completions"),
        json={**body, "max_tokens": 200, "response_format": json_schema_format(small)},
        timeout=60,
    )
    assert r.status_code == 200, r.text


def test_metrics_show_compile_and_bitmask_time(server, client):
    schema = obj({"unique_to_the_metrics_test": {"type": "boolean"}})
    before = scrape_metrics(server)
    chat(client, seed=1, response_format=json_schema_format(schema))
    after = scrape_metrics(server)

    def delta(name: str) -> float:
        return metric(after, name, **LABEL) - metric(before, name, **LABEL)

    assert delta("tandem:grammar_compile_time_seconds_count") == 1  # a new schema: one compile
    assert delta("tandem:grammar_bitmask_time_seconds_count") >= 3  # one per token at least
    assert delta("tandem:grammar_bitmask_time_seconds_sum") > 0


# ------------------------------------------------------------------ without HTTP


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    with LLM(str(tiny_model(tmp_path_factory)), max_model_len=512) as llm:
        yield llm


def test_offline_llm_mixes_constrained_and_free_requests(llm):
    schema = SCHEMAS[12]
    spec = StructuredSpec("json_schema", json.dumps(schema))
    params = [
        SamplingParams(temperature=1.0, seed=s, max_tokens=MAX_TOKENS, structured=spec)
        for s in range(3)
    ]
    params.append(SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True))
    outs = llm.generate(["a", "b", "c", "d"], params)
    for out in outs[:3]:
        assert out.outputs[0].finish_reason == "stop"
        jsonschema.validate(json.loads(out.outputs[0].text), schema)
    assert len(outs[3].outputs[0].token_ids) == 8
    # Greedy rows take the argmax of the masked logits.
    bounded = SCHEMAS[1]
    spec = StructuredSpec("json_schema", json.dumps(bounded))
    (out,) = llm.generate("a", SamplingParams(temperature=0.0, max_tokens=64, structured=spec))
    assert out.outputs[0].finish_reason == "stop"
    jsonschema.validate(json.loads(out.outputs[0].text), bounded)


def test_offline_requests_compile_each_grammar_once(llm, monkeypatch):
    """The offline engine checks a request's grammar with the compiler that serves it: a new
    regex is compiled once (checked, then served from the cache), not once per compiler."""
    import tandem.engine.structured_output as so

    compiled = []
    real = so.compile_matcher

    def counting(ll_tokenizer, spec):
        compiled.append(spec.text)
        return real(ll_tokenizer, spec)

    monkeypatch.setattr(so, "compile_matcher", counting)
    spec = StructuredSpec("regex", "(yes|no), [a-c]{3}")
    outs = llm.generate(["a", "b"], SamplingParams(temperature=0.0, max_tokens=20, structured=spec))
    assert all(re.fullmatch(spec.text, o.outputs[0].text) for o in outs)
    assert compiled == [spec.text]


def test_a_grammar_with_no_way_on_fails_the_request(llm, monkeypatch):
    """A grammar that allows no token at some step ends its request with an error naming the
    request's field (no hang, no unmasked token), and the engine goes on serving."""
    spec = StructuredSpec("regex", "[0-9]{40}")
    real = llm.engine.structured.masks
    calls = []

    def dead_at_the_fourth_step(ids: list[str], width: int) -> StepMasks:
        out = real(ids, width)
        calls.append(len(calls))
        if len(calls) >= 4:
            out = StepMasks({}, dict.fromkeys(ids, "the grammar allows no token here (test)"))
        return out

    monkeypatch.setattr(llm.engine.structured, "masks", dead_at_the_fourth_step)
    params = SamplingParams(temperature=1.0, seed=0, max_tokens=60, structured=spec)
    with pytest.raises(StructuredOutputError, match="allows no token here") as failed:
        llm.generate("a", params)
    assert failed.value.param == spec.param  # the request's field, not a server fault
    monkeypatch.undo()
    assert len(calls) == 4
    assert not llm.engine.has_unfinished_requests()
    assert not llm.engine.structured.matchers and not llm.engine.structured.pending
    (out,) = llm.generate("a", params)
    assert re.fullmatch("[0-9]{40}", out.outputs[0].text)


def test_a_refused_token_is_the_servers_fault_a_passed_limit_the_requests(llm):
    """``advance``: a token outside the grammar can only come from a mask the server got wrong
    (a server error); a token the mask allowed that passes a matcher limit is the request's."""
    manager = llm.engine.structured
    tok = llm.tokenizer
    digits = StructuredSpec("regex", "[0-9]+")
    manager.matchers["digits"] = manager.compiler.matcher(digits)
    wide = StructuredSpec("json_schema", json.dumps(ROW_LIMIT_SCHEMA))
    manager.matchers["wide"] = manager.compiler.matcher(wide)
    try:
        refused = manager.advance("digits", tok.encode("x", add_special_tokens=False)[0])
        passed = manager.advance("wide", tok.encode("{", add_special_tokens=False)[0])
    finally:
        manager.forget("digits")
        manager.forget("wide")
    assert isinstance(refused, GrammarFailure) and not refused.request_at_fault, refused
    assert isinstance(passed, GrammarFailure) and passed.request_at_fault, passed
    assert "items" in passed.message and "\n" not in passed.message


def test_a_slow_grammar_does_not_hold_up_other_requests(llm, monkeypatch):
    """Grammars compile off the step loop: while one compiles, other requests run to the end."""
    engine = llm.engine
    gate = threading.Event()
    real = engine.structured._matcher

    def slow(spec: StructuredSpec):
        gate.wait(30)
        return real(spec)

    monkeypatch.setattr(engine.structured, "_matcher", slow)
    spec = StructuredSpec("regex", "slow-[0-9]{3}")
    engine.add_request("slow", "a", SamplingParams(temperature=0.0, max_tokens=20, structured=spec))
    engine.add_request("free", "b", SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True))
    finished = {}
    for _ in range(50):
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
        if "free" in finished:
            break
    assert "free" in finished and "slow" not in finished
    assert "slow" in engine.structured.pending
    gate.set()
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                finished[out.request_id] = out
    assert re.fullmatch("slow-[0-9]{3}", finished["slow"].outputs[0].text)


def test_apply_token_bitmask_matches_a_boolean_mask():
    g = torch.Generator().manual_seed(0)
    vocab = 70  # not a multiple of 32: the bitmask has 3 words, the last partly used
    logits = torch.randn(3, vocab, generator=g)
    allowed = torch.rand(3, 96, generator=g) < 0.3
    allowed[2] = True  # an unconstrained row
    words = (allowed.view(3, 3, 32).long() << torch.arange(32)).sum(-1)
    bitmask = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    out = apply_token_bitmask(logits, bitmask)
    expect = logits.masked_fill(~allowed[:, :vocab], float("-inf"))
    assert torch.equal(out, expect)
    # A bitmask narrower than the logits allows nothing past its width.
    narrow = apply_token_bitmask(logits, bitmask[:, :1])
    assert torch.isinf(narrow[:, 32:]).all() and torch.equal(narrow[:, :32], expect[:, :32])


@pytest.fixture(scope="module")
def ll_tokenizers(tmp_path_factory):
    """llguidance's view of the tiny tokenizer as it is, and with ``</think>`` added as a
    special token (as some reasoning models ship it)."""
    from transformers import AutoTokenizer

    from tandem.engine.structured_output import build_ll_tokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model(tmp_path_factory))
    special = AutoTokenizer.from_pretrained(tiny_model(tmp_path_factory))
    special.add_special_tokens({"additional_special_tokens": ["</think>"]})
    return {
        False: (tok, build_ll_tokenizer(tok, len(tok), frozenset([tok.eos_token_id]))),
        True: (special, build_ll_tokenizer(special, len(special), frozenset([tok.eos_token_id]))),
    }


AFTER_SCHEMA = json.dumps(obj({"a": {"type": "integer"}}, ["a"]))


@pytest.mark.parametrize("special", [False, True], ids=["text-marker", "special-token-marker"])
@pytest.mark.parametrize(
    "kind,text,answer",
    [
        ("json_schema", AFTER_SCHEMA, '{"a":12}'),
        ("regex", "[0-9]+/x", "12/x"),
        ("choice", json.dumps(["yes", "no"]), "no"),
        ("grammar", 'start: "A" NUM\nNUM: /[0-9]+/', "A42"),
    ],
)
def test_a_constraint_after_the_thinking_starts_at_its_end(
    ll_tokenizers, special, kind, text, answer
):
    """``after``: free text up to the first ``</think>`` (a thinking section, itself opened or
    not), up to 4 whitespace characters, then the constraint, for every kind of spec."""
    from tandem.engine.structured_output import compile_matcher

    tok, llt = ll_tokenizers[special]
    spec = StructuredSpec(kind, text, after="</think>", after_special=special)

    def verdict(output: str) -> tuple[bool, bool]:
        matcher = compile_matcher(llt, spec)
        ok = matcher.consume_tokens(tok.encode(output, add_special_tokens=False))
        return ok and not matcher.is_error(), matcher.is_accepting()

    for thinking in ["I think {not json} </think>\n\n", "<think>\nx < y\n</think>", "</think>"]:
        assert verdict(thinking + answer) == (True, True), thinking
    assert verdict("still thinking " + answer) == (True, False)  # free until the marker
    assert verdict("a</think>b</think>" + answer)[0] is False  # the first marker ends it
    assert verdict("</think>" + " " * 5 + answer)[0] is False  # at most 4 whitespace chars
    assert verdict("</think>" + answer + "!")[0] is False  # then the constraint, to its end
    assert StructuredSpec(kind, text).key != spec.key  # cached apart from the plain spec
