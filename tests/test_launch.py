"""Launching like vLLM (issue #45, item 6): the `vllm serve` lines of the peers' recipes parse
into the engine and server settings they mean; Hugging Face ids resolve from a hub cache (the hub
library's own layout) with HF_HUB_OFFLINE=1; --max-model-len defaults to the model's own length,
a KV budget too small for one such request fails naming the longest length that fits, and
`auto` takes it (with the draft look-ahead, from the block count the ranks agree on); dotted keys
equal the JSON form; what Tandem cannot honour is refused by name. The recipes' lines start as
written against cached ids (DeepSeek-R1's and GLM-4.5's on 8 ranks, with tiny checkpoints of
their architectures; Qwen3's CPU line) and answer the official openai client."""

from __future__ import annotations

import argparse
import json
import re
import shlex
import shutil
from pathlib import Path
from typing import Any

import httpx
import pytest

from checkpoints import add_mtp_layers, build_deepseek_v3, build_llama
from tandem.cli import build_parser, main
from tandem.engine.config import MAX_MODEL_LEN_AUTO, EngineArgs, parse_max_model_len
from tandem.engine.engine_core import generation_defaults
from tandem.engine.llm import LLM
from tandem.engine.sampling_params import SamplingParams
from tandem.models.hub import resolve_folder
from tandem.server.cli import engine_args_from, server_settings_from
from tandem.server.launch_flags import flag_notes

HUB_ID = "tandem-test/tiny-llama-64k"  # stands in for each recipe's model id
COMMIT = "0123456789abcdef0123456789abcdef01234567"
V1_COMMIT = "89abcdef0123456789abcdef0123456789abcdef"
CONTEXT = 65536  # the checkpoint's max_position_embeddings: past any recipe's --max-model-len
SAMPLING = {"temperature": 0.6, "top_p": 0.95}  # its generation_config.json's defaults
BUDGET = 1 << 20  # --kv-cache-memory for the fit tests: 128 blocks of 16 tokens (8 KiB each)

# The recipes' lines as published (vllm-project/recipes), the model id replaced by HUB_ID.
# DeepSeek/DeepSeek-V3.md, "Running DeepSeek-R1 with FP8 on 8xH200":
DEEPSEEK_R1 = "vllm serve {m} --trust-remote-code --tensor-parallel-size 8 --enable_expert_parallel"
# models/deepseek-ai/DeepSeek-R1.yaml: base_args, then the reasoning and tool_calling features.
DEEPSEEK_R1_FEATURES = (
    "vllm serve {m} --trust-remote-code --enable-expert-parallel --reasoning-parser deepseek_r1 "
    "--enable-auto-tool-choice --tool-call-parser deepseek_v3 "
    "--chat-template examples/tool_chat_template_deepseekr1.jinja"
)
# vLLM's expert-parallel deployment guide: one node, attention DP 8 with the experts spread over
# the 8 ranks, EPLB with its JSON config.
WIDE_EP = (
    "vllm serve {m} --tensor-parallel-size 1 --data-parallel-size 8 --enable-expert-parallel "
    '--enable-eplb --eplb-config \'{{"window_size": 1000, "step_interval": 3000, '
    '"num_redundant_experts": 2, "log_balancedness": true}}\''
)
# GLM/GLM.md (GLM-4.5-Air), and models/zai-org/GLM-4.5.yaml with its MTP opt-in:
GLM45 = (
    "vllm serve {m} --tensor-parallel-size 8 --tool-call-parser glm45 --reasoning-parser glm45 "
    "--enable-auto-tool-choice"
)
GLM45_MTP = (
    "vllm serve {m} --trust-remote-code --tool-call-parser glm45 --enable-auto-tool-choice "
    "--reasoning-parser glm45 --speculative-config.method mtp "
    "--speculative-config.num_speculative_tokens 1"
)
# Qwen/Qwen3.md, BF16:
QWEN3 = (
    "vllm serve {m} --trust-remote-code -tp 4 --disable-log-requests --swap-space 32 "
    "--distributed-executor-backend mp --max-num-batched-tokens 32768 --max-model-len 32768 "
    "--no-enable-prefix-caching --gpu-memory-utilization 0.8"
)
# models/Qwen/Qwen3-8B.yaml: tool_calling and reasoning features, the CPU hardware override.
QWEN3_CPU = (
    "vllm serve {m} --enable-auto-tool-choice --tool-call-parser hermes --reasoning-parser qwen3 "
    "--max-num-batched-tokens 16384 --gpu-memory-utilization 0.8"
)


