"""What the AOT tool compiles (`benchmarks/aot.py`): every Triton launch the kernels' entry points
make on fake CUDA tensors (shapes and dtypes, no memory, no device), at the shapes each shipped
preset serves, recorded as distinct variants (constexprs, argument dtypes, launch options)."""

from __future__ import annotations

import contextlib
import inspect
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from tandem.bench.shapes import MODELS, PRESET_MODEL, UNPRESET_MODELS
from tandem.engine.presets import PRESETS_DIR, load_preset

KS = range(1, 9)


TREE_NODES = (4, 8, 16, 63)  # num_draft_tokens of draft trees


DTYPES = (torch.bfloat16, torch.float16)


_TYPE = {
    torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int64: "i64",
    torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
    torch.float8_e4m3fn: "fp8e4nv",
}  # fmt: skip


@dataclass(frozen=True)
class Variant:
    kernel: str
    name: str  # constexprs, pointer dtypes and options, readable
    fn: Any = field(compare=False, hash=False)
    signature: tuple[tuple[str, str], ...]
    constexprs: tuple[tuple[str, Any], ...]
    options: tuple[tuple[str, int], ...]


@dataclass
class Shape:
    """One preset's serving shape: what the kernels see on one rank."""

    preset: str
    family: str
    tp: int
    adp: bool
    k: int
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int


def preset_shapes(names: list[str] | None = None) -> list[Shape]:
    shapes = []
    for path in sorted(PRESETS_DIR.glob("*.yaml")):
        if names and path.stem not in names:
            continue
        if path.stem not in PRESET_MODEL:
            raise ValueError(f"preset {path.stem}: add the model it serves to PRESET_MODEL")
        p = load_preset(path)
        spec = p.get("speculative_config") or {}
        shapes.append(
            Shape(
                preset=path.stem,
                family=PRESET_MODEL[path.stem],
                tp=int(p.get("tensor_parallel_size", 1)),
                adp=bool(p.get("enable_attention_dp", False)),
                k=int(spec.get("num_speculative_tokens", 3)),
                block_size=int(p.get("block_size", 16)),
                max_num_seqs=int(p.get("max_num_seqs", 64)),
                max_num_batched_tokens=int(p.get("max_num_batched_tokens") or 2048),
            )
        )
    for name, (family, tp) in UNPRESET_MODELS.items():  # the engine's defaults
        if not names or name in names:
            shapes.append(Shape(name, family, tp, False, 3, 16, 256, 2048))
    return shapes


def _signature(fn: Any, args: tuple[Any, ...]) -> tuple[dict[str, str], dict[str, Any]]:
    names = list(inspect.signature(fn.fn).parameters)
    constexpr = {p.name for p in fn.params if p.is_constexpr}
    sig: dict[str, str] = {}
    consts: dict[str, Any] = {}
    for name, value in zip(names, args, strict=True):
        if name in constexpr:
            sig[name], consts[name] = "constexpr", value
        elif isinstance(value, torch.Tensor):
            sig[name] = "*" + _TYPE[value.dtype]
        elif isinstance(value, bool):
            sig[name] = "i1"
        elif isinstance(value, int):
            sig[name] = "i32" if -(2**31) <= value < 2**31 else "i64"
        elif isinstance(value, float):
            sig[name] = "fp32"
        else:
            raise TypeError(f"{fn.fn.__name__}: argument {name}={value!r} has no Triton type")
    return sig, consts


@contextlib.contextmanager
def recording() -> Iterator[list[Variant]]:
    """Every kernel launch records its variant instead of running."""
    from tandem.kernels.launch import launch_hook

    found: list[Variant] = []

    def record(
        kernel: Any, grid: tuple[int, ...], device: torch.device, *args: Any, **options: int
    ) -> None:
        del grid, device
        sig, consts = _signature(kernel, args)
        opts = {"num_warps": 4, "num_stages": 3, **options}  # Triton's CUDA defaults
        ptrs = ",".join(t[1:] for t in sig.values() if t.startswith("*"))
        label = " ".join(f"{k}={v}" for k, v in consts.items())
        label += f" | {ptrs} | w{opts['num_warps']} s{opts['num_stages']}"
        found.append(
            Variant(
                kernel.fn.__name__.lstrip("_"),
                label,
                kernel,
                tuple(sig.items()),
                tuple(consts.items()),
                tuple(sorted(opts.items())),
            )  # fmt: skip
        )

    with launch_hook(record):
        yield found


