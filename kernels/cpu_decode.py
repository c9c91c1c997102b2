"""CPU decode fast path: a Llama decoder stack in one C++ call for small batches.

``cpu_decode.cpp`` runs every layer (norms, fused QKV, rotary, paged KV write, attention over
the paged cache, MLP) for at most ``MAX_ROWS`` rows without returning to Python; the eager
modules of ``models/llama.py`` are its reference and serve every other step. It is built with
the machine's C++ compiler at first use (some 15 s of one core) into PyTorch's extension folder
(``$TORCH_EXTENSIONS_DIR``, default ``~/.cache/torch_extensions``) and loaded from there
afterwards. It is built for AVX-512 (F, BW; with BF16's dot product where the CPU has it), else
for AVX2 + FMA. ``TANDEM_CPU_FAST_DECODE=0`` turns it off; a CPU with none of these, or a failed
build, falls back to the eager path with a warning. ``TANDEM_CPU_DECODE_ISA=avx2`` (or ``avx512``)
builds a lower branch than the best one the CPU has, so one machine can test every branch it can
run; naming one the CPU lacks, or no branch at all, disables the fast path with a warning that
says so.
"""

from __future__ import annotations

import fcntl
import functools
import hashlib
import logging
import os
import shutil
import sys
import sysconfig
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
ENV_VAR = "TANDEM_CPU_FAST_DECODE"
ISA_ENV_VAR = "TANDEM_CPU_DECODE_ISA"  # build this branch, not the best one (tests, diagnosis)
# Build without the VNNI byte dot products (as for a Zen 3 EPYC or a Skylake Xeon), so a VNNI
# machine tests the block products' fallback (tests, diagnosis).
NO_VNNI_ENV_VAR = "TANDEM_CPU_DECODE_NO_VNNI"
MAX_ROWS = 64  # 2-core machine, 60 rows: fast 191 vs eager 199 ms (bf16), 147 vs 197 (fp32)
# On a 2-core Zen 3 EPYC (AVX2), built-in model prefill, fast vs eager: fp32 40 rows 121 vs
# 213-249 ms, 60 rows 101-108 vs 218-319 (best of 3, two runs); bf16 60 rows 119 vs 675.
MAX_HEAD_DIM = 256  # the attention's 16-lane chunks per head (MAX_CHUNKS in the source)
# The instruction sets it builds for, best first, with the /proc/cpuinfo flags each needs.
ISA_FLAGS = {
    "avx512_bf16": ("avx512f", "avx512bw", "avx512_bf16"),
    "avx512": ("avx512f", "avx512bw"),
    "avx2": ("avx2", "fma"),
}
# What each branch turns off from -march=native on a CPU that has more (the source picks its
# branch from the compiler's __AVX512F__ / __AVX512BF16__ macros).
ISA_CFLAGS = {"avx512_bf16": [], "avx512": ["-mno-avx512bf16"], "avx2": ["-mno-avx512f"]}
DTYPES = (torch.float32, torch.bfloat16)
NO_TREE = torch.empty(0, dtype=torch.int64)  # StepRows.tree_words of a step without tree rows

_lock = threading.Lock()
_ext: Any = None
_error: str | None = None


def enabled_by_env() -> bool:
    return os.environ.get(ENV_VAR, "1").strip().lower() not in ("0", "false", "no", "off")


@functools.cache
def cpu_flags() -> set[str]:
    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        return set()
    for line in text.splitlines():
        if line.startswith("flags"):
            return set(line.split(":", 1)[1].split())
    return set()


def runnable_isas() -> list[str]:
    """Every branch this CPU can run, best first."""
    flags = cpu_flags()
    return [name for name, need in ISA_FLAGS.items() if flags.issuperset(need)]


def isa() -> str | None:
    """The instruction set the extension builds for on this CPU: ``TANDEM_CPU_DECODE_ISA`` if set
    and runnable, else the best of ``ISA_FLAGS`` the CPU has (None: none, or a bad override)."""
    wanted = os.environ.get(ISA_ENV_VAR, "").strip()
    runnable = runnable_isas()
    if wanted:
        return wanted if wanted in runnable else None
    return runnable[0] if runnable else None


