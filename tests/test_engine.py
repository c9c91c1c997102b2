"""Engine behaviour: batching, chunked prefill, prefix caching, preemption, stops, seeds."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints import build_llama
from tandem import LLM, SamplingParams
from text_checks import check_text_against_tokens

GREEDY = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
SHARED = list(range(10, 50))  # a 40-token shared prefix: 2 full blocks of 16
PROMPTS = [
    [7, 8, 9],
    SHARED + [3, 4, 5],
    SHARED + [200, 201],
    list(range(100, 170)),
    [11] * 20,
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_llama(tmp_path_factory.mktemp("ck") / "llama")


def _tokens(outs: list) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def _assert_all_blocks_free(llm: LLM) -> None:
    stats = llm.engine.get_stats()
    assert stats.num_used_kv_blocks == 0
    assert stats.num_running == 0 and stats.num_waiting == 0


@pytest.fixture(scope="module")
def reference(ckpt: Path) -> list[list[int]]:
    """Each prompt alone, no prefix caching, no chunking."""
    with LLM(str(ckpt), enable_prefix_caching=False) as llm:
        return [_tokens(llm.generate([p], GREEDY))[0] for p in PROMPTS]


def test_batched_equals_one_at_a_time(ckpt: Path, reference: list[list[int]]) -> None:
    with LLM(str(ckpt), enable_prefix_caching=False) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference
        _assert_all_blocks_free(llm)


@pytest.mark.parametrize("prefix_caching", [False, True])
def test_tiny_chunked_prefill(ckpt: Path, reference: list[list[int]], prefix_caching: bool) -> None:
    with LLM(str(ckpt), max_num_batched_tokens=8, enable_prefix_caching=prefix_caching) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference
        _assert_all_blocks_free(llm)


def test_prefix_caching_hits_and_keeps_outputs(ckpt: Path, reference: list[list[int]]) -> None:
    with LLM(str(ckpt), enable_prefix_caching=True) as llm:
        first = _tokens(llm.generate(PROMPTS, GREEDY))
        hits_before = llm.engine.get_stats().prefix_cache_hits
        second = _tokens(llm.generate(PROMPTS, GREEDY))
        stats = llm.engine.get_stats()
        assert first == reference and second == reference
        # Second pass: every full prompt block (except the last token's) comes from the cache.
        assert stats.prefix_cache_hits - hits_before >= 32 + 32 + 64 + 16
        _assert_all_blocks_free(llm)


def test_a_cached_block_is_reused_only_after_the_same_prefix(ckpt: Path) -> None:
    """A block's key chains its parent's: after X+S+T is cached, S+T (S now first) and X'+S+T
    (another first block) hit nothing, and their output equals a run without prefix caching.
    A key built without the parent reused S's KV, computed after X, at another position."""
    x, x2 = list(range(10, 26)), list(range(200, 216))
    s, t = list(range(30, 46)), list(range(50, 70))
    prompts = [x + s + t, s + t, x2 + s + t]
    with LLM(str(ckpt), enable_prefix_caching=False) as llm:
        want = _tokens(llm.generate(prompts, GREEDY))
    with LLM(str(ckpt)) as llm:
        got = _tokens(llm.generate(prompts[:1], GREEDY))
        hits = llm.engine.get_stats().prefix_cache_hits
        for prompt in prompts[1:]:
            got += _tokens(llm.generate([prompt], GREEDY))
            assert llm.engine.get_stats().prefix_cache_hits == hits  # no block matched
        again = _tokens(llm.generate(prompts[:1], GREEDY))
        assert llm.engine.get_stats().prefix_cache_hits > hits  # X+S+T itself is cached
    assert got == want and again == want[:1]


def test_preemption_keeps_greedy_outputs(ckpt: Path, reference: list[list[int]]) -> None:
    # 12 blocks of 16 tokens cannot hold the five requests at once (they need 19).
    with LLM(str(ckpt), num_kv_blocks=12, max_model_len=128) as llm:
        assert _tokens(llm.generate(PROMPTS, GREEDY)) == reference
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0
        _assert_all_blocks_free(llm)


