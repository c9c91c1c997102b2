"""Speculative decoding through the HTTP server: same greedy text, spec_decode usage, metrics."""

from __future__ import annotations

import json
import re

import openai
import pytest

from server_utils import RemoteServer, metric, scrape_metrics, tiny_mtp_model
from tandem import LLM, SamplingParams

PROMPT = "Hello world! How are you today?"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_mtp_model(tmp_path_factory)


# K by batch size: 3 for one request, 2 from 4, none from 8 (the most a step runs here).
SCHEDULE = {"1": 3, "4": 2, "8": 0}


@pytest.fixture(scope="module")
def server(model_dir):
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": SCHEDULE})
    with RemoteServer(model_dir, ["--speculative-config", spec, "--max-num-seqs", "8"]) as s:
        yield s


def test_greedy_text_and_spec_usage(server, model_dir):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=60)
    before = scrape_metrics(server)
    resp = client.completions.create(
        model=model_dir.name,
        prompt=PROMPT,
        max_tokens=24,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    with LLM(str(model_dir), max_model_len=256) as llm:
        (ref,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert resp.choices[0].text == ref.outputs[0].text
    usage = resp.usage.model_extra["spec_decode"]
    # Every verification step has 1..K drafts (fewer only when max_tokens is near).
    assert 1 <= usage["num_drafts"] <= usage["num_draft_tokens"] <= 3 * usage["num_drafts"]
    assert resp.usage.completion_tokens == 24
    after = scrape_metrics(server)
    model = model_dir.name
    for prefix, labels in (("tandem:", {}), ("vllm:", {"method": "mtp"})):  # vLLM's names too
        for name, key in (
            ("spec_decode_num_drafts_total", "num_drafts"),
            ("spec_decode_num_draft_tokens_total", "num_draft_tokens"),
            ("spec_decode_num_accepted_tokens_total", "num_accepted_tokens"),
        ):
            name = prefix + name
            assert (
                metric(after, name, model_name=model, **labels)
                - metric(before, name, model_name=model, **labels)
                == usage[key]
            )
        name = prefix + "spec_decode_num_accepted_tokens_per_pos_total"
        per_pos = [
            _or_zero(after, name, model_name=model, position=str(p), **labels)
            - _or_zero(before, name, model_name=model, position=str(p), **labels)
            for p in range(3)
        ]
        assert sum(per_pos) == usage["num_accepted_tokens"]


def _or_zero(samples: dict, name: str, **labels: str) -> float:
    """A series that appears with its first count reads 0 before."""
    try:
        return metric(samples, name, **labels)
    except KeyError:
        return 0.0


def test_schedule_gives_each_load_its_k(server, model_dir):
    """1, 4 and 16 requests, read from the metrics: each load's steps draft its K from the
    schedule and never a larger load's (one: batch 1's K only; four: batch 4's while all four
    run, never batch 8's; sixteen: batch 8's). Each load is one completions call with a list of
    prompts, so its requests reach the engine together: separate calls on a loaded machine
    arrive a moment apart, and a step of this model takes milliseconds (four such calls once ran
    one after another)."""
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=60)
    name = "tandem:spec_decode_steps_by_draft_len_total"

    def steps(samples: dict) -> dict[int, float]:
        model = model_dir.name
        return {k: _or_zero(samples, name, model_name=model, draft_len=str(k)) for k in (0, 2, 3)}

    for streams, want in ((1, 3), (4, 2), (16, 0)):
        before = steps(scrape_metrics(server))
        client.completions.create(
            model=model_dir.name, prompt=[f"{PROMPT} {i}" for i in range(streams)],
            max_tokens=160, temperature=0, extra_body={"ignore_eos": True},
        )  # fmt: skip
        after = steps(scrape_metrics(server))
        delta = {k: after[k] - before[k] for k in after}
        larger = {1: (2, 0), 4: (0,), 16: ()}[streams]
        assert delta[want] > 0 and all(delta[k] == 0 for k in larger), (streams, delta)


def test_streaming_under_speculation(server, model_dir):
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=60)
    stream = client.chat.completions.create(
        model=model_dir.name,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    text, usage = "", None
    for chunk in stream:
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
        if chunk.usage is not None:
            usage = chunk.usage
    full = client.chat.completions.create(
        model=model_dir.name,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=16,
        temperature=0,
    )
    assert text == full.choices[0].message.content
    assert usage is not None and usage.completion_tokens == full.usage.completion_tokens


def test_penalties_and_logit_bias_are_served_under_speculation(server, model_dir):
    """Greedy with penalties and a bias through the speculating server equals the offline
    engine without speculation (the OpenAI field shapes: a string-keyed logit_bias)."""
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=60)
    pen = {"presence_penalty": 1.0, "frequency_penalty": 0.5}
    resp = client.completions.create(
        model=model_dir.name, prompt=PROMPT, max_tokens=16, temperature=0, **pen,
        logit_bias={"5": 4.0}, extra_body={"repetition_penalty": 1.2, "ignore_eos": True},
    )  # fmt: skip
    params = SamplingParams(
        temperature=0, max_tokens=16, ignore_eos=True, repetition_penalty=1.2,
        logit_bias={5: 4.0}, **pen,
    )  # fmt: skip
    with LLM(str(model_dir), max_model_len=256) as llm:
        (ref,) = llm.generate(PROMPT, params)
    assert resp.choices[0].text == ref.outputs[0].text


