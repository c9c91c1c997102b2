"""`tandem bench serve`, `tandem bench compare` and tandem.bench.gpu on tiny models."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from checkpoints import build_eagle3_draft
from server_utils import RemoteServer, tiny_model, tiny_mtp_model
from tandem.bench.compare_tables import (
    Row,
    format_step_costs,
    kv_bytes_per_step,
    measure_memory_bandwidth,
    roofline_tokens_per_s,
    weight_bytes_per_step,
)
from tandem.bench.serve_report import format_block, parse_metrics, speculative_stats, summarize
from tandem.bench.serve_requests import arrival_delays
from tandem.cli import main

BLOCK_LABELS = (
    "Successful requests:",
    "Failed requests:",
    "Maximum request concurrency:",
    "Benchmark duration (s):",
    "Total input tokens:",
    "Total generated tokens:",
    "Request throughput (req/s):",
    "Output token throughput (tok/s):",
    *(f"{s} {m} (ms):" for m in ("TTFT", "TPOT", "ITL") for s in ("Mean", "Median", "P99")),
    "Speculative Decoding",
)
SPEC_LABELS = (
    "Tokens per step:",
    "Draft acceptance rate (%):",
    "Per-position acceptance (%):",
)
K = 3


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """One server for every HTTP test (a start costs seconds): the tiny model with MTP."""
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": K})
    args = ["--speculative-config", spec, "--max-num-seqs", "8"]
    with RemoteServer(tiny_mtp_model(tmp_path_factory), args) as s:
        yield s


def _bench(capsys, *args: str) -> tuple[int, str, str]:
    rc = main(["bench", "serve", *args])
    out = capsys.readouterr()
    return rc, out.out, out.err


def _check_run(run: dict, num: int, in_len: int | None, out_len: int) -> None:
    assert run["completed"] == num and run["failed"] == 0
    assert run["total_output_tokens"] == sum(run["output_lens"]) == num * out_len
    if in_len is not None:
        assert run["total_input_tokens"] == sum(run["input_lens"]) == num * in_len
    assert all(0 < t <= lat for t, lat in zip(run["ttfts"], run["latencies"], strict=True))
    assert run["duration"] >= max(run["latencies"])
    assert run["output_throughput"] == pytest.approx(run["total_output_tokens"] / run["duration"])
    assert run["request_throughput"] == pytest.approx(num / run["duration"])
    # TPOT = (latency - TTFT) / (output tokens - 1), per request, then averaged.
    tpots = [
        (lat - t) / (n - 1)
        for t, lat, n in zip(run["ttfts"], run["latencies"], run["output_lens"], strict=True)
    ]
    assert run["mean_tpot_ms"] == pytest.approx(1000 * sum(tpots) / len(tpots))
    assert run["median_ttft_ms"] <= run["p99_ttft_ms"]


def test_serve_random_prints_block_writes_json_and_plot(server, tmp_path, capsys):
    result, png = tmp_path / "r.json", tmp_path / "r.png"
    rc, out, err = _bench(
        capsys, "--base-url", server.base_url, "--dataset", "random",
        "--random-input-len", "12", "--random-output-len", "5", "--num-prompts", "6",
        "--max-concurrency", "1,3", "--ignore-eos", "--result-file", str(result),
        "--plot", str(png),
    )  # fmt: skip
    assert rc == 0, err
    assert "random prompts: 12 token ids" in out  # the served model's tokenizer was found
    for label in (*BLOCK_LABELS, *SPEC_LABELS):
        assert out.count(label) == 2, label  # one block per concurrency
    data = json.loads(result.read_text())
    assert [r["max_concurrency"] for r in data["runs"]] == [1, 3]
    for run in data["runs"]:
        _check_run(run, 6, 12, 5)
        assert run["speculative"]["num_drafts"] > 0  # each run's own /metrics difference
    # Concurrency 1: requests run one after another.
    lat = data["runs"][0]["latencies"]
    assert data["runs"][0]["duration"] >= sum(lat) * 0.99
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_serve_eval_chat_with_poisson_arrivals(server, tmp_path, capsys):
    result = tmp_path / "r.json"
    rc, out, err = _bench(
        capsys, "--base-url", server.base_url, "--dataset", "eval", "--num-prompts", "4",
        "--max-tokens", "4", "--ignore-eos", "--request-rate", "40", "--seed", "3",
        "--result-file", str(result),
    )  # fmt: skip
    assert rc == 0, err
    data = json.loads(result.read_text())
    assert data["endpoint"] == "chat" and data["request_rate"] == 40
    (run,) = data["runs"]
    _check_run(run, 4, None, 4)
    assert "Request rate (req/s):                   40.00" in out


def test_poisson_arrivals_have_the_requested_rate():
    gaps = arrival_delays(4000, 20.0, seed=1)
    assert sum(gaps) / len(gaps) == pytest.approx(1 / 20, rel=0.06)
    # Exponential gaps: the standard deviation equals the mean.
    mean = sum(gaps) / len(gaps)
    std = (sum((g - mean) ** 2 for g in gaps) / len(gaps)) ** 0.5
    assert std == pytest.approx(mean, rel=0.1)
    assert arrival_delays(3, float("inf"), seed=1) == [0.0, 0.0, 0.0]


def test_serve_speculative_section(server, tmp_path, capsys):
    result = tmp_path / "r.json"
    rc, out, err = _bench(
        capsys, "--base-url", server.base_url, "--random-input-len", "8",
        "--random-output-len", "16", "--num-prompts", "4", "--max-concurrency", "2",
        "--ignore-eos", "--result-file", str(result),
    )  # fmt: skip
    assert rc == 0, err
    for label in (*BLOCK_LABELS, *SPEC_LABELS):
        assert label in out, label
    (run,) = json.loads(result.read_text())["runs"]
    _check_run(run, 4, 8, 16)
    spec = run["speculative"]
    assert spec is not None and spec["num_drafts"] > 0
    assert spec["num_drafts"] <= spec["num_draft_tokens"] <= K * spec["num_drafts"]
    assert 1.0 <= spec["tokens_per_step"] <= K + 1
    assert spec["tokens_per_step"] == pytest.approx(
        1 + spec["num_accepted_tokens"] / spec["num_drafts"]
    )
    assert 0.0 <= spec["draft_acceptance_rate"] <= 1.0
    per_pos = spec["per_position_acceptance"]
    assert len(per_pos) == K and all(0.0 <= a <= 1.0 for a in per_pos)
    # Greedy acceptance stops at the first miss: a later position never beats an earlier one.
    assert per_pos == sorted(per_pos, reverse=True)
    # Sum over positions of accepted / drafts = accepted per step.
    assert sum(per_pos) == pytest.approx(spec["tokens_per_step"] - 1)


def test_speculative_section_without_drafts():
    scrape = (
        "# TYPE tandem:spec_decode_num_drafts counter\n"
        'tandem:spec_decode_num_drafts_total{model_name="m"} 7.0\n'
    )
    before = after = parse_metrics(scrape)
    assert speculative_stats(before, after) is None  # drafts did not move during the run
    summary = summarize([], 1.0, None, float("inf"), None)
    assert "no drafts in /metrics during the run" in format_block(summary)


def test_serve_bad_dataset_path_is_a_clear_error(tmp_path, capsys):
    missing = tmp_path / "nope.jsonl"
    rc, _, err = _bench(
        capsys, "--base-url", "http://127.0.0.1:9", "--dataset", "jsonl",
        "--dataset-path", str(missing),
    )  # fmt: skip
    assert rc == 2
    assert f"dataset file {str(missing)!r} does not exist" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "fine"}\n{"text": "no prompt"}\n')
    rc, _, err = _bench(
        capsys, "--base-url", "http://127.0.0.1:9", "--dataset", "jsonl",
        "--dataset-path", str(bad),
    )  # fmt: skip
    assert rc == 2 and "line 2" in err
    rc, _, err = _bench(capsys, "--dataset", "random")
    assert rc == 2 and "--base-url" in err


def test_compare_quick_prints_every_row_and_column(tmp_path_factory, tmp_path, capsys):
    target = tiny_mtp_model(tmp_path_factory)
    eagle3 = build_eagle3_draft(tmp_path / "eagle3", target)
    result = tmp_path / "c.json"
    rc = main(
        [
            "bench", "compare", "--quick", "--model", str(target), "--eagle3", str(eagle3),
            "--assistant-model", str(tiny_model(tmp_path_factory)),
            "--draft-model", str(tiny_model(tmp_path_factory)), "--result-file", str(result),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0
    rows = (
        "transformers generate",
        "transformers generate + assistant",
        "tandem",
        f"tandem + eagle3 (K={K})",
        f"tandem + eagle3 (K={K}, presence_penalty 0.5)",  # what a penalty costs
        f"tandem + mtp (K={K})",
        f"tandem + ngram (K={K})",  # drafts from the prompt's own text: no head
        f"tandem + suffix (K={K})",  # draft trees from the text and earlier outputs
        f"tandem + draft_model (K={K})",  # the assistant model as a draft model
    )
    header = next(line for line in out.splitlines() if line.startswith("tokens/s"))
    assert header.split()[1:] == ["batch", "1", "c=1", "c=2", "tok/step", "RSS", "MiB"]
    for name in rows:
        # One line in the tokens/s table, one in each ratio table.
        assert sum(line.startswith(name + " ") for line in out.splitlines()) >= 3, name
    assert "vs transformers" in out and "vs tandem" in out
    assert "memory bandwidth:" in out and "roofline" in out
    data = json.loads(result.read_text())
    by_name = {r["name"]: r for r in data["rows"]}
    assert set(by_name) == set(rows)
    for name in ("transformers generate", "tandem", f"tandem + mtp (K={K})"):
        r = by_name[name]
        assert r["batch1"] > 0 and all(v > 0 for v in r["concurrency"].values()), name
    # Assisted generation is batch 1 only: c=2 is n/a with the reason.
    assistant = by_name["transformers generate + assistant"]
    assert assistant["batch1"] > 0 and assistant["concurrency"]["2"] is None
    assert "one request at a time" in assistant["note"]
    for name in rows[3:]:
        assert 1.0 <= by_name[name]["tokens_per_step"] <= K + 1
        assert 1.0 <= by_name[name]["batch1_tokens_per_step"] <= K + 1
    assert by_name["tandem"]["batch1_tokens_per_step"] == 1.0  # one token per plain step
    # What loading an engine added to the process (a tiny model may add nothing measurable).
    assert isinstance(by_name["tandem"]["rss_mib"], float)
    assert by_name["transformers generate"]["rss_mib"] is None
    assert by_name["transformers generate"]["batch1_ms_per_step"] is None  # steps not counted
    # The per-step table: the seven Tandem rows, and what 1.6x would need of each speculative one.
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if line.startswith("batch 1, per decode step"))
    assert lines[at].split()[-4:] == ["ms/step", "tok/step", "cost", "speedup"]
    assert [line.split()[0] for line in lines[at + 1 : at + 8]] == ["tandem"] * 7
    assert lines[at + 1].split()[-2:] == ["1.00x", "1.00x"]  # plain: its own cost and speedup
    assert sum("tokens/step at this step cost" in line for line in lines) == 6
    assert data["roofline_tokens_per_s"] > 0 and data["roofline_fraction"] > 0
    # The roofline's bandwidth: probed before and after the one batch-1 prompt (quick).
    probes = data["memory_bandwidth_batch1_probes"]
    assert len(probes) == 2 and min(probes) > 0
    assert min(probes) <= data["roofline_bandwidth"] <= max(probes)
    assert "during the batch-1 column (median of 2 probes" in out


def test_step_costs_take_the_batch1_ratio_apart():
    plain = Row("tandem", batch1_steps=63, batch1_tokens=63, batch1_seconds=2.0)
    spec = Row("tandem + eagle3 (K=3)", batch1_steps=35, batch1_tokens=63, batch1_seconds=1.5)
    other = Row("transformers generate", batch1_tokens=63, batch1_seconds=6.0)
    out = format_step_costs([other, plain, spec], plain, goal=1.6)
    cells = {line.split("  ")[0]: line.split()[-4:] for line in out.splitlines()[1:3]}
    assert "transformers generate" not in out  # no counted steps, no row
    assert cells["tandem"] == ["31.7", "1.00", "1.00x", "1.00x"]
    # 42.9 ms for 1.8 tokens: 1.35 plain steps, 1.8 / 1.35 = 1.33x = (63 / 1.5) / (63 / 2.0)
    assert cells["tandem + eagle3 (K=3)"] == ["42.9", "1.80", "1.35x", "1.33x"]
    need = next(line for line in out.splitlines() if "tokens/step at this step cost" in line)
    words = need.split()
    # 1.6 x 1.35 = 2.16 tokens/step; 1.8 / 1.6 = 1.125 plain steps
    assert float(words[words.index("tokens/step") - 1]) == pytest.approx(2.16, abs=0.006)
    assert float(words[words.index("most") + 1]) == pytest.approx(1.125, abs=0.006)
    assert format_step_costs([other], other).endswith("n/a (no steps counted)")


# A stand-in for llama-cpp-python (the real one lives in a scratch venv, never in ours): the
# runner's protocol end to end, each "generated" token the next integer.
FAKE_LLAMA_CPP = """
class Llama:
    def __init__(self, model_path, **kw):
        open(model_path).close()
    def token_eos(self):
        return 7
    def generate(self, ids, **kw):
        t = 0
        while True:
            t += 1
            yield 100 + t
