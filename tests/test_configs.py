"""Deployment presets (configs/*.yaml): every preset loads and validates without weights, keys and
types map one to one onto EngineArgs / SpeculativeConfig, and `tandem serve --config FILE` puts
the file between the defaults and the command-line flags."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from checkpoints import build_llama
from tandem import LLM, EngineArgs, SamplingParams
from tandem import cli as tandem_cli
from tandem.engine.config import ParallelConfig, SpeculativeConfig
from tandem.engine.presets import (
    PRESETS_DIR,
    load_preset,
    resolve_preset,
    shipped_presets,
    validate_preset,
)
from tandem.server import cli

REPO = Path(__file__).resolve().parents[1]
PRESETS = sorted((REPO / "configs").glob("*.yaml"))


def test_the_documented_presets_exist() -> None:
    assert {p.name for p in PRESETS} >= {
        "cpu.yaml",
        "llama3.1-8b-eagle3.yaml",
        "deepseek-v3-mtp-tp8.yaml",
        "qwen3-8b-eagle3.yaml",
        "qwen3-30b-a3b-eagle3.yaml",
    }


@pytest.mark.parametrize("path", PRESETS, ids=lambda p: p.name)
def test_every_preset_loads_and_validates_without_weights(path: Path) -> None:
    preset = load_preset(path)
    assert set(preset) <= EngineArgs.field_names()
    args = EngineArgs(**{"model": "/models/placeholder", **preset})
    ParallelConfig(
        args.tensor_parallel_size, args.enable_attention_dp, args.enable_lm_head_tp_in_adp
    )
    if args.speculative_config is not None:
        assert SpeculativeConfig.from_dict(args.speculative_config) is not None
    if path.name != "cpu.yaml":
        assert preset["model"].startswith("/models/")  # the image mounts model folders there


def test_preset_contents() -> None:
    llama = load_preset(REPO / "configs/llama3.1-8b-eagle3.yaml")
    assert llama["tensor_parallel_size"] == 1
    assert llama["speculative_config"]["method"] == "eagle3"
    assert llama["speculative_config"]["num_speculative_tokens"] == 3

    ds = load_preset(REPO / "configs/deepseek-v3-mtp-tp8.yaml")
    assert (ds["tensor_parallel_size"], ds["enable_attention_dp"]) == (8, True)
    assert ds["enable_lm_head_tp_in_adp"] is True
    spec = SpeculativeConfig.from_dict(ds["speculative_config"])
    assert (spec.method, spec.num_speculative_tokens, spec.use_rejection_sampling) == (
        "mtp",
        3,
        True,
    )

    qwen = load_preset(REPO / "configs/qwen3-8b-eagle3.yaml")
    assert "Qwen3" in qwen["model"] and qwen["speculative_config"]["method"] == "eagle3"
    moe = load_preset(REPO / "configs/qwen3-30b-a3b-eagle3.yaml")
    assert "Qwen3-30B-A3B" in moe["model"] and moe["tensor_parallel_size"] == 2
    assert moe["speculative_config"]["method"] == "eagle3"

    assert load_preset(REPO / "configs/cpu.yaml")["device"] == "cpu"


def test_cpu_preset_runs_a_model(tmp_path: Path) -> None:
    """The one-to-one mapping, end to end: the preset's keys go straight into LLM(**preset)."""
    folder = build_llama(tmp_path / "m", max_position_embeddings=2048)
    preset = load_preset(REPO / "configs/cpu.yaml")
    preset["kv_cache_memory_bytes"] = 16 << 20  # keep the test light
    with LLM(str(folder), **preset) as llm:
        cfg = llm.engine.config
        assert cfg.device.type == "cpu"
        assert cfg.scheduler_config.max_num_seqs == preset["max_num_seqs"]
        assert cfg.model_config.max_model_len == preset["max_model_len"]
        (out,) = llm.generate([[5, 6, 7]], SamplingParams(temperature=0, max_tokens=4))
    assert len(out.outputs[0].token_ids) == 4


