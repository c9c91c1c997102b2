"""GPU checks (``make gpu-check``): speculation on CUDA gives the CPU's greedy output and the
target's sampling distribution, a one-rank NCCL group runs the tensor-parallel executor path,
and CUDA-graph replay equals eager execution for every graph key (and warm-up captures every
bucket).

Triton kernels compiled for real and compared with their references are the gpu tests in
``test_paged_attention.py`` and ``test_spec_kernels.py``; ``scripts/gpu_check.sh`` runs every
file with gpu tests. Everything here is skipped on machines without CUDA.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist

from checkpoints import add_mtp_layers, build_eagle3_draft, build_llama, zero_residual_writes
from graph_checks import GREEDY as GRAPH_GREEDY
from graph_checks import (
    MIXED,
    build_graph_models,
    check_adp_dummy,
    check_variant,
    make_worker,
    spec_config,
)
from tandem import LLM, EngineArgs, LLMEngine, SamplingParams
from tandem.engine.cuda_graph import ADVANCED, SAMPLED, GraphKey, dummy_kv_tokens
from tandem.engine.cuda_graph import GREEDY as GRAPH_GREEDY_VARIANT
from tandem.engine.executor import MultiProcExecutor

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

DEVICE = "cuda"
PROMPTS = [[5, 6, 7], list(range(40, 90)), [100, 101], list(range(120, 139))]
GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpu")
    target = build_llama(root / "target", layers=4)
    add_mtp_layers(target, 1)
    vanilla = root / "vanilla"
    shutil.copytree(target, vanilla)
    add_mtp_layers(vanilla, 3, seed=5)
    perfect = build_llama(root / "perfect", layers=2, seed=3)
    zero_residual_writes(perfect)
    add_mtp_layers(perfect, 1, perfect=True)
    small = build_llama(root / "small-vocab", layers=2, vocab_size=12, init_std=0.15)
    # The near-echo pair of the draft-tree graph checks (tree nodes are accepted).
    echo = {k: v for k, v in build_graph_models(root / "graphs").items() if k.startswith("echo")}
    return {
        **echo,
        "target": target,
        "vanilla": vanilla,
        "eagle3": build_eagle3_draft(root / "eagle3", target, draft_vocab=160),
        "perfect": perfect,
        "small-vocab": small,
        "small-vocab-eagle3": build_eagle3_draft(root / "small-eagle3", small),
    }


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


@pytest.fixture(scope="module")
def cpu_greedy(models: dict[str, Path]) -> dict[str, list[list[int]]]:
    """The oracle: plain greedy decoding on the CPU, without speculation."""
    out = {}
    for name in ("target", "vanilla"):
        with LLM(str(models[name]), device="cpu", dtype="float32") as llm:
            out[name] = _tokens(llm.generate(PROMPTS, GREEDY))
    return out


def _spec(models: dict[str, Path], method: str) -> dict | None:
    return {
        "none": None,
        "eagle3": {"method": "eagle3", "model": str(models["eagle3"]), "num_speculative_tokens": 3},
        "mtp-eagle": {"method": "mtp", "num_speculative_tokens": 3},
        "mtp-vanilla": {"method": "mtp", "mtp_mode": "vanilla", "num_speculative_tokens": 3},
        "eagle3-tree": {
            "method": "eagle3",
            "model": str(models["eagle3"]),
            "num_speculative_tokens": 3,
            "topk": 2,
            "num_draft_tokens": 6,
        },
        "mtp-tree": {
            "method": "mtp",
            "num_speculative_tokens": 3,
            "topk": 4,
            "num_draft_tokens": 8,
        },
    }[method]


@pytest.mark.parametrize(
    "method", ["none", "eagle3", "mtp-eagle", "mtp-vanilla", "eagle3-tree", "mtp-tree"]
)
def test_cuda_greedy_equals_cpu_greedy(models, cpu_greedy, method: str) -> None:
    target = "vanilla" if method == "mtp-vanilla" else "target"
    # A 16-token budget splits the 50-token prompt into chunks that share steps with decodes.
    with LLM(
        str(models[target]),
        device=DEVICE,
        dtype="float32",
        speculative_config=_spec(models, method),
        max_num_batched_tokens=16,
    ) as llm:
        assert llm.engine.config.device.type == DEVICE
        outs = llm.generate(PROMPTS, GREEDY)
        assert llm.engine.get_stats().num_used_kv_blocks == 0
    assert _tokens(outs) == cpu_greedy[target]
    if method != "none":
        assert all(o.spec_stats.num_drafts > 0 for o in outs)


def test_cuda_perfect_draft_is_always_accepted(models) -> None:
    """Equal output alone would hold with a useless draft; a perfect one must be accepted fully,
    so the draft loop itself is right on CUDA."""
    k, steps = 3, 5
    params = SamplingParams(temperature=0, max_tokens=1 + steps * (k + 1), ignore_eos=True)
    with LLM(str(models["perfect"]), device="cpu", dtype="float32") as llm:
        base = _tokens(llm.generate(PROMPTS, params))
    spec = {"method": "mtp", "num_speculative_tokens": k}
    with LLM(
        str(models["perfect"]), device=DEVICE, dtype="float32", speculative_config=spec
    ) as llm:
        outs = llm.generate(PROMPTS, params)
    assert _tokens(outs) == base
    for o in outs:
        assert o.spec_stats.accepted_per_pos == [steps] * k
        assert o.spec_stats.mean_tokens_per_step == k + 1


def test_cuda_rejection_sampling_keeps_the_target_distribution(models) -> None:
    """Positions 1 and 2 come from the first speculative step: with rejection sampling they are
    distributed as without speculation (two-sample chi-square over 8,000 samples each)."""
    from scipy.stats import chi2_contingency

    n, vocab = 8000, 12
    params = SamplingParams(temperature=0.7, max_tokens=3, ignore_eos=True)
    spec = {"method": "eagle3", "model": str(models["small-vocab-eagle3"])}
    hists, rates = [], []
    for speculative_config in (None, spec):
        with LLM(
            str(models["small-vocab"]),
            device=DEVICE,
            dtype="float32",
            speculative_config=speculative_config,
            max_num_seqs=1024,
            max_model_len=32,
            max_num_batched_tokens=4096,
            seed=1,
        ) as llm:
            toks = np.array(_tokens(llm.generate([[1, 2, 3]] * n, params)))
            rates.append(llm.engine.spec_stats.acceptance_rate)
        hists.append([np.bincount(toks[:, j], minlength=vocab) for j in (1, 2)])
    assert rates[1] > 0.2  # drafts are both accepted and rejected
    for j in range(2):
        table = np.array([hists[0][j], hists[1][j]])
        p = float(chi2_contingency(table[:, table.sum(0) > 0])[1])
        assert p > 1e-3, (j, table)


def test_one_rank_nccl_group_runs_the_tensor_parallel_path(models, cpu_greedy, monkeypatch):
    """The multi-rank executor with one rank: NCCL group for tensors, gloo for control, step
    broadcast over it; greedy output equals the CPU's."""
    for name in LAUNCH_ENV:
        monkeypatch.delenv(name, raising=False)
    config = EngineArgs(model=str(models["target"]), device=DEVICE, dtype="float32")
    engine_config = config.create_engine_config()
    executor = MultiProcExecutor(engine_config, timeout_s=60)
    engine = None
    try:
        groups = executor.groups
        assert groups is not None
        assert dist.get_backend(groups.tensor) == "nccl"
        assert dist.get_backend(groups.control) == "gloo"
        assert dist.get_world_size(groups.tensor) == 1
        x = torch.arange(8, dtype=torch.float32, device=DEVICE)
        dist.all_reduce(x, group=groups.tensor)
        parts = [torch.empty_like(x)]
        dist.all_gather(parts, x, group=groups.tensor)
        assert torch.equal(parts[0].cpu(), torch.arange(8, dtype=torch.float32))

        engine = LLMEngine(engine_config, executor=executor)
        for i, prompt in enumerate(PROMPTS):
            engine.add_request(str(i), engine.make_request(str(i), prompt, GREEDY))
        done = {}
        while engine.has_unfinished_requests():
            done.update({o.request_id: o for o in engine.step() if o.finished})
        assert [done[str(i)].outputs[0].token_ids for i in range(len(PROMPTS))] == cpu_greedy[
            "target"
        ]
    finally:
        (engine or executor).shutdown()
    assert not dist.is_initialized()