def fill_hub_cache(cache: Path, repo_id: str, folder: Path, commit: str, ref: str) -> Path:
    """``folder`` as the hub library caches ``repo_id`` at ``ref``:
    models--ORG--NAME/snapshots/<commit>/... and refs/<ref> holding the commit."""
    root = cache / ("models--" + repo_id.replace("/", "--"))
    snapshot = root / "snapshots" / commit
    shutil.copytree(folder, snapshot, dirs_exist_ok=True)
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / ref).write_text(commit)
    return snapshot


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = build_llama(tmp_path_factory.mktemp("long") / "m", max_position_embeddings=CONTEXT)
    gen = json.loads((folder / "generation_config.json").read_text())
    (folder / "generation_config.json").write_text(json.dumps({**gen, **SAMPLING}))
    return folder


@pytest.fixture(scope="module")
def mtp_model(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("long_mtp") / "m"
    shutil.copytree(model, folder)
    add_mtp_layers(folder, 1)
    return folder


@pytest.fixture(scope="module")
def cache(model: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("hub")
    fill_hub_cache(root, HUB_ID, model, COMMIT, "main")
    v1 = fill_hub_cache(root, HUB_ID, model, V1_COMMIT, "v1")
    (v1 / "generation_config.json").unlink()  # tells the two revisions apart
    return root


@pytest.fixture
def offline(cache: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """HF_HUB_OFFLINE=1, and ``cache`` as the default hub cache (HF_HUB_CACHE is read when
    huggingface_hub is imported: the constant is set instead)."""
    import huggingface_hub

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(cache))
    return cache


def snapshot(cache: Path, commit: str = COMMIT) -> str:
    return str(cache / ("models--" + HUB_ID.replace("/", "--")) / "snapshots" / commit)


def parse(line: str, model: str = HUB_ID) -> argparse.Namespace:
    """``tandem serve`` parsing a `vllm serve ...` line."""
    argv = shlex.split(line.format(m=model))
    assert argv[:2] == ["vllm", "serve"]
    return build_parser().parse_args(["serve", *argv[2:]])


def launch_args(ns: argparse.Namespace) -> EngineArgs:
    """The engine arguments `tandem serve` starts with: mapped, then ids fetched."""
    return engine_args_from(ns).with_local_folders()


def fields(obj: Any, *names: str) -> tuple[Any, ...]:
    return tuple(getattr(obj, n) for n in names)


# ------------------------------------------------------------------ recipe lines


def test_deepseek_r1_recipe_line(offline: Path) -> None:
    ns = parse(DEEPSEEK_R1)
    args = launch_args(ns)
    assert (args.model, args.served_model_name) == (snapshot(offline), HUB_ID)
    assert (args.tensor_parallel_size, args.max_model_len, args.speculative_config) == (
        8,
        None,
        None,
    )
    config = args.create_engine_config()
    assert config.model_config.max_model_len == CONTEXT  # the model's own, not 4096
    assert config.parallel_config.tensor_parallel_size == 8
    notes = " ".join(flag_notes(ns))
    assert "--trust-remote-code: no remote code is run" in notes
    assert config.parallel_config.expert_parallel  # the recipe's flag, honoured
    assert server_settings_from(ns).reasoning_parser == "auto"


@pytest.fixture(scope="module")
def moe_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_deepseek_v3(tmp_path_factory.mktemp("ep") / "m", layers=2)


def test_vllm_wide_ep_line_is_attention_dp_with_expert_parallelism(
    moe_model: Path, model: Path
) -> None:
    """vLLM's `-dp 8 --enable-expert-parallel` on a MoE model is one group of 8 ranks (attention
    DP, experts spread), not 8 replicas; its --eplb-config keys reach the engine."""
    args = launch_args(parse(WIDE_EP, str(moe_model)))
    assert fields(args, "tensor_parallel_size", "data_parallel_size", "enable_attention_dp") == (
        8,
        1,
        True,
    )
    assert fields(
        args,
        "enable_expert_parallel",
        "enable_eplb",
        "num_redundant_experts",
        "eplb_step_interval",
        "eplb_window_size",
    ) == (True, True, 2, 3000, 1000)
    pc = args.create_engine_config().parallel_config
    assert (pc.num_replicas, pc.expert_parallel) == (1, True)
    # Dotted keys are the JSON form; a value given twice, or a key vLLM does not have, is refused.
    dotted = (
        "vllm serve {m} --enable-eplb --eplb-config.window_size 7 --eplb-config.step_interval 5"
    )
    got = engine_args_from(parse(dotted, str(moe_model)))
    assert fields(got, "eplb_window_size", "eplb_step_interval") == (7, 5)
    with pytest.raises(ValueError, match="both set it"):
        engine_args_from(parse(dotted + " --eplb-window-size 9", str(moe_model)))
    with pytest.raises(ValueError, match="unknown key.*windows"):
        engine_args_from(parse("vllm serve {m} --eplb-config.windows 9", str(moe_model)))
    # vLLM's attention TP inside each DP rank has no equivalent here: refused, naming one.
    with pytest.raises(ValueError, match="-tp 8 --enable-attention-dp --enable-expert-parallel"):
        launch_args(parse("vllm serve {m} -tp 2 -dp 4 --enable-expert-parallel", str(moe_model)))
    # A dense model keeps -dp's replicas (expert parallelism has nothing to spread).
    dense = launch_args(parse("vllm serve {m} -dp 2 --enable-expert-parallel", str(model)))
    assert fields(dense, "tensor_parallel_size", "data_parallel_size") == (1, 2)


def test_deepseek_r1_recipe_features(offline: Path) -> None:
    """Waits on the deepseek_v3 choice of --tool-call-parser (issue #45, item 4)."""
    settings = server_settings_from(parse(DEEPSEEK_R1_FEATURES))
    assert fields(settings, "reasoning_parser", "tool_call_parser", "chat_template") == (
        "deepseek_r1",
        "deepseek_v3",
        "examples/tool_chat_template_deepseekr1.jinja",
    )


@pytest.mark.parametrize("line", [GLM45, GLM45_MTP], ids=["tp8", "mtp"])
def test_glm45_recipe_lines(offline: Path, line: str) -> None:
    """Waits on the glm45 choice of --tool-call-parser (issue #45, item 4)."""
    ns = parse(line)
    settings = server_settings_from(ns)
    assert (settings.tool_call_parser, settings.reasoning_parser) == ("glm45", "glm45")
    args = launch_args(ns)
    assert args.served_model_name == HUB_ID
    if line == GLM45:
        assert (args.tensor_parallel_size, args.speculative_config) == (8, None)
    else:
        assert args.speculative_config == {"method": "mtp", "num_speculative_tokens": 1}
        spec = args.create_engine_config().speculative_config
        assert spec is not None and (spec.method, spec.num_speculative_tokens) == ("mtp", 1)
    assert "--enable-auto-tool-choice: always on" in " ".join(flag_notes(ns))


def test_qwen3_recipe_line(offline: Path) -> None:
    ns = parse(QWEN3)
    config = launch_args(ns).create_engine_config()
    assert (config.model_config.max_model_len, config.model_config.served_model_name) == (
        32768,
        HUB_ID,
    )
    assert fields(config.scheduler_config, "max_num_batched_tokens", "max_model_len") == (
        32768,
        32768,
    )
    assert fields(config.cache_config, "enable_prefix_caching", "gpu_memory_utilization") == (
        False,
        0.8,
    )
    assert config.parallel_config.tensor_parallel_size == 4
    notes = flag_notes(ns)
    flags = ("--trust-remote-code", "--disable-log-requests", "--swap-space 32", "backend mp")
    for flag in flags:
        assert sum(flag in note for note in notes) == 1, (flag, notes)


def test_qwen3_cpu_recipe_line_serves_a_cached_id(model: Path, cache: Path) -> None:
    """The whole line as `tandem serve` with HF_HUB_OFFLINE=1: the id resolves from the cache,
    is the served model name, and the official openai client gets an answer. Waits on the
    qwen3 reasoning parser (issue #45, item 1) for --reasoning-parser qwen3."""
    import openai

    from server_utils import RemoteServer

    argv = shlex.split(QWEN3_CPU.format(m=HUB_ID))[2:]  # MODEL and the options, as written
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cache)}
    with RemoteServer(None, argv, env=env) as server:
        client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
        assert [m.id for m in client.models.list().data] == [HUB_ID]
        out = client.chat.completions.create(
            model=HUB_ID,
            messages=[{"role": "user", "content": "Hello"}],
            max_tokens=4,
            temperature=0,
        )
        assert out.model == HUB_ID and out.usage is not None
        assert out.usage.completion_tokens == 4 or out.choices[0].finish_reason == "stop"


