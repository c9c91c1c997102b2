"""Fuzz at scale, the bounded slice: `fuzz_driver.py` (what `make fuzz` runs with 51,000
requests) with a few hundred seeded requests per server against a speculating server (Eagle3
draft trees), ``-tp 2`` and ``-dp 2``: no 5xx but an overloaded queue's 503, no hang, healthy and
idle at the end; and the driver's verdicts themselves."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
from fuzz_cases import KINDS
from fuzz_driver import SERVERS, judge, run, table

SLICE = 180  # requests in all, a third per server
SEED = 49

pytestmark = pytest.mark.timeout(300)


def test_fuzz_slice_finds_no_5xx_hang_or_leak(tmp_path: Path) -> None:
    report = run(SLICE, SEED, SERVERS, concurrency=32, root=tmp_path)
    print("\n" + table(report))
    assert report.ok, table(report)
    assert len(report.outcomes) == SLICE
    seen = {(o.server, o.request.kind) for o in report.outcomes}
    assert seen == {(s, k) for s in SERVERS for k in KINDS}
    statuses = {o.status for o in report.outcomes}
    assert {"200", "400", "closed"} <= statuses  # both sides of validation, and the parser's


def _headers(**kw: str) -> httpx.Headers:
    return httpx.Headers(kw)


@pytest.mark.parametrize(
    ("status", "headers", "text", "bad"),
    [
        (200, {}, '{"id": "x"}', False),
        (400, {}, '{"error": {"message": "m", "type": "t", "param": null, "code": null}}', False),
        (400, {}, "Bad Request", True),  # not the OpenAI shape
        (
            500,
            {},
            '{"error": {"message": "m", "type": "server_error", "param": null, '
            '"code": "internal_error"}}',
            True,
        ),  # fmt: skip
        (502, {}, "", True),
        (503, {"retry-after": "1"}, '{"error": {"code": "queue_full"}}', False),
        (503, {}, '{"error": {"code": "queue_full"}}', True),  # no Retry-After
        (503, {"retry-after": "1"}, '{"error": {"code": "engine_dead"}}', True),
        (200, {"content-type": "text/event-stream"}, "data: {}\n\ndata: [DONE]\n\n", False),
        (200, {"content-type": "text/event-stream"}, "data: {}\n\n", True),  # cut short
        (
            200,
            {"content-type": "text/event-stream"},
            'data: {"error": {"type": "server_error"}}\n\ndata: [DONE]\n\n',
            True,
        ),  # fmt: skip
    ],
)
def test_the_driver_counts_what_the_issue_forbids(status, headers, text, bad) -> None:
    assert (judge(status, _headers(**headers), text) is not None) == bad


# ------------------------------------------------------------------ what the fuzzing caught

BIG_SCHEMA_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"days": "word " * 30_000}},
    },
}


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_forced_call_whose_grammar_passes_the_size_limit_is_a_400(tool_choice) -> None:
    """Caught by the driver (seed 49, tp2 #133): a forced call of a tool whose parameters hold
    a 150 KB string made a grammar past the server's size limit, and the size check's error
    reached the client as a 500."""
    from tandem.server.errors import APIError
    from tandem.server.protocol import ChatCompletionRequest
    from tandem.server.tools import plan_tools

    req = ChatCompletionRequest(
        model="tiny",
        messages=[{"role": "user", "content": "hi"}],
        tools=[BIG_SCHEMA_TOOL],
        tool_choice=tool_choice,
    )
    plan = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
    with pytest.raises(APIError) as refused:
        plan.grammar()
    assert refused.value.status == 400 and refused.value.param == "tools"
    assert "too large" in refused.value.message
    small = {**BIG_SCHEMA_TOOL, "function": {"name": "get_weather", "parameters": {}}}
    req = req.model_copy(update={"tools": [req.tools[0].model_validate(small)]})
    assert plan_tools(req.tools, req.tool_choice, None).grammar() is not None


def test_json_schema_whose_type_list_repeats_a_type_is_a_400() -> None:
    """Caught by the driver (seed 1, spec #8944): a response_format schema whose ``type`` list
    held "object" 5,000 times compiled, then passed the grammar parser's row limit at the first
    token: the request failed mid-generation, a 500 (a server error inside a stream)."""
    import json

    from tandem.engine.structured_output import StructuredOutputError, StructuredSpec, to_grammar
    from tandem.server.serving import engine_error_to_api

    param = "response_format.json_schema"
    nested = {"type": "object", "properties": {"a": {"type": ["string", "null", "string"]}}}
    for schema in ({"type": ["object"] * 5000}, nested):
        with pytest.raises(StructuredOutputError) as refused:
            to_grammar(StructuredSpec("json_schema", json.dumps(schema), param))
        error = engine_error_to_api(refused.value)
        assert error.status == 400 and error.param == param and "repeats a type" in error.message
    unique = {"type": ["object", "null"], "properties": {"a": {"type": ["string", "integer"]}}}
    assert to_grammar(StructuredSpec("json_schema", json.dumps(unique), param))


def test_a_repetition_penalty_float32_cannot_hold_is_a_400() -> None:
    """Caught by the driver (seed 1, dp2 #15310): repetition_penalty 1e-308 passed the (0, 10]
    check, became 0 in the sampler's float32, and 0 times a grammar's masked -inf made NaN
    logits: the argmax took a token the grammar forbids, a 500."""
    from tandem import SamplingParams
    from tandem.server.serving import engine_error_to_api

    with pytest.raises(ValueError, match="repetition_penalty") as refused:
        SamplingParams(repetition_penalty=1e-308)
    error = engine_error_to_api(refused.value)
    assert error.status == 400 and error.param == "repetition_penalty"
    assert SamplingParams(repetition_penalty=1.2e-38).repetition_penalty == 1.2e-38


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_a_penalty_that_overflows_the_logits_samples_what_the_grammar_allows(
    tmp_path: Path, temperature: float
) -> None:
    """The smallest penalty float32 holds divides a positive logit past the largest float
    (+inf): the logits are held at the largest float, so the softmax has no NaN and both greedy
    and sampled rows keep to the grammar."""
    from checkpoints import build_llama
    from tandem import LLM, SamplingParams
    from tandem.engine.structured_output import StructuredSpec

    model = build_llama(tmp_path / "m")
    with LLM(str(model), max_model_len=128) as llm:
        words = llm.tokenizer.encode("yes no", add_special_tokens=False)
        params = SamplingParams(
            temperature=temperature, max_tokens=5, min_p=0.05, top_p=0.5, seed=0,
            repetition_penalty=1.2e-38, presence_penalty=1.8,
            logit_bias=dict.fromkeys(words, 100.0),  # (logit + 100) / 1.2e-38: +inf
            structured=StructuredSpec.choice(["yes", "no"]),
        )  # fmt: skip
        outs = llm.generate(["yes no", "no yes yes"], params)
    assert {o.outputs[0].text for o in outs} <= {"yes", "no"}