# ------------------------------------------------------------------ CUDA graphs


def _graph_worker(models: dict[str, Path], method: str, **kw: Any) -> Any:
    target = models["vanilla" if method == "mtp-vanilla" else "target"]
    draft = models["eagle3"]
    if method.endswith("-tree"):  # draft trees: the near-echo pair (nodes are accepted)
        target, draft = models["echo"], models["echo_eagle3"]
    worker = make_worker(target, spec_config(method, draft), DEVICE, **kw)
    graphs = worker.runner.graph_runner
    assert graphs is not None and graphs.use_cuda
    for captured in graphs.graphs.values():  # real graphs, not the static fallback
        assert captured.target.graph is not None
        assert (captured.draft is None) == (method == "none")
        assert captured.draft is None or captured.draft.graph is not None
    return worker


@pytest.mark.parametrize(
    "method", ["none", "mtp-eagle", "eagle3", "mtp-vanilla", "eagle3-tree", "mtp-tree"]
)
def test_cuda_graph_replay_equals_eager(models, method: str) -> None:
    """For every graph key (padded batch size, draft length, sampling variant): replaying the
    captured target forward plus draft loop gives what eager execution gives, padding rows
    included, and padding rows leave the live rows' greedy output unchanged."""
    worker = _graph_worker(models, method)
    check_variant(worker, [GRAPH_GREEDY] * 4, GRAPH_GREEDY_VARIANT)
    check_variant(worker, MIXED, ADVANCED if method != "none" else SAMPLED)


