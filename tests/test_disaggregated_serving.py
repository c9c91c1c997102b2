"""Disaggregated serving over HTTP: `tandem router` in front of a `--role prefill` and a
`--role decode` instance, both `-tp 2` (each rank moves its own KV shard, 2 of 4 heads and 1 of
2 KV heads, and draft state to the rank of its index), a Llama target with an Eagle3 head
(K = 3), against one `--role both` instance on one rank, through the official `openai` client:

- greedy completions and chat completions, streamed and not: the same text, log-probs and
  speculative counts (drafts verified and accepted) per request as the instance doing both;
- seeded sampled requests (temperature 0.8) give the same text: the request's random generator
  moves with it;
- a request the prefill instance refuses (400) reaches the client as that 400;
- the decode instance gone: the client gets a 503 naming it, the router's /health answers 503
  naming it, and the prefill instance frees the blocks it held for the hand-over.
"""

from __future__ import annotations

import subprocess
import sys
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from checkpoints import build_llama, make_echo_target, perfect_eagle3_draft
from server_utils import RemoteServer, free_port, metric, scrape_metrics

MODEL = "t"  # the served name: the model folder's
PROMPTS = ["Hello world! How are you today?", "Paris is the capital of", "The quick brown fox"]
pytestmark = pytest.mark.timeout(180)


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    root = tmp_path_factory.mktemp("pd_http")
    target = build_llama(root / MODEL, layers=2, heads=4, kv_heads=2)
    make_echo_target(target, residual_scale=20.0)
    draft = perfect_eagle3_draft(root / "d", target, residual_scale=3.0)
    spec = ["--speculative-config", f'{{"method": "eagle3", "model": "{draft}", '
            '"num_speculative_tokens": 3}']  # fmt: skip
    both = RemoteServer(target, spec)
    tp2 = [*spec, "-tp", "2"]
    prefill = RemoteServer(target, [*tp2, "--role", "prefill", "--kv-transfer-timeout", "3"])
    decode = RemoteServer(target, [*tp2, "--role", "decode"])
    router: subprocess.Popen[bytes] | None = None
    try:
        for s in (both, prefill, decode):
            s.wait_ready()
        router, url = _start_router(prefill, decode)
        yield {
            "both": both,
            "prefill": prefill,
            "decode": decode,
            "router": url,
            "target": target,
            "spec": spec,
        }
    finally:
        _stop_router(router)
        for s in (both, prefill, decode):
            s.stop()


