"""Bad checkpoints and bad arguments fail with a ValueError that names the problem."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import build_llama
from tandem import LLM, SamplingParams


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("ck") / "llama")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir()
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def test_unknown_architecture_lists_supported(ckpt: Path, tmp_path: Path) -> None:
    folder = _copy(ckpt, tmp_path / "m")
    cfg = json.loads((folder / "config.json").read_text())
    cfg["architectures"] = ["GPTNeoXForCausalLM"]
    cfg["model_type"] = "llama"
    (folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(ValueError, match="unsupported model architecture.*LlamaForCausalLM"):
        LLM(str(folder))


def test_missing_tensor(ckpt: Path, tmp_path: Path) -> None:
    folder = _copy(ckpt, tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    del state["model.layers.1.mlp.down_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match=r"missing tensors: model\.layers\.1\.mlp\.down_proj"):
        LLM(str(folder))


def test_unexpected_tensor(ckpt: Path, tmp_path: Path) -> None:
    folder = _copy(ckpt, tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.0.mlp.extra_proj.weight"] = torch.zeros(2, 2)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="unexpected tensor.*extra_proj"):
        LLM(str(folder))


def test_shape_mismatch(ckpt: Path, tmp_path: Path) -> None:
    folder = _copy(ckpt, tmp_path / "m")
    state = load_file(str(folder / "model.safetensors"))
    state["model.layers.0.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ValueError, match="o_proj.*shape mismatch"):
        LLM(str(folder))


def test_not_a_model_folder(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not a local model folder|config.json not found"):
        LLM(str(tmp_path / "nothing"))


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.1), "temperature"),
        (dict(min_p=1.5), "min_p"),
        (dict(min_p=1.0), "min_p"),
        (dict(top_k=2**40), "top_k"),
        (dict(n=0), "n="),
        (dict(logprobs=99), "logprobs"),
        (dict(presence_penalty=3.0), "presence_penalty"),
        (dict(repetition_penalty=0.0), "repetition_penalty"),
        (dict(stop=[""]), "stop"),
    ],
)
def test_bad_sampling_params(kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kwargs)


def test_bad_engine_and_request_args(ckpt: Path) -> None:
    with pytest.raises(ValueError, match="unknown LLM arguments"):
        LLM(str(ckpt), max_num_sequences=4)
    with pytest.raises(ValueError, match="max_model_len"):
        LLM(str(ckpt), max_model_len=10**6)
    with LLM(str(ckpt), max_model_len=32) as llm:
        with pytest.raises(ValueError, match="maximum context length is 32"):
            llm.generate([list(range(40))], SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="maximum context length"):
            llm.generate([list(range(20))], SamplingParams(max_tokens=20))
        with pytest.raises(ValueError, match="out of range"):
            llm.generate([[1, 2, 10**6]], SamplingParams(max_tokens=1))
        with pytest.raises(ValueError, match="empty"):
            llm.generate([[]], SamplingParams(max_tokens=1))
        # Nothing was left behind by the rejected requests.
        assert not llm.engine.has_unfinished_requests()
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=2, ignore_eos=True))
        assert len(out[0].outputs[0].token_ids) == 2