# ------------------------------------------------------------------ recipe lines, served
# The R1 and GLM-4.5 lines start as written (8 ranks where they say --tensor-parallel-size 8),
# each against a tiny checkpoint of its model's architecture, cached under the recipe's own id,
# with the model's real chat template and the config values of the release that matter here
# (R1: YaRN factor 40 over 4096 positions, 163840 in all; GLM-4.5: q/k norms, one expert group,
# half-rotary heads, 8 KV heads that the 8 ranks split one each).

R1_ID, GLM_ID = "deepseek-ai/DeepSeek-R1", "zai-org/GLM-4.5"
R1_YARN = {
    "rope_type": "yarn",
    "rope_theta": 10000.0,
    "factor": 40.0,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 1.0,
}
TEMPLATES = Path(__file__).parent / "data" / "chat_templates"


def with_template(folder: Path, template: str) -> Path:
    """``template`` as the folder's chat template (the file transformers reads first)."""
    (folder / "chat_template.jinja").write_text(template)
    return folder


@pytest.fixture(scope="module")
def recipe_cache(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from test_glm4_moe import add_glm_mtp_layer, build_glm4_moe

    root = tmp_path_factory.mktemp("recipes")
    r1 = build_deepseek_v3(root / "r1", heads=8, rope=R1_YARN, max_position_embeddings=163840)
    # R1's template since its 2025 revision opens the thinking in the generation prompt.
    original = (TEMPLATES / "deepseek_r1.jinja").read_text()
    opened = original.replace(
        "{{'<｜Assistant｜>'}}{% endif %}", "{{'<｜Assistant｜><think>\\n'}}{% endif %}"
    )
    assert opened.rstrip().endswith("<think>\\n'}}{% endif %}")
    with_template(r1, opened)
    glm = build_glm4_moe(
        root / "glm", heads=8, kv_heads=8, use_qk_norm=True, n_group=1, topk_group=1, top_k=2
    )
    add_glm_mtp_layer(glm)
    with_template(glm, (TEMPLATES / "glm45_excerpt.jinja").read_text())
    fill_hub_cache(root / "hub", R1_ID, r1, COMMIT, "main")
    fill_hub_cache(root / "hub", GLM_ID, glm, COMMIT, "main")
    (root / "examples").mkdir()  # the R1 features line names vLLM's example template
    shutil.copy(
        TEMPLATES / "deepseek_r1.jinja", root / "examples" / "tool_chat_template_deepseekr1.jinja"
    )
    return root


def served(line: str, model_id: str, cwd: Path) -> Any:
    """``line`` as `tandem serve` with HF_HUB_OFFLINE=1 in ``cwd``, its id from the cache, and
    nothing added (the model's own context length)."""
    from server_utils import RemoteServer

    argv = shlex.split(line.format(m=model_id))[2:]
    env = {"HF_HUB_OFFLINE": "1", "HF_HUB_CACHE": str(cwd / "hub")}
    return RemoteServer(None, argv, env=env, cwd=cwd, max_model_len=None)


def ask(server: Any, model_id: str, **extra: Any) -> Any:
    import openai

    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    assert [m.id for m in client.models.list().data] == [model_id]
    out = client.chat.completions.create(
        model=model_id,
        messages=[{"role": "user", "content": "What is 2 + 3?"}],
        max_tokens=6,
        temperature=0,
        extra_body={"min_tokens": 6},
        **extra,
    )
    assert out.model == model_id and out.usage is not None
    assert (out.usage.completion_tokens, out.choices[0].finish_reason) == (6, "length")
    return out.choices[0].message


def test_deepseek_r1_recipe_line_serves_on_8_ranks(recipe_cache: Path) -> None:
    """The TP=8 line: the reasoning parser is chosen from the template (it opens <think>), so
    the whole unfinished answer is thinking."""
    with served(DEEPSEEK_R1, R1_ID, recipe_cache) as server:
        message = ask(server, R1_ID)
        assert "rank 0/8 joined" in Path(server.log.name).read_text()
    extra = message.model_extra or {}
    assert message.content is None and extra["reasoning_content"]
    assert extra["reasoning"] == extra["reasoning_content"]


def test_deepseek_r1_recipe_features_line_serves(recipe_cache: Path) -> None:
    """The features line: vLLM's example template by its relative path (the first R1 template:
    no <think> in the generation prompt, so output that does not open one is the answer) and
    the deepseek_v3 tool-call parser, so a request with tools is served."""
    tool = {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}}}
    with served(DEEPSEEK_R1_FEATURES, R1_ID, recipe_cache) as server:
        message = ask(server, R1_ID, tools=[tool])
    assert message.content and message.tool_calls is None
    assert (message.model_extra or {}).get("reasoning_content") is None  # the parser is on