def test_seeded_sampling_is_reproducible(ckpt: Path) -> None:
    params = SamplingParams(temperature=1.0, top_p=0.9, seed=1234, max_tokens=16, ignore_eos=True)
    with LLM(str(ckpt)) as llm:
        alone = _tokens(llm.generate([PROMPTS[0]], params))[0]
        crowd = [SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)] * 3 + [params]
        mixed = _tokens(llm.generate(PROMPTS[1:4] + [PROMPTS[0]], crowd))[3]
        other = _tokens(
            llm.generate([PROMPTS[0]], SamplingParams(temperature=1.0, seed=99, max_tokens=16))
        )[0]
    assert alone == mixed
    assert alone != other


def test_n_samples_differ_and_are_ordered(ckpt: Path) -> None:
    params = SamplingParams(n=3, temperature=1.0, seed=7, max_tokens=12, ignore_eos=True)
    with LLM(str(ckpt)) as llm:
        (out,) = llm.generate([PROMPTS[0]], params)
    assert [c.index for c in out.outputs] == [0, 1, 2]
    assert len({tuple(c.token_ids) for c in out.outputs}) == 3


def test_stop_conditions(ckpt: Path, reference: list[list[int]]) -> None:
    with LLM(str(ckpt)) as llm:
        ref = reference[3]
        tok = llm.tokenizer
        # stop_token_ids: ends on that token, inclusive, reason "stop".
        (out,) = llm.generate(
            [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=24, stop_token_ids=[ref[5]])
        )
        c = out.outputs[0]
        first = ref.index(ref[5])
        assert c.token_ids == ref[: first + 1] and c.finish_reason == "stop"
        assert c.stop_reason == ref[5]
        # stop string: the text ends before it and does not contain it.
        full = tok.decode(ref, skip_special_tokens=True)
        stop = full[len(full) // 2 : len(full) // 2 + 3]
        if stop.strip():
            (out,) = llm.generate(
                [PROMPTS[3]],
                SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=stop),
            )
            c = out.outputs[0]
            assert c.finish_reason == "stop" and c.stop_reason == stop
            assert stop not in c.text and full.startswith(c.text)
            assert c.text == full[: full.index(stop)]
        # max_tokens: exactly that many, reason "length".
        (out,) = llm.generate(
            [PROMPTS[3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
        )
        assert out.outputs[0].token_ids == ref[:5] and out.outputs[0].finish_reason == "length"
        _assert_all_blocks_free(llm)


@pytest.mark.parametrize("min_tokens", [1, 4, 9])
def test_min_tokens_bans_stop_tokens_as_transformers_does(
    ckpt: Path, reference: list[list[int]], min_tokens: int
) -> None:
    """Before min_tokens the stop tokens (EOS and stop_token_ids) cannot be sampled at all, as
    vLLM and transformers' ``min_new_tokens`` mask them: the output equals transformers' greedy
    generate with the stop token as an EOS. (Letting the stop token through and not stopping
    on it gave a model that had ended its answer and went on.)"""
    import transformers as tf

    ref = reference[3]
    stop = ref[0]  # the model's greedy first token: the ban changes the output
    params = SamplingParams(
        temperature=0, max_tokens=24, stop_token_ids=[stop], min_tokens=min_tokens
    )
    with LLM(str(ckpt)) as llm:
        (out,) = llm.generate([PROMPTS[3]], params)
        eos = sorted({stop, *llm.tokenizer.convert_tokens_to_ids([llm.tokenizer.eos_token])})
    model = tf.AutoModelForCausalLM.from_pretrained(str(ckpt), dtype=torch.float32).eval()
    with torch.no_grad():
        hf = model.generate(
            torch.tensor([PROMPTS[3]]),
            attention_mask=torch.ones(1, len(PROMPTS[3]), dtype=torch.long),
            do_sample=False,
            max_new_tokens=24,
            min_new_tokens=min_tokens,
            eos_token_id=eos,
            pad_token_id=0,
        )
    want = hf[0, len(PROMPTS[3]) :].tolist()
    got = out.outputs[0].token_ids
    assert got == want
    assert stop not in got[:min_tokens] and got[0] != stop
    assert out.outputs[0].finish_reason == ("stop" if stop in got else "length")


def test_top_logprobs(ckpt: Path) -> None:
    with LLM(str(ckpt)) as llm:
        (out,) = llm.generate([PROMPTS[1]], SamplingParams(temperature=0, max_tokens=6, logprobs=5))
    for lp in out.outputs[0].logprobs:
        assert len(lp.top_token_ids) == 5
        assert lp.top_token_ids[0] == lp.token_id  # greedy picks the most likely token
        assert lp.top_logprobs == sorted(lp.top_logprobs, reverse=True)
        assert abs(lp.top_logprobs[0] - lp.logprob) < 1e-6


def test_string_prompt_and_text(ckpt: Path) -> None:
    with LLM(str(ckpt)) as llm:
        (out,) = llm.generate(
            "Hello world!", SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
        )
        assert out.prompt_token_ids == llm.tokenizer.encode("Hello world!")
        assert out.outputs[0].text == llm.tokenizer.decode(
            out.outputs[0].token_ids, skip_special_tokens=True
        )


def test_detokenize_false_keeps_the_tokens_and_leaves_the_text_empty(ckpt: Path) -> None:
    """As vLLM's: the same tokens, an empty text, and stop strings (which match text) refused;
    stop token ids still end the request."""
    greedy = {"temperature": 0, "max_tokens": 8, "ignore_eos": True}
    with LLM(str(ckpt)) as llm:
        (text,) = llm.generate("Hello world!", SamplingParams(**greedy))
        (ids,) = llm.generate("Hello world!", SamplingParams(**greedy, detokenize=False))
        assert ids.outputs[0].token_ids == text.outputs[0].token_ids
        assert text.outputs[0].text and ids.outputs[0].text == ""
        tokens = text.outputs[0].token_ids
        (stopped,) = llm.generate(
            "Hello world!", SamplingParams(**greedy, detokenize=False, stop_token_ids=[tokens[2]])
        )
        assert stopped.outputs[0].token_ids == tokens[: tokens.index(tokens[2]) + 1]
        assert stopped.outputs[0].finish_reason == "stop"
    with pytest.raises(ValueError, match="detokenize"):
        SamplingParams(stop=["x"], detokenize=False)


def test_block_hash_is_sha256_of_parent_and_token_bytes() -> None:
    """Python's hash() of a token tuple is not collision-resistant: crafted prompts could make
    one request reuse another's KV. Blocks are keyed by SHA-256 (hashlib is the oracle)."""
    import hashlib
    import struct

    from tandem.engine.block_manager import block_hash

    first = block_hash(None, [1, 2, 3])
    assert first == hashlib.sha256(struct.pack("<3i", 1, 2, 3)).digest()
    second = block_hash(first, [70000, 5])
    assert second == hashlib.sha256(first + struct.pack("<2i", 70000, 5)).digest()
    assert block_hash(second, [1, 2, 3]) != first  # the parent is part of the key


def test_prefix_cache_counts_each_prompt_once(ckpt: Path) -> None:
    """A waiting request is matched again every step it cannot be admitted; /metrics' hit rate
    counts each prompt once (preempted requests are not counted again either)."""
    with LLM(str(ckpt), num_kv_blocks=12, max_model_len=128) as llm:
        llm.generate(PROMPTS, GREEDY)
        stats = llm.engine.get_stats()
        assert stats.num_preemptions > 0
        assert stats.prefix_cache_queries == sum(len(p) for p in PROMPTS)


@pytest.mark.parametrize("include", [False, True])
def test_min_tokens_with_a_stop_string_keeps_text_equal_to_tokens(
    ckpt: Path, include: bool
) -> None:
    """A stop string that appears before min_tokens is reached does not cut the text (it was
    cut, and later text appended after the cut: text != decode(token_ids))."""
    prompt = [7, 8, 9]
    with LLM(str(ckpt)) as llm:
        free = check_text_against_tokens(
            llm, prompt, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
        )
        text, tokens = free[0], free[2]
        # A stop string that first shows within the first tokens' text.
        early = llm.tokenizer.decode(tokens[:3], skip_special_tokens=True)
        stop = early[-2:] if len(early) >= 2 else early
        assert stop and stop in text
        for min_tokens in (0, 6, 24):
            params = SamplingParams(
                temperature=0,
                max_tokens=24,
                ignore_eos=True,
                min_tokens=min_tokens,
                stop=[stop],
                include_stop_str_in_output=include,
            )
            got, reason, ids = check_text_against_tokens(llm, prompt, params)
            assert ids == tokens[: len(ids)]
            assert len(ids) >= min_tokens and (reason == stop or len(ids) == 24)
            assert (reason == stop) if min_tokens == 0 else True
            assert (reason is None) if min_tokens == 24 else True


def test_host_rows_reads_every_part_in_its_own_dtype() -> None:
    """The step's one host read: ints stay ints (exact past 2**53, where a float64 trip rounds
    them), float32 values stay their float32 values, bools read as 0 / 1, row by row."""
    from tandem.engine.step_io import host_rows

    ids = torch.tensor([[2**53 + 1, -3], [7, 2**62]])
    lp = torch.tensor([[0.1], [-1e-30]], dtype=torch.float32)
    flags = torch.tensor([[True], [False]])
    got = host_rows(ids, lp, flags, ids[:, :1])
    assert got[0] == [[2**53 + 1, -3], [7, 2**62]]
    assert got[1] == [[float(torch.tensor(0.1))], [float(torch.tensor(-1e-30))]]
    assert got[2] == [[1], [0]] and got[3] == [[2**53 + 1], [7]]
    assert all(type(v) is int for row in got[0] for v in row)
    assert host_rows(torch.empty(0, 3), ids[:0]) == [[], []]


@pytest.mark.parametrize("method", ["none", "mtp", "eagle3"])
def test_the_last_reference_frees_the_weights_and_the_kv_cache(
    ckpt: Path, tmp_path: Path, method: str
) -> None:
    """No reference cycle holds an engine: its weights and KV cache go with the last reference,
    without a garbage collection (a process that paces its collector, or runs several engines
    one after another, would hold every old one's memory until a full collection)."""
    import gc
    import shutil
    import weakref

    from checkpoints import add_mtp_layers, build_eagle3_draft

    target, spec = ckpt, None
    if method == "mtp":
        target = Path(shutil.copytree(ckpt, tmp_path / "mtp"))
        add_mtp_layers(target, 1)
        spec = {"method": "mtp", "num_speculative_tokens": 2}
    elif method == "eagle3":
        head = build_eagle3_draft(tmp_path / "eagle3", ckpt, draft_vocab=160)
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    gc.collect()
    gc.disable()
    try:
        llm = LLM(str(target), max_model_len=128, speculative_config=spec)
        llm.generate(["hello world", [5, 6, 7]], SamplingParams(max_tokens=6, temperature=0.8))
        runner = llm.engine.executor.worker.runner
        draft = runner.spec.draft if runner.spec is not None else None
        assert (draft is None) == (spec is None)
        modules = [runner.model] + ([draft] if draft is not None else [])
        tensors = [p for m in modules for p in m.parameters()]
        tensors += [a.k_cache for m in modules for a in m.attention_layers()]
        refs = [weakref.ref(t) for t in tensors]
        del tensors, modules, draft, runner
        llm.shutdown()
        del llm
        alive = sum(r() is not None for r in refs)
    finally:
        gc.enable()
    assert refs and alive == 0, f"{alive} of {len(refs)} tensors outlived the engine"


@pytest.mark.parametrize("include", [False, True])
def test_the_token_that_ends_a_request_is_not_in_its_text(ckpt: Path, include: bool) -> None:
    """As vLLM: a stop token (or EOS) ends the request with its id in ``token_ids`` but not its
    text in ``text`` (decoded with special tokens kept, an EOS would show as its string), unless
    ``include_stop_str_in_output``."""
    prompt = [7, 8, 9]
    with LLM(str(ckpt)) as llm:
        free = llm.generate([prompt], SamplingParams(temperature=0, max_tokens=8, ignore_eos=True))
        tokens = free[0].outputs[0].token_ids
        i = next(j for j in range(1, len(tokens)) if tokens[j] not in tokens[:j])
        params = SamplingParams(
            temperature=0,
            max_tokens=8,
            stop_token_ids=[tokens[i]],
            skip_special_tokens=False,
            include_stop_str_in_output=include,
        )
        (out,) = llm.generate([prompt], params)
    got = out.outputs[0]
    assert got.token_ids == tokens[: i + 1] and got.finish_reason == "stop"
    kept = tokens[: i + 1] if include else tokens[:i]
    assert got.text == llm.tokenizer.decode(kept, skip_special_tokens=False)
