"""Tensor parallelism: TP=2/4 greedy outputs equal TP=1, sharded loading reads only each rank's
slice, and a rank that dies or hangs makes the executor raise and leaves no process behind."""

from __future__ import annotations

import json
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors.torch import load_file

from checkpoints import build_llama
from tandem import LLM, EngineArgs, LLMEngine, SamplingParams
from tandem.engine.distributed import LaunchEnv, collective_timeout
from tandem.engine.executor import MultiProcExecutor, RankFailedError, make_executor
from tandem.models.checkpoint import iterate_checkpoint, safetensors_files
from tandem.models.device import cpu_threads
from tandem.models.loader import check_complete, load_hf_config
from tandem.models.parallel import ParallelMapping
from tandem.models.registry import resolve_model_class

REPO = Path(__file__).resolve().parents[1]
PROMPTS = [[5, 6, 7], list(range(40, 51)), [100], list(range(60, 97))]
GREEDY = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=0)
# Vocabularies not divisible by the TP size; KV heads fewer than ranks (replicated) and not.
CASES: dict[str, dict[str, Any]] = {
    "mqa-tied": dict(arch="llama", vocab_size=321, heads=4, kv_heads=1, tie=True),
    "gqa-untied-bias": dict(arch="qwen2", vocab_size=322, heads=4, kv_heads=2, tie=False),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tp")
    # init_std 0.2: varied greedy continuations, not one repeated token.
    return {name: build_llama(root / name, init_std=0.2, **kw) for name, kw in CASES.items()}


def _generate(llm: LLM) -> list[tuple[list[int], list[float]]]:
    outs = llm.generate(PROMPTS, GREEDY)
    return [(o.outputs[0].token_ids, [lp.logprob for lp in o.outputs[0].logprobs]) for o in outs]


@pytest.fixture(scope="module")
def references(ckpts: dict[str, Path]) -> dict[str, list[tuple[list[int], list[float]]]]:
    refs = {}
    for name, folder in ckpts.items():
        with LLM(str(folder), dtype="float32") as llm:
            refs[name] = _generate(llm)
    return refs


def _assert_same(got: list[Any], expected: list[Any]) -> None:
    for (tokens, logprobs), (ref_tokens, ref_logprobs) in zip(got, expected, strict=True):
        assert tokens == ref_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True)) < 1e-4


def _alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie waiting for its reaper counts as gone)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _wait_gone(pids: list[int], within_s: float = 30.0) -> list[int]:
    deadline = time.monotonic() + within_s
    while (left := [p for p in pids if _alive(p)]) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _rank_pids(llm: LLM) -> list[int]:
    executor = llm.engine.executor
    assert isinstance(executor, MultiProcExecutor)
    return [p.pid for p in executor.procs]


def _no_rank_children() -> bool:
    return not [p for p in multiprocessing.active_children() if p.name.startswith("tandem-rank")]


# ------------------------------------------------------------------ outputs equal TP=1