def _start_router(prefill: RemoteServer, decode: RemoteServer) -> tuple[Any, str]:
    port = free_port()
    router = subprocess.Popen(
        [sys.executable, "-m", "tandem.cli", "router", "--port", str(port),
         "--prefill", prefill.base_url, "--decode", decode.base_url],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(url)
    except BaseException:
        _stop_router(router)
        raise
    return router, url


def _stop_router(router: Any) -> None:
    if router is not None:
        router.terminate()
        try:
            router.wait(timeout=20)
        except subprocess.TimeoutExpired:
            router.kill()
            router.wait(timeout=10)


def _wait_healthy(url: str) -> None:
    end = time.monotonic() + 60
    while time.monotonic() < end:
        try:
            if httpx.get(url + "/health", timeout=5).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise TimeoutError("the router never answered /health with 200")


def _client(base: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=base + "/v1", api_key="none", max_retries=0, timeout=120)


def _completion(base: str, prompt: str, **kw: Any) -> tuple[str, list[float], Any]:
    resp = _client(base).completions.create(
        model=MODEL, prompt=prompt, max_tokens=16, logprobs=0, extra_body={"ignore_eos": True}, **kw
    )
    choice = resp.choices[0]
    return choice.text, choice.logprobs.token_logprobs, resp.usage.model_extra["spec_decode"]


def test_completions_through_the_router_equal_one_instance(servers: dict[str, Any]) -> None:
    accepted = 0
    for prompt in PROMPTS:
        want = _completion(servers["both"].base_url, prompt, temperature=0)
        got = _completion(servers["router"], prompt, temperature=0)
        assert got[0] == want[0]
        assert max(abs(a - b) for a, b in zip(got[1], want[1], strict=True)) < 1e-4
        assert got[2] == want[2]  # drafts verified and accepted, step for step
        accepted += want[2]["num_accepted_tokens"]
    for s in (servers["prefill"], servers["decode"]):
        _assert_blocks_freed(s)
    assert accepted > 0
    samples = scrape_metrics(_At(servers["router"]))  # type: ignore[arg-type]
    assert metric(samples, "tandem_router_handover_bytes_total") > 0
    assert metric(samples, "tandem_router_requests_total", outcome="ok") >= len(PROMPTS)


class _At:
    """A router where ``scrape_metrics`` expects a server."""

    def __init__(self, base: str) -> None:
        self.base = base

    def url(self, path: str) -> str:
        return self.base + path


def test_streamed_chat_and_seeded_sampling_equal_one_instance(servers: dict[str, Any]) -> None:
    messages = [{"role": "user", "content": "Say something about Paris."}]

    def chat(base: str) -> str:
        stream = _client(base).chat.completions.create(
            model=MODEL, messages=messages, max_tokens=12, temperature=0, stream=True
        )
        return "".join(c.choices[0].delta.content or "" for c in stream if c.choices)

    assert chat(servers["router"]) == chat(servers["both"].base_url)
    for seed in (1, 2):
        want = _completion(servers["both"].base_url, PROMPTS[0], temperature=0.8, seed=seed)
        got = _completion(servers["router"], PROMPTS[0], temperature=0.8, seed=seed)
        assert got[0] == want[0]


@pytest.mark.timeout(300)
def test_attention_dp_on_both_sides(servers: dict[str, Any]) -> None:
    """`-tp 2 --enable-attention-dp` instances: a request's KV is whole on the one rank that
    prefilled it and moves to the one rank that decodes it (every rank hears of every
    transfer); requests in flight together spread over both ranks of each side."""
    args = [*servers["spec"], "-tp", "2", "--enable-attention-dp"]
    prefill = RemoteServer(servers["target"], [*args, "--role", "prefill"])
    decode = RemoteServer(servers["target"], [*args, "--role", "decode"])
    router = None
    try:
        prefill.wait_ready()
        decode.wait_ready()
        router, url = _start_router(prefill, decode)
        want = [_completion(servers["both"].base_url, p, temperature=0) for p in PROMPTS]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            got = list(pool.map(lambda p: _completion(url, p, temperature=0), PROMPTS))
        for g, w in zip(got, want, strict=True):
            assert g[0] == w[0]
            assert max(abs(a - b) for a, b in zip(g[1], w[1], strict=True)) < 1e-4
            assert g[2] == w[2]
        for s in (prefill, decode):
            _assert_blocks_freed(s)
    finally:
        _stop_router(router)
        prefill.stop()
        decode.stop()
    # Both paired, both stopped by SIGTERM: a clean exit (no transfer thread left inside gloo).
    assert (prefill.proc.returncode, decode.proc.returncode) == (0, 0)


def test_a_request_the_prefill_instance_refuses_is_the_clients_400(
    servers: dict[str, Any],
) -> None:
    with pytest.raises(openai.BadRequestError) as e:
        _client(servers["router"]).completions.create(model=MODEL, prompt="x", max_tokens=0)
    assert "max_tokens" in str(e.value)


def test_a_dead_decode_instance_is_a_503_and_the_prefill_side_frees_its_blocks(
    servers: dict[str, Any],
) -> None:
    """Runs last: it stops the decode instance."""
    decode, prefill = servers["decode"], servers["prefill"]
    decode.stop()
    with pytest.raises(openai.APIStatusError) as e:
        _completion(servers["router"], PROMPTS[1], temperature=0)
    assert e.value.status_code == 503
    assert decode.base_url in str(e.value)
    health = httpx.get(servers["router"] + "/health", timeout=30)
    assert health.status_code == 503
    assert decode.base_url in health.json()["dead"]
    _assert_blocks_freed(prefill)  # the hand-over expires after --kv-transfer-timeout 3


def _assert_blocks_freed(server: RemoteServer) -> None:
    """Within 30 s (the engine's stats reach /metrics with its next message)."""
    end = time.monotonic() + 30
    used = None
    while time.monotonic() < end:
        used = metric(scrape_metrics(server), "tandem:kv_cache_used_blocks")
        if used == 0:
            return
        time.sleep(0.5)
    raise AssertionError(f"{used} KV blocks still in use")
