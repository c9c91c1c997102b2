"""gpt-oss (``GptOssForCausalLM``, issue #48 item 2) on tiny checkpoints whose config.json holds
gpt-oss-20b's released values (YaRN without truncation, a 128-token window on every other
layer, attention biases, sinks, head_dim independent of the hidden size): greedy tokens and
log-probs equal transformers' on prompts longer than the window, from a bf16 checkpoint and from
one with the experts in the released MXFP4 layout (transformers' own dequantizing load as the
oracle, tensor for tensor); TP = 2 speculating with an Eagle3 head equals one rank, and greedy
speculation equals plain decoding; what gpt-oss does not run on yet is refused at start."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from checkpoints import (
    _read_state,
    _write_state,
    assert_matches_hf,
    build_eagle3_draft,
    build_gpt_oss,
    build_llama,
    hf_greedy,
)
from tandem import LLM, SamplingParams
from tandem.models.gpt_oss import check_gpt_oss

_gen = torch.Generator().manual_seed(1)
# Past the 128-token window of layer 0 (the two longer ones), and one short prompt.
PROMPTS = [torch.randint(3, 250, (n,), generator=_gen).tolist() for n in (5, 140, 200)]
NEW_TOKENS = 16
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True, logprobs=0)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("gpt_oss")
    bf16 = build_gpt_oss(root / "bf16")
    return {
        "bf16": bf16,
        "mxfp4": build_gpt_oss(root / "mxfp4", mxfp4=True),
        "eagle3": build_eagle3_draft(root / "eagle3", bf16),
    }


def _hf_load(name: str) -> dict[str, Any]:
    import transformers as tf

    # On a CPU transformers dequantizes the MXFP4 experts when asked (its kernels need CUDA).
    return {"quantization_config": tf.Mxfp4Config(dequantize=True)} if name == "mxfp4" else {}


@pytest.mark.parametrize("name", ["bf16", "mxfp4"])
def test_greedy_matches_transformers(ckpts: dict[str, Path], name: str) -> None:
    ref = hf_greedy(ckpts[name], PROMPTS, NEW_TOKENS, **_hf_load(name))
    with LLM(str(ckpts[name]), dtype="float32", max_model_len=512) as llm:
        outs = llm.generate(PROMPTS, GREEDY)
    assert_matches_hf(outs, ref)


def test_mxfp4_experts_equal_transformers_dequantizing_load(ckpts: dict[str, Path]) -> None:
    import transformers as tf

    hf = tf.AutoModelForCausalLM.from_pretrained(
        str(ckpts["mxfp4"]), dtype=torch.float32, **_hf_load("mxfp4")
    )
    with LLM(str(ckpts["mxfp4"]), dtype="float32", max_model_len=512) as llm:
        ours = llm.engine.executor.worker.model
        for layer, theirs in zip(ours.model.layers, hf.model.layers, strict=True):
            experts = layer.mlp.experts
            assert torch.equal(experts.w13, theirs.mlp.experts.gate_up_proj.float())
            assert torch.equal(experts.w2, theirs.mlp.experts.down_proj.float())
            assert torch.equal(experts.w13_bias, theirs.mlp.experts.gate_up_proj_bias.float())


@pytest.mark.timeout(300)
def test_two_ranks_and_eagle3_equal_one_rank_plain(ckpts: dict[str, Path]) -> None:
    """Greedy Eagle3 (K = 3) equals plain decoding on one rank, and so do suffix decoding's
    draft trees (tree rows through the sinks and windows, the accepted path's KV compacted in
    both KV groups); TP = 2 (heads, KV heads, sinks
    and experts split) and attention DP = 2 with LM-head TP (attention replicated, the MoE over
    both ranks' rows), speculating, equal one rank: tokens, log-probs, drafts accepted per
    position."""
    spec = {"method": "eagle3", "model": str(ckpts["eagle3"]), "num_speculative_tokens": 3}
    # Engine-proposed trees over earlier outputs: after sampled outputs that mostly follow the
    # greedy ones (T = 0.3), trees that branch where they differ, some nodes accepted.
    tree = {"method": "suffix", "num_speculative_tokens": 4}
    warm = [
        SamplingParams(temperature=0.3, max_tokens=NEW_TOKENS, ignore_eos=True, seed=i)
        for i in range(4 * len(PROMPTS))
    ]
    adp = {"enable_attention_dp": True, "enable_lm_head_tp_in_adp": True}
    runs = []
    for tp, kw in ((1, {}), (1, {"speculative_config": spec}),
                   (2, {"speculative_config": spec}), (2, {"speculative_config": spec, **adp}),
                   (1, {"speculative_config": tree})):  # fmt: skip
        with LLM(
            str(ckpts["bf16"]), dtype="float32", max_model_len=512, tensor_parallel_size=tp, **kw
        ) as llm:
            if kw.get("speculative_config") is tree:
                llm.generate(PROMPTS * 4, warm)
            outs = llm.generate(PROMPTS, GREEDY)
            assert llm.engine.get_stats().num_used_kv_blocks == 0
        runs.append(outs)
    tokens = [[o.outputs[0].token_ids for o in outs] for outs in runs]
    assert tokens[0] == tokens[1] == tokens[2] == tokens[3] == tokens[4]
    lps = [[lp.logprob for o in outs for lp in o.outputs[0].logprobs] for outs in runs]
    accepted = [[o.spec_stats.accepted_per_pos for o in outs] for outs in runs[1:4]]
    for other in (2, 3):
        assert max(abs(a - b) for a, b in zip(lps[1], lps[other], strict=True)) < 1e-4
        assert accepted[other - 1] == accepted[0]
    assert max(abs(a - b) for a, b in zip(lps[0], lps[4], strict=True)) < 1e-4
    assert sum(o.spec_stats.num_draft_tokens for o in runs[1]) > 0
    assert sum(o.spec_stats.num_accepted_tokens for o in runs[4]) > 0


def _window_blocks_per_step(llm: LLM, prompt: list[int], params: SamplingParams) -> tuple:
    """One request stepped to the end: its output, and the window group's blocks in use
    (counted through the block manager) after every step."""
    engine = llm.engine
    engine.add_request("long", prompt, params)
    held, outs = [], []
    while engine.has_unfinished_requests():
        outs += [o for o in engine.step() if o.finished]
        held.append(engine.block_manager.num_used_window_blocks)
    return outs[0], held


@pytest.mark.timeout(300)
def test_sliding_layers_keep_only_their_window(ckpts: dict[str, Path]) -> None:
    """A prompt of almost five windows, prefilled in 64-token chunks: between steps the
    sliding layers' pool holds at most window / block_size + 1 blocks (with an Eagle3 head,
    its look-ahead's block more), the full layers' pool every block, and the output equals
    transformers'; the same prompt again reuses its cached prefix with the same output, and
    every block is free at the end."""
    prompt = torch.randint(3, 250, (600,), generator=torch.Generator().manual_seed(2)).tolist()
    (ref,) = hf_greedy(ckpts["bf16"], [prompt], NEW_TOKENS)
    spec = {"method": "eagle3", "model": str(ckpts["eagle3"]), "num_speculative_tokens": 3}
    for kw in ({}, {"speculative_config": spec}):
        with LLM(
            str(ckpts["bf16"]), dtype="float32", max_model_len=1024, max_num_batched_tokens=64,
            **kw,
        ) as llm:  # fmt: skip
            bm = llm.engine.block_manager
            window, bs = 128, bm.block_size
            assert bm.window == window and bs == 16
            lookahead = llm.engine.executor.worker.runner.spec.config.kv_lookahead if kw else 0
            bound = window // bs + 1 + -(-lookahead // bs)
            out, held = _window_blocks_per_step(llm, prompt, GREEDY)
            assert max(held) <= bound and bm.num_used_window_blocks == 0, (bound, held)
            assert out.outputs[0].token_ids == ref["tokens"]
            lps = [lp.logprob for lp in out.outputs[0].logprobs]
            assert max(abs(a - b) for a, b in zip(lps, ref["logprobs"], strict=True)) < 1e-4
            again, _ = _window_blocks_per_step(llm, prompt, GREEDY)
            assert again.num_cached_tokens >= 512 and again.outputs[0].token_ids == ref["tokens"]
            assert bm.num_used_blocks == bm.num_used_window_blocks == 0


def _broken_copy(src: Path, dst: Path, edit: Any) -> Path:
    import shutil

    shutil.copytree(src, dst)
    state = _read_state(dst)
    edit(state)
    _write_state(dst, state)
    return dst


def test_loading_errors_name_the_tensor(ckpts: dict[str, Path], tmp_path: Path) -> None:
    """An MXFP4 tensor with a wrong block shape, blocks without their scales, and an Eagle3
    head built for another hidden size: each refused at load, naming the tensor."""
    name = "model.layers.1.mlp.experts.down_proj"

    def wrong_block(state: dict[str, torch.Tensor]) -> None:
        blocks = state[f"{name}_blocks"]
        state[f"{name}_blocks"] = blocks.reshape(*blocks.shape[:-2], -1, 8).contiguous()

    bad = _broken_copy(ckpts["mxfp4"], tmp_path / "block", wrong_block)
    with pytest.raises(ValueError, match=f"{name}_blocks: MXFP4 blocks"):
        LLM(str(bad), dtype="float32", max_model_len=512)
    bad = _broken_copy(
        ckpts["mxfp4"], tmp_path / "scales", lambda state: state.pop(f"{name}_scales")
    )
    with pytest.raises(ValueError, match=f"without their other half.*{name}"):
        LLM(str(bad), dtype="float32", max_model_len=512)
    other = build_eagle3_draft(tmp_path / "head", build_llama(tmp_path / "llama", hidden_size=32))
    spec = {"method": "eagle3", "model": str(other), "num_speculative_tokens": 3}
    with pytest.raises(ValueError, match="hidden"):
        LLM(str(ckpts["bf16"]), dtype="float32", max_model_len=512, speculative_config=spec)


def test_a_checkpoint_whose_experts_are_not_mxfp4_is_refused_on_gpus(ckpts: dict) -> None:
    """On GPUs the experts run in the MXFP4 kernels: a bf16 checkpoint is refused there (and
    served on CPUs), the released layout is not."""
    from transformers import AutoConfig

    cuda = torch.device("cuda")
    with pytest.raises(ValueError, match="not MXFP4.*--device cpu"):
        check_gpt_oss(cuda, AutoConfig.from_pretrained(ckpts["bf16"]))
    check_gpt_oss(cuda, AutoConfig.from_pretrained(ckpts["mxfp4"]))
    check_gpt_oss(torch.device("cpu"), AutoConfig.from_pretrained(ckpts["bf16"]))