class _FakeCudaIndexing(torch.overrides.TorchFunctionMode):
    """Basic indexing and ``.contiguous()`` of fake CUDA tensors through aten ops: their Python
    paths take a CUDA device guard first, which a build without CUDA refuses."""

    def __torch_function__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        kwargs = kwargs or {}
        if func is torch.Tensor.contiguous:
            x = args[0]
            return x if x.is_contiguous() else x.clone(memory_format=torch.contiguous_format)
        if func is torch.Tensor.__getitem__ and _integer_tensor(args[1]):
            x, idx = args
            picked = torch.index_select(x, 0, idx.reshape(-1))
            return picked.view(*idx.shape, *x.shape[1:])
        if func is torch.Tensor.__getitem__ and _basic_index(args[1]):
            x, index = args
            index = index if isinstance(index, tuple) else (index,)
            dim = 0
            for item in index:
                if isinstance(item, slice):
                    start, stop, step = item.indices(x.shape[dim])
                    x = torch.ops.aten.slice.Tensor(x, dim, start, stop, step)
                    dim += 1
                elif item is None:
                    x = x.unsqueeze(dim)
                    dim += 1
                else:
                    x = torch.ops.aten.select.int(x, dim, int(item))
            return x
        return func(*args, **kwargs)


def _integer_tensor(index: Any) -> bool:
    return (
        isinstance(index, torch.Tensor)
        and not index.dtype.is_floating_point
        and (index.dtype != torch.bool)
    )