@pytest.mark.parametrize("line", [GLM45, GLM45_MTP], ids=["tp8", "mtp"])
def test_glm45_recipe_lines_serve(recipe_cache: Path, line: str) -> None:
    with served(line, GLM_ID, recipe_cache) as server:
        message = ask(server, GLM_ID)
        log = Path(server.log.name).read_text()
        metrics = httpx.get(server.url("/metrics")).text
    assert isinstance(message.content, str) and message.content
    if line == GLM45:
        assert "rank 0/8 joined" in log
    else:  # dotted --speculative-config keys: one MTP draft token in each step

        def counter(name: str) -> float:
            pattern = rf"^tandem:spec_decode_{name}_total(?:\{{[^}}]*\}})? (\S+)$"
            found = re.search(pattern, metrics, re.M)
            assert found is not None, metrics
            return float(found.group(1))

        assert counter("num_draft_tokens") == counter("num_drafts") >= 1


# ------------------------------------------------------------------ dotted keys and spellings


@pytest.mark.parametrize(
    ("dotted", "as_json"),
    [
        (
            [
                "--speculative-config.method",
                "mtp",
                "--speculative-config.num_speculative_tokens",
                "3",
            ],
            '{"method": "mtp", "num_speculative_tokens": 3}',
        ),
        (
            ["--speculative-config.method=eagle3", "--speculative-config.model", "/heads/x"],
            '{"method": "eagle3", "model": "/heads/x"}',
        ),
        (  # merged into the JSON form; values parse as JSON (true, null, lists)
            [
                "--speculative-config",
                '{"method": "mtp"}',
                "--speculative_config.use_rejection_sampling",
                "false",
                "--speculative-config.disable_by_batch_size",
                "null",
            ],
            '{"method": "mtp", "use_rejection_sampling": false, "disable_by_batch_size": null}',
        ),
    ],
)
def test_dotted_keys_equal_the_json_form(tmp_path: Path, dotted: list[str], as_json: str) -> None:
    ns = build_parser().parse_args(["serve", str(tmp_path), *dotted])
    want = build_parser().parse_args(["serve", str(tmp_path), "--speculative-config", as_json])
    assert json.loads(ns.speculative_config) == json.loads(want.speculative_config)
    assert engine_args_from(ns).speculative_config == json.loads(as_json)


