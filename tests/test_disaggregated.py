"""Prefill/decode disaggregation at the engine (engine/kv_transfer.py): a prefill engine hands
each request over after its first token, a decode engine pulls its KV blocks (target and draft
layers) and draft state over a gloo pair and goes on; against one engine doing both:

- greedy tokens and log-probs equal, and the drafts accepted per position equal (a missing draft
  KV or draft state would lower acceptance right after the hand-over, not change the text),
  without speculation, with Eagle3 chains and trees on a Llama target, and with MTP on a
  DeepSeek-V3 target (MLA's latent cache);
- seeded sampled requests (temperature 0.8) give the same tokens: the request's random generator
  and its drafts' probabilities move with it; unseeded ones are distributed as colocated ones
  (two-sample chi-square);
- chunked prefill and a prefix-cache hit on the prefill side, a JSON schema on both;
- failures: an offer nobody pulls expires and frees its blocks; a pull from an address where no
  prefill instance listens, or of a transfer the prefill instance no longer holds, fails the
  request with its reason and frees the decode side's blocks; a decode instance with another
  KV layout is refused, naming both.
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from stats import two_sample_p

from checkpoints import (
    build_deepseek_mtp_target,
    build_eagle3_draft,
    build_llama,
    make_echo_target,
    perfect_eagle3_draft,
)
from tandem import LLM, SamplingParams
from tandem.engine.config import EngineArgs
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput

PROMPTS = [
    "Hello world! How are you today?",
    "Paris is the capital of",
    "Hello world! How are you doing?",  # shares a block with the first: a prefix-cache hit
    "a",
]
GREEDY = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=1)
SAMPLED = SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True)
RUN: dict[str, Any] = {"max_model_len": 256, "max_num_batched_tokens": 8}  # chunked prefill


@pytest.fixture(scope="module")
def llama(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("pd_llama")
    target = build_llama(root / "t", layers=2, heads=4, kv_heads=2)
    make_echo_target(target, residual_scale=20.0)
    return target, perfect_eagle3_draft(root / "d", target, residual_scale=3.0)


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek_mtp_target(tmp_path_factory.mktemp("pd_dsv3") / "t", 2)


def _engine(model: Path, spec: dict[str, Any] | None, role: str, **kw: Any) -> LLMEngine:
    """An engine of ``role`` (both: the colocated one) with the test's settings."""
    args = EngineArgs(model=str(model), speculative_config=spec, kv_role=role, **RUN, **kw)
    return LLMEngine.from_engine_args(args)


def _finish(engine: LLMEngine, rid: str, deadline_s: float = 60.0) -> RequestOutput:
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        for out in engine.step():
            if out.request_id == rid and out.finished:
                return out
        failed = engine.take_failed()
        assert not failed, failed
    raise AssertionError(f"request {rid} did not finish")


def _disaggregated(
    prefill: LLMEngine, decode: LLMEngine, params: SamplingParams, prompts: list[str]
) -> list[RequestOutput]:
    """Each prompt through the prefill engine (handed over), then the decode engine."""
    outs = []
    for i, prompt in enumerate(prompts):
        rid = f"r{i}"
        p = dataclasses.replace(params, kv_transfer={"do_remote_decode": True})
        prefill.add_request(rid, prefill.make_request(rid, prompt, p))
        handed = _finish(prefill, rid)
        kv = handed.kv_transfer_params
        assert kv is not None and len(handed.outputs[0].token_ids) == 1
        prefill.step()  # the ranks offer it with the step after the hand-over
        d = dataclasses.replace(params, kv_transfer=kv)
        decode.add_request(rid, decode.make_request(rid, prompt, d))
        outs.append(_finish(decode, rid))
    _drain(prefill)
    return outs


def _drain(engine: LLMEngine) -> None:
    """Until the prefill engine has freed every handed-over request's blocks."""
    end = time.monotonic() + 30
    while engine.has_unfinished_requests() and time.monotonic() < end:
        engine.step()
    assert not engine.has_unfinished_requests()


def _colocated(
    model: Path, spec: dict[str, Any] | None, params: SamplingParams, **kw: Any
) -> list[Any]:
    """One engine doing both, the prompts one after another as the hand-overs run them (a
    batch's other rows would change a near-tied draft)."""
    with LLM(str(model), speculative_config=spec, **RUN, **kw) as llm:
        return [llm.generate([prompt], params)[0] for prompt in PROMPTS]