def test_structured_output_is_served_under_speculation(server, model_dir):
    """Grammar + speculation (issue 34): the drafts are verified against the masked target, so
    the answers match the grammar (tests/test_structured_spec.py checks exactness offline)."""
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=60)
    msgs = [{"role": "user", "content": PROMPT}]
    name = "tandem:spec_decode_constrained_num_draft_tokens_total"
    before = metric(scrape_metrics(server), name)
    resp = client.chat.completions.create(
        model=model_dir.name,
        messages=msgs,
        max_tokens=200,
        temperature=1.0,
        seed=1,
        response_format={"type": "json_object"},
    )
    if resp.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(resp.choices[0].message.content), dict)
    resp = client.chat.completions.create(
        model=model_dir.name,
        messages=msgs,
        max_tokens=40,
        extra_body={"structured_outputs": {"regex": "[a-z]{3,12}"}},
    )
    assert re.fullmatch("[a-z]{3,12}", resp.choices[0].message.content)
    resp = client.completions.create(
        model=model_dir.name,
        prompt=PROMPT,
        max_tokens=10,
        extra_body={"structured_outputs": {"choice": ["yes", "no"]}},
    )
    assert resp.choices[0].text in ("yes", "no")
    # Their drafts are counted apart too (the constrained acceptance rate).
    samples = scrape_metrics(server)
    drafted = metric(samples, name) - before
    accepted = metric(samples, "tandem:spec_decode_constrained_num_accepted_tokens_total")
    assert drafted > 0 and 0 <= accepted <= drafted, (drafted, accepted)


@pytest.fixture(scope="module")
def tree_server(model_dir):
    spec = {"method": "mtp", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}
    with RemoteServer(model_dir, ["--speculative-config", json.dumps(spec)]) as s:
        yield s


def test_tree_statistics_in_usage_and_metrics(tree_server, model_dir):
    """Draft trees (issue #35): usage.spec_decode and /metrics carry tokens per step, the
    verified tree's size and acceptance per depth, and they agree."""
    client = openai.OpenAI(
        base_url=tree_server.url("/v1"), api_key="none", max_retries=0, timeout=60
    )
    model = model_dir.name
    before = scrape_metrics(tree_server)
    resp = client.completions.create(
        model=model, prompt=PROMPT, max_tokens=24, temperature=0, extra_body={"ignore_eos": True}
    )
    with LLM(str(model_dir), max_model_len=256) as llm:
        (ref,) = llm.generate(PROMPT, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True))
    assert resp.choices[0].text == ref.outputs[0].text
    usage = resp.usage.model_extra["spec_decode"]
    steps, accepted = usage["num_drafts"], usage["num_accepted_tokens"]
    drafted = usage["num_draft_tokens"]  # whole trees of 6, less the nodes past max_tokens
    assert steps > 0 and 6 * (steps - 2) <= drafted <= 6 * steps
    assert usage["mean_draft_tokens_per_step"] == pytest.approx(drafted / steps)
    assert usage["mean_tokens_per_step"] == pytest.approx((accepted + steps) / steps)
    per_depth = usage["num_accepted_tokens_per_depth"]
    # One entry per depth (not per node); a token accepted at depth d + 1 has one at depth d.
    assert len(per_depth) == 3 and sum(per_depth) == accepted
    assert all(a >= b for a, b in zip(per_depth, per_depth[1:], strict=False))
    after = scrape_metrics(tree_server)

    def delta(name: str, **labels: str) -> float:
        try:
            old = metric(before, name, model_name=model, **labels)
        except KeyError:  # a per-depth series appears with its first step
            old = 0.0
        return metric(after, name, model_name=model, **labels) - old

    assert delta("tandem:spec_decode_num_draft_tokens_total") == drafted
    for d, count in enumerate(per_depth):
        name = "tandem:spec_decode_num_accepted_tokens_per_pos_total"
        assert delta(name, position=str(d)) == count
    name = "tandem:spec_decode_mean_draft_tokens_per_step"
    assert metric(after, name, model_name=model) == pytest.approx(drafted / steps)
    name = "tandem:spec_decode_mean_tokens_per_step"
    assert metric(after, name, model_name=model) == pytest.approx(
        usage["mean_tokens_per_step"]
    )  # the only request so far


def test_structured_output_with_trees(tree_server, model_dir):
    """Grammars under draft trees (tests/test_structured_spec.py checks exactness offline)."""
    client = openai.OpenAI(
        base_url=tree_server.url("/v1"), api_key="none", max_retries=0, timeout=60
    )
    resp = client.completions.create(
        model=model_dir.name,
        prompt=PROMPT,
        max_tokens=40,
        temperature=1.0,
        seed=3,
        extra_body={"structured_outputs": {"regex": "[a-z]{3,12}"}},
    )
    assert re.fullmatch("[a-z]{3,12}", resp.choices[0].text), resp.choices[0].text
    assert resp.usage.model_extra["spec_decode"]["num_drafts"] > 0