def test_dotted_template_kwargs_and_underscore_spellings(tmp_path: Path) -> None:
    ns = build_parser().parse_args(
        ["serve", str(tmp_path), "--default-chat-template-kwargs.enable_thinking", "false",
         "--default_chat_template_kwargs.extra.depth", "2", "--max_model_len=32K",
         "--max_num_seqs", "3", "--enable_prefix_caching"]
    )  # fmt: skip
    settings = server_settings_from(ns)
    assert settings.default_chat_template_kwargs == {
        "enable_thinking": False,
        "extra": {"depth": 2},
    }
    args = engine_args_from(ns)
    assert (args.max_model_len, args.max_num_seqs, args.enable_prefix_caching) == (32768, 3, True)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["--speculative-config", '{"method": "mtp"}', "--speculative-config.method", "eagle3"],
            'speculative-config.method is given twice: "mtp" and "eagle3"',
        ),
        (["--speculative-config", "none", "--speculative-config.method", "mtp"], "turns it off"),
        (["--speculative-config.method"], "needs a value"),
        (["--speculative-config.", "3"], "expected --speculative-config.KEY VALUE"),
        (["--speculative-config.k+", "3"], "a list goes in as JSON"),
        (["--speculative-config.a", "1", "--speculative-config.a.b", "2"], "a is not an object"),
        (["--max-model-len", "lots"], "--max-model-len: 'lots' is invalid"),
        (["--distributed-executor-backend", "threads"], "invalid choice: 'threads'"),
    ],
)
def test_bad_launch_arguments_are_named(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], argv: list[str], message: str
) -> None:
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(["serve", str(tmp_path), *argv])
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--no-enable-chunked-prefill"], "--no-enable-chunked-prefill cannot be honoured"),
        (["--distributed-executor-backend", "ray"], "ray is not supported"),
        (
            ["--distributed-executor-backend", "uni", "-tp", "2"],
            "it needs --tensor-parallel-size 1",
        ),
        (["--distributed-executor-backend", "external_launcher"], "with torchrun or srun"),
        (["--swap-space", "-1"], "--swap-space must be >= 0"),
    ],
)
def test_flags_tandem_cannot_honour_are_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, argv: list[str], message: str
) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(ValueError, match=message):
        engine_args_from(build_parser().parse_args(["serve", str(tmp_path), *argv]))


