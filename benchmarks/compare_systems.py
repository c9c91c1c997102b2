"""`tandem bench compare`'s runners: one class per system (Tandem's offline engine, transformers'
`generate`, with or without an assistant model), each timing batch-1 decode and aggregate
throughput, and the interleaved run that gives every system the same machine."""

from __future__ import annotations

import gc
import json
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tandem.bench.compare_tables import Row
from tandem.bench.compare_workloads import BenchConfig, cycle_prompts
from tandem.bench.support import BenchError


class TandemSystem:
    """Tandem's offline engine, driven step by step (requests kept in flight by hand)."""

    def __init__(
        self,
        model: str,
        cfg: BenchConfig,
        spec: dict[str, Any] | None,
        name: str,
        warm_up: list[int],
        sampling: dict[str, Any] | None = None,
        cpu_weights: str = "dtype",
    ) -> None:
        """``sampling``: more greedy sampling parameters for every request (penalties);
        ``cpu_weights``: the engine's ``cpu_weights``. The row's RSS is what loading the engine
        added to this process."""
        from tandem.engine.config import EngineArgs
        from tandem.engine.llm_engine import LLMEngine
        from tandem.engine.sampling_params import SamplingParams

        self.row = Row(name)
        self.spec = spec
        before = rss_mib()
        self.engine = LLMEngine.from_engine_args(
            EngineArgs(
                model=model,
                dtype=cfg.dtype,
                device=cfg.device,
                max_num_seqs=max(cfg.concurrency),
                enable_prefix_caching=False,  # every run prefills like the first
                speculative_config=spec,
                cpu_weights=cpu_weights,
            )
        )
        self.row.rss_mib = rss_mib() - before
        from tandem.engine.structured_output import StructuredSpec

        structured = StructuredSpec("json_schema", cfg.json_schema) if cfg.json_schema else None
        self.params = SamplingParams(
            temperature=0.0,
            max_tokens=cfg.max_tokens,
            ignore_eos=not cfg.stop_at_eos,
            structured=structured,
            **(sampling or {}),
        )
        self.counter = iter(range(1 << 30))
        self.engine.add_request("warm-up", warm_up, SamplingParams(temperature=0.0, max_tokens=4))
        while self.engine.has_unfinished_requests():
            self.engine.step()
        self.before = self.engine.get_stats()

    def batch1(self, ids: list[int]) -> tuple[int, float, int]:
        """(tokens after the first, seconds after the first, engine steps after the first) of
        one request alone."""
        engine = self.engine
        engine.add_request(f"b1-{next(self.counter)}", ids, self.params)
        first = last = None
        n = steps = 0
        while engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                if first is not None:
                    steps += 1
                elif out.outputs[0].token_ids:
                    first = now
                n, last = len(out.outputs[0].token_ids), now
        if first is None or last is None:
            return 0, 0.0, 0
        return n - 1, last - first, steps

    def aggregate(self, prompts: list[list[int]], conc: int) -> tuple[int, float] | None:
        """(output tokens, seconds) with ``conc`` requests in flight until every prompt is
        done."""
        engine = self.engine
        queue = cycle_prompts(prompts, max(len(prompts), conc))
        in_flight: set[str] = set()
        tokens = 0
        start = time.perf_counter()
        while queue or in_flight:
            while queue and len(in_flight) < conc:
                rid = f"c{conc}-{next(self.counter)}"
                engine.add_request(rid, queue.pop(0), self.params)
                in_flight.add(rid)
            for out in engine.step():
                if out.finished:
                    in_flight.discard(out.request_id)
                    tokens += len(out.outputs[0].token_ids)
        return tokens, time.perf_counter() - start

    def close(self) -> None:
        try:
            if self.spec is not None:
                after = self.engine.get_stats()
                drafts = after.spec_num_drafts - self.before.spec_num_drafts
                accepted = after.spec_num_accepted_tokens - self.before.spec_num_accepted_tokens
                self.row.tokens_per_step = 1 + accepted / drafts if drafts else None
        finally:
            self.engine.shutdown()
            del self.engine
            gc.collect()


