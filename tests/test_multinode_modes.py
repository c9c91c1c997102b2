"""Every parallel mode across two "nodes" on one machine: two `tandem serve -tp 4` process trees
(two gloo ranks each) started separately with `--nnodes 2 --node-rank 0/1`, and greedy output
over the official `openai` client equal to one rank's, token for token and log-prob for
log-prob, with the same drafts accepted at every draft position (verification would correct
wrong drafts, so equal tokens alone do not show equal drafting):

- a DeepSeek-V3 MoE target (MLA, grouped top-k experts, an MTP layer) under attention DP with
  LM-head TP, expert parallelism and MTP-Eagle speculation: requests spread over the four DP
  ranks, experts split over the ranks of both nodes, each row sent all-to-all to its experts'
  ranks, greedy drafts from the vocabulary split across nodes; EPLB with 4 redundant experts
  (12 physical, 3 per rank) rebalancing every 4 steps, so weights move between the nodes
  mid-run (its rounds and imbalance on /metrics); seeded requests at temperature 0.8 next to
  greedy ones (the group-synced greedy flag) complete, and greedy ones next to them are
  unchanged;
- the same target under plain TP with vanilla MTP (two MTP layers, draft row pick on);
- a Qwen3-MoE target (6 experts) with an Eagle3 head under attention DP with LM-head TP,
  expert parallelism and EPLB with 2 redundant experts (8 physical, 2 per rank);
- a Llama target with an Eagle3 head under plain TP with draft row pick off on both nodes, and
  under attention DP with LM-head TP with it on, with a chain and with draft trees.

A speculative configuration, or a draft row-pick switch, that differs on node 1 stops both
nodes at start-up, naming it."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NamedTuple

import openai
import pytest
from transformers import AutoTokenizer

from checkpoints import (
    build_deepseek_mtp_target,
    build_llama,
    build_qwen3_moe,
    make_echo_target,
    perfect_eagle3_draft,
)
from server_utils import RemoteServer, free_port, scrape_metrics
from tandem import LLM, SamplingParams
from tandem.engine.speculative.interface import DISABLE_ROW_PICK_ENV
from tandem.server.logprobs import TokenText
from test_multinode import EXIT_WITHIN_S, _assert_gone, _family, _start, _wait_exit

PROMPTS = [
    "Hello world! How are you today?",
    "Paris is the capital of",
    "The quick brown fox",
    "One two three four five six",
    "a",
]
MAX_TOKENS = 16
MTP_EAGLE = {"method": "mtp", "num_speculative_tokens": 3}
MTP_VANILLA = {"method": "mtp", "num_speculative_tokens": 2, "mtp_mode": "vanilla"}
ADP = ["--enable-attention-dp", "--enable-lm-head-tp-in-adp"]
EP = ["--enable-expert-parallel", "--enable-eplb", "--num-redundant-experts", "4"]
EP += ["--eplb-step-interval", "4"]
# A 16-token budget chunks the longer prompts' prefill.
BUDGET = ["--max-num-batched-tokens", "16"]
PER_POS = "tandem:spec_decode_num_accepted_tokens_per_pos_total"
LOGPROB_TOL = 1e-4

pytestmark = pytest.mark.timeout(240)


class Generation(NamedTuple):
    """One greedy completion as the API reports it and its speculative counts."""

    text: str
    tokens: list[str]
    logprobs: list[float]
    drafts: tuple[int, int, int]  # (num_drafts, num_draft_tokens, num_accepted_tokens)


class Run(NamedTuple):
    generations: list[Generation]  # by prompt
    accepted_per_pos: list[int]  # summed over the prompts


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """DeepSeek-V3: a dense and an MoE layer (8 experts, 2 per rank), 322 tokens (LM-head
    shards of unequal use), two MTP layers whose drafts are mostly right (eagle mode reads the
    first)."""
    return build_deepseek_mtp_target(tmp_path_factory.mktemp("mn_dsv3") / "t", 2)


@pytest.fixture(scope="module")
def qwen3_moe_eagle3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A near-echo Qwen3-MoE (6 experts, top-2, every layer sparse) and a near-perfect Eagle3
    head for it."""
    root = tmp_path_factory.mktemp("mn_qwen3moe")
    target = build_qwen3_moe(root / "t", layers=2, experts=6, seed=3)
    make_echo_target(target, residual_scale=0.3)
    return target, perfect_eagle3_draft(root / "d", target, residual_scale=1.0)


