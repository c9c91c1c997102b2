"""``AsyncLLM`` on its own (no HTTP): a real engine process, streamed outputs, aborts, and a
clean shutdown."""

from __future__ import annotations

import asyncio

import pytest

from server_utils import MAX_MODEL_LEN, tiny_model, wait_until
from tandem.engine.async_llm import AsyncLLM
from tandem.engine.client import EngineNotReadyError
from tandem.engine.config import EngineArgs
from tandem.engine.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_model(tmp_path_factory)


# The aborted request may run this many tokens: thousands of steps (seconds on this machine), so the
# abort cannot lose the race to the request's end even when a loaded machine delays this process
# by a few hundred steps (CI once saw the 200-token request finish first).
LONG_TOKENS = 4000


def test_generate_abort_and_shutdown(model_dir, tmp_path):
    from checkpoints import build_llama
    from tandem import LLM

    model_dir = build_llama(tmp_path / "long", max_position_embeddings=LONG_TOKENS + 16)
    args = EngineArgs(model=str(model_dir), max_model_len=LONG_TOKENS + 16, max_num_seqs=8)
    greedy = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
    offline = LLM(str(model_dir), max_model_len=MAX_MODEL_LEN)
    want = offline.generate([[5, 6, 7]], greedy)[0].outputs[0]
    offline.shutdown()

    async def run() -> dict:
        llm = AsyncLLM(args, ready_timeout_s=120, heartbeat_interval_s=0.1)
        with pytest.raises(EngineNotReadyError):
            llm.add_requests([("early", [1, 2], greedy)])
        try:
            info = await asyncio.wait_for(llm.start(), timeout=120)
            seen = [out async for out in llm.generate("g", [5, 6, 7], greedy)]
            # A long request whose consumer stops after two outputs: it is aborted.
            long = SamplingParams(temperature=0, max_tokens=LONG_TOKENS, ignore_eos=True)
            stream = llm.generate("long", [5, 6, 7], long)
            got = [await stream.__anext__(), await stream.__anext__()]
            await stream.aclose()
            in_flight = llm.num_in_flight

            async def idle() -> bool:
                for _ in range(300):
                    s = llm.stats
                    if s is not None and s.num_running == 0 and s.kv_cache_usage == 0:
                        return True
                    await asyncio.sleep(0.05)
                return False

            return {
                "info": info,
                "seen": seen,
                "got": got,
                "in_flight": in_flight,
                "idle": await idle(),
                "healthy": llm.is_healthy,
                "generated": llm.stats.generation_tokens,
                "llm": llm,
            }
        finally:
            await asyncio.to_thread(llm.shutdown)

    r = asyncio.run(run())
    assert r["info"].max_model_len == LONG_TOKENS + 16 and r["info"].num_blocks > 0
    lengths = [len(o.outputs[0].token_ids) for o in r["seen"]]
    # Cumulative outputs; a slow consumer may skip some (the next one contains them).
    assert lengths == sorted(set(lengths)) and lengths[-1] == 6
    assert r["seen"][-1].finished and r["seen"][-1].outputs[0].token_ids == want.token_ids
    assert r["seen"][-1].outputs[0].text == want.text
    assert not r["got"][-1].finished and r["in_flight"] == 0
    assert r["idle"] and r["healthy"]
    assert r["generated"] < 6 + LONG_TOKENS  # the long one did not run to the end
    llm = r["llm"]
    wait_until(lambda: not llm._proc.is_alive(), timeout_s=15)
    assert llm._proc.exitcode == 0 and not llm.is_healthy


def test_both_engine_clients_satisfy_the_servers_contract(model_dir):
    """The server is written against ``EngineClient``: ``AsyncLLM`` and ``ReplicatedLLM`` (-dp)
    both have every member, with the protocol's parameters (nothing is launched here)."""
    import inspect

    from tandem.engine.client import EngineClient
    from tandem.engine.dp_client import ReplicatedLLM, make_engine_client

    one = make_engine_client(EngineArgs(model=str(model_dir), max_model_len=MAX_MODEL_LEN))
    two = make_engine_client(
        EngineArgs(model=str(model_dir), max_model_len=MAX_MODEL_LEN, data_parallel_size=2)
    )
    assert (type(one), type(two)) == (AsyncLLM, ReplicatedLLM)
    members = [n for n in dir(EngineClient) if not n.startswith("_")]
    assert {"add_requests", "abort", "shutdown", "start", "is_healthy", "dead_reason"} <= set(
        members
    )
    for client in (one, two):
        assert isinstance(client, EngineClient)
        for name in members:
            want = inspect.getattr_static(EngineClient, name)
            if callable(want):
                got = inspect.signature(getattr(client, name)).parameters
                assert list(got) == list(inspect.signature(want).parameters)[1:], (client, name)