def test_accepted_flags_say_so_once(tmp_path: Path) -> None:
    ns = build_parser().parse_args(
        ["serve", str(tmp_path), "--enable-chunked-prefill", "--no-trust-remote-code",
         "--distributed-executor-backend", "uni"]
    )  # fmt: skip
    engine_args_from(ns)
    assert flag_notes(ns) == [
        "--enable-chunked-prefill: always on (long prompts are prefilled in chunks of "
        "--max-num-batched-tokens)",
        "--distributed-executor-backend uni: accepted (Tandem starts and places its ranks itself)",
    ]


def test_max_model_len_spellings() -> None:
    assert [parse_max_model_len(v) for v in ("8192", "32k", "32K", "25.6k", "auto", "-1")] == [
        8192,
        32000,
        32768,
        25600,
        -1,
        -1,
    ]
    for bad in ("0", "1.5", "inf", "k", "-2"):
        with pytest.raises(ValueError, match="max_model_len"):
            parse_max_model_len(bad)


# ------------------------------------------------------------------ Hugging Face ids


def test_ids_resolve_from_the_hub_cache_offline(model: Path, offline: Path) -> None:
    assert resolve_folder(HUB_ID) == snapshot(offline)
    assert resolve_folder(HUB_ID, revision="v1") == snapshot(offline, V1_COMMIT)
    assert resolve_folder(str(model)) == str(model)  # a local folder wins
    args = EngineArgs(
        model=HUB_ID,
        tokenizer=HUB_ID,
        revision="v1",
        speculative_config={"method": "eagle3", "model": HUB_ID},
    ).with_local_folders()
    assert (args.model, args.tokenizer) == (snapshot(offline, V1_COMMIT), snapshot(offline))
    assert args.speculative_config == {"method": "eagle3", "model": snapshot(offline)}
    assert args.served_model_name == HUB_ID
    named = EngineArgs(model=HUB_ID, served_model_name="mine").with_local_folders()
    assert named.served_model_name == "mine"


