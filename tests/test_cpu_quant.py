"""Block-quantized weights in the CPU fast path (``--cpu-weights q8 / q4``): the products
against a float64 reference of the same quantized weights, the built-in model's GGUF blocks
against the ``gguf`` package's own dequantization, and the whole model against the float32
model on the dequantized weights (teacher-forced greedy tokens and log-probabilities)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from checkpoints import build_llama
from tandem.kernels import cpu_decode

pytestmark = pytest.mark.skipif(
    cpu_decode.load_extension() is None, reason="the CPU decode fast path is unavailable"
)

FORMATS = ["q8_0", "q4_1"]


def random_blocks(
    fmt: str, o: int, k: int, g: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Weights as a GGUF file holds them: Q8_0 from ``quantize_q8_0``, Q4_1 with random fp16
    scales and minima (as llama.cpp's quantizer writes: q in 0 .. 15)."""
    if fmt == "q8_0":
        q, d = cpu_decode.quantize_q8_0(torch.randn(o, k, generator=g) * 0.05)
        return q, d, None
    q = torch.randint(0, 16, (o, k), generator=g, dtype=torch.uint8)
    d = (torch.rand(o, k // 32, generator=g) * 0.01).half().float()
    m = (-torch.rand(o, k // 32, generator=g) * 0.08).half().float()
    return q, d, m


def rounding_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """|y - x @ w.T| can reach, per output, when each activation moves by up to half its
    32-block's fine step (max |x| / (127 * 254): the second int8 pass's grid), plus fp32 sums:
    the contract's tolerance."""
    m, k = x.shape
    xb = x.double().view(m, k // 32, 32)
    step = xb.abs().amax(dim=2) / (2 * 127 * 254)  # [M, K/32]
    wsum = w.double().abs().view(w.shape[0], k // 32, 32).sum(dim=2)  # [O, K/32]
    return step @ wsum.T + 1e-5 * (x.double().abs() @ w.double().abs().T)


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_products_are_within_the_activations_rounding(fmt: str, dtype: torch.dtype) -> None:
    """Every output within ``rounding_bound`` of float64 on the dequantized weights (bf16
    outputs: plus their own rounding), batch-invariant (a row alone is bit-identical), and
    exact to fp32 sums where the activations are exactly representable."""
    if cpu_decode.no_vnni():  # the fallback's build (test_every_branch_this_cpu_can_run...)
        assert not cpu_decode.load_extension().vnni()
    g = torch.Generator().manual_seed(7)
    for rows, o, k in [(1, 576, 576), (3, 200, 96), (5, 33, 1536), (cpu_decode.MAX_ROWS, 50, 64)]:
        q, d, m = random_blocks(fmt, o, k, g)
        w = cpu_decode.dequantize_blocks(q, d, m, torch.float64)
        packed = cpu_decode.pack_blocks(q, d, m)
        assert packed.dtype == torch.uint8 and packed.shape[:2] == (-(-o // 16), k // 32)
        x = torch.randn(rows, k, generator=g).to(dtype)
        got = cpu_decode.linear(x, packed, o)
        assert got.dtype == dtype and got.shape == (rows, o)
        ref = x.double() @ w.T
        bound = rounding_bound(x, w)
        if dtype == torch.bfloat16:
            bound = bound + ref.abs() * 2**-8
        err = (got.double() - ref).abs()
        assert (err <= bound).all(), f"{fmt} {rows}x{o}x{k}: {(err / bound).max():.3f} of bound"
        # The bound is not loose to the point of proving nothing: the error is a visible
        # fraction of it, and rounding the activations alone explains it.
        assert (err / bound).max() > 0.02
        for r in range(rows):
            assert torch.equal(cpu_decode.linear(x[r : r + 1], packed, o)[0], got[r])
        # Activations on their blocks' grids: nothing to round, fp32 sums only.
        steps = torch.rand(rows, k // 32, 1, generator=g) + 0.5
        ints = torch.randint(-127, 128, (rows, k // 32, 32), generator=g).float()
        ints[:, :, 0] = 127.0  # each block's max |x| sets the step exactly
        exact = (ints * steps.half().float()).view(rows, k).float()
        y = cpu_decode.linear(exact, packed, o).double()
        ref = exact.double() @ w.T
        assert ((y - ref).abs() <= 1e-5 * (exact.double().abs() @ w.abs().T) + 1e-6).all()


def test_block_packing_refuses_what_it_cannot_hold() -> None:
    g = torch.Generator().manual_seed(0)
    q, d, m = random_blocks("q4_1", 20, 64, g)
    with pytest.raises(ValueError, match="0 .. 15"):
        cpu_decode.pack_blocks(q + 16, d, m)
    with pytest.raises(ValueError, match="multiple of 32"):
        cpu_decode.quantize_q8_0(torch.randn(4, 40))
    packed = cpu_decode.pack_blocks(q, d, m)
    with pytest.raises(RuntimeError, match="block-quantized weight does not match"):
        cpu_decode.linear(torch.zeros(2, 96), packed, 20)


def test_q8_0_quantization_is_ggufs() -> None:
    """``quantize_q8_0`` writes what the ``gguf`` package's own Q8_0 quantizer writes."""
    from gguf import GGMLQuantizationType
    from gguf.quants import dequantize, quantize

    w = torch.randn(8, 96, generator=torch.Generator().manual_seed(3))
    raw = quantize(w.numpy(), GGMLQuantizationType.Q8_0)
    theirs = torch.from_numpy(dequantize(raw, GGMLQuantizationType.Q8_0).copy()).float()
    q, d = cpu_decode.quantize_q8_0(w)
    assert torch.equal(cpu_decode.dequantize_blocks(q, d, None, torch.float32), theirs)


@pytest.fixture(scope="module")
def blocks() -> dict[str, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
    from tandem.models.builtin import gguf_blocks

    return gguf_blocks()


def test_the_built_in_models_blocks_are_the_files_own_values(blocks: dict) -> None:
    """Each matrix's blocks, dequantized, equal the ``gguf`` package's dequantization of the
    file's tensors (q/k rows in Hugging Face's rotary order, fused rows stacked)."""
    from gguf import GGUFReader
    from gguf.quants import dequantize

    from tandem.models.builtin import _unpermute_rope, find_gguf

    tensors = {t.name: t for t in GGUFReader(str(find_gguf())).tensors}

    def theirs(name: str, heads: int = 0) -> torch.Tensor:
        t = tensors[name]
        w = torch.from_numpy(dequantize(t.data, t.tensor_type).copy()).float()
        return _unpermute_rope(w, heads) if heads else w

    q, d, m = blocks["model.layers.5.self_attn.qkv_proj"]
    assert q.dtype == torch.uint8 and m is not None  # Q4_1
    want = torch.cat([theirs("blk.5.attn_q.weight", 9), theirs("blk.5.attn_k.weight", 3),
                      theirs("blk.5.attn_v.weight")])  # fmt: skip
    assert torch.equal(cpu_decode.dequantize_blocks(q, d, m, torch.float32), want)
    q, d, m = blocks["model.layers.29.mlp.gate_up_proj"]
    want = torch.cat([theirs("blk.29.ffn_gate.weight"), theirs("blk.29.ffn_up.weight")])
    assert torch.equal(cpu_decode.dequantize_blocks(q, d, m, torch.float32), want)
    q, d, m = blocks["lm_head"]
    assert q.dtype == torch.int8 and m is None  # the tied Q8_0 embedding
    want = theirs("token_embd.weight")
    assert torch.equal(cpu_decode.dequantize_blocks(q, d, m, torch.float32), want)
    assert len(blocks) == 1 + 4 * 30


NUM_PROMPTS = 12
POSITIONS = 12


@pytest.mark.slow
def test_the_q4_model_follows_the_float32_model_on_its_dequantized_weights() -> None:
    """Teacher-forced over the eval prompts: at each position of the float32 model's greedy
    answer (the file's dequantized weights, no quantized product), the model on the file's Q4_1
    blocks (float32 activations: the only new error is their rounding to the 15-bit grid of two
    int8 passes) picks the same token on >= 99 % of positions (the issue asks 95 %), and the
    mean |log-probability| gap of the chosen tokens is printed and bounded. Measured here (12
    prompts x 12 positions): 144 / 144 equal, MAE 0.0002; over 24 positions 288 / 288 (one
    int8 pass, as llama.cpp quantizes activations: 278 / 288, MAE 0.034; in bfloat16
    activations 282 / 288, 0.022, against the bf16 model on the dense weights' 279 / 288,
    0.021)."""
    cpu_weights = "q4"
    from tandem import LLM, SamplingParams
    from tandem.models.builtin import builtin_model_path
    from tandem.training.data import chat_prompt_ids, load_prompts

    path = builtin_model_path()
    prompts = load_prompts(name="eval")[:NUM_PROMPTS]
    greedy = SamplingParams(temperature=0.0, max_tokens=POSITIONS, ignore_eos=True, logprobs=0)
    with LLM(path, dtype="float32", max_num_seqs=NUM_PROMPTS) as ref_llm:
        ids = [chat_prompt_ids(ref_llm.tokenizer, p) for p in prompts]
        ref = [o.outputs[0] for o in ref_llm.generate(ids, greedy)]
    prefixes, want, want_lp = [], [], []
    for p, out in zip(ids, ref, strict=True):
        for t in range(POSITIONS):
            prefixes.append(p + list(out.token_ids[:t]))
            want.append(out.token_ids[t])
            want_lp.append(out.logprobs[t].logprob)
    one = SamplingParams(temperature=0.0, max_tokens=1, logprobs=5)
    with LLM(path, dtype="float32", max_num_seqs=32, cpu_weights=cpu_weights) as llm:
        got = [o.outputs[0] for o in llm.generate(prefixes, one)]
    equal = sum(o.token_ids[0] == w for o, w in zip(got, want, strict=True))
    gaps = []
    for o, w, lp in zip(got, want, want_lp, strict=True):
        top = o.logprobs[0]
        if w in top.top_token_ids:
            gaps.append(abs(top.top_logprobs[top.top_token_ids.index(w)] - lp))
    mae = sum(gaps) / len(gaps)
    print(f"{cpu_weights}: greedy equal {equal}/{len(want)}, chosen-token logprob MAE {mae:.4f}")
    assert equal >= 0.99 * len(want)
    assert len(gaps) >= 0.99 * len(want) and mae < 0.005


def test_any_llama_model_serves_q8_blocks_held_once(tmp_path: Path) -> None:
    """``q8`` on a model without GGUF blocks: its matrices quantized at load (Q8_0 of the
    checkpoint's values), the fast path's products reading the blocks, and the dense matrices
    freed (one copy of the model in memory; the tied embedding keeps its rows)."""
    from safetensors.torch import load_file

    from tandem import LLM, SamplingParams

    folder = build_llama(tmp_path / "tiny", tie=True)
    state = load_file(str(folder / "model.safetensors"))
    with LLM(str(folder), dtype="float32", cpu_weights="q8", max_num_seqs=2) as llm:
        model = llm.engine.executor.worker.model
        layer = model.model.layers[0]
        parts = {
            layer.self_attn.qkv_proj: ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"],
            layer.mlp.down_proj: ["mlp.down_proj"],
        }
        for linear, names in parts.items():
            dense = torch.cat([state[f"model.layers.0.{n}.weight"] for n in names]).float()
            want = cpu_decode.pack_blocks(*cpu_decode.quantize_q8_0(dense), None)
            assert torch.equal(linear.fast_weight, want)
            assert linear.weight.device.type == "meta"  # freed: the blocks serve every product
        assert model.lm_head.weight.device.type == "meta"
        assert model.model.embed_tokens.weight.device.type == "cpu"
        out = llm.generate([[5, 6, 7]], SamplingParams(temperature=0.0, max_tokens=6))
        assert len(out[0].outputs[0].token_ids) == 6


def test_cpu_weights_are_refused_where_they_cannot_serve(tmp_path: Path) -> None:
    from tandem.engine.config import EngineArgs

    folder = build_llama(tmp_path / "tiny")
    with pytest.raises(ValueError, match="not the built-in model"):
        EngineArgs(model=str(folder), cpu_weights="q4").create_engine_config()
    with pytest.raises(ValueError, match="cpu_weights='int4' is invalid"):
        EngineArgs(model=str(folder), cpu_weights="int4").create_engine_config()
    with pytest.raises(ValueError, match="one rank"):
        EngineArgs(
            model=str(folder), cpu_weights="q8", tensor_parallel_size=2
        ).create_engine_config()
    assert EngineArgs(model=str(folder)).create_engine_config().model_config.cpu_weights == "dtype"