def unavailable_reason() -> str | None:
    """Why the fast path cannot run on this machine (None: it can, once built)."""
    if not enabled_by_env():
        return f"{ENV_VAR}=0"
    wanted = os.environ.get(ISA_ENV_VAR, "").strip()
    if wanted and isa() is None:
        return (
            f"{ISA_ENV_VAR}={wanted!r} is not a branch this CPU can run "
            f"(it can run: {', '.join(runnable_isas()) or 'none'}; branches: {', '.join(ISA_FLAGS)})"
        )
    if isa() is None:
        needs = "; ".join(f"{name} ({', '.join(need)})" for name, need in ISA_FLAGS.items())
        return f"the CPU has none of {needs}"
    return _error


def no_vnni() -> bool:
    return os.environ.get(NO_VNNI_ENV_VAR, "0").strip().lower() in ("1", "true", "yes", "on")


def extension_name(branch: str) -> str:
    """The module's name: the source, torch (its version and where it is installed), Python and
    the instruction set name it, so an edited source, or a cache shared with a machine of another
    kind, never loads a stale build, and installs of torch at other paths (another venv, the
    wheel's, the image's) build their own: the build's commands name torch's headers and
    libraries by path, and torch rebuilt the one folder whenever they changed, so two installs
    sharing the cache rebuilt each other's build at every start."""
    torch_dir = Path(torch.__file__).resolve().parent
    build = [
        torch.__version__,
        torch_dir,
        sys.version_info[:2],
        sysconfig.get_path("include"),
        branch,
        no_vnni(),
    ]
    key = SOURCE.read_bytes() + " ".join(map(str, build)).encode()
    return f"tandem_cpu_decode_{hashlib.sha256(key).hexdigest()[:16]}"


def build_directory(name: str) -> Path:
    """Where ``name`` is built and cached (made if missing)."""
    from torch.utils.cpp_extension import get_default_build_root  # imports setuptools: lazily

    root = Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())
    folder = root / name
    folder.mkdir(parents=True, exist_ok=True)
    return folder


def load_extension() -> Any | None:
    """The built extension module, building it on first use; None where unavailable."""
    global _ext, _error
    with _lock:
        if _ext is not None:
            return _ext
        reason = unavailable_reason()
        if reason is not None:
            return None
        branch = isa()
        try:
            from torch.utils.cpp_extension import load

            logger.info(
                "loading the CPU decode fast path for %s (the first start builds it: some 15 s)",
                branch,
            )
            # TANDEM_EXPECT_ISA: the source's static_assert that the flags picked this branch.
            expect = f'-DTANDEM_EXPECT_ISA=\\"{branch}\\"'
            name = extension_name(branch)
            folder = build_directory(name)
            # One build at a time, under a lock the kernel drops when its holder dies. torch's
            # own lock file outlives a build that was killed (Ctrl-C at the first start) and
            # would stop every later load; under ours no other build runs, so one left is stale.
            with open(folder.with_suffix(".flock"), "a") as held:
                fcntl.flock(held, fcntl.LOCK_EX)
                (folder / "lock").unlink(missing_ok=True)
                # Built from a copy inside the folder: torch rebuilds when the build file names
                # another source path, so a second copy of the package on the same torch (a
                # checkout, a reinstall elsewhere) rebuilt the first one's build. The folder's
                # name covers the source's bytes: the copy is the same file.
                source = folder / SOURCE.name
                if not source.exists():
                    shutil.copyfile(SOURCE, source)
                _ext = load(
                    name=name,
                    sources=[str(source)],
                    extra_cflags=[
                        "-O3",
                        "-march=native",
                        *ISA_CFLAGS[branch],
                        *(["-mno-avxvnni", "-mno-avx512vnni"] if no_vnni() else []),
                        expect,
                        "-fopenmp",
                    ],
                    extra_ldflags=["-fopenmp"],
                    build_directory=str(folder),
                    verbose=False,
                )
        except Exception as exc:  # no compiler, no ninja, a build error: stay on the eager path
            _error = f"its build failed ({type(exc).__name__}: {str(exc).strip()[:300]})"
            logger.warning("CPU decode fast path disabled: %s", _error)
            return None
        return _ext