def _assert_same(got: list[RequestOutput], want: list[Any], speculative: bool) -> None:
    for g, w in zip(got, want, strict=True):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids
        assert g.outputs[0].text == w.outputs[0].text
        if w.outputs[0].logprobs is not None:
            assert g.outputs[0].logprobs is not None
            diff = max(
                abs(a.logprob - b.logprob)
                for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs, strict=True)
            )
            assert diff < 1e-5
        if speculative:
            assert g.spec_stats is not None and w.spec_stats is not None
            assert g.spec_stats.accepted_per_pos == w.spec_stats.accepted_per_pos
            assert g.spec_stats.num_drafts == w.spec_stats.num_drafts


EAGLE3_CHAIN = {"method": "eagle3", "num_speculative_tokens": 3}
EAGLE3_TREE = {"method": "eagle3", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}


@pytest.mark.parametrize("spec", [None, EAGLE3_CHAIN, EAGLE3_TREE], ids=["plain", "chain", "tree"])
def test_llama_handed_over_equals_colocated(llama: tuple[Path, Path], spec: Any) -> None:
    target, draft = llama
    spec = None if spec is None else {**spec, "model": str(draft)}
    want = _colocated(target, spec, GREEDY)
    if spec is not None:  # drafts accepted and rejected: the counts can tell
        per_pos = [
            sum(x) for x in zip(*(w.spec_stats.accepted_per_pos for w in want), strict=False)
        ]
        assert per_pos[0] > 0 and sum(per_pos) < 3 * sum(w.spec_stats.num_drafts for w in want)
    prefill, decode = _engine(target, spec, "prefill"), _engine(target, spec, "decode")
    try:
        got = _disaggregated(prefill, decode, GREEDY, PROMPTS)
        _assert_same(got, want, spec is not None)
        assert prefill.get_stats().prefix_cache_hits > 0  # the third prompt's first block
        for engine in (prefill, decode):
            assert engine.get_stats().num_used_kv_blocks == 0
        if spec is not None:  # sampled: the generator and the draft probabilities move
            want = _colocated(target, spec, SAMPLED)
            got = _disaggregated(prefill, decode, SAMPLED, PROMPTS)
            assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_sampled_tokens_follow_the_colocated_distribution(tmp_path: Path) -> None:
    """Two-sample chi-square at temperature 0.8 (p > 0.01), a 12-token model with a random
    Eagle3 head: positions 1 and 2 (the decode side's first step verifies drafts made on the
    prefill side from the moved draft state) over N requests each way. Every request has its own
    seed (the two sides' differ), so the samples are independent and the test is deterministic
    however the hand-overs batch."""
    n = 600
    target = build_llama(tmp_path / "t", layers=2, vocab_size=12, init_std=0.15)
    spec = {"method": "eagle3", "model": str(build_eagle3_draft(tmp_path / "d", target))}
    spec["num_speculative_tokens"] = 3
    params = [
        SamplingParams(temperature=0.8, max_tokens=3, ignore_eos=True, detokenize=False, seed=i)
        for i in range(2 * n)
    ]
    run = {"max_model_len": 32, "max_num_seqs": n, "max_num_batched_tokens": 4096}
    with LLM(str(target), speculative_config=spec, **run) as llm:
        colocated = [o.outputs[0].token_ids for o in llm.generate([[1, 2, 3]] * n, params[:n])]

    def engine(role: str) -> LLMEngine:
        args = EngineArgs(model=str(target), speculative_config=spec, kv_role=role, **run)
        return LLMEngine.from_engine_args(args)

    prefill, decode = engine("prefill"), engine("decode")
    try:
        for i in range(n):
            handover = dataclasses.replace(params[n + i], kv_transfer={"do_remote_decode": True})
            prefill.add_request(f"r{i}", [1, 2, 3], handover)
        handed = _finish_all(prefill, n)
        prefill.step()  # the ranks offer them with the step after the hand-over
        for rid, out in handed.items():
            kv = out.kv_transfer_params
            p = dataclasses.replace(params[n + int(rid[1:])], kv_transfer=kv)
            decode.add_request(rid, [1, 2, 3], p)
        finished = _finish_all(decode, n)
        rate = decode.spec_stats.acceptance_rate
        _drain(prefill)
        for e in (prefill, decode):
            assert e.get_stats().num_used_kv_blocks == 0
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert 0.2 < rate < 0.95, rate  # drafts accepted and rejected after the hand-over
    disaggregated = [o.outputs[0].token_ids for o in finished.values()]
    for j in (1, 2):
        a = Counter(t[j] for t in colocated)
        b = Counter(t[j] for t in disaggregated)
        p = two_sample_p(a, b)
        print(f"position {j}: colocated {sorted(a.items())}, handed over {sorted(b.items())}, "
              f"p = {p:.3f}")  # fmt: skip
        assert p > 0.01, (j, a, b)