@pytest.fixture(scope="module")
def llama_eagle3(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A near-echo Llama (4 heads, 2 KV heads: replicated over 4 ranks) whose layers change some
    next tokens, and an Eagle3 head that drafts nearly the echo (its midlayer, split over the
    ranks, changes some drafts): acceptance differs by position."""
    root = tmp_path_factory.mktemp("mn_eagle3")
    target = build_llama(root / "t", layers=2, heads=4, kv_heads=2)
    make_echo_target(target, residual_scale=20.0)
    return target, perfect_eagle3_draft(root / "d", target, residual_scale=3.0)


def _one_rank(model: Path, spec: dict[str, Any], **kw: Any) -> Run:
    """The offline engine on one rank: PROMPTS at once, greedy."""
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    with LLM(str(model), speculative_config=spec, max_model_len=256, **kw) as llm:
        outs = llm.generate(PROMPTS, params)
    token_text = TokenText(AutoTokenizer.from_pretrained(model))
    gens, per_pos = [], [0] * spec["num_speculative_tokens"]
    for out in outs:
        o, stats = out.outputs[0], out.spec_stats
        assert stats is not None
        gens.append(
            Generation(
                o.text,
                [token_text.text(t) for t in o.token_ids],
                [lp.logprob for lp in o.logprobs],
                (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens),
            )
        )
        for pos, count in enumerate(stats.accepted_per_pos):
            per_pos[pos] += count
    return Run(gens, per_pos)


@contextmanager
def _two_nodes(
    model: Path, args: list[str], env: dict[str, str] | None = None
) -> Iterator[RemoteServer]:
    """Node 0 (serving) and node 1 (headless), ready; both stopped and gone afterwards."""
    addr = f"127.0.0.1:{free_port()}"
    node0, node1 = (
        _start(model, 0, addr, args=args, env=env),
        _start(model, 1, addr, args=args, env=env),
    )
    family: list[int] = []
    try:
        node0.wait_ready()
        assert node1.proc.poll() is None, node1.log_tail()
        family = _family(node0.proc.pid) + _family(node1.proc.pid)
        yield node0
        assert node1.proc.poll() is None, node1.log_tail()
    finally:
        node0.stop()
        node1.stop()
    _assert_gone(sorted(family))


def _complete(server: RemoteServer, prompt: str, **kw: Any) -> Any:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0, timeout=120)
    assert server.model is not None
    return client.completions.create(
        model=server.model.name,
        prompt=prompt,
        max_tokens=MAX_TOKENS,
        logprobs=0,
        extra_body={"ignore_eos": True},
        **kw,
    )


def _per_pos(samples: dict[Any, float], k: int) -> list[int]:
    out = [0] * k
    for (name, labels), value in samples.items():
        if name == PER_POS:
            out[int(dict(labels)["position"])] += int(value)
    return out


def _serve(server: RemoteServer, k: int, sampled: int = 0) -> tuple[Run, list[Any]]:
    """PROMPTS greedy, all in flight at once (with ``sampled`` seeded temperature-0.8 requests
    of PROMPTS[0] next to them): the greedy run as the API reports it (per-position acceptance
    from /metrics, counted only when nothing else ran) and the sampled choices."""
    before = _per_pos(scrape_metrics(server), k)
    jobs = [{"prompt": p, "temperature": 0} for p in PROMPTS]
    jobs += [{"prompt": PROMPTS[0], "temperature": 0.8, "seed": 7}] * sampled
    with ThreadPoolExecutor(len(jobs)) as pool:
        resps = list(pool.map(lambda job: _complete(server, **job), jobs))
    after = _per_pos(scrape_metrics(server), k)
    gens = []
    for resp in resps[: len(PROMPTS)]:
        choice, spec = resp.choices[0], resp.usage.model_extra["spec_decode"]
        gens.append(
            Generation(
                choice.text,
                choice.logprobs.tokens,
                choice.logprobs.token_logprobs,
                (spec["num_drafts"], spec["num_draft_tokens"], spec["num_accepted_tokens"]),
            )
        )
    per_pos = [a - b for a, b in zip(after, before, strict=True)]
    return Run(gens, per_pos), [r.choices[0] for r in resps[len(PROMPTS) :]]


def _assert_same(got: Run, want: Run, check_per_pos: bool = True) -> None:
    for g, w in zip(got.generations, want.generations, strict=True):
        assert (g.text, g.tokens, g.drafts) == (w.text, w.tokens, w.drafts)
        assert max(abs(a - b) for a, b in zip(g.logprobs, w.logprobs, strict=True)) < LOGPROB_TOL
    if check_per_pos:
        assert got.accepted_per_pos == want.accepted_per_pos


def _assert_acceptance_varies(run: Run) -> None:
    """Drafts are accepted at every position but not always: per-position counts can tell a
    right draft from a wrong one."""
    per_pos, drafts = run.accepted_per_pos, sum(g.drafts[0] for g in run.generations)
    assert all(0 < c < drafts for c in per_pos), (per_pos, drafts)


@pytest.mark.timeout(300)
def test_deepseek_moe_mtp_under_attention_dp_and_lm_head_tp(deepseek: Path) -> None:
    want = _one_rank(deepseek, MTP_EAGLE)
    _assert_acceptance_varies(want)
    spec = ["--speculative-config", json.dumps(MTP_EAGLE)]
    with _two_nodes(deepseek, [*ADP, *EP, *BUDGET, *spec]) as server:
        got, _ = _serve(server, 3)
        _assert_same(got, want)
        metrics = {name: v for (name, _), v in scrape_metrics(server).items()}
        assert metrics["tandem:eplb_num_rebalances_total"] >= 1
        before = metrics["tandem:eplb_imbalance_before"]
        assert 1.0 <= metrics["tandem:eplb_imbalance_after"] <= before
        # Seeded sampled requests next to greedy ones on other DP ranks: every rank must take
        # the sampled-draft path in those steps, or the LM-head TP collectives mismatch.
        mixed, sampled = _serve(server, 3, sampled=2)
        _assert_same(mixed, want, check_per_pos=False)
        for choice in sampled:
            assert choice.finish_reason == "length"
            assert len(choice.logprobs.tokens) == MAX_TOKENS
            assert all(lp <= 0 for lp in choice.logprobs.token_logprobs)
        assert sampled[0].text == sampled[1].text  # the same seed (on any DP ranks)


def test_deepseek_moe_vanilla_mtp_under_tp(deepseek: Path) -> None:
    want = _one_rank(deepseek, MTP_VANILLA)
    _assert_acceptance_varies(want)
    spec = ["--speculative-config", json.dumps(MTP_VANILLA)]
    with _two_nodes(deepseek, [*BUDGET, *spec]) as server:
        got, _ = _serve(server, 2)
    _assert_same(got, want)


@pytest.mark.parametrize(
    ("args", "row_pick", "tree"),
    [([], False, False), (ADP, True, False), (ADP, True, True)],
    ids=["tp-without-row-pick", "adp-lm-head-tp-with-row-pick", "adp-lm-head-tp-tree"],
)
def test_llama_eagle3(
    llama_eagle3: tuple[Path, Path], args: list[str], row_pick: bool, tree: bool
) -> None:
    """``tree``: draft trees (2 children per node, all 10 nodes verified: depth 3 among them),
    the per-depth counts included."""
    target, draft = llama_eagle3
    eagle3 = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    if tree:
        eagle3 |= {"topk": 2, "num_draft_tokens": 10}
    want = _one_rank(target, eagle3)
    _assert_acceptance_varies(want)
    spec = ["--speculative-config", json.dumps(eagle3)]
    env = {DISABLE_ROW_PICK_ENV: "0" if row_pick else "1"}
    with _two_nodes(target, [*args, *spec], env=env) as server:
        got, _ = _serve(server, 3)
    _assert_same(got, want)


def test_qwen3_moe_eagle3_under_expert_parallelism(qwen3_moe_eagle3: tuple[Path, Path]) -> None:
    """Eagle3 on a MoE target, EP over the four ranks of both nodes, EPLB moving experts (and
    their 2 redundant copies) between them every 4 steps."""
    target, draft = qwen3_moe_eagle3
    eagle3 = {"method": "eagle3", "model": str(draft), "num_speculative_tokens": 3}
    want = _one_rank(target, eagle3, dtype="float32")  # its config says bfloat16
    _assert_acceptance_varies(want)
    ep = [
        "--dtype",
        "float32",
        "--enable-expert-parallel",
        "--enable-eplb",
        "--eplb-step-interval",
        "4",
    ]
    ep += ["--eplb-config.num_redundant_experts", "2"]
    spec = ["--speculative-config", json.dumps(eagle3)]
    with _two_nodes(target, [*ADP, *ep, *spec]) as server:
        got, _ = _serve(server, 3)
        metrics = {name: v for (name, _), v in scrape_metrics(server).items()}
    _assert_same(got, want)
    assert metrics["tandem:eplb_num_rebalances_total"] >= 1


def test_node_1_speculating_otherwise_stops_both_naming_it(deepseek: Path) -> None:
    """Node 1 with another speculative config and draft row pick off: both nodes stop, each
    naming both differences (every difference is listed, so one start checks the two).
    Without the checks the ranks would run collectives of different shapes at warm-up."""
    addr = f"127.0.0.1:{free_port()}"
    node0 = _start(deepseek, 0, addr, args=["--speculative-config", json.dumps(MTP_EAGLE)])
    node1 = _start(
        deepseek,
        1,
        addr,
        args=["--speculative-config", json.dumps(MTP_VANILLA)],
        env={DISABLE_ROW_PICK_ENV: "1"},
    )
    family: set[int] = set()  # every process either tree had while they ran
    try:
        deadline = time.monotonic() + EXIT_WITHIN_S
        while time.monotonic() < deadline and None in (node0.proc.poll(), node1.proc.poll()):
            family.update(_family(node0.proc.pid) + _family(node1.proc.pid))
            time.sleep(0.2)
        assert _wait_exit(node1, 1) != 0
        assert _wait_exit(node0, 1) != 0
        for node in (node0, node1):
            log = node.log_tail(100_000)
            assert "node 1 has --speculative-config" in log
            assert f"node 1 has ${DISABLE_ROW_PICK_ENV} 1, node 0 has 0" in log
    finally:
        node0.stop()
        node1.stop()
    _assert_gone(sorted(family))