def _ext_or_raise() -> Any:
    ext = load_extension()
    if ext is None:
        raise RuntimeError(f"the CPU decode fast path is unavailable: {unavailable_reason()}")
    return ext


@dataclass(frozen=True)
class StepRows:
    """What a step's rows index, in the extension's types: row ``m`` sits at ``positions[m]``,
    writes its K/V at ``slots[m]`` and attends to the first ``kv_len[m]`` keys of sequence
    ``row_seq[m]`` (whose blocks are row ``row_seq[m]`` of ``block_tables``) — or, where
    ``tree_words[m]`` is nonzero, to the keys before its sequence's step rows and the step rows
    its word names (``paged_attention``'s ``tree_mask`` contract)."""

    positions: torch.Tensor  # [M] int64
    slots: torch.Tensor  # [M] int64
    row_seq: torch.Tensor  # [M] int64
    kv_len: torch.Tensor  # [M] int64
    block_tables: torch.Tensor  # [num_seqs, max_blocks] int32
    tree_words: torch.Tensor = NO_TREE  # [M] int64, or empty: every row causal


def step_rows(
    positions: torch.Tensor,
    slot_mapping: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    query_start_loc: torch.Tensor,
    max_query_len: int,
    tree_mask: torch.Tensor | None = None,
) -> StepRows:
    """A step's rows, sequence after sequence: row ``j`` of a sequence's ``q`` query rows sees
    ``seq_len - q + j + 1`` keys (causal, the step's own keys included), the paged attention
    kernels' contract; ``tree_mask``: its tree attention words."""
    num_rows, num_seqs = positions.shape[0], seq_lens.shape[0]
    seq_lens = seq_lens.long()
    if max_query_len == 1 and num_rows == num_seqs:  # one token per sequence
        row_seq, kv_len = torch.arange(num_rows), seq_lens
    else:
        qsl = query_start_loc.long()
        qlens = qsl[1:] - qsl[:-1]
        row_seq = torch.repeat_interleave(torch.arange(num_seqs), qlens, output_size=num_rows)
        j = torch.arange(num_rows) - qsl[row_seq]
        kv_len = seq_lens[row_seq] - qlens[row_seq] + j + 1
    return StepRows(
        positions.long().contiguous(),
        slot_mapping.long().contiguous(),
        row_seq,
        kv_len.contiguous(),
        block_tables.to(torch.int32).contiguous(),
        NO_TREE if tree_mask is None else tree_mask.long().contiguous(),
    )


def pack(weight: torch.Tensor) -> torch.Tensor:
    """A copy of ``weight`` [O, K] in the layout the extension's matrix products read (16
    output features side by side; bfloat16 pairs along K). Inference only: it does not follow
    later in-place updates of ``weight``."""
    return _ext_or_raise().pack(weight.detach().contiguous())


QBLOCK = 32  # weights along K per Q8_0 / Q4_1 block
# A matrix in blocks: (q [O, K], d [O, K / 32], m [O, K / 32] for Q4_1 or None for Q8_0).
Blocks = tuple[torch.Tensor, torch.Tensor, "torch.Tensor | None"]