def _finish_all(engine: LLMEngine, n: int, deadline_s: float = 120.0) -> dict[str, Any]:
    """Step ``engine`` until ``n`` requests have finished; their final outputs by id."""
    done: dict[str, Any] = {}
    end = time.monotonic() + deadline_s
    while len(done) < n and time.monotonic() < end:
        done.update((o.request_id, o) for o in engine.step() if o.finished)
        failed = engine.take_failed()
        assert not failed, failed
    assert len(done) == n, f"{len(done)} of {n} finished"
    return done


@pytest.mark.parametrize(
    "spec",
    [
        {"method": "mtp", "num_speculative_tokens": 3},
        {"method": "mtp", "num_speculative_tokens": 2, "mtp_mode": "vanilla"},
    ],
    ids=["eagle", "vanilla"],
)
def test_deepseek_mtp_handed_over_equals_colocated(deepseek: Path, spec: dict[str, Any]) -> None:
    """Eagle mode (the first MTP layer, K times) and vanilla (one layer per depth, whose KV of
    the last prompt positions waits for later tokens)."""
    want = _colocated(deepseek, spec, GREEDY)
    prefill, decode = _engine(deepseek, spec, "prefill"), _engine(deepseek, spec, "decode")
    try:
        got = _disaggregated(prefill, decode, GREEDY, PROMPTS)
    finally:
        prefill.shutdown()
        decode.shutdown()
    _assert_same(got, want, True)
    assert sum(sum(w.spec_stats.accepted_per_pos) for w in want) > 0


def test_a_json_schema_holds_across_the_hand_over(llama: tuple[Path, Path]) -> None:
    from tandem.engine.structured_output import StructuredSpec

    target, draft = llama
    spec = {**EAGLE3_CHAIN, "model": str(draft)}
    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    params = dataclasses.replace(
        GREEDY,
        ignore_eos=False,
        max_tokens=24,
        structured=StructuredSpec("json_schema", json.dumps(schema)),
    )
    want = _colocated(target, spec, params)
    prefill, decode = _engine(target, spec, "prefill"), _engine(target, spec, "decode")
    try:
        got = _disaggregated(prefill, decode, params, PROMPTS[:2])
    finally:
        prefill.shutdown()
        decode.shutdown()
    _assert_same(got, want[:2], True)