def test_cuda_graph_warm_up_captures_every_bucket(models) -> None:
    """Every configured bucket x variant is captured at start-up (none silently skipped), the
    dummy request's reserved blocks hold all it writes, and the attention-DP dummy replays."""
    sizes = (1, 2, 3, 4, 8)
    worker = _graph_worker(models, "mtp-eagle", batch_sizes=sizes)
    runner = worker.runner
    assert runner.graph_runner is not None
    k = runner.k
    expected = {GraphKey(b, k, v) for b in sizes for v in (GRAPH_GREEDY_VARIANT, ADVANCED)}
    assert set(runner.graph_runner.graphs) == expected
    assert len(runner.dummy_block_ids) * runner.block_size >= dummy_kv_tokens(k)
    check_adp_dummy(_graph_worker(models, "mtp-eagle", adp=True))


def test_cuda_graph_engine_equals_enforce_eager(models) -> None:
    """End to end on CUDA: greedy and seeded-random generation with graphs give the eager
    engine's tokens, and steps really replay."""
    spec = spec_config("mtp-eagle", None)
    params = [
        SamplingParams(temperature=0, max_tokens=16, ignore_eos=True),
        SamplingParams(temperature=0.8, seed=11, max_tokens=16, ignore_eos=True),
    ]
    outs = {}
    for eager in (True, False):
        with LLM(
            str(models["target"]),
            device=DEVICE,
            dtype="float32",
            speculative_config=spec,
            max_num_seqs=4,
            enforce_eager=eager,
        ) as llm:
            graphs = llm.engine.executor.worker.runner.graph_runner
            assert (graphs is None) == eager
            outs[eager] = [_tokens(llm.generate(PROMPTS, p)) for p in params]
            if graphs is not None:
                assert graphs.num_replays > 0
    assert outs[False] == outs[True]


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    from checkpoints import build_gpt_oss

    root = tmp_path_factory.mktemp("gpt_oss")
    target = build_gpt_oss(root / "t", mxfp4=True, sliding_window=8)
    return target, build_eagle3_draft(root / "d", target)


@pytest.fixture(scope="module")
def gpt_oss_cpu_greedy(gpt_oss: tuple[Path, Path]) -> list[list[int]]:
    """The oracle: plain greedy decoding on the CPU, the experts dequantized at load."""
    with LLM(str(gpt_oss[0]), device="cpu", dtype="float32", max_model_len=128) as llm:
        return _tokens(llm.generate(PROMPTS, GREEDY))


@pytest.mark.parametrize("method", ["none", "eagle3", "eagle3-tree"])
def test_cuda_gpt_oss_mxfp4_equals_cpu_greedy(
    gpt_oss: tuple[Path, Path], gpt_oss_cpu_greedy: list[list[int]], method: str
) -> None:
    """gpt-oss on CUDA: MXFP4 experts kept as released in the Triton GEMMs, sinks and an
    8-token window (shorter than the prompts) in the attention kernel, CUDA graphs on; greedy
    tokens equal the CPU's on the dequantized weights, with and without Eagle3 chains and
    trees."""
    target, head = gpt_oss
    spec = {"model": str(head), "num_speculative_tokens": 3, "method": "eagle3"}
    if method == "eagle3-tree":
        spec |= {"topk": 2, "num_draft_tokens": 6}
    with LLM(
        str(target),
        device=DEVICE,
        dtype="float32",
        max_model_len=128,
        speculative_config=None if method == "none" else spec,
    ) as llm:
        experts = llm.engine.executor.worker.model.model.layers[0].mlp.experts
        assert experts.mxfp4 and experts.w13_blocks.dtype == torch.uint8
        held = sum(
            t.numel() * t.element_size()
            for n, t in experts.named_parameters()
            if n.endswith(("_blocks", "_scales"))
        )
        values = 32 * (experts.w13_scales.numel() + experts.w2_scales.numel())
        print(f"\ngpt-oss expert weights resident on the GPU: {held:,} B (bf16: {2 * values:,} B)")
        assert held * 3 < 2 * values  # 4.25 bits a value against 16
        assert llm.engine.executor.worker.runner.graph_runner is not None
        got = _tokens(llm.generate(PROMPTS, GREEDY))
        assert llm.engine.get_stats().num_used_kv_blocks == 0
    assert got == gpt_oss_cpu_greedy