def test_rank_threads_take_omp_num_threads_else_their_share_of_the_cores(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """CPU ranks set torch's threads from $OMP_NUM_THREADS where it is set (a rank took half
    the cores whatever it said, and spun against the other processes of a shared host)."""
    monkeypatch.setattr(os, "cpu_count", lambda: 8)
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    assert cpu_threads(2) == 3
    for unset in ("", "0", "many"):
        monkeypatch.setenv("OMP_NUM_THREADS", unset)
        assert (cpu_threads(2), cpu_threads(16), cpu_threads()) == (4, 1, 8)


@pytest.mark.timeout(120)
@pytest.mark.parametrize(("case", "tp"), [("mqa-tied", 2), ("mqa-tied", 4), ("gqa-untied-bias", 2)])
def test_greedy_equals_single_rank(
    ckpts: dict[str, Path], references: dict[str, Any], case: str, tp: int
) -> None:
    with LLM(str(ckpts[case]), dtype="float32", tensor_parallel_size=tp) as llm:
        pids = _rank_pids(llm)
        assert len(pids) == tp - 1
        _assert_same(_generate(llm), references[case])
    assert _wait_gone(pids) == []
    assert _no_rank_children()


@pytest.mark.timeout(180)
def test_tp4_equals_single_rank_then_a_killed_rank_fails_the_step(
    ckpts: dict[str, Path], references: dict[str, Any]
) -> None:
    case = "gqa-untied-bias"  # 2 KV heads over 4 ranks: replicated
    with LLM(str(ckpts[case]), dtype="float32", tensor_parallel_size=4) as llm:
        pids = _rank_pids(llm)
        _assert_same(_generate(llm), references[case])

        engine = llm.engine
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(f"kill-{i}", prompt, GREEDY)
        for _ in range(3):
            engine.step()
        os.kill(pids[1], signal.SIGKILL)
        with pytest.raises(RankFailedError, match="rank 2"):
            while engine.has_unfinished_requests():
                engine.step()
        with pytest.raises(RankFailedError):
            engine.executor.check_health()
    assert _wait_gone(pids) == []
    assert _no_rank_children()


@pytest.mark.timeout(120)
def test_hung_rank_fails_the_step_after_the_collective_timeout(ckpts: dict[str, Path]) -> None:
    """A 15 s step timeout: long enough that a loaded machine's slow steps never trip it (the
    suite runs this beside other files), and the wait after the SIGSTOP costs no CPU."""
    config = EngineArgs(
        model=str(ckpts["mqa-tied"]), dtype="float32", tensor_parallel_size=2
    ).create_engine_config()
    executor = MultiProcExecutor(config, timeout_s=15)
    engine = LLMEngine(config, executor=executor)
    pids = [p.pid for p in executor.procs]
    try:
        engine.add_request("a", PROMPTS[1], GREEDY)
        engine.step()
        os.kill(pids[0], signal.SIGSTOP)  # alive but never answers
        with pytest.raises(RankFailedError, match="a step failed"):
            while engine.has_unfinished_requests():
                engine.step()
    finally:
        engine.shutdown()
    assert _wait_gone(pids) == []
    assert _no_rank_children()


@pytest.mark.timeout(120)
def test_startup_failure_raises_and_reaps_ranks(ckpts: dict[str, Path]) -> None:
    with pytest.raises(ValueError, match="KV cache budget"):
        LLM(
            str(ckpts["mqa-tied"]),
            dtype="float32",
            tensor_parallel_size=2,
            kv_cache_memory_bytes=4096,
        )
    assert _no_rank_children()


_ORPHAN_SCRIPT = """
import json, multiprocessing, os, signal, sys, time
from tandem import LLM, SamplingParams
from tandem.engine.distributed import start_parent_watchdog

def idle():  # in no collective: only the watchdog can end it
    start_parent_watchdog()
    time.sleep(600)

watched = multiprocessing.get_context("fork").Process(target=idle, daemon=True)
watched.start()
llm = LLM(sys.argv[1], dtype="float32", tensor_parallel_size=2)
llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=2))
print(json.dumps([watched.pid] + [p.pid for p in llm.engine.executor.procs]), flush=True)
os.kill(os.getpid(), signal.SIGKILL)
"""


@pytest.mark.timeout(150)
def test_ranks_exit_when_the_engine_process_dies(ckpts: dict[str, Path]) -> None:
    proc = subprocess.run(
        [sys.executable, "-c", _ORPHAN_SCRIPT, str(ckpts["mqa-tied"])],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == -signal.SIGKILL, proc.stderr[-2000:]
    pids = json.loads(proc.stdout.strip().splitlines()[-1])
    assert len(pids) == 2  # the watchdog-only child and rank 1
    assert _wait_gone(pids) == []


_LAUNCHED_SCRIPT = """
import json, sys
from tandem import LLM, SamplingParams
prompts, model = json.loads(sys.argv[2]), sys.argv[1]
with LLM(model, dtype="float32", tensor_parallel_size=2) as llm:  # ranks != 0 stay inside
    outs = llm.generate(prompts, SamplingParams(temperature=0, max_tokens=32, ignore_eos=True))
    print("TOKENS " + json.dumps([o.outputs[0].token_ids for o in outs]), flush=True)
"""


@pytest.mark.timeout(150)
def test_torchrun_launch(
    ckpts: dict[str, Path], references: dict[str, Any], tmp_path: Path
) -> None:
    """Every rank started by the launcher (env:// rendezvous), as on several nodes."""
    script = tmp_path / "serve_tp2.py"
    script.write_text(_LAUNCHED_SCRIPT)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    proc = subprocess.run(
        [*cmd, str(script), str(ckpts["mqa-tied"]), json.dumps(PROMPTS)],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        capture_output=True,
        text=True,
        timeout=140,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = [ln for ln in proc.stdout.splitlines() if ln.startswith("TOKENS ")]
    assert len(lines) == 1  # only rank 0 returns from the constructor
    assert json.loads(lines[0][len("TOKENS ") :]) == [t for t, _ in references["mqa-tied"]]


# ------------------------------------------------------------------ sharded loading


class RecordingSlice:
    """A lazy safetensors slice that counts the elements a loader actually reads."""

    def __init__(self, inner: Any, name: str, reads: Counter[str]) -> None:
        self.inner, self.name, self.reads = inner, name, reads

    def get_shape(self) -> list[int]:
        return self.inner.get_shape()

    def __getitem__(self, key: Any) -> torch.Tensor:
        out = self.inner[key]
        self.reads[self.name] += out.numel()
        return out


def _load_rank(folder: Path, tp: int, rank: int) -> tuple[torch.nn.Module, Counter[str]]:
    config = load_hf_config(folder)
    model = resolve_model_class(config)(config, ParallelMapping(tp_size=tp, tp_rank=rank))
    reads: Counter[str] = Counter()
    stream = iterate_checkpoint(safetensors_files(folder))
    loaded = model.load_weights((n, RecordingSlice(s, n, reads)) for n, s in stream)
    check_complete(model, loaded, folder)
    return model, reads


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("case", sorted(CASES))
def test_sharded_loading_reads_only_the_rank_slice(
    ckpts: dict[str, Path], case: str, tp: int
) -> None:
    folder, kw = ckpts[case], CASES[case]
    full = load_file(str(safetensors_files(folder)[0]))
    hidden, inter, vocab = 64, 128, kw["vocab_size"]
    heads, kv_heads = kw["heads"], kw["kv_heads"]
    d = hidden // heads
    local_heads, local_kv = heads // tp, max(1, kv_heads // tp)
    local_vocab = math.ceil(vocab / tp)
    attn, mlp = "model.layers.0.self_attn.", "model.layers.0.mlp."
    embeds = []
    for rank in range(tp):
        model, reads = _load_rank(folder, tp, rank)
        p = dict(model.named_parameters())
        qkv = p[attn + "qkv_proj.weight"]
        assert qkv.shape == ((local_heads + 2 * local_kv) * d, hidden)
        assert p[attn + "o_proj.weight"].shape == (hidden, heads * d // tp)
        assert p[mlp + "gate_up_proj.weight"].shape == (2 * inter // tp, hidden)
        assert p[mlp + "down_proj.weight"].shape == (hidden, inter // tp)
        assert p["model.embed_tokens.weight"].shape == (local_vocab, hidden)
        assert (model.lm_head.weight is model.model.embed_tokens.weight) == kw["tie"]

        # Each rank reads its shard, never the whole tensor.
        assert reads[attn + "q_proj.weight"] == local_heads * d * hidden
        assert reads[attn + "k_proj.weight"] == local_kv * d * hidden
        assert reads[attn + "o_proj.weight"] == hidden * heads * d // tp
        assert reads[mlp + "gate_proj.weight"] == inter // tp * hidden
        assert reads[mlp + "down_proj.weight"] == hidden * inter // tp
        real_rows = max(0, min(local_vocab, vocab - rank * local_vocab))
        assert reads["model.embed_tokens.weight"] == real_rows * hidden
        assert reads["model.norm.weight"] == hidden  # replicated

        # ... and the shard is the right one.
        q, k, v = qkv.split([local_heads * d, local_kv * d, local_kv * d])
        kv_head = rank * local_kv if kv_heads >= tp else rank // (tp // kv_heads)
        kv_rows = slice(kv_head * d, (kv_head + local_kv) * d)
        assert torch.equal(q, full[attn + "q_proj.weight"][rank * local_heads * d :][: len(q)])
        assert torch.equal(k, full[attn + "k_proj.weight"][kv_rows])
        assert torch.equal(v, full[attn + "v_proj.weight"][kv_rows])
        if case == "gqa-untied-bias":
            assert torch.equal(
                p[attn + "qkv_proj.bias"][len(q) : len(q) + len(k)],
                full[attn + "k_proj.bias"][kv_rows],
            )
        cols = slice(rank * heads * d // tp, (rank + 1) * heads * d // tp)
        assert torch.equal(p[attn + "o_proj.weight"], full[attn + "o_proj.weight"][:, cols])
        up = p[mlp + "gate_up_proj.weight"][inter // tp :]
        assert torch.equal(up, full[mlp + "up_proj.weight"].chunk(tp)[rank])
        embeds.append(p["model.embed_tokens.weight"])
    stacked = torch.cat(embeds)
    assert torch.equal(stacked[:vocab], full["model.embed_tokens.weight"])
    assert not stacked[vocab:].any()  # padding rows of the last rank stay zero


# ------------------------------------------------------------------ configuration errors


def test_configuration_errors(ckpts: dict[str, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    # Attention DP itself is supported (tests/test_attention_dp.py); LM-head TP needs it.
    args = EngineArgs(
        model=str(ckpts["mqa-tied"]), tensor_parallel_size=2, enable_lm_head_tp_in_adp=True
    )
    with pytest.raises(ValueError, match="enable_attention_dp"):
        make_executor(args.create_engine_config())
    with pytest.raises(ValueError, match="seconds > 0"):
        collective_timeout(0)
    monkeypatch.setenv("TANDEM_DIST_TIMEOUT_S", "soon")
    with pytest.raises(ValueError, match="TANDEM_DIST_TIMEOUT_S"):
        collective_timeout()
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("MASTER_ADDR", raising=False)
    with pytest.raises(ValueError, match="MASTER_ADDR"):
        LaunchEnv.from_env()