def test_transfers_that_cannot_complete_free_their_blocks(llama: tuple[Path, Path]) -> None:
    target, _ = llama
    prefill = _engine(target, None, "prefill", kv_transfer_timeout=0.5)
    decode = _engine(target, None, "decode", kv_transfer_timeout=5)
    try:
        # An offer nobody pulls expires: its blocks are freed.
        p = dataclasses.replace(GREEDY, kv_transfer={"do_remote_decode": True})
        prefill.add_request("x", prefill.make_request("x", PROMPTS[0], p))
        kv = _finish(prefill, "x").kv_transfer_params
        prefill.step()
        assert kv is not None and prefill.get_stats().num_used_kv_blocks > 0
        _drain(prefill)
        assert prefill.get_stats().num_used_kv_blocks == 0
        # Pulling it now: the prefill instance no longer holds it.
        d = dataclasses.replace(GREEDY, kv_transfer=kv)
        decode.add_request("x", decode.make_request("x", PROMPTS[0], d))
        failed = _failures(decode)
        assert "no longer holds transfer" in failed[0].message
        # A prefill instance of two ranks for this one-rank decode instance: refused at once.
        two = {**kv, "remote_addresses": kv["remote_addresses"] * 2}
        with pytest.raises(ValueError, match="2 rank address.*this decode instance 1 rank"):
            decode.add_request(
                "z", decode.make_request("z", PROMPTS[0], dataclasses.replace(d, kv_transfer=two))
            )
        # A prefill instance under attention DP (its KV whole on one rank) for this one.
        adp = {**kv, "remote_rank": 0}
        with pytest.raises(ValueError, match="one side runs attention DP and the other does not"):
            decode.add_request(
                "w", decode.make_request("w", PROMPTS[0], dataclasses.replace(d, kv_transfer=adp))
            )
        # Nothing listens there.
        dead = {**kv, "remote_addresses": ["127.0.0.1:9"]}
        decode.add_request(
            "y", decode.make_request("y", PROMPTS[0], dataclasses.replace(d, kv_transfer=dead))
        )
        failed = _failures(decode)
        assert "127.0.0.1:9" in failed[0].message  # cannot reach it, or no answer in time
        assert decode.get_stats().num_used_kv_blocks == 0
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_a_pair_idle_longer_than_the_timeout_still_serves(llama: tuple[Path, Path]) -> None:
    """Transfers have deadlines; the pair's process group must not (a gloo timeout closes it,
    and a pair idles between pulls)."""
    target, _ = llama
    prefill = _engine(target, None, "prefill", kv_transfer_timeout=1.0)
    decode = _engine(target, None, "decode", kv_transfer_timeout=1.0)
    try:
        first = _disaggregated(prefill, decode, GREEDY, PROMPTS[:1])
        time.sleep(1.5)
        again = _disaggregated(prefill, decode, GREEDY, PROMPTS[:1])
    finally:
        prefill.shutdown()
        decode.shutdown()
    assert again[0].outputs[0].token_ids == first[0].outputs[0].token_ids


def _failures(engine: LLMEngine) -> list[Any]:
    end = time.monotonic() + 30
    while time.monotonic() < end:
        engine.step()
        failed = engine.take_failed()
        if failed:
            assert not engine.has_unfinished_requests()
            return failed
    raise AssertionError("no failure reported")


def test_a_decode_instance_with_another_kv_layout_is_refused(llama: tuple[Path, Path]) -> None:
    target, _ = llama
    prefill = _engine(target, None, "prefill", dtype="float32")
    decode = _engine(target, None, "decode", dtype="bfloat16")
    try:
        p = dataclasses.replace(GREEDY, kv_transfer={"do_remote_decode": True})
        prefill.add_request("x", prefill.make_request("x", PROMPTS[0], p))
        kv = _finish(prefill, "x").kv_transfer_params
        prefill.step()
        d = dataclasses.replace(GREEDY, kv_transfer=kv)
        decode.add_request("x", decode.make_request("x", PROMPTS[0], d))
        message = _failures(decode)[0].message
        assert "KV cache layouts differ" in message
        assert "float32" in message and "bfloat16" in message
    finally:
        prefill.shutdown()
        decode.shutdown()


def test_roles_are_refused_where_the_kv_would_not_move() -> None:
    with pytest.raises(ValueError, match="kv_role='decode' runs on one node without -dp replicas"):
        EngineArgs(model=".", kv_role="decode", data_parallel_size=2)._kv_transfer_config()
    with pytest.raises(ValueError, match="kv_role='middle' is invalid"):
        EngineArgs(model=".", kv_role="middle")._kv_transfer_config()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_prefill_decode_pair_on_one_gpu(llama: tuple[Path, Path]) -> None:
    """`make gpu-check`: both engines on the GPU (CUDA graphs on the decode side), the KV
    staged through the host over the gloo pair: greedy and seeded sampled output, and the drafts
    accepted per position, equal one engine doing both."""
    target, draft = llama
    spec = {**EAGLE3_CHAIN, "model": str(draft)}
    want = _colocated(target, spec, GREEDY, device="cuda")
    sampled = _colocated(target, spec, SAMPLED, device="cuda")
    prefill = _engine(target, spec, "prefill", device="cuda")
    decode = _engine(target, spec, "decode", device="cuda")
    try:
        _assert_same(_disaggregated(prefill, decode, GREEDY, PROMPTS), want, True)
        got = _disaggregated(prefill, decode, SAMPLED, PROMPTS)
        assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in sampled]
    finally:
        prefill.shutdown()
        decode.shutdown()
