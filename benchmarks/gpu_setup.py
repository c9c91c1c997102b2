"""What the GPU benchmark's sections share (benchmarks/gpu.py, benchmarks/gpu_tree.py): the
random-weight model and draft head, their KV caches, a step's inputs, timing and tables."""

from __future__ import annotations

import argparse
import copy
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

NOMINAL_HBM = {"H200": 4.8e12, "H100": 3.35e12, "B200": 8.0e12, "A100": 2.0e12}


BLOCK_SIZE = 16


EAGLE3_DRAFT_VOCAB = 32000


def tiny_config() -> Any:
    from transformers import LlamaConfig

    return LlamaConfig(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=6,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        architectures=["LlamaForCausalLM"],
    )


class Timer:
    """Median milliseconds of ``fn`` (CUDA events on a GPU, wall clock on CPU)."""

    def __init__(self, device: Any, iters: int, warmup: int = 3) -> None:
        self.device, self.iters, self.warmup = device, iters, warmup

    def __call__(self, fn: Callable[[], object]) -> float:
        import torch

        for _ in range(self.warmup):
            fn()
        times = []
        if self.device.type == "cuda":
            torch.cuda.synchronize()
            for _ in range(self.iters):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(True)
                start.record()
                fn()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end))
        else:
            for _ in range(self.iters):
                t = time.perf_counter()
                fn()
                times.append(1000 * (time.perf_counter() - t))
        times.sort()
        return times[len(times) // 2]


def capture_graph(fn: Callable[[], object]) -> Callable[[], object]:
    """``fn`` captured in a CUDA graph (warmed up on a side stream first); returns replay."""
    import torch

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


def table(header: list[str], rows: list[list[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) + 2 for i, h in enumerate(header)]
    lines = ["".join(h.rjust(w) for h, w in zip(header, widths, strict=True))]
    lines += ["".join(c.rjust(w) for c, w in zip(r, widths, strict=True)) for r in rows]
    return "\n".join(lines)


def build_model(config: Any, device: Any, dtype: Any) -> Any:
    """Our LlamaForCausalLM with random weights, built directly on ``device``."""
    import torch

    from tandem.models.llama import LlamaForCausalLM
    from tandem.models.loader import default_dtype

    with default_dtype(dtype), torch.device(device):
        model = LlamaForCausalLM(config)
    init_random(model)
    return model.eval()


def init_random(module: Any, std: float = 0.02) -> None:
    """Normal weights for every matrix (norm weights stay ones), d2t-style buffers untouched."""
    import torch

    gen = torch.Generator(device=next(module.parameters()).device).manual_seed(0)
    with torch.no_grad():
        for p in module.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, std, generator=gen)


def weight_bytes(model: Any) -> int:
    """Bytes one decode step reads: every parameter once, less an untied input embedding."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    if not model.tie_word_embeddings:
        emb = model.model.embed_tokens.weight
        total -= emb.numel() * emb.element_size()
    return total


def bind_kv_cache(layers: list[Any], num_blocks: int, dtype: Any, device: Any) -> int:
    """One K and one V cache per attention layer; returns the bytes per cached token."""
    import torch

    per_token = 0
    for attn in layers:
        shape = (num_blocks, BLOCK_SIZE, attn.num_kv_heads, attn.head_dim)
        attn.k_cache = torch.zeros(shape, dtype=dtype, device=device)
        attn.v_cache = torch.zeros(shape, dtype=dtype, device=device)
        per_token += 2 * attn.num_kv_heads * attn.head_dim * attn.k_cache.element_size()
    return per_token


@dataclass
class StepInputs:
    input_ids: Any  # [B * ql]
    positions: Any  # [B * ql]
    meta: Any  # AttentionMetadata


def step_inputs(
    batch: int, query_len: int, seq_len: int, blocks_per_seq: int, vocab: int, device: Any
) -> StepInputs:
    """``batch`` sequences of KV length ``seq_len`` (this step's ``query_len`` rows last), each
    on its own ``blocks_per_seq`` blocks."""
    import torch

    from tandem.models.attention import AttentionMetadata

    tables = torch.arange(batch * blocks_per_seq, device=device, dtype=torch.int32)
    tables = tables.view(batch, blocks_per_seq)
    pos = torch.arange(seq_len - query_len, seq_len, device=device)  # [ql]
    slots = tables[:, pos // BLOCK_SIZE].long() * BLOCK_SIZE + pos % BLOCK_SIZE  # [B, ql]
    meta = AttentionMetadata(
        slot_mapping=slots.reshape(-1),
        block_tables=tables,
        seq_lens=torch.full((batch,), seq_len, dtype=torch.int32, device=device),
        query_start_loc=torch.arange(batch + 1, dtype=torch.int32, device=device) * query_len,
        max_query_len=query_len,
        max_seq_len=seq_len,
    )
    ids = torch.randint(0, vocab, (batch * query_len,), device=device)
    return StepInputs(ids, pos.repeat(batch), meta)


@dataclass
class Setup:
    args: argparse.Namespace
    device: Any
    dtype: Any
    config: Any
    timer: Timer
    deadline: float
    failures: list[str]

    def time_left(self) -> float:
        return self.deadline - time.monotonic()


def measure_bandwidth(s: Setup) -> float:
    from tandem.bench.compare_tables import measure_memory_bandwidth

    size = (64 << 20) if s.args.smoke else (2 << 30)
    bw = measure_memory_bandwidth(size, repeats=3 if s.args.smoke else 10, device=s.device.type)
    name = device_name(s.device)
    nominal = next((v for k, v in NOMINAL_HBM.items() if k in name), None)
    print(f"\n== memory bandwidth ({name})")
    nominal_text = f"; nominal {nominal / 1e12:.2f} TB/s" if nominal else ""
    frac = f" = {bw['bandwidth'] / nominal:.0%} of nominal" if nominal else ""
    print(
        f"copy {bw['copy'] / 1e12:.3f} TB/s, sum {bw['sum'] / 1e12:.3f} TB/s "
        f"(best of N over {bw['buffer_bytes'] / 2**30:.2f} GiB){nominal_text}{frac}"
    )
    return bw["bandwidth"]


def device_name(device: Any) -> str:
    import torch

    return torch.cuda.getdevice_name(device) if device.type == "cuda" else "cpu"


def build_draft(s: Setup, model: Any) -> Any:
    """A random-weight Eagle3 head (one Llama layer of the target's shape) bound to ``model``,
    with its own KV cache; ``free_draft`` releases the cache."""
    import torch

    from tandem.models.eagle3 import Eagle3Draft
    from tandem.models.loader import default_dtype
    from tandem.models.parallel import ParallelMapping

    cfg = copy.deepcopy(s.config)
    cfg.num_hidden_layers = 1
    cfg.draft_vocab_size = min(EAGLE3_DRAFT_VOCAB, s.config.vocab_size)
    with default_dtype(s.dtype), torch.device(s.device):
        draft = Eagle3Draft(cfg, s.config, ParallelMapping())
    init_random(draft)
    draft.bind_target(model)
    draft.eval()
    bind_kv_cache(draft.attention_layers(), s.args.num_blocks, s.dtype, s.device)
    return draft


def free_draft(draft: Any) -> None:
    """Release the KV cache ``build_draft`` bound."""
    import torch

    for attn in draft.attention_layers():
        attn.k_cache = attn.v_cache = torch.empty(0)


def capture_layers(config: Any) -> tuple[int, ...]:
    """The target layers an Eagle3 head reads (its default choice)."""
    layers = config.num_hidden_layers
    return (1, layers // 2 - 1, layers - 4)