"""


def test_compare_names_why_a_row_is_missing_and_adds_weights_and_llama_cpp_rows(
    tmp_path_factory, tmp_path, capsys
):
    """Rows without a head say why; ``--cpu-weights dtype,q8`` repeats each Tandem row per
    value; ``--llama-cpp PYTHON`` adds a batch-1 row from another interpreter (its own RSS,
    n/a under concurrency)."""
    fake = tmp_path / "fake"
    fake.mkdir()
    (fake / "llama_cpp.py").write_text(FAKE_LLAMA_CPP)
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={fake} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    gguf = tmp_path / "model.gguf"
    gguf.write_bytes(b"GGUF")
    result = tmp_path / "c.json"
    argv = [
        "bench", "compare", "--quick", "--model", str(tiny_model(tmp_path_factory)),
        "--skip-transformers", "--concurrency", "1", "--cpu-weights", "dtype,q8",
        "--llama-cpp", str(python), "--gguf", str(gguf), "--result-file", str(result),
    ]  # fmt: skip
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "no head given; pass --eagle3 PATH" in out
    assert "no head given; pass --mtp PATH" in out
    assert "vs transformers: n/a" in out
    rows = {r["name"]: r for r in json.loads(result.read_text())["rows"]}
    for name in ("tandem", "tandem [q8]"):
        assert rows[name]["batch1"] > 0 and rows[name]["concurrency"]["1"] > 0, name
    llama = rows["llama.cpp"]
    assert llama["batch1"] > 0 and llama["concurrency"]["1"] is None and llama["rss_mib"] > 0
    assert "batch 1 only" in llama["note"]
    assert main([*argv[:-2], "--cpu-weights", "int4"]) == 2
    assert main(["bench", "compare", "--quick", "--llama-cpp", str(python), "--gguf", "nope"]) == 2
    # An interpreter without llama_cpp: the runner exits, a clear error (and no runner left).
    no_llama = [*argv[:-6], "--llama-cpp", sys.executable, "--gguf", str(gguf)]
    assert main([*no_llama, "--cpu-weights", "dtype"]) == 2
    err = capsys.readouterr().err
    assert "--cpu-weights 'int4'" in err and "llama.cpp runner exited" in err


SCHEDULE = '{"1": 3, "2": 1}'


def test_compare_with_speculation_off_under_load(tmp_path_factory, tmp_path, capsys):
    result = tmp_path / "c.json"
    rc = main(
        [
            "bench", "compare", "--quick", "--model", str(tiny_mtp_model(tmp_path_factory)),
            "--skip-transformers", "--eagle3", "none", "--disable-by-batch-size", "2",
            "--trees", "2:4", "--schedule", SCHEDULE, "--workload", "grounded", "--ngram",
            "1:2", "--cost-aware", "--confidence", "0.001", "--result-file", str(result),
        ]
    )  # fmt: skip
    assert rc == 0
    out = capsys.readouterr().out.splitlines()
    rows = {r["name"]: r for r in json.loads(result.read_text())["rows"]}
    # --schedule: an adaptive row per chain method (n-gram drafts from the grounded prompts),
    # with --cost-aware one more per method with a draft forward, with --confidence one more
    # per head method.
    assert any("prompts from grounded_prompts.jsonl" in line for line in out)
    names = ("mtp (adaptive", "ngram (adaptive", "mtp (adaptive, cost-aware")
    for name in (*names, "mtp (adaptive, confidence 0.001"):
        row = rows[f"tandem + {name}, schedule {SCHEDULE})"]
        assert row["batch1"] > 0 and row["concurrency"]["2"] > 0
        assert 1.0 <= row["tokens_per_step"] <= K + 1
    assert f"tandem + ngram (adaptive, cost-aware, schedule {SCHEDULE})" not in rows
    assert not any("ngram (adaptive, confidence" in name for name in rows)
    # The chain, and a draft tree of depth K (--trees).
    for name in (
        f"tandem + mtp (K={K}, off at 2+)",
        f"tandem + mtp (K={K}, topk 2 N 4, off at 2+)",
    ):
        # Its line in the tokens/s table, the vs-tandem table (no transformers baseline) and
        # the per-step table.
        assert sum(line.startswith(name + " ") for line in out) == 3
        row = rows[name]
        assert row["batch1"] > 0 and row["concurrency"]["2"] > 0
        assert 1.0 <= row["tokens_per_step"] <= K + 1
    bad = ["bench", "compare", "--quick", "--trees", "2:2", "--result-file", str(result)]
    assert main(bad) == 2
    assert main(["bench", "compare", "--quick", "--ngram", "3"]) == 2
    assert main(["bench", "compare", "--quick", "--schedule", "{"]) == 2
    assert "--trees '2:2'" in capsys.readouterr().err
    assert main(["bench", "compare", "--quick", "--confidence", "0.2"]) == 2  # no --schedule
    assert "--confidence needs --schedule" in capsys.readouterr().err


def test_compare_rounds_batch1_prompts_and_int8_drafts(
    tmp_path_factory, tmp_path, capsys, monkeypatch
):
    """``--rounds 2`` runs the concurrency columns forward then backward (one figure from both),
    ``--batch1-prompts`` sets the batch-1 column's prompts, ``--draft-quantization`` reaches the
    speculative rows' configuration."""
    from tandem.bench.compare_systems import TandemSystem
    from tandem.kernels import cpu_decode

    if cpu_decode.unavailable_reason() is not None:
        pytest.skip(f"no CPU fast path: {cpu_decode.unavailable_reason()}")
    order: list[tuple[str, int]] = []
    aggregate = TandemSystem.aggregate

    def record(self, prompts, conc):
        order.append((self.row.name, conc))
        return aggregate(self, prompts, conc)

    monkeypatch.setattr(TandemSystem, "aggregate", record)
    result = tmp_path / "c.json"
    rc = main(
        [
            "bench", "compare", "--quick", "--model", str(tiny_mtp_model(tmp_path_factory)),
            "--skip-transformers", "--eagle3", "none", "--draft-quantization", "int8",
            "--rounds", "2", "--batch1-prompts", "2", "--result-file", str(result),
        ]
    )  # fmt: skip
    assert rc == 0
    name = f"tandem + mtp (K={K}, int8)"
    assert [c for n, c in order if n == name] == [1, 2, 2, 1]
    assert [c for n, c in order if n == "tandem"] == [1, 2, 2, 1]
    data = json.loads(result.read_text())
    assert (data["rounds"], data["batch1_prompts"], data["draft_quantization"]) == (2, 2, "int8")
    assert len(data["memory_bandwidth_batch1_probes"]) == 3  # before each prompt, after the last
    row = {r["name"]: r for r in data["rows"]}[name]
    assert row["batch1"] > 0 and all(v > 0 for v in row["concurrency"].values())
    assert "the first 2 at batch 1" in capsys.readouterr().out
    assert main(["bench", "compare", "--quick", "--rounds", "0"]) == 2