def rss_mib(pid: int | str = "self") -> float:
    """Resident memory of a process (this one by default), MiB (Linux; 0 elsewhere)."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


# The llama.cpp runner's side, run by another interpreter: one JSON line per request on stdin
# ({"ids", "max_tokens", "stop_at_eos"}), one line back ({"tokens", "seconds"}: after the first).
LLAMA_CPP_RUNNER = """
import json, sys, time
from llama_cpp import Llama
cfg = json.loads(sys.stdin.readline())
llm = Llama(model_path=cfg["gguf"], n_ctx=cfg["n_ctx"], n_threads=cfg["threads"],
            n_threads_batch=cfg["threads"], verbose=False)
eos = llm.token_eos()
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    req = json.loads(line)
    times = []
    for tok in llm.generate(req["ids"], top_k=1, temp=0.0, reset=True):
        times.append(time.perf_counter())
        if (req["stop_at_eos"] and tok == eos) or len(times) >= req["max_tokens"]:
            break
    out = {"tokens": len(times) - 1, "seconds": times[-1] - times[0] if times else 0.0}
    print(json.dumps(out), flush=True)
"""


class LlamaCppSystem:
    """llama.cpp on a GGUF file through llama-cpp-python, in the interpreter ``python`` (a
    scratch venv: never one of our dependencies), greedy, one sequence at a time: the batch-1
    column only. The row's RSS is that process's."""

    def __init__(self, python: str, gguf: str, cfg: BenchConfig, warm_up: list[int]) -> None:
        import subprocess

        import torch

        self.row = Row("llama.cpp", note=f"llama-cpp-python, {Path(gguf).name}, batch 1 only")
        self.cfg = cfg
        self.proc = subprocess.Popen(
            [python, "-c", LLAMA_CPP_RUNNER],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        setup = {"gguf": gguf, "n_ctx": 4096, "threads": torch.get_num_threads()}
        try:
            ready = self._ask(setup)
            if not ready.get("ready"):
                raise BenchError(f"llama.cpp runner did not start: {ready}")
            self._ask({"ids": warm_up, "max_tokens": 4, "stop_at_eos": False})
        except BaseException:  # no row to close it: stop the runner here
            self.proc.kill()
            self.proc.wait()
            raise
        self.row.rss_mib = rss_mib(self.proc.pid)

    def _ask(self, msg: dict[str, Any]) -> dict[str, Any]:
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self.proc.stdin.write(json.dumps(msg) + "\n")
        self.proc.stdin.flush()
        line = self.proc.stdout.readline()
        if not line:
            raise BenchError(f"llama.cpp runner exited ({self.proc.wait()})")
        return json.loads(line)

    def batch1(self, ids: list[int]) -> tuple[int, float, int | None]:
        cfg = self.cfg
        got = self._ask({"ids": ids, "max_tokens": cfg.max_tokens, "stop_at_eos": cfg.stop_at_eos})
        return int(got["tokens"]), float(got["seconds"]), None

    def aggregate(self, prompts: list[list[int]], conc: int) -> tuple[int, float] | None:
        return None  # one sequence at a time

    def close(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except Exception:
            self.proc.kill()


class StepTimes:
    """A ``generate`` streamer that timestamps every put (the prompt first, then new tokens)."""

    def __init__(self) -> None:
        self.events: list[tuple[float, int]] = []

    def put(self, value: Any) -> None:
        self.events.append((time.perf_counter(), int(value.numel())))

    def end(self) -> None:
        pass

    def decode(self) -> tuple[int, float]:
        """(tokens after the first, seconds after the first) of one generate call."""
        new = self.events[1:]  # events[0] is the prompt
        if len(new) < 2:
            return 0, 0.0
        return sum(n for _, n in new[1:]), new[-1][0] - new[0][0]


class TransformersSystem:
    """transformers ``generate``, greedy, ``max_tokens`` new tokens each (EOS ignored), or up to
    EOS with ``stop_at_eos``."""

    def __init__(
        self, model_path: str, cfg: BenchConfig, warm_up: list[int], assistant: str | None = None
    ) -> None:
        import torch
        import transformers as tf

        from tandem.engine.tokenizer import as_id_set

        dtype = getattr(torch, cfg.dtype)
        self.dev = torch.device(cfg.device)
        self.model = tf.AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype)
        self.model = self.model.to(self.dev).eval()
        self.helper = None
        if assistant is not None:
            helper = tf.AutoModelForCausalLM.from_pretrained(assistant, dtype=dtype)
            self.helper = helper.to(self.dev).eval()
        # Tandem's end tokens: the generation config's, the model config's and the tokenizer's.
        self.eos: set[int] = set()
        if cfg.stop_at_eos:
            tok = tf.AutoTokenizer.from_pretrained(model_path)
            for ids in (
                self.model.generation_config.eos_token_id,
                self.model.config.eos_token_id,
                tok.eos_token_id,
            ):
                self.eos |= as_id_set(ids)
            if not self.eos:
                raise BenchError("--stop-at-eos: the model names no EOS token")
        for m in (self.model, self.helper):  # None: run the full length, like ignore_eos
            if m is not None:
                m.generation_config.eos_token_id = sorted(self.eos) or None
        pad = self.model.generation_config.pad_token_id
        self.pad = 0 if pad is None else int(pad if isinstance(pad, int) else pad[0])
        self.kw: dict[str, Any] = dict(
            do_sample=False,
            max_new_tokens=cfg.max_tokens,
            min_new_tokens=None if cfg.stop_at_eos else cfg.max_tokens,
            pad_token_id=self.pad,
            temperature=None,
            top_p=None,
            top_k=None,
        )
        if self.helper is not None:
            self.kw["assistant_model"] = self.helper
        self.row = Row("transformers generate" + (" + assistant" if self.helper else ""))
        self.generate([warm_up])

    def generate(self, batch: list[list[int]], streamer: Any = None) -> int:
        import torch

        width = max(len(ids) for ids in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):  # left padding
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        with torch.inference_mode():
            out = self.model.generate(
                ids.to(self.dev), attention_mask=mask.to(self.dev), streamer=streamer, **self.kw
            )
        return sum(until_eos(row, self.eos) for row in out[:, width:].tolist())

    def batch1(self, ids: list[int]) -> tuple[int, float, int | None]:
        timer = StepTimes()
        self.generate([ids], timer)
        return (*timer.decode(), None)  # generate's steps are not counted

    def aggregate(self, prompts: list[list[int]], conc: int) -> tuple[int, float] | None:
        if self.helper is not None and conc > 1:
            self.row.note = "assisted generation runs one request at a time"
            return None
        queue = cycle_prompts(prompts, max(len(prompts), conc))
        tokens = 0
        start = time.perf_counter()
        for i in range(0, len(queue), conc):
            tokens += self.generate(queue[i : i + conc])
        return tokens, time.perf_counter() - start

    def close(self) -> None:
        del self.model, self.helper
        gc.collect()


def until_eos(tokens: list[int], eos: set[int]) -> int:
    """New tokens of one ``generate`` row: up to and including its first EOS (the padding after
    it is not output), all of them when ``eos`` is empty."""
    for i, t in enumerate(tokens):
        if t in eos:
            return i + 1
    return len(tokens)


def run_interleaved(
    systems: list[Any],
    prompts: list[list[int]],
    cfg: BenchConfig,
    probe: Callable[[], float] | None = None,
) -> list[float]:
    """Every system's batch-1 figure, prompt by prompt in turn, then each concurrency in turn:
    the systems share the machine's slow and fast phases, so their ratios hold up to drift.
    ``probe`` (memory bandwidth) runs before each batch-1 prompt round and after the last;
    returns its values. The concurrency columns run ``cfg.rounds`` times, in turn forward and
    backward, each figure the tokens over the seconds of every round."""
    probes: list[float] = []
    for ids in prompts[: cfg.batch1_prompts]:
        if probe is not None:
            probes.append(probe())
        for system in systems:
            n, sec, steps = system.batch1(ids)
            row = system.row
            row.batch1_tokens += n
            row.batch1_seconds += sec
            if steps is not None:
                row.batch1_steps = (row.batch1_steps or 0) + steps
    if probe is not None:
        probes.append(probe())
    for system in systems:
        row = system.row
        row.batch1 = row.batch1_tokens / row.batch1_seconds if row.batch1_seconds > 0 else None
    runs: dict[tuple[int, int], list[tuple[int, float] | None]] = {}
    for r in range(cfg.rounds):
        for conc in cfg.concurrency if r % 2 == 0 else cfg.concurrency[::-1]:
            for i, system in enumerate(systems):
                runs.setdefault((i, conc), []).append(system.aggregate(prompts, conc))
    for (i, conc), got in runs.items():
        done = [g for g in got if g is not None]
        seconds = sum(sec for _, sec in done)
        value = sum(n for n, _ in done) / seconds if done and seconds > 0 else None
        systems[i].row.by_concurrency[conc] = value
    return probes
