"""The engine process loop (engine/engine_core.py) with a fake engine and in-process queues:
failures are reported, not swallowed; persistent failure exits non-zero; idle means heartbeats."""

from __future__ import annotations

import pickle
import queue
import threading
import time

from tandem.engine.engine_core import (
    AbortRequests,
    AddRequests,
    EngineDead,
    RequestsFailed,
    Shutdown,
    StepOutputs,
    generation_defaults,
    run_engine_loop,
    stats_since,
)
from tandem.engine.outputs import (
    CompletionOutput,
    EngineStats,
    OutputAssembly,
    OutputEncoder,
    RequestOutput,
)
from tandem.engine.request import Request, TokenLogprobs
from tandem.engine.sampling_params import SamplingParams


def stats(**kw) -> EngineStats:
    base = dict(
        num_running=0, num_waiting=0, num_kv_blocks=10, num_used_kv_blocks=0, kv_cache_usage=0.0,
        num_preemptions=0, prompt_tokens=0, generation_tokens=0, prefix_cache_queries=0,
        prefix_cache_hits=0,
    )  # fmt: skip
    base.update(kw)
    return EngineStats(**base)


class FakeEngine:
    """Each request runs ``length`` steps; ``fail_steps`` lists step numbers that raise."""

    def __init__(self, length: int = 2, fail_steps: set[int] | None = None) -> None:
        self.length = length
        self.fail_steps = fail_steps or set()
        self.running: dict[str, int] = {}
        self.steps = 0
        self.aborted: list[str] = []

    def add_request(self, request_id: str, request: Request) -> Request:
        if request_id in self.running:
            raise ValueError(f"duplicate {request_id}")
        self.running[request_id] = 0
        return request

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            if self.running.pop(rid, None) is not None:
                self.aborted.append(rid)

    def has_unfinished_requests(self) -> bool:
        return bool(self.running)

    def step(self) -> list[RequestOutput]:
        self.steps += 1
        if self.steps in self.fail_steps:
            raise RuntimeError(f"step {self.steps} exploded")
        outs = []
        for rid in list(self.running):
            self.running[rid] += 1
            done = self.running[rid] >= self.length
            tokens = list(range(self.running[rid]))
            c = CompletionOutput(0, tokens, "t" * len(tokens), "length" if done else None)
            outs.append(RequestOutput(rid, None, [1], [c], done))
            if done:
                del self.running[rid]
        return outs

    def get_stats(self) -> EngineStats:
        return stats(num_running=len(self.running), generation_tokens=self.steps)


def request(rid: str) -> Request:
    return Request(rid, [1, 2], SamplingParams(max_tokens=2), frozenset(), max_tokens=2)


def run_loop(engine: FakeEngine, inputs: list, until, **kw) -> tuple[int, list]:
    """Run the loop in a thread until ``until(messages)`` holds, then send Shutdown."""
    in_q: queue.Queue = queue.Queue()
    out_q: queue.Queue = queue.Queue()
    for msg in inputs:
        in_q.put(msg)
    result: list[int] = []

    def target() -> None:
        result.append(run_engine_loop(engine, in_q, out_q, heartbeat_interval_s=0.05, **kw))

    t = threading.Thread(target=target)
    t.start()
    msgs: list = []
    deadline = time.monotonic() + 10
    while not until(msgs) and time.monotonic() < deadline and t.is_alive():
        try:
            msgs.append(out_q.get(timeout=0.1))
        except queue.Empty:
            pass
    in_q.put(Shutdown())
    t.join(timeout=10)
    assert not t.is_alive()
    while not out_q.empty():
        msgs.append(out_q.get())
    return result[0], msgs


def finished_ids(msgs: list) -> list[str]:
    return [
        o.request_id for m in msgs if isinstance(m, StepOutputs) for o in m.outputs if o.finished
    ]


def test_runs_requests_and_shuts_down_cleanly():
    engine = FakeEngine(length=2)
    code, msgs = run_loop(
        engine, [AddRequests([request("a"), request("b")])], lambda m: len(finished_ids(m)) == 2
    )
    assert code == 0
    assert sorted(finished_ids(msgs)) == ["a", "b"]
    # Outputs are batched per step: both requests advance in the same message.
    assert any(len(m.outputs) == 2 for m in msgs if isinstance(m, StepOutputs))


def test_idle_loop_sends_heartbeats():
    engine = FakeEngine()

    def beats(msgs: list) -> list:
        return [m for m in msgs if isinstance(m, StepOutputs) and not m.outputs]

    code, msgs = run_loop(engine, [], lambda m: len(beats(m)) >= 3)
    heartbeats = beats(msgs)
    assert code == 0 and len(heartbeats) >= 3
    assert heartbeats[-1].timestamp >= heartbeats[0].timestamp


def test_failed_step_fails_its_requests_and_the_loop_goes_on():
    engine = FakeEngine(length=2, fail_steps={1})
    in_q: queue.Queue = queue.Queue()
    out_q: queue.Queue = queue.Queue()
    done: list[int] = []
    t = threading.Thread(
        target=lambda: done.append(run_engine_loop(engine, in_q, out_q, heartbeat_interval_s=0.05))
    )
    in_q.put(AddRequests([request("a")]))
    t.start()
    msgs = [out_q.get(timeout=10)]
    while not isinstance(msgs[-1], RequestsFailed):
        msgs.append(out_q.get(timeout=10))
    assert msgs[-1].request_ids == ["a"] and "exploded" in msgs[-1].message
    assert engine.aborted == ["a"]
    # The loop still serves: the next request runs to the end.
    in_q.put(AddRequests([request("b")]))
    while "b" not in finished_ids(msgs):
        msgs.append(out_q.get(timeout=10))
    in_q.put(Shutdown())
    t.join(timeout=10)
    assert done == [0]
    assert not any(isinstance(m, EngineDead) for m in msgs)