def test_compare_stop_at_eos_ends_both_systems_at_the_same_token(tmp_path_factory, tmp_path):
    """``--stop-at-eos``: transformers ``generate`` (the oracle) and Tandem stop at the first
    EOS and count the same tokens; by default both run exactly ``max_tokens``."""
    import shutil

    import transformers as tf

    from tandem.bench.compare_systems import TandemSystem, TransformersSystem
    from tandem.bench.compare_workloads import BenchConfig

    folder = tmp_path / "eos"
    shutil.copytree(tiny_model(tmp_path_factory), folder)
    tok = tf.AutoTokenizer.from_pretrained(folder)
    ids = tok.encode("the quick brown fox")
    model = tf.AutoModelForCausalLM.from_pretrained(folder)
    out = model.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False)
    new = out[0, len(ids) :].tolist()
    # The end token: the first new token past the first that did not come before it.
    cut = next(i for i in range(1, len(new)) if new[i] not in new[:i])
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [new[cut]]
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": new[cut]}))
    for stop, want in ((True, cut + 1), (False, 8)):
        cfg = BenchConfig("float32", "cpu", 8, [1], 1, stop_at_eos=stop)
        hf = TransformersSystem(str(folder), cfg, ids)
        ours = TandemSystem(str(folder), cfg, None, "tandem", ids)
        try:
            assert hf.aggregate([ids, ids], 2)[0] == 2 * want
            assert ours.aggregate([ids, ids], 2)[0] == 2 * want
            assert hf.batch1(ids)[0] == ours.batch1(ids)[0] == want - 1
        finally:
            hf.close()
            ours.close()