def _basic_index(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(isinstance(i, (slice, int)) or i is None for i in items)


def _entry_points(shape: Shape, dtype: torch.dtype) -> Iterator[tuple[str, Callable[[], Any]]]:
    """(description, call) for every kernel entry point at this shape, on fake CUDA tensors."""
    from tandem.kernels.fp8 import fp8_linear
    from tandem.kernels.moe import grouped_topk, moe_experts
    from tandem.kernels.mxfp4 import gpt_oss_experts_mxfp4
    from tandem.kernels.paged_attention import FP8_KV_DTYPE, paged_attention, write_kv_cache
    from tandem.kernels.spec_decode import (
        accept_matching,
        build_draft_step0_inputs,
        rejection_sample,
    )

    c = MODELS[shape.family]
    f = {  # the values the kernels see, by short names
        "heads": c["num_attention_heads"],
        "kv_heads": c.get("num_key_value_heads"),
        "head_dim": c.get("head_dim"),
        "vocab": c["vocab_size"],
        "hidden": c["hidden_size"],
    }
    if "kv_lora_rank" in c:
        f.update(kv_lora_rank=c["kv_lora_rank"], rope_dim=c["qk_rope_head_dim"])
    if "n_routed_experts" in c:
        f.update(
            experts=c["n_routed_experts"],
            top_k=c["num_experts_per_tok"],
            n_group=c["n_group"],
            topk_group=c["topk_group"],
            moe_inter=c["moe_intermediate_size"],
        )
    if "fp8_block" in c:
        f["fp8_block"] = c["fp8_block"]
    if "num_experts" in c:  # Qwen3-MoE: softmax routing (PyTorch), the grouped experts
        f.update(softmax_experts=c["num_experts"], top_k=c["num_experts_per_tok"])
        f["moe_inter"] = c["moe_intermediate_size"]
    if "num_local_experts" in c:  # gpt-oss: MXFP4 experts
        f.update(mxfp4_experts=c["num_local_experts"], top_k=c["experts_per_token"])
        f["moe_inter"] = c["intermediate_size"]
    dev = "cuda"

    def empty(*size: int, dt: torch.dtype = dtype) -> torch.Tensor:
        return torch.empty(*size, dtype=dt, device=dev)

    def ints(*size: int, dt: torch.dtype = torch.int64) -> torch.Tensor:
        return torch.zeros(*size, dtype=dt, device=dev)

    if "kv_lora_rank" in f:  # MLA: absorbed queries over one latent "KV head"
        heads = f["heads"] if shape.adp else f["heads"] // shape.tp
        kv_heads, head_dim = 1, f["kv_lora_rank"] + f["rope_dim"]
    else:
        heads = max(1, f["heads"] // shape.tp)
        kv_heads, head_dim = max(1, f["kv_heads"] // shape.tp), f["head_dim"]
    seqs, blocks_per_seq = 2, 64
    num_blocks = seqs * blocks_per_seq
    cache = empty(num_blocks, shape.block_size, kv_heads, head_dim)
    fp8_cache = empty(num_blocks, shape.block_size, kv_heads, head_dim, dt=FP8_KV_DTYPE)
    tables = ints(seqs, blocks_per_seq, dt=torch.int32)
    phases = {"decode": 1, "prefill": shape.max_num_batched_tokens}
    phases.update({f"verify K={k}": k + 1 for k in KS})
    # Draft trees: the root + num_draft_tokens rows with a tree mask (up to 64 rows).
    phases.update({f"tree N={n}": n + 1 for n in TREE_NODES})
    for phase, q_len in phases.items():
        t = seqs * q_len
        seq_lens = ints(seqs, dt=torch.int32)
        qsl = ints(seqs + 1, dt=torch.int32)
        tree_mask = ints(t) if phase.startswith("tree") else None

        def attend(
            t: int = t, q_len: int = q_len, seq_lens: Any = seq_lens, qsl: Any = qsl,
            tree_mask: Any = tree_mask,
        ) -> Any:  # fmt: skip
            q, kv = empty(t, heads, head_dim), empty(t, kv_heads, head_dim)  # (no views: fake
            write_kv_cache(kv, kv, cache, cache, ints(t), use_triton=True)  # CUDA views fail)
            return paged_attention(
                q, cache, cache, tables, seq_lens, qsl, 0.1, q_len, q_len + 1024,
                use_triton=True, tree_mask=tree_mask,
            )  # fmt: skip

        yield f"attention {phase}", attend

        def attend_fp8_kv(
            t: int = t, q_len: int = q_len, seq_lens: Any = seq_lens, qsl: Any = qsl,
            tree_mask: Any = tree_mask,
        ) -> Any:  # fmt: skip
            q, kv = empty(t, heads, head_dim), empty(t, kv_heads, head_dim)
            write_kv_cache(kv, kv, fp8_cache, fp8_cache, ints(t), use_triton=True,
                           k_scale=0.5, v_scale=0.25)  # fmt: skip
            return paged_attention(
                q, fp8_cache, fp8_cache, tables, seq_lens, qsl, 0.1, q_len, q_len + 1024,
                use_triton=True, tree_mask=tree_mask, k_scale=0.5, v_scale=0.25,
            )  # fmt: skip

        # --kv-cache-dtype fp8: e4m3 KV read and written by the same kernels (sm_89 and newer).
        yield f"attention {phase} fp8-kv", attend_fp8_kv
        if "sliding_window" in c:  # sinks, and a window on every other layer (trees too)
            for window in (None, c["sliding_window"]):

                def attend_sinks(
                    t: int = t, q_len: int = q_len, seq_lens: Any = seq_lens, qsl: Any = qsl,
                    window: int | None = window, tree_mask: Any = tree_mask,
                ) -> Any:  # fmt: skip
                    q = empty(t, heads, head_dim)
                    return paged_attention(
                        q, cache, cache, tables, seq_lens, qsl, 0.1, q_len, q_len + 1024,
                        use_triton=True, sinks=empty(heads, dt=torch.float32), window=window,
                        tree_mask=tree_mask,
                    )  # fmt: skip

                yield f"attention {phase} sinks window={window}", attend_sinks
    if "experts" in f:
        experts, local = f["experts"], f["experts"] // shape.tp
        for t in (1, shape.max_num_seqs * (shape.k + 1), shape.max_num_batched_tokens):
            yield f"router T={t}", lambda t=t: grouped_topk(
                empty(t, experts, dt=torch.float32), empty(experts, dt=torch.float32), f["top_k"],
                f["n_group"], f["topk_group"], True, 2.5, use_triton=True,
            )  # fmt: skip
            yield f"experts T={t}", lambda t=t: moe_experts(
                empty(t, f["hidden"]), empty(local, 2 * f["moe_inter"], f["hidden"]),
                empty(local, f["hidden"], f["moe_inter"]), empty(t, f["top_k"], dt=torch.float32),
                ints(t, f["top_k"]), 0, use_triton=True,
            )  # fmt: skip
            if "fp8_block" in f:  # the released weights: FP8 experts
                h, i, (bn, bk) = f["hidden"], f["moe_inter"], f["fp8_block"]
                yield f"FP8 experts T={t}", lambda t=t, h=h, i=i, bn=bn, bk=bk: moe_experts(
                    empty(t, h), empty(local, 2 * i, h, dt=torch.float8_e4m3fn),
                    empty(local, h, i, dt=torch.float8_e4m3fn),
                    empty(t, f["top_k"], dt=torch.float32), ints(t, f["top_k"]), 0,
                    fp8_scales=(
                        empty(local, -(-2 * i // bn), -(-h // bk), dt=torch.float32),
                        empty(local, -(-h // bn), -(-i // bk), dt=torch.float32), (bn, bk),
                    ),
                    use_triton=True,
                )  # fmt: skip
    if "softmax_experts" in f:
        local, h, i = f["softmax_experts"] // shape.tp, f["hidden"], f["moe_inter"]
        for t in (1, shape.max_num_seqs * (shape.k + 1), shape.max_num_batched_tokens):
            yield f"experts T={t}", lambda t=t: moe_experts(
                empty(t, h), empty(local, 2 * i, h), empty(local, h, i),
                empty(t, f["top_k"], dt=torch.float32), ints(t, f["top_k"]), 0, use_triton=True,
            )  # fmt: skip
    if "mxfp4_experts" in f:
        local, h, i = f["mxfp4_experts"] // shape.tp, f["hidden"], f["moe_inter"]
        u8 = torch.uint8
        for t in (1, shape.max_num_seqs * (shape.k + 1), shape.max_num_batched_tokens):
            yield f"MXFP4 experts T={t}", lambda t=t: gpt_oss_experts_mxfp4(
                empty(t, h), empty(local, 2 * i, h // 32, 16, dt=u8),
                empty(local, 2 * i, h // 32, dt=u8), empty(local, 2 * i),
                empty(local, h, i // 32, 16, dt=u8), empty(local, h, i // 32, dt=u8),
                empty(local, h), empty(t, f["top_k"], dt=torch.float32), ints(t, f["top_k"]),
                0, 1.702, 7.0, use_triton=True,
            )  # fmt: skip
    b = shape.max_num_seqs
    if "fp8_block" in f:
        bn, bk = f["fp8_block"]
        n, k = 1536, f["hidden"]  # q_a_proj; the tiles depend on the rows and the blocks only
        for t in (1, b * (shape.k + 1), shape.max_num_batched_tokens):
            yield f"fp8 linear T={t}", lambda t=t: fp8_linear(
                empty(t, k), empty(n, k, dt=torch.float8_e4m3fn),
                empty(-(-n // bn), -(-k // bk), dt=torch.float32), (bn, bk), use_triton=True,
            )  # fmt: skip
    for k in KS:
        yield (
            f"accept K={k}",
            lambda k=k: accept_matching(ints(b, k + 1), ints(b, k), ints(b), use_triton=True),
        )
        v = f["vocab"]
        yield f"rejection K={k}", lambda k=k, v=v: rejection_sample(
            empty(b, k + 1, v, dt=torch.float32), empty(b, k, v, dt=torch.float32), ints(b, k),
            ints(b), empty(b, k, dt=torch.float32), empty(b, k + 1, v, dt=torch.float32),
            use_triton=True,
        )  # fmt: skip
        yield (
            f"draft step 0 K={k}",
            lambda k=k: build_draft_step0_inputs(
                ints(b),
                ints(b),
                ints(b, k + 1),
                ints(b * (k + 1)),
                ints(b),
                ints(b),
                use_triton=True,
            ),
        )


def collect_variants(shapes: list[Shape]) -> tuple[list[Variant], list[dict[str, Any]]]:
    """Distinct variants over every shape, and the entry points that failed on fake tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    seen: dict[tuple[Any, ...], Variant] = {}
    failures: list[dict[str, Any]] = []
    for shape in shapes:
        for dtype in DTYPES:
            fake = FakeTensorMode(allow_non_fake_inputs=True)
            with recording() as found, fake, _FakeCudaIndexing():
                for what, call in _entry_points(shape, dtype):
                    try:
                        call()
                    except Exception as exc:  # a data-dependent op or a host read
                        failures.append(
                            {
                                "kernel": what,
                                "variant": f"{shape.preset} {str(dtype)[6:]}",
                                "error": f"{type(exc).__name__}: {str(exc).splitlines()[0]}",
                            }
                        )
            for v in found:
                seen.setdefault((v.kernel, v.signature, v.constexprs, v.options), v)
    return list(seen.values()), failures