# ------------------------------------------------------------------ errors name the key


@pytest.mark.parametrize(
    ("text", "needles"),
    [
        ("max_num_seq: 8", ["max_num_seq", "max_num_seqs"]),  # typo: lists the known keys
        ("extra: {a: 1}", ["extra"]),
        ("speculative_config: {method: mtp, k: 3}", ["speculative_config.k"]),
        ("max_num_seqs: '64'", ["max_num_seqs", "expected int", "str '64'"]),
        ("max_num_seqs: 1.5", ["max_num_seqs", "expected int"]),
        ("tensor_parallel_size: true", ["tensor_parallel_size", "expected int", "bool"]),
        ("enable_attention_dp: 1", ["enable_attention_dp", "expected bool"]),
        ("max_model_len: 8k", ["max_model_len", "int or null"]),
        ("gpu_memory_utilization: high", ["gpu_memory_utilization", "expected float"]),
        ("speculative_config: 3", ["speculative_config", "mapping"]),
        (
            "speculative_config: {method: eagle3, model: /d, eagle3_layers_to_capture: [1, x]}",
            ["speculative_config.eagle3_layers_to_capture", "a list of int"],
        ),
        (
            "speculative_config: {method: mtp, num_speculative_tokens: '3'}",
            ["speculative_config.num_speculative_tokens", "expected int"],
        ),
        # The frozen configs' own validators run without the model folder.
        ("speculative_config: {method: mtp, num_speculative_tokens: 17}", ["num_speculative"]),
        ("speculative_config: {method: eagle3}", ["speculative_config.model"]),
        ("speculative_config: {num_speculative_tokens: 3}", ["speculative_config.method"]),
        ("enable_lm_head_tp_in_adp: true", ["enable_lm_head_tp_in_adp", "enable_attention_dp"]),
        ("tensor_parallel_size: 0", ["tensor_parallel_size"]),
        ("num_redundant_experts: 2", ["num_redundant_experts=2", "enable_eplb"]),
        ("enable_eplb: true", ["enable_eplb", "expert parallelism"]),
        ("enable_eplb: true\nenable_expert_parallel: true", ["enable_eplb", "more than one rank"]),
        (
            "tensor_parallel_size: 4\nexpert_parallel_size: 2",
            ["expert_parallel_size=2", "tensor_parallel_size=4"],
        ),
        ("eplb_step_interval: 0", ["eplb_step_interval"]),
        ("block_size: 12", ["block_size", "power of two"]),
        ("gpu_memory_utilization: 1.5", ["gpu_memory_utilization"]),
        ("dtype: float8", ["dtype"]),
        ("device: tpu", ["device"]),
        ("- max_num_seqs: 8", ["mapping", "list"]),
        ("", ["mapping", "null"]),
        ("max_num_seqs: 8\nmax_num_seqs: 16", ["max_num_seqs", "twice"]),
        ("max_num_seqs: [8", ["not valid YAML"]),
    ],
)
def test_bad_presets_are_errors_that_name_the_key(tmp_path: Path, text: str, needles) -> None:
    path = tmp_path / "bad.yaml"
    path.write_text(text + "\n")
    with pytest.raises(ValueError) as e:
        load_preset(path)
    for needle in [str(path), *needles]:
        assert needle in str(e.value), str(e.value)


def test_types_are_converted_where_yaml_cannot_say_them() -> None:
    out = validate_preset(
        {
            "gpu_memory_utilization": 1,
            "max_model_len": None,
            "speculative_config": {
                "method": "eagle3",
                "model": "/d",
                "eagle3_layers_to_capture": [1, 2, 5],
            },
        }
    )
    assert out["gpu_memory_utilization"] == 1.0 and isinstance(out["gpu_memory_utilization"], float)
    assert out["max_model_len"] is None
    assert out["speculative_config"]["eagle3_layers_to_capture"] == (1, 2, 5)


