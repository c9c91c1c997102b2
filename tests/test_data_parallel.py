"""Data-parallel replicas (``tandem serve -dp N``): the same greedy output as one replica,
dispatch that follows the prompt prefix and spreads load, per-replica /metrics, the start-up
errors, and one dead replica making the server unhealthy."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import httpx
import openai
import pytest

from server_utils import (
    RemoteServer,
    child_pids,
    cmdline,
    comm,
    metric,
    scrape_metrics,
    tiny_model,
    wait_until,
)
from tandem import LLM
from tandem import cli as tandem_cli
from tandem.engine.config import EngineArgs, ParallelConfig
from tandem.engine.dp_client import (
    AFFINITY_SLACK,
    ReplicatedLLM,
    make_engine_client,
    prefix_hashes,
    replica_devices,
)
from tandem.server import cli

BLOCK = 8
ARGS = ["--served-model-name", "tiny", "--max-num-seqs", "8", "--block-size", str(BLOCK)]
ARGS += ["--num-kv-blocks", "96"]
PROMPTS = ["The quick brown fox", "Hello world! How are you today?", "1 2 3 4 5 6", "Once upon"]
CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Count."}],
]
GREEDY: dict[str, Any] = {"temperature": 0, "max_tokens": 12, "extra_body": {"ignore_eos": True}}


@pytest.fixture(scope="module")
def servers(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """A one-replica and a two-replica server of the tiny model, started side by side."""
    model = tiny_model(tmp_path_factory)
    one = RemoteServer(model, ARGS)
    two = RemoteServer(model, [*ARGS, "-dp", "2"])
    try:
        one.wait_ready()
        two.wait_ready()
        yield SimpleNamespace(one=one, two=two)
    finally:
        one.stop()
        two.stop()


def _client(server: RemoteServer) -> openai.OpenAI:
    return openai.OpenAI(
        base_url=server.url("/v1"),
        api_key="unused",
        max_retries=0,
        timeout=60,
        _strict_response_validation=True,
    )


def _per_replica(server: RemoteServer, name: str) -> list[float]:
    samples = scrape_metrics(server)
    return [metric(samples, name, model_name="tiny", replica=str(i)) for i in range(2)]


def _greedy_outputs(server: RemoteServer) -> list[str]:
    with _client(server) as client:
        texts = []
        for prompt in PROMPTS:
            r = client.completions.create(model="tiny", prompt=prompt, **GREEDY)
            assert r.usage is not None and r.usage.completion_tokens == 12
            texts.append(r.choices[0].text)
        # Several prompts in one request: one group, sent whole to one replica.
        r = client.completions.create(model="tiny", prompt=PROMPTS[:2], **GREEDY)
        texts += [c.text for c in sorted(r.choices, key=lambda c: c.index)]
        for messages in CHATS:
            c = client.chat.completions.create(model="tiny", messages=messages, **GREEDY)  # type: ignore[arg-type]
            texts.append(c.choices[0].message.content or "")
    return texts


def test_two_replicas_answer_greedy_requests_like_one(servers: Any) -> None:
    before = _per_replica(servers.two, "tandem:prompt_tokens_total")
    two = _greedy_outputs(servers.two)
    after = _per_replica(servers.two, "tandem:prompt_tokens_total")
    assert _greedy_outputs(servers.one) == two
    # Both replicas answered some of them (the comparison covers each one's output).
    assert all(a > b for a, b in zip(after, before, strict=True)), (before, after)


def test_one_replica_keeps_its_unlabelled_metrics(servers: Any) -> None:
    samples = scrape_metrics(servers.one)
    assert metric(samples, "tandem:prompt_tokens_total", model_name="tiny") > 0
    names = {name for name, labels in samples if any(k == "replica" for k, _ in labels)}
    assert names == set()


def test_a_shared_prefix_goes_to_the_replica_that_caches_it(servers: Any) -> None:
    shared = [(7 * i + 11) % 250 + 20 for i in range(5 * BLOCK)]  # five full KV blocks
    prompts = [shared + [300 + i, 301, 302] for i in range(4)]
    hits0 = _per_replica(servers.two, "tandem:prefix_cache_hits_total")
    prompt0 = _per_replica(servers.two, "tandem:prompt_tokens_total")
    with _client(servers.two) as client:
        for prompt in prompts:  # one after the other: each finds the first one's blocks cached
            client.completions.create(model="tiny", prompt=prompt, max_tokens=2, temperature=0)
    hits = [
        b - a
        for a, b in zip(
            hits0, _per_replica(servers.two, "tandem:prefix_cache_hits_total"), strict=True
        )
    ]
    sent = [
        b - a
        for a, b in zip(
            prompt0, _per_replica(servers.two, "tandem:prompt_tokens_total"), strict=True
        )
    ]
    owner = max(range(2), key=lambda i: sent[i])
    assert sent[owner] == sum(len(p) for p in prompts) and sent[1 - owner] == 0, sent
    assert hits[owner] >= 3 * len(shared) and hits[1 - owner] == 0, hits


def test_concurrent_distinct_prompts_spread_over_both_replicas(servers: Any) -> None:
    gen0 = _per_replica(servers.two, "tandem:generation_tokens_total")

    async def run() -> None:
        async with openai.AsyncOpenAI(
            base_url=servers.two.url("/v1"), api_key="unused", max_retries=0, timeout=60
        ) as client:
            await asyncio.gather(
                *(
                    client.completions.create(
                        model="tiny",
                        prompt=[(31 * i + j) % 250 + 20 for j in range(3 * BLOCK)],
                        max_tokens=16,
                        temperature=0,
                        extra_body={"ignore_eos": True},
                    )
                    for i in range(8)
                )
            )

    asyncio.run(run())
    gen = _per_replica(servers.two, "tandem:generation_tokens_total")
    grew = [b - a for a, b in zip(gen0, gen, strict=True)]
    assert sum(grew) == 8 * 16 and min(grew) >= 16, grew


# ---------------------------------------------------------------- no server needed


def test_invalid_data_parallel_settings_are_clear_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValueError, match="data_parallel_size=0"):
        ParallelConfig(data_parallel_size=0)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 .*tensor_parallel_size=4"):
        ParallelConfig(tensor_parallel_size=4, enable_attention_dp=True, data_parallel_size=2)
    with pytest.raises(ValueError, match=r"data_parallel_size=2 with nnodes=2"):
        ParallelConfig(
            tensor_parallel_size=2, nnodes=2, dist_init_addr="10.0.0.1:29500", data_parallel_size=2
        )
    # Under attention DP, -dp N equal to the ADP width keeps that meaning: no replicas.
    adp = ParallelConfig(tensor_parallel_size=4, enable_attention_dp=True, data_parallel_size=4)
    assert adp.num_replicas == 1
    assert ParallelConfig(tensor_parallel_size=2, data_parallel_size=3).num_replicas == 3
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2")
    with pytest.raises(ValueError, match=r"need 4 CUDA devices, 3 are visible"):
        replica_devices(2, 2)


def test_replicas_take_consecutive_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    assert replica_devices(2, 2) == ["4,5", "6,7"]


def test_dp_flag_and_config_file_reach_engine_args(tmp_path: Path) -> None:
    argv = ["serve", "/m", "-dp", "2"]
    assert cli.engine_args_from(tandem_cli.build_parser().parse_args(argv)).data_parallel_size == 2
    preset = tmp_path / "dp.yaml"
    preset.write_text("data_parallel_size: 3\n")
    argv = ["/m", "--config", str(preset)]
    ns = tandem_cli.build_parser().parse_args(["serve", *argv])
    cli.apply_config_file(ns, argv)
    assert cli.engine_args_from(ns).data_parallel_size == 3


def test_engine_client_refuses_what_it_cannot_run(tmp_path_factory: Any) -> None:
    model = str(tiny_model(tmp_path_factory))
    args = EngineArgs(model=model, device="cpu", data_parallel_size=3, enable_attention_dp=True)
    with pytest.raises(ValueError, match="data_parallel_size=3"):
        make_engine_client(args)
    with pytest.raises(ValueError, match="tandem serve -dp N"):
        LLM(model, device="cpu", data_parallel_size=2)


def test_dispatch_prefers_the_prefix_owner_within_the_load_slack(tmp_path_factory: Any) -> None:
    llm = ReplicatedLLM(
        EngineArgs(model=str(tiny_model(tmp_path_factory)), device="cpu", data_parallel_size=2)
    )
    block = 16  # before start-up the client hashes 16-token blocks
    shared = list(range(20, 20 + 2 * block))

    def req(tail: int) -> Any:
        return SimpleNamespace(prompt_token_ids=[*shared, tail])

    def busy(replica: int, n: int) -> None:  # n requests in flight on ``replica``
        llm.replicas[replica]._tracked = {f"r{i}": None for i in range(n)}  # type: ignore[misc]

    first = llm.choose([req(1)])
    assert llm.choose([req(2)]) == first  # same prefix, equal load
    busy(first, AFFINITY_SLACK)
    assert llm.choose([req(3)]) == first  # busier, but within the slack
    busy(first, AFFINITY_SLACK + 1)
    assert llm.choose([req(4)]) == 1 - first  # too busy: the least loaded takes it ...
    busy(first, 0)
    assert llm.choose([req(5)]) == 1 - first  # ... and owns the prefix from then on
    # No prefix and equal loads: the one sent fewer requests (``first`` got three, it two).
    assert llm.choose([SimpleNamespace(prompt_token_ids=[1, 2, 3])]) == 1 - first
    assert len(prefix_hashes(shared + [0] * 5, block, 64)) == 2


def test_killing_one_replica_makes_the_server_unhealthy(servers: Any) -> None:
    """Last in this file: it ends the two-replica server."""
    server = servers.two
    engines = [p for p in child_pids(server.proc.pid) if comm(p).startswith("tandem-engine")]
    assert len(engines) == 2, engines
    # Both replicas' engines are forks of the server process (the second fork too).
    assert [cmdline(p) for p in engines] == [cmdline(server.proc.pid)] * 2
    assert httpx.get(server.url("/health"), timeout=5).status_code == 200
    os.kill(engines[1], signal.SIGKILL)

    def dead_replica_named() -> bool:
        r = httpx.get(server.url("/health"), timeout=5)
        return r.status_code == 503 and "replica " in r.json()["error"]["message"]

    wait_until(dead_replica_named, timeout_s=4.0)