def test_bandwidth_and_roofline(tmp_path_factory):
    bw = measure_memory_bandwidth(16 << 20, repeats=2)
    assert bw["bandwidth"] > 0 and bw["copy"] > 0 and bw["sum"] > 0
    from transformers import AutoConfig

    folder = tiny_model(tmp_path_factory)
    config = AutoConfig.from_pretrained(folder)
    from safetensors.torch import load_file

    state = load_file(str(folder / "model.safetensors"))
    # Untied: the LM head is read, the input embedding only row by row.
    expected = sum(t.numel() for n, t in state.items() if n != "model.embed_tokens.weight")
    assert weight_bytes_per_step(config, 4) == 4 * expected
    config.tie_word_embeddings = True
    assert weight_bytes_per_step(config, 2) == 2 * expected  # the shared matrix counted once
    kv = kv_bytes_per_step(config, 2, 100)
    assert kv == 2 * config.num_hidden_layers * 2 * 16 * 2 * 100  # K+V, 2 KV heads of 16
    assert roofline_tokens_per_s(bw["bandwidth"], expected * 4 + kv) > 0
    with pytest.raises(ValueError):
        roofline_tokens_per_s(0.0, 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA path")
def test_gpu_bench_help_and_no_cuda_message():
    script = ["-m", "tandem.bench.gpu"]
    r = subprocess.run(
        [sys.executable, *script, "--help"], capture_output=True, text=True, timeout=60
    )
    assert r.returncode == 0 and "usage:" in r.stdout, r.stderr
    r = subprocess.run([sys.executable, *script], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert "needs a CUDA device" in r.stderr


def test_compare_holds_every_tandem_row_to_a_json_schema(
    tmp_path_factory, tmp_path, capsys, monkeypatch
):
    """``--json-schema``: the plain and speculative rows run constrained (each request's params
    carry the schema), the transformers rows say why they are missing."""
    from tandem.bench.compare_systems import TandemSystem

    schema = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}
    path = tmp_path / "schema.json"
    path.write_text(json.dumps(schema))
    seen: list = []
    real_batch1 = TandemSystem.batch1

    def batch1(self, ids):
        seen.append(self.params.structured)
        return real_batch1(self, ids)

    monkeypatch.setattr(TandemSystem, "batch1", batch1)
    result = tmp_path / "c.json"
    rc = main(
        [
            "bench", "compare", "--quick", "--model", str(tiny_mtp_model(tmp_path_factory)),
            "--eagle3", "none", "--ngram", "none", "--suffix", "none", "--json-schema", str(path),
            "--result-file", str(result),
        ]
    )  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    assert "held to the JSON schema" in out and "no grammar (--json-schema)" in out
    assert len(seen) == 2 and all(s is not None and json.loads(s.text) == schema for s in seen)
    rows = {r["name"]: r for r in json.loads(result.read_text())["rows"]}
    assert rows["tandem"]["batch1"] > 0
    assert 1.0 <= rows[f"tandem + mtp (K={K})"]["batch1_tokens_per_step"] <= K + 1
    assert main(["bench", "compare", "--quick", "--json-schema", str(tmp_path / "nope")]) == 2