def test_missing_or_unreadable_preset_is_one_line_listing_the_shipped_ones(tmp_path: Path) -> None:
    shipped = shipped_presets()
    assert {"cpu", "llama3.1-8b-eagle3"} <= set(shipped)
    unreadable = tmp_path / "unreadable.yaml"
    unreadable.mkdir()  # a folder: open() fails even as root
    for bad in (tmp_path / "nope.yaml", "no-such-preset", unreadable):
        with pytest.raises(ValueError) as e:
            load_preset(bad)
        message = str(e.value)
        assert "\n" not in message and "shipped presets: " + ", ".join(shipped) in message


def test_shipped_preset_by_name(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)  # not the checkout: names resolve in the package's configs/
    for name in ("cpu", "cpu.yaml", "configs/cpu.yaml"):
        assert resolve_preset(name) == PRESETS_DIR / "cpu.yaml"
    assert load_preset("cpu") == load_preset(PRESETS_DIR / "cpu.yaml")
    # A file of the same name in the working folder is the user's, and wins.
    (tmp_path / "cpu.yaml").write_text("max_num_seqs: 3\n")
    assert load_preset("cpu.yaml") == {"max_num_seqs": 3}


# ------------------------------------------------------------------ tandem serve --config


def _preset(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "preset.yaml"
    path.write_text(textwrap.dedent(text))
    return path


def _engine_args(argv: list[str]) -> EngineArgs:
    ns = tandem_cli.build_parser().parse_args(["serve", *argv])
    cli.apply_config_file(ns, argv)
    return cli.engine_args_from(ns)


PRESET = """\
    model: /models/from-file
    served_model_name: file-name
    dtype: float16
    max_num_seqs: 8
    kv_cache_memory_bytes: 3000000
    enable_prefix_caching: true
    speculative_config:
      method: mtp
      num_speculative_tokens: 2
"""


def test_config_file_sits_between_defaults_and_flags(tmp_path: Path) -> None:
    path = str(_preset(tmp_path, PRESET))
    args = _engine_args(["--config", path])
    assert args.model == "/models/from-file"
    assert args.served_model_name == "file-name"
    assert (args.dtype, args.max_num_seqs, args.kv_cache_memory_bytes) == ("float16", 8, 3000000)
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 2}
    assert args.max_waiting_requests == 1024 and args.block_size == 16  # defaults stay

    args = _engine_args(
        [
            "/models/from-flag",
            "--config",
            path,
            "--max-num-seqs",
            "64",  # equal to the default, but given: it wins
            "--kv-cache-memory",
            "1GiB",
            "--no-enable-prefix-caching",
            "--speculative-config",
            '{"method": "mtp", "num_speculative_tokens": 5}',
        ]
    )
    assert args.model == "/models/from-flag"
    assert (args.max_num_seqs, args.kv_cache_memory_bytes) == (64, 1 << 30)
    assert args.enable_prefix_caching is False
    assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 5}
    assert args.dtype == "float16"  # not given: the file's


def test_config_file_fills_parallel_options(tmp_path: Path) -> None:
    text = "tensor_parallel_size: 2\nenable_attention_dp: true\nenable_lm_head_tp_in_adp: true\n"
    path = _preset(tmp_path, text)
    argv = ["/m", "--config", str(path)]
    ns = tandem_cli.build_parser().parse_args(["serve", *argv])
    cli.apply_config_file(ns, argv)
    assert ns.enable_attention_dp is True and ns.enable_lm_head_tp_in_adp is True
    assert ns.config_engine_fields == {}  # every engine field has a command-line option
    args = cli.engine_args_from(ns)
    assert (args.tensor_parallel_size, args.enable_attention_dp) == (2, True)
    assert args.enable_lm_head_tp_in_adp is True


def test_serve_reports_a_bad_config_file(tmp_path: Path, capsys) -> None:
    path = _preset(tmp_path, "max_num_seqs: lots\n")
    assert tandem_cli.main(["serve", "/m", "--config", str(path)]) == 2
    err = capsys.readouterr().err
    assert "max_num_seqs" in err and "expected int" in err