def test_three_failures_in_a_row_exit_nonzero():
    engine = FakeEngine(length=5, fail_steps={1, 2, 3})
    in_q: queue.Queue = queue.Queue()
    out_q: queue.Queue = queue.Queue()
    done: list[int] = []

    def feed_and_run() -> None:
        done.append(run_engine_loop(engine, in_q, out_q, heartbeat_interval_s=0.05))

    t = threading.Thread(target=feed_and_run)
    in_q.put(AddRequests([request("a")]))
    t.start()
    for rid in ("b", "c"):
        # Wait for the previous failure before sending the next request.
        while True:
            msg = out_q.get(timeout=10)
            if isinstance(msg, RequestsFailed):
                break
        in_q.put(AddRequests([request(rid)]))
    t.join(timeout=10)
    assert not t.is_alive() and done == [1]
    rest = []
    while not out_q.empty():
        rest.append(out_q.get())
    assert isinstance(rest[-1], EngineDead) and "3 engine steps failed" in rest[-1].message


def test_abort_and_duplicate_ids():
    engine = FakeEngine(length=1000)
    inputs = [AddRequests([request("a"), request("a")]), AbortRequests(["a"])]
    code, msgs = run_loop(engine, inputs, lambda m: bool(engine.aborted))
    dup = [m for m in msgs if isinstance(m, RequestsFailed)]
    assert len(dup) == 1 and "duplicate" in dup[0].message
    assert engine.aborted == ["a"] and code == 0


def test_generation_defaults_and_stats_baseline():
    cfg = {"temperature": 0.6, "top_p": 0.95, "do_sample": True, "eos_token_id": 2}
    assert generation_defaults(cfg) == {"temperature": 0.6, "top_p": 0.95}
    now = stats(prompt_tokens=30, generation_tokens=12, num_running=3)
    base = stats(prompt_tokens=8, generation_tokens=4)
    delta = stats_since(base, now)
    assert (delta.prompt_tokens, delta.generation_tokens, delta.num_running) == (22, 8, 3)


def test_step_messages_stay_small_however_long_the_generation():
    """The queue carries what each step added, not the whole output so far: the last step of a
    1500-token generation sends as many bytes as the tenth (cumulative outputs would resend
    every token each step; the engine fell behind and took > 10 s to stop)."""
    engine = FakeEngine(length=1500)
    code, msgs = run_loop(engine, [AddRequests([request("a")])], lambda m: finished_ids(m) == ["a"])
    steps = [m for m in msgs if isinstance(m, StepOutputs) and m.outputs]
    assert code == 0 and len(steps) == 1500
    sizes = [len(pickle.dumps(m.outputs)) for m in steps]
    assert sizes[-1] <= sizes[10] + 64, (sizes[10], sizes[-1])  # a finish reason, a bigger int
    # The API process's assembly gives back the cumulative output.
    assembly = OutputAssembly()
    outs = [assembly.apply(d) for m in steps for d in m.outputs]
    assert outs[-1].finished and outs[-1].outputs[0].token_ids == list(range(1500))
    assert outs[-1].outputs[0].text == "t" * 1500 and outs[-1].prompt_token_ids == [1]
    assert outs[9].outputs[0].token_ids == list(range(10))  # earlier outputs are snapshots


def lp(token: int) -> TokenLogprobs:
    return TokenLogprobs(token, -0.5, [token], [-0.5])


def test_output_deltas_round_trip_including_rewrites():
    """Encoder (engine) and assembly (API) agree on every cumulative output: growth, a text that
    shrinks or changes (a held-back stop string), the prompt sent once, logprobs or none."""
    steps = [
        ([5], "He", [lp(5)]),
        ([5, 6], "Hello", [lp(5), lp(6)]),
        ([5, 6, 7], "Hello", [lp(5), lp(6), lp(7)]),  # no new text (held back)
        ([5, 6, 7, 8], "Help", [lp(5), lp(6), lp(7), lp(8)]),  # text rewritten
        ([9], "x", [lp(9)]),  # everything restarted
    ]
    for with_logprobs in (True, False):
        encoder, assembly = OutputEncoder(), OutputAssembly()
        deltas = []
        for i, (tokens, text, logprobs) in enumerate(steps):
            done = i == len(steps) - 1
            c = CompletionOutput(0, tokens, text, "stop" if done else None,
                                 logprobs=logprobs if with_logprobs else None)  # fmt: skip
            out = RequestOutput("r", "prompt", [1, 2, 3], [c], done, metrics={"i": i})
            deltas.append(encoder.encode(out))
            assert assembly.apply(deltas[-1]) == out
        assert deltas[0].prompt_token_ids == [1, 2, 3]
        assert all(d.prompt_token_ids is None and d.prompt is None for d in deltas[1:])
        assert deltas[2].new_token_ids == [7] and deltas[2].new_text == ""
        assert (deltas[3].text_start, deltas[3].new_text) == (0, "Help")  # resent whole
        assert (deltas[4].token_start, deltas[4].text_start) == (0, 0)
        assert not encoder._sent  # finished: nothing kept


def test_aborted_requests_are_forgotten_by_the_encoder():
    encoder = OutputEncoder()
    c = CompletionOutput(0, [1], "t")
    encoder.encode(RequestOutput("a", None, [1], [c], False))
    encoder.forget(["a"])
    assert encoder.encode(RequestOutput("a", None, [1], [c], False)).prompt_token_ids == [1]