def test_download_dir_is_the_cache(cache: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ns = build_parser().parse_args(["serve", HUB_ID, "--download-dir", str(cache)])
    assert launch_args(ns).model == snapshot(cache)


def test_an_id_neither_cached_nor_reachable_is_one_clear_line(
    offline: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert main(["serve", "nobody/nothing", "--max-model-len", "64"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    assert "model 'nobody/nothing'" in err and str(offline) in err and "HF_HUB_OFFLINE" in err
    spec = json.dumps({"method": "eagle3", "model": "nobody/head"})
    with pytest.raises(ValueError, match="speculative_config.model 'nobody/head'.*HF_HUB_OFFLINE"):
        launch_args(build_parser().parse_args(["serve", HUB_ID, "--speculative-config", spec]))
    with pytest.raises(ValueError, match="nor a Hugging Face id"):
        resolve_folder("./no/such/folder")
    with pytest.raises(ValueError, match="at revision 'v2' is not a local model folder"):
        resolve_folder(HUB_ID, revision="v2")


# ------------------------------------------------------------------ max_model_len and the KV cache


def expected_longest(folder: Path, budget: int, lookahead: int) -> int:
    """The longest request ``budget`` bytes of KV blocks hold, from the config: fp32 K and V of
    every layer (MTP layers too), 16 tokens a block."""
    cfg = json.loads((folder / "config.json").read_text())
    layers = cfg["num_hidden_layers"] + cfg.get("num_nextn_predict_layers", 0)
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_block = layers * 2 * cfg["num_key_value_heads"] * head_dim * 4 * 16
    return budget // per_block * 16 - lookahead


MTP = {"method": "mtp", "num_speculative_tokens": 1}  # a chain of K = 1: 2 look-ahead slots


@pytest.mark.parametrize("spec", [None, MTP], ids=["plain", "mtp"])
def test_too_long_default_names_the_longest_length_that_fits(
    model: Path, mtp_model: Path, spec: dict[str, Any] | None
) -> None:
    folder = model if spec is None else mtp_model
    longest = expected_longest(folder, BUDGET, 0 if spec is None else 2)
    with pytest.raises(ValueError) as e:
        LLM(str(folder), kv_cache_memory_bytes=BUDGET, speculative_config=spec)
    message = str(e.value)
    assert f"max_model_len={CONTEXT} needs" in message  # the default: the model's own length
    assert f"the longest max_model_len that fits is {longest}" in message
    assert f"--max-model-len {longest} (or --max-model-len auto)" in message
    assert "raise --kv-cache-memory" in message
    with pytest.raises(ValueError, match=f"fits is {longest}:"):
        LLM(str(folder), kv_cache_memory_bytes=BUDGET, speculative_config=spec,
            max_model_len=longest + 1)  # fmt: skip


def test_auto_takes_the_longest_that_fits_with_the_draft_look_ahead(mtp_model: Path) -> None:
    longest = expected_longest(mtp_model, BUDGET, 2)
    with LLM(
        str(mtp_model),
        kv_cache_memory_bytes=BUDGET,
        speculative_config=MTP,
        max_model_len="auto",
        generation_config="vllm",
    ) as llm:
        assert llm.engine.max_model_len == llm.engine.config.scheduler_config.max_model_len
        assert llm.engine.max_model_len == longest
        assert generation_defaults(llm.engine.generation_config) == {}  # "vllm": none
        assert llm.engine.eos_token_ids  # still the model folder's
        params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True)
        (out,) = llm.generate([[5] * (longest - 2)], params)  # a request of exactly longest
        assert len(out.outputs[0].token_ids) == 2
        with pytest.raises(ValueError, match=f"maximum context length is {longest}"):
            llm.generate([[5] * (longest - 1)], params)


def test_auto_from_a_cached_id_and_the_generation_config(offline: Path) -> None:
    with LLM(HUB_ID, kv_cache_memory_bytes=BUDGET, max_model_len=-1) as llm:
        assert llm.engine.max_model_len == expected_longest(Path(snapshot(offline)), BUDGET, 0)
        assert generation_defaults(llm.engine.generation_config) == SAMPLING  # "auto"


def test_auto_fits_the_block_count_the_ranks_agreed_on(model: Path) -> None:
    """Every rank fits max_model_len to the agreed (smallest) count, so all serve the same."""
    from tandem.engine.worker import Worker

    config = EngineArgs(model=str(model), max_model_len=MAX_MODEL_LEN_AUTO).create_engine_config()
    assert config.model_config.max_model_len == CONTEXT and config.model_config.fit_max_model_len
    worker = Worker(config, agree_num_blocks=lambda blocks: 100)
    assert (worker.num_blocks, worker.max_model_len) == (100, 100 * 16)


def test_generation_config_folder_and_bad_values(model: Path, tmp_path: Path) -> None:
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": 0.3}))
    mc = EngineArgs(model=str(model), generation_config=str(tmp_path)).create_engine_config()
    assert mc.model_config.generation_config == str(tmp_path)
    ns = build_parser().parse_args(["serve", str(model), "--generation-config", "vllm"])
    assert launch_args(ns).create_engine_config().model_config.generation_config is None
    with pytest.raises(ValueError, match="'auto'.*'vllm'.*or a folder"):
        EngineArgs(model=str(model), generation_config="hf").create_engine_config()
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="has no generation_config.json"):
        EngineArgs(
            model=str(model), generation_config=str(tmp_path / "empty")
        ).create_engine_config()


@pytest.mark.parametrize(
    "spec",
    [None, MTP, {"method": "mtp", "num_speculative_tokens": 3, "topk": 2, "num_draft_tokens": 6}],
    ids=["plain", "chain", "tree"],
)
@pytest.mark.parametrize("adp", [False, True], ids=["tp1", "adp2"])
def test_longest_request_inverts_the_blocks_a_request_needs(
    model: Path, spec: dict[str, Any] | None, adp: bool
) -> None:
    """``longest_request`` is the exact inverse of ``blocks_required`` (the draft look-ahead, a
    tree's nodes, the dummy requests' blocks under attention DP): the blocks one request of L
    needs hold L, and one block fewer does not."""
    from tandem.engine.worker import blocks_required, longest_request

    base = EngineArgs(
        model=str(model),
        speculative_config=spec,
        tensor_parallel_size=2 if adp else 1,
        enable_attention_dp=adp,
    ).create_engine_config()
    assert (blocks_required(base)[1] > 0) == adp  # dummy blocks kept under attention DP
    for length in (1, 15, 16, 17, 1000, 4093):
        config = base.with_max_model_len(length)
        per_request, reserved = blocks_required(config)
        assert longest_request(config, per_request + reserved) >= length
        assert longest_request(config, per_request + reserved - 1) < length