def quantize_q8_0(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """GGUF's Q8_0 of ``weight`` [O, K] (K a multiple of 32): (q int8 [O, K], d float32
    [O, K / 32]) with ``weight ~ d * q`` per 32-block, as the format's reference quantizer
    writes it: d = max |w| / 127, q = w * (1 / d) rounded half away from zero, d stored as
    fp16."""
    o, k = weight.shape
    if k % QBLOCK:
        raise ValueError(f"Q8_0 needs rows of a multiple of {QBLOCK} weights, got {k}")
    w = weight.detach().float().view(o, k // QBLOCK, QBLOCK)
    d = w.abs().amax(dim=2) / 127.0
    inv = torch.where(d > 0, 1.0 / d.clamp_min(1e-30), 0.0)
    x = w * inv[..., None]
    q = torch.sign(x) * torch.floor(x.abs() + 0.5)
    return q.clamp(-127, 127).to(torch.int8).view(o, k), d.half().float()


def dequantize_blocks(
    q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None, dtype: torch.dtype
) -> torch.Tensor:
    """``d * q + m`` per 32-block along K (``m`` None: Q8_0), computed in fp32 (what llama.cpp's
    reference computes) and rounded to ``dtype``."""
    o, k = q.shape
    w = q.float().view(o, k // QBLOCK, QBLOCK) * d.float()[..., None]
    if m is not None:
        w = w + m.float()[..., None]
    return w.view(o, k).to(dtype)


def pack_blocks(q: torch.Tensor, d: torch.Tensor, m: torch.Tensor | None) -> torch.Tensor:
    """Q8_0 (``q`` int8, ``m`` None) or Q4_1 (``q`` uint8 in 0 .. 15, ``m`` the blocks' minima)
    weights [O, K] with their fp16-exact scales [O, K / 32] in the layout the extension's products
    read (``cpu_decode.cpp``, "block-quantized weights"): uint8 [ceil(O / 16), K / 32, 576 or
    320]. Padding outputs have scale 0."""
    o, k = q.shape
    nb, nkb = -(-o // 16), k // QBLOCK
    if k % QBLOCK or tuple(d.shape) != (o, nkb) or (m is not None and tuple(m.shape) != (o, nkb)):
        raise ValueError(f"pack_blocks: q [O, K] with K % 32 == 0 and scales [O, K/32]: {q.shape}")
    if m is None:
        u = (q.to(torch.int16) + 128).to(torch.uint8)  # w = d * u - 128 d
        c = -128.0 * d.float()
    else:
        if q.dtype != torch.uint8 or int(q.max()) > 15:
            raise ValueError("pack_blocks: Q4_1 values must be uint8 in 0 .. 15")
        u, c = q, m.float()
    pad = nb * 16 - o
    u = torch.cat([u, u.new_zeros(pad, k)]) if pad else u
    d = torch.cat([d.float(), d.new_zeros(pad, nkb, dtype=torch.float32)]) if pad else d.float()
    c = torch.cat([c, c.new_zeros(pad, nkb)]) if pad else c
    if m is None:  # [nb, 16 lanes, nkb, 8 groups, 4] -> [nb, nkb, 8, 16, 4]
        body = u.view(nb, 16, nkb, 8, 4).permute(0, 2, 3, 1, 4).reshape(nb, nkb, 512)
    else:  # K 4g + i in the low nibble, K 16 + 4g + i in the high one
        halves = u.view(nb, 16, nkb, 2, 4, 4)
        nibbles = halves[:, :, :, 0] | (halves[:, :, :, 1] << 4)
        body = nibbles.permute(0, 2, 3, 1, 4).reshape(nb, nkb, 256)

    def scales(x: torch.Tensor) -> torch.Tensor:
        return x.half().view(nb, 16, nkb).permute(0, 2, 1).contiguous().view(torch.uint8)

    return torch.cat([body, scales(d), scales(c)], dim=2).contiguous()


def llama_stack(
    x: torch.Tensor,
    rows: StepRows,
    weights: list[torch.Tensor],
    caches: list[torch.Tensor],
    final_norm: torch.Tensor,
    cos_sin: torch.Tensor,
    shape: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    capture: list[int],
) -> list[torch.Tensor]:
    """One call of the extension: ``x`` [M, hidden] embeddings → [final normed hidden, the
    residual stream after each ``capture`` layer]. ``weights``: per layer input norm, QKV, O,
    post-attention norm, gate/up, down, the matrices ``pack``-ed; ``caches``: per layer K, V.
    ``shape``: (num_heads, num_kv_heads, head_dim, block_size, intermediate_size)."""
    return _ext_or_raise().llama_stack(
        x, *_row_args(rows), weights, caches, final_norm, cos_sin, *shape, eps, scale, capture
    )


def _row_args(rows: StepRows) -> tuple[torch.Tensor, ...]:
    return rows.positions, rows.slots, rows.row_seq, rows.kv_len, rows.block_tables, rows.tree_words


def linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """``x @ weight.T`` (``x`` [M, K]; ``packed``: ``pack(weight)``, weight [out_features, K]
    in x's dtype, or ``pack_blocks``), each block of the weight read from memory once for all rows
    (fp32 accumulation, output in x's dtype)."""
    return _ext_or_raise().linear(x, packed, out_features)


def eagle3_layer(
    embeds: torch.Tensor,
    hidden: torch.Tensor,
    pick: list[int],
    rows: StepRows,
    weights: list[torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    cos_sin: torch.Tensor,
    shape: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
) -> torch.Tensor:
    """The Eagle3 midlayer: attention over ``cat[norm(embeds), hidden_norm(hidden)]`` on every
    row (each writes its draft KV), residual add and MLP on the ``pick`` rows (empty: all).
    ``weights``: input norm, hidden norm, QKV, O, post-attention norm, gate/up, down (the
    matrices ``pack``-ed); ``shape`` as for ``llama_stack``. Returns
    the pre-norm output [len(pick) or M, hidden]."""
    return _ext_or_raise().eagle3_layer(
        embeds, hidden, pick, *_row_args(rows), weights, *caches, cos_sin, *shape, eps, scale
    )


def argmax(x: torch.Tensor) -> torch.Tensor:
    """``x.argmax(-1)`` (the first maximal index; a row's first NaN wins), through the
    extension's vector pass for CPU tensors in bfloat16 or float32 once it is loaded (16 rows of
    49152 bfloat16 logits: 44 us against torch's 1.0 ms after a float copy, 2-core Xeon), else
    torch's. Greedy sampling and drafting call it every step."""
    ext = _ext
    if ext is None or x.device.type != "cpu" or x.dtype not in DTYPES or 0 in (x.dim(), x.numel()):
        return x.argmax(dim=-1)  # (empty or 0-d: torch's own result or error)
    return ext.argmax_rows(x.reshape(-1, x.shape[-1])).reshape(x.shape[:-1])


def eagle3_chain(
    hidden: torch.Tensor,
    tokens: torch.Tensor,
    positions: torch.Tensor,
    block_tables: torch.Tensor,
    embedding: torch.Tensor,
    weights: list[torch.Tensor],
    caches: tuple[torch.Tensor, torch.Tensor],
    cos_sin: torch.Tensor,
    final_norm: torch.Tensor,
    lm_head: torch.Tensor,
    d2t: torch.Tensor,
    steps: int,
    shape: tuple[int, int, int, int, int],
    eps: float,
    scale: float,
    confidence: torch.Tensor | None = None,
    min_confidence: float = 0.0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Greedy Eagle3 draft steps 1 .. ``steps`` in one call, one row per request: each step
    embeds the previous draft (``embedding``: the target's, fp32 or the head's dtype), runs the
    midlayer at ``positions + j`` (writing its draft KV; ``block_tables`` [B, blocks] int32),
    the final norm, the LM head (``lm_head`` packed, over the draft vocabulary) and its argmax,
    mapped to target ids through ``d2t``. ``hidden`` [B, H] / ``tokens`` [B]: step 0's output
    and drafts. Returns ([B, steps] target ids, None).

    ``confidence`` (float32 [B], each row's product of its drafts' probabilities after step 0):
    the second result is then [B, steps], each step's running product (times the head's softmax
    probability of its argmax), and the chain stops after a step where every row's product is
    under ``min_confidence``: the steps not run repeat the row's last draft with confidence 0."""
    gauge = torch.empty(0) if confidence is None else confidence.float().contiguous()
    drafts, conf = _ext_or_raise().eagle3_chain(
        hidden,
        tokens,
        positions,
        block_tables,
        embedding,
        weights,
        *caches,
        cos_sin,
        final_norm,
        lm_head,
        d2t,
        steps,
        *shape,
        eps,
        scale,
        gauge,
        min_confidence,
    )
    return drafts, None if confidence is None else conf
