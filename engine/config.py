"""Frozen engine configuration, validated at construction with errors a user can act on."""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tandem.models.device import resolve_device

logger = logging.getLogger(__name__)


def _is_moe(folder: str) -> bool:
    """Whether the model folder's config.json describes a mixture of experts."""
    try:
        raw = json.loads((Path(folder) / "config.json").read_text())
    except (OSError, ValueError):
        return False
    keys = ("n_routed_experts", "num_experts", "num_local_experts")
    return any(isinstance(raw.get(k), int) and raw[k] > 1 for k in keys)


def _require(ok: bool, name: str, value: Any, allowed: str) -> None:
    if not ok:
        raise ValueError(f"{name}={value!r} is invalid: {allowed}")


# ``max_model_len`` -1 (``--max-model-len auto``): the longest request the KV cache holds, up
# to the model's own context length; known once the KV cache is sized (engine/worker.py).
MAX_MODEL_LEN_AUTO = -1
_DECIMAL = {"k": 10**3, "m": 10**6, "g": 10**9}
_BINARY = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}


def parse_max_model_len(value: int | str | None) -> int | None:
    """An int, None (the model's own length), -1 or "auto" (``MAX_MODEL_LEN_AUTO``), or a
    length with a unit: "32k" is 32,000, "32K" 32,768, "1.5m" 1,500,000."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if not isinstance(value, str):
        raise ValueError(f"max_model_len={value!r} is invalid: an integer, 'auto' or e.g. '32k'")
    text = value.strip()
    if text.lower() in ("auto", "-1"):
        return MAX_MODEL_LEN_AUTO
    scale = _DECIMAL.get(text[-1:]) or _BINARY.get(text[-1:]) or 1
    number = text[:-1] if scale != 1 else text
    try:
        length = float(number) * scale
    except ValueError:
        length = float("nan")
    if not (math.isfinite(length) and length >= 1 and length == int(length)):
        raise ValueError(
            f"max_model_len={value!r} is invalid: a positive number of tokens (e.g. 8192, 32k = "
            "32,000, 32K = 32,768) or 'auto' (the longest that the KV cache holds)"
        )
    return int(length)


def model_context_length(hf_config: Any) -> int | None:
    """The context length the checkpoint states (``max_position_embeddings``), None if none."""
    value = getattr(hf_config, "max_position_embeddings", None)
    return int(value) if isinstance(value, int) and value > 0 else None


@dataclass(frozen=True)
class ModelConfig:
    model: str
    hf_config: Any
    dtype: torch.dtype
    max_model_len: int
    tokenizer: str
    seed: int = 0
    served_model_name: str = ""
    # --max-model-len auto: ``max_model_len`` is the model's own length, an upper bound that the
    # ranks lower to the longest request their KV cache holds (``fitted_max_model_len``).
    fit_max_model_len: bool = False
    # The folder whose generation_config.json gives the server's sampling defaults; None: none
    # (OpenAI's defaults). End-of-sequence ids always come from the model folder.
    generation_config: str | None = None
    # The CPU fast path's matrices: "dtype" (the model's weights in ``dtype``), "q8" (Q8_0
    # blocks quantized at load) or "q4" (the built-in model's own GGUF blocks: Q4_1, Q8_0 LM
    # head); see ``EngineArgs.cpu_weights``.
    cpu_weights: str = "dtype"

    @property
    def vocab_size(self) -> int:
        return int(self.hf_config.vocab_size)

    @property
    def num_layers(self) -> int:
        return int(self.hf_config.num_hidden_layers)


KV_CACHE_DTYPES = ("auto", "fp8", "fp8_e4m3")


def fp8_kv_unavailable(device: torch.device) -> str | None:
    """Why an FP8 KV cache cannot serve on ``device`` (None: it can). CPUs read it on the
    PyTorch path; on a GPU the Triton kernels convert e4m3 in registers, which needs what FP8
    weights need (Triton, compute capability 8.9 and newer)."""
    from tandem.kernels.launch import gpu_paths
    from tandem.models.quantization import fp8_compute_unavailable

    return fp8_compute_unavailable(device) if gpu_paths(device) else None


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16
    # CPU: bytes for the KV cache. CUDA: fraction of free device memory after loading weights.
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_blocks_override: int | None = None
    # "auto": the KV cache in the model's dtype; "fp8" (= "fp8_e4m3"): float8 e4m3 values with
    # a per-tensor scale per layer (the checkpoint's k_scale / v_scale, else 1.0), half the
    # bytes of bf16 per token (vLLM's --kv-cache-dtype).
    kv_cache_dtype: str = "auto"

    @property
    def fp8_kv(self) -> bool:
        return self.kv_cache_dtype != "auto"

    def __post_init__(self) -> None:
        _require(
            self.kv_cache_dtype in KV_CACHE_DTYPES,
            "kv_cache_dtype",
            self.kv_cache_dtype,
            f"one of {', '.join(KV_CACHE_DTYPES)}",
        )
        _require(
            self.block_size > 0 and self.block_size & (self.block_size - 1) == 0,
            "block_size",
            self.block_size,
            "a power of two",
        )
        _require(
            self.kv_cache_memory_bytes > 0,
            "kv_cache_memory_bytes",
            self.kv_cache_memory_bytes,
            "> 0",
        )
        _require(
            0 < self.gpu_memory_utilization <= 1,
            "gpu_memory_utilization",
            self.gpu_memory_utilization,
            "in (0, 1]",
        )
        if self.num_blocks_override is not None:
            _require(
                self.num_blocks_override > 0, "num_blocks_override", self.num_blocks_override, "> 0"
            )


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 2048
    max_waiting_requests: int = 1024

    def __post_init__(self) -> None:
        _require(self.max_num_seqs >= 1, "max_num_seqs", self.max_num_seqs, ">= 1")
        _require(
            self.max_num_batched_tokens >= 1,
            "max_num_batched_tokens",
            self.max_num_batched_tokens,
            ">= 1",
        )
        _require(self.max_model_len >= 1, "max_model_len", self.max_model_len, ">= 1")
        _require(
            self.max_waiting_requests >= 1,
            "max_waiting_requests",
            self.max_waiting_requests,
            ">= 1",
        )


def split_host_port(addr: str, name: str = "dist_init_addr") -> tuple[str, int]:
    """'HOST:PORT' (IPv6 as '[::1]:PORT') -> (host, port); ValueError naming ``name`` if not."""
    host, sep, port = addr.rpartition(":")
    host = host.removeprefix("[").removesuffix("]")
    if not sep or not host or not port.isdigit() or not 0 < int(port) < 65536:
        raise ValueError(f"{name}={addr!r} is invalid: HOST:PORT, e.g. 10.0.0.1:29500")
    return host, int(port)


@dataclass(frozen=True)
class ParallelConfig:
    """``tensor_parallel_size`` ranks in all, ``tensor_parallel_size // nnodes`` on each node.
    Node 0 hosts rank 0 and the rendezvous at ``dist_init_addr``; the other nodes run headless
    ranks (``tandem serve ... --node-rank R``).

    ``data_parallel_size`` N: N replicas of all that (each its own TP group and engine process)
    behind one API process (engine/dp_client.py). With ``enable_attention_dp`` it keeps its
    attention-DP meaning instead: it must equal the attention-DP width (the tensor-parallel
    size) and creates no replicas.

    MoE experts are always placed whole over the ranks (models/expert_parallel.py).
    ``enable_expert_parallel`` (or ``expert_parallel_size`` > 1, which must equal the ranks):
    under attention DP, rows travel all-to-all to their experts' ranks instead of being
    all-gathered to every rank. ``enable_eplb``: expert load balancing every
    ``eplb_step_interval`` engine steps from the loads of the last ``eplb_window_size`` steps,
    with ``num_redundant_experts`` extra copies per MoE layer (needs expert parallelism over more
    than one rank)."""

    tensor_parallel_size: int = 1
    enable_attention_dp: bool = False
    enable_lm_head_tp_in_adp: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None  # HOST:PORT of node 0's rendezvous; needed when nnodes > 1
    data_parallel_size: int = 1
    enable_expert_parallel: bool = False
    expert_parallel_size: int | None = None
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_step_interval: int = 3000
    eplb_window_size: int = 1000

    def __post_init__(self) -> None:
        _require(
            self.tensor_parallel_size >= 1,
            "tensor_parallel_size",
            self.tensor_parallel_size,
            ">= 1",
        )
        dp = self.data_parallel_size
        _require(
            isinstance(dp, int) and not isinstance(dp, bool) and dp >= 1,
            "data_parallel_size",
            dp,
            "an integer >= 1",
        )
        if self.enable_attention_dp and dp not in (1, self.tensor_parallel_size):
            raise ValueError(
                f"data_parallel_size={dp} with enable_attention_dp=True must equal the "
                f"attention-DP width, tensor_parallel_size={self.tensor_parallel_size} (there it "
                "means attention DP over the tensor-parallel ranks, not replicas)"
            )
        if self.num_replicas > 1 and self.nnodes > 1:
            raise ValueError(
                f"data_parallel_size={dp} with nnodes={self.nnodes} is not supported: replicas "
                "run on node 0 only (start one server per node group instead)"
            )
        if self.enable_lm_head_tp_in_adp and not self.enable_attention_dp:
            raise ValueError("enable_lm_head_tp_in_adp=True requires enable_attention_dp=True")
        _require(self.nnodes >= 1, "nnodes", self.nnodes, ">= 1")
        _require(
            0 <= self.node_rank < self.nnodes,
            "node_rank",
            self.node_rank,
            f"in [0, nnodes={self.nnodes})",
        )
        if self.tensor_parallel_size % self.nnodes:
            raise ValueError(
                f"tensor_parallel_size={self.tensor_parallel_size} is not divisible by "
                f"nnodes={self.nnodes}: every node runs tensor_parallel_size / nnodes ranks"
            )
        if self.nnodes > 1 and self.dist_init_addr is None:
            raise ValueError(
                f"nnodes={self.nnodes} needs dist_init_addr (--dist-init-addr HOST:PORT, or "
                "--master-addr and --master-port): node 0's address that every node can reach"
            )
        if self.dist_init_addr is not None:
            split_host_port(self.dist_init_addr)
        self._check_expert_parallel()

    def _check_expert_parallel(self) -> None:
        ep, tp = self.expert_parallel_size, self.tensor_parallel_size
        if ep is not None:
            _require(
                isinstance(ep, int) and not isinstance(ep, bool) and ep >= 1,
                "expert_parallel_size",
                ep,
                "an integer >= 1",
            )
            if ep != tp:
                raise ValueError(
                    f"expert_parallel_size={ep} must equal the engine's ranks, "
                    f"tensor_parallel_size={tp}: experts are spread over every rank (attention "
                    "DP or TP inside, EP across)"
                )
        r = self.num_redundant_experts
        _require(
            isinstance(r, int) and not isinstance(r, bool) and r >= 0,
            "num_redundant_experts",
            r,
            "an integer >= 0",
        )
        for name in ("eplb_step_interval", "eplb_window_size"):
            n = getattr(self, name)
            _require(isinstance(n, int) and not isinstance(n, bool) and n >= 1, name, n, ">= 1")
        if r and not self.enable_eplb:
            raise ValueError(
                f"num_redundant_experts={r} needs enable_eplb=True (--enable-eplb): the copies "
                "are placed by the load balancer"
            )
        if self.enable_eplb and not self.expert_parallel:
            raise ValueError("enable_eplb=True needs expert parallelism (--enable-expert-parallel)")
        if self.enable_eplb and tp == 1:
            raise ValueError(
                "enable_eplb=True needs more than one rank (--tensor-parallel-size): one rank "
                "holds every expert"
            )

    @property
    def expert_parallel(self) -> bool:
        return self.enable_expert_parallel or (self.expert_parallel_size or 1) > 1

    @property
    def num_replicas(self) -> int:
        """Model replicas behind the API process (1 under attention DP)."""
        return 1 if self.enable_attention_dp else self.data_parallel_size

    @property
    def ranks_per_node(self) -> int:
        return self.tensor_parallel_size // self.nnodes

    @property
    def node_ranks(self) -> range:
        """The global ranks this node runs."""
        return range(
            self.node_rank * self.ranks_per_node, (self.node_rank + 1) * self.ranks_per_node
        )


@dataclass(frozen=True)
class CUDAGraphConfig:
    """CUDA graphs for generation-only steps (captured at start-up, replayed per step).

    ``enforce_eager``: never capture (every step runs eagerly). ``cuda_graph_batch_sizes``: the
    padded batch sizes to capture, ascending; None: 1, 2, 4, 8, then multiples of 8 up to
    ``max_num_seqs``. Sizes above ``max_num_seqs`` are refused (``EngineArgs``). CPU never
    captures."""

    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] | None = None

    def __post_init__(self) -> None:
        sizes = self.cuda_graph_batch_sizes
        if sizes is not None:
            _require(
                len(sizes) >= 1
                and all(isinstance(b, int) and not isinstance(b, bool) and b >= 1 for b in sizes)
                and list(sizes) == sorted(set(sizes)),
                "cuda_graph_batch_sizes",
                sizes,
                "a non-empty, strictly ascending list of integers >= 1",
            )


SPEC_METHODS = ("eagle3", "mtp", "ngram", "draft_model", "suffix")
# Drafts from the requests' own text (suffix: and recent outputs): no draft model.
DRAFTLESS_METHODS = ("ngram", "suffix")
NGRAM_DEFAULT_LOOKUP = 5  # prompt_lookup_min / _max when neither is given (as vLLM)
# method "suffix": each key's default (engine/speculative/suffix.py).
SUFFIX_DEFAULTS: dict[str, Any] = {
    "suffix_max_tree_nodes": 16,
    "suffix_min_probability": 0.1,
    "suffix_max_spec_factor": 1.0,
    "suffix_max_match_length": 16,
    "suffix_max_cached_requests": 64,
}
DRAFT_DTYPES = ("auto", "float32", "bfloat16", "float16")
DRAFT_VOCABS = ("auto", "full")
DRAFT_QUANTIZATIONS = ("none", "int8")


def parse_draft_len_schedule(schedule: dict[Any, Any]) -> tuple[tuple[int, int], ...]:
    """{"1": 5, "4": 3, "32": 0} -> ((1, 5), (4, 3), (32, 0)); keys are batch sizes >= 1 (one
    of them 1), values K in [0, 16], at least one of them > 0."""
    name = "speculative_config.num_speculative_tokens"
    pairs = []
    for key, value in schedule.items():
        try:
            size = int(key)
        except (TypeError, ValueError):
            size = 0
        if size < 1 or str(size) != str(key).strip():
            raise ValueError(f"{name}: schedule key {key!r} is not a batch size (an integer >= 1)")
        _require(
            isinstance(value, int) and not isinstance(value, bool) and 0 <= value <= 16,
            f"{name}[{key!r}]",
            value,
            "an integer in [0, 16]",
        )
        pairs.append((size, value))
    pairs.sort()
    if not pairs or pairs[0][0] != 1:
        raise ValueError(f'{name}: a schedule needs a value for batch size 1 (key "1")')
    if max(v for _, v in pairs) < 1:
        raise ValueError(f"{name}: a schedule whose every value is 0 never speculates")
    return tuple(pairs)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding: a draft head (or the request's own text) proposes K tokens, the
    target verifies."""

    method: str
    # K, or a schedule by batch size ({"1": 5, "4": 3, "16": 1, "32": 0}: a step of B requests
    # drafts the value of the largest key <= B; 0 proposes nothing); K is then its largest value.
    num_speculative_tokens: int = 3
    # method "ngram": the longest suffix of n tokens, n in [prompt_lookup_min,
    # prompt_lookup_max], found earlier in the request's text proposes what followed it.
    prompt_lookup_min: int | None = None
    prompt_lookup_max: int | None = None
    model: str | None = None  # draft folder; for MTP default: the target checkpoint itself
    use_rejection_sampling: bool = True
    eagle3_layers_to_capture: tuple[int, ...] | None = None
    mtp_mode: str = "eagle"  # "eagle": one MTP layer reused K times; "vanilla": K layers
    disable_draft_row_pick: bool = False
    # Steps that run at least this many requests (all ranks together) propose no drafts: the
    # next step decodes one token per request. None: always speculate.
    disable_by_batch_size: int | None = None
    # The draft head's weights, activations and KV cache (an MTP head's LM head too when it has
    # a draft vocabulary; the whole-vocabulary LM head stays the target's): "auto" is the
    # target's dtype, except for a CPU fp32 target with a head stored in bfloat16, which then
    # runs in bfloat16 (half the bytes per draft pass; verification keeps the output the
    # target's).
    draft_dtype: str = "auto"
    # MTP: "auto" drafts from the head's reduced vocabulary when its checkpoint has one (a
    # ``d2t`` tensor: a draft pass then reads only those rows of the LM head); "full" drafts
    # from the target's whole vocabulary. Either way the target verifies every token.
    draft_vocab: str = "auto"
    # "int8": the draft head's matrices (its layers, fc / eh_proj and its own LM head; never the
    # target's) become Q8_0 blocks (int8, an fp16 scale per 32 weights) at start-up, and the CPU
    # fast path's draft passes read those (0.56 of a bfloat16 head's bytes); verification keeps
    # the output the target's. CPU only, with the fast path.
    draft_quantization: str = "none"
    # Draft trees (issue #35): every node proposes its ``topk`` best children per depth
    # (num_speculative_tokens depths) and the ``num_draft_tokens`` best nodes by cumulative draft
    # log-probability are verified in one target forward. topk = 1: the chain (num_draft_tokens
    # then equals num_speculative_tokens, its default).
    topk: int = 1
    num_draft_tokens: int | None = None
    # method "suffix": a draft tree (num_speculative_tokens deep) from counts of what followed
    # the request's latest tokens in its own text and in recent outputs: at most
    # suffix_max_tree_nodes nodes, each of estimated probability >= suffix_min_probability, at
    # most suffix_max_spec_factor * (matched tokens) deep; matches of at most
    # suffix_max_match_length tokens; the outputs of the last suffix_max_cached_requests
    # finished requests are kept (0: none). None: SUFFIX_DEFAULTS.
    suffix_max_tree_nodes: int | None = None
    suffix_min_probability: float | None = None
    suffix_max_spec_factor: float | None = None
    suffix_max_match_length: int | None = None
    suffix_max_cached_requests: int | None = None
    # method "draft_model": the draft model's tensor-parallel size, 1 (replicated on every
    # rank) or the target's (sharded like it); None: the target's.
    draft_tensor_parallel_size: int | None = None
    # The schedule as ((batch size, K), ...) ascending, from a dict num_speculative_tokens; ()
    # for a fixed K.
    draft_len_schedule: tuple[tuple[int, int], ...] = ()
    # Per-request draft length from the request's own acceptance, within the step's K
    # (engine/speculative/adaptive.py); chains only.
    adaptive: bool = False
    # With adaptive: time the decode steps and run a step without drafts where plain decoding
    # measured more tokens per second (engine/speculative/adaptive.py, StepCosts).
    cost_aware: bool = False
    # With adaptive (eagle3, mtp): a request verifies only the drafts whose running product of
    # the head's own probabilities (softmax of its argmax, or q of a sampled draft) is at least
    # this, EAGLE-2 style; it may then draft up to K while the head is sure (the rate rule
    # still pauses a request whose drafts stopped paying). None: off.
    confidence_threshold: float | None = None

    def __post_init__(self) -> None:
        _require(
            self.method in SPEC_METHODS,
            "speculative_config.method",
            self.method,
            f"one of {SPEC_METHODS}",
        )
        if isinstance(self.num_speculative_tokens, dict):
            schedule = parse_draft_len_schedule(self.num_speculative_tokens)
            object.__setattr__(self, "draft_len_schedule", schedule)
            object.__setattr__(self, "num_speculative_tokens", max(v for _, v in schedule))
        k = self.num_speculative_tokens
        _require(
            isinstance(k, int) and 1 <= k <= 16,
            "speculative_config.num_speculative_tokens",
            k,
            "an integer in [1, 16]",
        )
        _require(
            self.mtp_mode in ("eagle", "vanilla"),
            "speculative_config.mtp_mode",
            self.mtp_mode,
            "'eagle' or 'vanilla'",
        )
        if self.method == "eagle3" and not self.model:
            raise ValueError(
                "speculative_config.model is required for method 'eagle3' (the draft folder)"
            )
        if self.method == "eagle3" and self.mtp_mode != "eagle":
            raise ValueError("speculative_config.mtp_mode applies to method 'mtp' only")
        self._check_ngram()
        self._check_suffix()
        self._check_draft_model()
        self._check_schedule()
        n = self.disable_by_batch_size
        if n is not None:
            _require(
                isinstance(n, int) and not isinstance(n, bool) and n >= 1,
                "speculative_config.disable_by_batch_size",
                n,
                "a positive integer (or null)",
            )
            if self.mtp_mode == "vanilla":
                # A paused step would have to write every layer's KV, and layer k reads the
                # token k + 1 ahead: not known without drafts.
                raise ValueError(
                    "speculative_config.disable_by_batch_size is not supported with "
                    "mtp_mode 'vanilla'"
                )
        _require(
            self.draft_dtype in DRAFT_DTYPES,
            "speculative_config.draft_dtype",
            self.draft_dtype,
            f"one of {DRAFT_DTYPES}",
        )
        _require(
            self.draft_vocab in DRAFT_VOCABS,
            "speculative_config.draft_vocab",
            self.draft_vocab,
            f"one of {DRAFT_VOCABS}",
        )
        _require(
            self.draft_quantization in DRAFT_QUANTIZATIONS,
            "speculative_config.draft_quantization",
            self.draft_quantization,
            f"one of {DRAFT_QUANTIZATIONS}",
        )
        if self.method != "mtp" and self.draft_vocab != "auto":
            # An Eagle3 head's vocabulary is its own LM head's.
            raise ValueError("speculative_config.draft_vocab applies to method 'mtp' only")
        self._check_tree()
        layers = self.eagle3_layers_to_capture
        if layers is not None:
            _require(
                self.method == "eagle3"
                and len(layers) >= 1
                and all(isinstance(i, int) and i >= 0 for i in layers),
                "speculative_config.eagle3_layers_to_capture",
                layers,
                "non-negative layer indices, for method 'eagle3'",
            )

    def _check_ngram(self) -> None:
        lo, hi = self.prompt_lookup_min, self.prompt_lookup_max
        if self.method != "ngram":
            if lo is not None or hi is not None:
                raise ValueError(
                    "speculative_config.prompt_lookup_min / prompt_lookup_max apply to method "
                    "'ngram' only"
                )
            return
        for key, value in (("prompt_lookup_min", lo), ("prompt_lookup_max", hi)):
            if value is not None:
                _require(
                    isinstance(value, int) and not isinstance(value, bool) and value >= 1,
                    f"speculative_config.{key}",
                    value,
                    "a positive integer",
                )
        lo = lo if lo is not None else hi if hi is not None else NGRAM_DEFAULT_LOOKUP
        hi = hi if hi is not None else lo
        if lo > hi:
            raise ValueError(
                f"speculative_config.prompt_lookup_min ({lo}) must be <= prompt_lookup_max ({hi})"
            )
        object.__setattr__(self, "prompt_lookup_min", lo)
        object.__setattr__(self, "prompt_lookup_max", hi)
        # Keys that describe a draft model: refused rather than ignored.
        given = {
            "model": self.model is not None,
            "mtp_mode": self.mtp_mode != "eagle",
            "draft_dtype": self.draft_dtype != "auto",
            "draft_quantization": self.draft_quantization != "none",
            "disable_draft_row_pick": self.disable_draft_row_pick,
            "topk": self.topk != 1,
        }
        wrong = [key for key, set_ in given.items() if set_]
        if wrong:
            raise ValueError(
                f"speculative_config: {', '.join(wrong)} do not apply to method 'ngram' (it "
                "has no draft model; topk > 1 draft trees need a draft head)"
            )

    def _check_suffix(self) -> None:
        keys = list(SUFFIX_DEFAULTS)
        if self.method != "suffix":
            given = [key for key in keys if getattr(self, key) is not None]
            if given:
                raise ValueError(
                    f"speculative_config: {', '.join(given)} apply to method 'suffix' only"
                )
            return
        for key in keys:
            if getattr(self, key) is None:
                object.__setattr__(self, key, SUFFIX_DEFAULTS[key])

        def number(value: Any) -> bool:
            return isinstance(value, (int, float)) and not isinstance(value, bool)

        def integer(value: Any) -> bool:
            return isinstance(value, int) and not isinstance(value, bool)

        from tandem.engine.speculative.tree import MAX_TREE_ROWS

        n = self.suffix_max_tree_nodes
        _require(
            integer(n) and 1 <= n <= MAX_TREE_ROWS - 1,
            "speculative_config.suffix_max_tree_nodes",
            n,
            f"an integer in [1, {MAX_TREE_ROWS - 1}] (the root and the nodes are verified as at "
            f"most {MAX_TREE_ROWS} rows)",
        )
        k = self.num_speculative_tokens
        if integer(k) and n < k:
            raise ValueError(
                f"speculative_config.suffix_max_tree_nodes ({n}) must be >= "
                f"num_speculative_tokens ({k}), the tree's depth"
            )
        p = self.suffix_min_probability
        _require(
            number(p) and 0 <= p <= 1,
            "speculative_config.suffix_min_probability",
            p,
            "a number in [0, 1]",
        )
        f = self.suffix_max_spec_factor
        _require(
            number(f) and f > 0 and math.isfinite(f),
            "speculative_config.suffix_max_spec_factor",
            f,
            "a positive number (drafts per matched token)",
        )
        m = self.suffix_max_match_length
        _require(
            integer(m) and 1 <= m <= 64,
            "speculative_config.suffix_max_match_length",
            m,
            "an integer in [1, 64]",
        )
        c = self.suffix_max_cached_requests
        _require(
            integer(c) and c >= 0,
            "speculative_config.suffix_max_cached_requests",
            c,
            "a non-negative integer (0: no outputs kept)",
        )
        if self.draft_len_schedule:
            raise ValueError(
                "speculative_config: a num_speculative_tokens schedule does not apply to method "
                "'suffix' (its tree's size follows each match; give one depth)"
            )
        # Keys of draft models and head trees: refused rather than ignored.
        given = {
            "model": self.model is not None,
            "mtp_mode": self.mtp_mode != "eagle",
            "draft_dtype": self.draft_dtype != "auto",
            "draft_quantization": self.draft_quantization != "none",
            "disable_draft_row_pick": self.disable_draft_row_pick,
            "topk": self.topk != 1,
            "num_draft_tokens": self.num_draft_tokens is not None,
        }
        wrong = [key for key, set_ in given.items() if set_]
        if wrong:
            raise ValueError(
                f"speculative_config: {', '.join(wrong)} do not apply to method 'suffix' (it has "
                "no draft model; its tree's size is suffix_max_tree_nodes)"
            )

    def _check_draft_model(self) -> None:
        tp = self.draft_tensor_parallel_size
        if self.method != "draft_model":
            if tp is not None:
                raise ValueError(
                    "speculative_config.draft_tensor_parallel_size applies to method "
                    "'draft_model' only"
                )
            return
        if not self.model:
            raise ValueError(
                "speculative_config.model is required for method 'draft_model' (a folder or "
                "Hugging Face id of a small model with the target's tokenizer)"
            )
        if tp is not None:
            _require(
                isinstance(tp, int) and not isinstance(tp, bool) and tp >= 1,
                "speculative_config.draft_tensor_parallel_size",
                tp,
                "1 or the target's tensor_parallel_size",
            )
        given = {
            "mtp_mode": self.mtp_mode != "eagle",
            "draft_vocab": self.draft_vocab != "auto",
            "draft_quantization": self.draft_quantization != "none",
            "topk": self.topk != 1,
        }
        wrong = [key for key, set_ in given.items() if set_]
        if wrong:
            raise ValueError(
                f"speculative_config: {', '.join(wrong)} do not apply to method 'draft_model' "
                "(a chain of K drafts from the model's own vocabulary, the target's)"
            )

    def _check_schedule(self) -> None:
        _require(
            isinstance(self.adaptive, bool), "speculative_config.adaptive", self.adaptive, "a bool"
        )
        if self.adaptive and (self.is_tree or self.mtp_mode == "vanilla"):
            raise ValueError(
                "speculative_config.adaptive applies to chains (topk 1) of eagle3, mtp (mode "
                "'eagle'), ngram and draft_model"
            )
        _require(
            isinstance(self.cost_aware, bool),
            "speculative_config.cost_aware",
            self.cost_aware,
            "a bool",
        )
        if self.cost_aware and not self.adaptive:
            raise ValueError(
                "speculative_config.cost_aware needs adaptive: true (it weighs the requests' "
                "running acceptance against the measured step costs)"
            )
        if self.cost_aware and self.method == "ngram":
            raise ValueError(
                "speculative_config.cost_aware applies to eagle3, mtp and draft_model (n-gram "
                "drafts cost no draft forward: a step's K is the adaptive rule's alone)"
            )
        c = self.confidence_threshold
        if c is not None:
            _require(
                isinstance(c, (int, float)) and not isinstance(c, bool) and 0.0 < c < 1.0,
                "speculative_config.confidence_threshold",
                c,
                "a number in (0, 1)",
            )
            if not self.adaptive:
                raise ValueError(
                    "speculative_config.confidence_threshold needs adaptive: true (it sets each "
                    "request's draft length from its head's confidence)"
                )
            if self.method not in ("eagle3", "mtp"):
                raise ValueError(
                    "speculative_config.confidence_threshold applies to eagle3 and mtp (the "
                    f"draft head's probabilities); method {self.method!r} has none here"
                )
            object.__setattr__(self, "confidence_threshold", float(c))
        if not self.draft_len_schedule:
            return
        if self.mtp_mode == "vanilla":
            raise ValueError(
                "speculative_config: a num_speculative_tokens schedule does not support mtp_mode "
                "'vanilla' (each of its K layers writes KV for every step)"
            )
        if self.topk != 1:
            raise ValueError(
                "speculative_config: a num_speculative_tokens schedule applies to chains "
                "(topk 1); a draft tree's shape is fixed"
            )
        if self.disable_by_batch_size is not None:
            raise ValueError(
                "speculative_config: give either a num_speculative_tokens schedule or "
                "disable_by_batch_size (a 0 in the schedule pauses speculation)"
            )

    def draft_len(self, batch_size: int) -> int:
        """The K a step of ``batch_size`` requests drafts (the schedule's, else the fixed K)."""
        k = self.num_speculative_tokens
        for at_least, value in self.draft_len_schedule:
            if batch_size >= at_least:
                k = value
        return k

    @property
    def has_draft_model(self) -> bool:
        return self.method not in DRAFTLESS_METHODS

    def _check_tree(self) -> None:
        from tandem.engine.speculative.tree import check_tree_shape

        if self.method == "suffix":
            return  # the engine's tree: _check_suffix
        k = self.num_speculative_tokens
        if self.num_draft_tokens is None and isinstance(self.topk, int) and self.topk == 1:
            object.__setattr__(self, "num_draft_tokens", k)  # the chain's
        n = self.num_draft_tokens
        if n is None:
            raise ValueError(
                f"speculative_config.num_draft_tokens is required with topk={self.topk!r} (the "
                "tree nodes verified per step, e.g. 8)"
            )
        try:
            check_tree_shape(k, self.topk, n)
        except ValueError as e:
            raise ValueError(f"speculative_config: {e}") from None
        if self.topk == 1:
            return
        rows = (k - 1) * self.topk
        if rows > 63:
            raise ValueError(
                f"speculative_config: (num_speculative_tokens - 1) * topk = {rows} must be <= 63 "
                "(the draft attends over its tree's frontier nodes with a 64-bit mask)"
            )
        if self.method == "mtp" and self.mtp_mode == "vanilla":
            raise ValueError(
                "speculative_config.topk > 1 (draft trees) does not support mtp_mode 'vanilla' "
                "yet; use topk 1 (a chain)"
            )

    @property
    def is_tree(self) -> bool:
        return self.topk > 1 or self.method == "suffix"

    @property
    def kv_lookahead(self) -> int:
        """KV positions past a request's tokens that a step may write: 2K for the chain; a
        tree's draft writes its frontier nodes, (K - 1) * topk rows, after the new root, which
        sits up to K + 1 rows past the verified root."""
        k = self.num_speculative_tokens
        if self.method == "suffix":
            # Its N nodes' verify rows (N past the root, whatever the room left); a captured
            # step's dummy request is sized as a chain of N drafts (dummy_kv_tokens): 2N.
            return 2 * int(self.suffix_max_tree_nodes or 0)
        if not self.is_tree:
            return 2 * k
        # The verify rows of a whole tree may pass max_tokens (its nodes deeper than the room
        # left are not verified): N more.
        return max(2 * k, k + 1 + (k - 1) * self.topk) + int(self.num_draft_tokens or 0)

    @classmethod
    def from_dict(cls, d: dict[str, Any] | SpeculativeConfig | None) -> SpeculativeConfig | None:
        if d is None or isinstance(d, SpeculativeConfig):
            return d
        if not isinstance(d, dict):
            raise ValueError(f"speculative_config must be a JSON object, got {type(d).__name__}")
        names = {f.name for f in dataclasses.fields(cls)} - {"draft_len_schedule"}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown speculative_config keys {unknown}; known: {sorted(names)}")
        if "method" not in d:
            raise ValueError(f"speculative_config.method is required (one of {SPEC_METHODS})")
        kw = dict(d)
        if kw.get("eagle3_layers_to_capture") is not None:
            kw["eagle3_layers_to_capture"] = tuple(kw["eagle3_layers_to_capture"])
        return cls(**kw)


@dataclass(frozen=True)
class EngineConfig:
    model_config: ModelConfig
    cache_config: CacheConfig
    scheduler_config: SchedulerConfig
    parallel_config: ParallelConfig
    device: torch.device
    speculative_config: SpeculativeConfig | None = None
    graph_config: CUDAGraphConfig = CUDAGraphConfig()
    kv_transfer_config: KVTransferConfig | None = None  # None: role "both"

    def with_max_model_len(self, max_model_len: int) -> EngineConfig:
        """This config serving ``max_model_len`` (what ``--max-model-len auto`` resolved to)."""
        if max_model_len == self.model_config.max_model_len:
            return self
        return dataclasses.replace(
            self,
            model_config=dataclasses.replace(self.model_config, max_model_len=max_model_len),
            scheduler_config=dataclasses.replace(
                self.scheduler_config, max_model_len=max_model_len
            ),
        )


KV_ROLES = ("both", "prefill", "decode")


@dataclass(frozen=True)
class KVTransferConfig:
    """Disaggregated serving (engine/kv_transfer.py): a ``prefill`` instance hands each request
    that asks for it over after its first token, holding its KV for ``timeout_s`` at
    ``host:port`` (0: a free port); a ``decode`` instance pulls it and goes on."""

    role: str
    host: str = "127.0.0.1"
    port: int = 0
    timeout_s: float = 60.0

    def __post_init__(self) -> None:
        _require(self.role in KV_ROLES[1:], "kv_role", self.role, "'prefill' or 'decode'")
        _require(0 <= self.port < 65536, "kv_transfer_port", self.port, "a port number")
        _require(self.timeout_s > 0, "kv_transfer_timeout", self.timeout_s, "> 0 seconds")


GENERATION_CONFIG_MODES = ("auto", "vllm")


CPU_WEIGHTS = ("auto", "dtype", "q8", "q4")


@dataclass
class EngineArgs:
    """Everything a user can set, flat (the CLI and ``LLM(**kwargs)`` map onto it).

    ``model``, ``tokenizer`` and the draft head's ``speculative_config["model"]``: local folders,
    or Hugging Face ids that ``with_local_folders`` fetches (``revision`` for the model,
    ``download_dir`` as the hub cache). ``max_model_len``: None is the model's own context
    length; -1 (``MAX_MODEL_LEN_AUTO``, or "auto") the longest request the KV cache holds.
    ``generation_config``: "auto" (the model folder's generation_config.json gives the server's
    sampling defaults), "vllm" (none: OpenAI's defaults) or a folder to read it from.
    ``cpu_weights``: the CPU fast path's matrices, "dtype" (the weights in ``dtype``; what "auto"
    resolves to here: ``tandem serve`` picks "q4" for the built-in model before), "q8" (Q8_0
    blocks quantized at load) or "q4" (the built-in model's own GGUF Q4_1 blocks)."""

    model: str
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    seed: int = 0
    max_model_len: int | None = None
    max_num_seqs: int = 64
    max_num_batched_tokens: int | None = None
    max_waiting_requests: int = 1024
    block_size: int = 16
    kv_cache_memory_bytes: int = 1 << 30
    gpu_memory_utilization: float = 0.9
    enable_prefix_caching: bool = True
    num_kv_blocks: int | None = None
    kv_cache_dtype: str = "auto"
    tensor_parallel_size: int = 1
    data_parallel_size: int = 1
    enable_attention_dp: bool = False
    enable_lm_head_tp_in_adp: bool = False
    nnodes: int = 1
    node_rank: int = 0
    dist_init_addr: str | None = None
    enable_expert_parallel: bool = False
    expert_parallel_size: int | None = None
    enable_eplb: bool = False
    num_redundant_experts: int = 0
    eplb_step_interval: int = 3000
    eplb_window_size: int = 1000
    kv_role: str = "both"
    kv_transfer_host: str = "127.0.0.1"
    kv_transfer_port: int = 0
    kv_transfer_timeout: float = 60.0
    served_model_name: str | None = None
    speculative_config: dict[str, Any] | None = None
    enforce_eager: bool = False
    cuda_graph_batch_sizes: tuple[int, ...] | None = None
    revision: str | None = None
    download_dir: str | None = None
    generation_config: str = "auto"
    cpu_weights: str = "auto"
    extra: dict[str, Any] = field(default_factory=dict)

    @classmethod
    def field_names(cls) -> set[str]:
        return {f.name for f in dataclasses.fields(cls)} - {"extra"}

    def _cpu_weights(self, device: torch.device) -> str:
        """``cpu_weights`` resolved: "auto" is the model's dtype (the CLI picks the built-in
        model's measured fastest before this); "q4" needs the built-in model's GGUF blocks,
        "q4" and "q8" the CPU fast path's products (a CPU device, one rank)."""
        want = self.cpu_weights
        _require(want in CPU_WEIGHTS, "cpu_weights", want, f"one of {', '.join(CPU_WEIGHTS)}")
        if want in ("auto", "dtype"):
            return "dtype"
        where = None
        if device.type != "cpu":
            where = "a CPU device"
        elif self.tensor_parallel_size != 1 or self.enable_attention_dp or self.nnodes != 1:
            where = "one rank (no tensor or attention parallelism)"
        if where is not None:
            raise ValueError(
                f"cpu_weights={want!r} needs {where}: it serves the CPU decode fast path"
            )
        if want == "q4":
            from tandem.models.builtin import builtin_source

            if builtin_source(self.model) is None:
                raise ValueError(
                    "cpu_weights='q4' serves the built-in model's own GGUF Q4_1 blocks; "
                    f"{self.model} is not the built-in model (any model can use 'q8')"
                )
        return want

    def _kv_transfer_config(self) -> KVTransferConfig | None:
        """``kv_role`` prefill / decode: under tensor parallelism each rank moves its own KV shard
        to the rank of the same index on the other side; under attention DP the rank holding a
        request moves its whole KV to the rank that will decode it (replicas and several nodes
        are not handled yet)."""
        _require(self.kv_role in KV_ROLES, "kv_role", self.kv_role, ", ".join(KV_ROLES))
        if self.kv_role == "both":
            return None
        if self.nnodes != 1 or (self.data_parallel_size != 1 and not self.enable_attention_dp):
            raise ValueError(
                f"kv_role={self.kv_role!r} runs on one node without -dp replicas for now (no "
                "--nnodes, no -dp without attention DP): the transfer addresses one engine's "
                "ranks on one host"
            )
        return KVTransferConfig(
            self.kv_role, self.kv_transfer_host, self.kv_transfer_port, self.kv_transfer_timeout
        )

    def with_local_folders(self) -> EngineArgs:
        """These arguments with each Hugging Face id (the model, the tokenizer, the draft head's
        ``model``) replaced by its local snapshot (``models/hub.py``; a local folder of that name
        wins), fetched once here so every process after reads the same folders. A model named by
        id is served under that id unless ``served_model_name`` says otherwise."""
        from tandem.models.hub import resolve_folder

        cache = self.download_dir
        model = resolve_folder(self.model, revision=self.revision, cache_dir=cache)
        served = self.served_model_name
        if served is None and model != self.model:
            served = self.model
        tokenizer = self.tokenizer
        if tokenizer is not None:
            tokenizer = resolve_folder(tokenizer, cache_dir=cache, what="tokenizer", weights=False)
        spec = self.speculative_config
        if isinstance(spec, dict) and isinstance(spec.get("model"), str):
            SpeculativeConfig.from_dict(spec)  # its own errors first, before any download
            draft = resolve_folder(spec["model"], cache_dir=cache, what="speculative_config.model")
            spec = {**spec, "model": draft}
        return dataclasses.replace(
            self,
            model=model,
            tokenizer=tokenizer,
            served_model_name=served,
            speculative_config=spec,
        ).with_moe_data_parallel()

    def with_moe_data_parallel(self) -> EngineArgs:
        """vLLM's ``--data-parallel-size N --enable-expert-parallel`` on a MoE model: one
        attention-DP group of N ranks with the experts spread over them, not N replicas; here
        ``-tp N --enable-attention-dp --enable-expert-parallel`` (logged). With ``-tp`` > 1 (vLLM's
        attention TP inside each DP rank) it is refused: attention DP here replicates
        attention."""
        dp = self.data_parallel_size
        if dp == 1 or self.enable_attention_dp or not self.enable_expert_parallel:
            return self
        if not os.path.isdir(self.model) or not _is_moe(self.model):
            return self
        if self.tensor_parallel_size != 1:
            raise ValueError(
                f"data_parallel_size={dp} with tensor_parallel_size={self.tensor_parallel_size} "
                "and expert parallelism on a MoE model: attention DP here replicates attention "
                f"on each rank (no TP inside it); use -tp {dp * self.tensor_parallel_size} "
                "--enable-attention-dp --enable-expert-parallel"
            )
        logger.info(
            "data_parallel_size=%d with expert parallelism on a MoE model: attention DP over %d "
            "ranks with the experts spread over them (as -tp %d --enable-attention-dp "
            "--enable-expert-parallel)",
            dp,
            dp,
            dp,
        )
        return dataclasses.replace(
            self, tensor_parallel_size=dp, enable_attention_dp=True, data_parallel_size=1
        )

    def _max_model_len(self, hf_config: Any) -> tuple[int, bool]:
        """(the length the config holds, whether ``auto`` may lower it to what the KV cache
        holds)."""
        want = parse_max_model_len(self.max_model_len)
        own = model_context_length(hf_config)
        if want is None or want == MAX_MODEL_LEN_AUTO:
            if own is None:
                raise ValueError(
                    "max_model_len: the model's config.json states no context length "
                    "(max_position_embeddings); pass --max-model-len N"
                )
            return own, want == MAX_MODEL_LEN_AUTO
        limit = own or 1 << 20
        _require(
            0 < want <= limit,
            "max_model_len",
            want,
            f"between 1 and the model's max_position_embeddings ({limit}), or 'auto'",
        )
        return want, False

    def _generation_config_folder(self) -> str | None:
        mode = self.generation_config
        if mode == "auto":
            return self.model
        if mode == "vllm":
            return None
        if not isinstance(mode, str) or not os.path.isdir(mode):
            raise ValueError(
                f"generation_config={mode!r} is invalid: 'auto' (the model folder's "
                "generation_config.json), 'vllm' (none: OpenAI's defaults) or a folder"
            )
        if not os.path.isfile(os.path.join(mode, "generation_config.json")):
            raise ValueError(
                f"generation_config={mode!r}: the folder has no generation_config.json"
            )
        return mode

    def create_engine_config(self) -> EngineConfig:
        from tandem.models.loader import load_hf_config, resolve_dtype

        if not os.path.isdir(self.model):
            raise ValueError(
                f"model={self.model!r} is not a local model folder (a Hugging Face id is fetched "
                "by EngineArgs.with_local_folders(), as `tandem serve` and LLM do)"
            )
        above = [b for b in self.cuda_graph_batch_sizes or () if b > self.max_num_seqs]
        if above:
            raise ValueError(
                f"cuda_graph_batch_sizes {above} exceed max_num_seqs={self.max_num_seqs}: no "
                "step is that large, so those graphs would never replay; drop them or raise "
                "max_num_seqs"
            )
        hf_config = load_hf_config(self.model)
        max_model_len, fit = self._max_model_len(hf_config)
        device = resolve_device(self.device)
        model_config = ModelConfig(
            model=self.model,
            hf_config=hf_config,
            dtype=resolve_dtype(self.dtype, hf_config),
            max_model_len=max_model_len,
            tokenizer=self.tokenizer or self.model,
            seed=self.seed,
            served_model_name=self.served_model_name
            or os.path.basename(os.path.normpath(self.model)),
            fit_max_model_len=fit,
            generation_config=self._generation_config_folder(),
            cpu_weights=self._cpu_weights(device),
        )
        batched = self.max_num_batched_tokens or max(2048, self.max_num_seqs)
        spec = SpeculativeConfig.from_dict(self.speculative_config)
        if getattr(hf_config, "model_type", None) == "gpt_oss":
            from tandem.models.gpt_oss import check_gpt_oss

            check_gpt_oss(device, hf_config)
        if self.kv_cache_dtype != "auto":
            why = fp8_kv_unavailable(device)
            if why is not None:
                raise ValueError(f"kv_cache_dtype={self.kv_cache_dtype!r} cannot serve here: {why}")
        if spec is not None and spec.draft_quantization != "none":
            # Its int8 blocks are read by the CPU fast path's products only (one rank).
            where = "a CPU device" if device.type != "cpu" else None
            if self.tensor_parallel_size != 1 or self.enable_attention_dp:
                where = "one rank (no tensor or attention parallelism)"
            if where is not None:
                raise ValueError(
                    f"speculative_config.draft_quantization={spec.draft_quantization!r} needs "
                    f"{where}: it serves the CPU decode fast path"
                )
        return EngineConfig(
            model_config=model_config,
            cache_config=CacheConfig(
                block_size=self.block_size,
                kv_cache_memory_bytes=self.kv_cache_memory_bytes,
                gpu_memory_utilization=self.gpu_memory_utilization,
                enable_prefix_caching=self.enable_prefix_caching,
                num_blocks_override=self.num_kv_blocks,
                kv_cache_dtype=self.kv_cache_dtype,
            ),
            scheduler_config=SchedulerConfig(
                max_num_seqs=self.max_num_seqs,
                max_num_batched_tokens=batched,
                max_model_len=max_model_len,
                max_waiting_requests=self.max_waiting_requests,
            ),
            parallel_config=ParallelConfig(
                tensor_parallel_size=self.tensor_parallel_size,
                enable_attention_dp=self.enable_attention_dp,
                enable_lm_head_tp_in_adp=self.enable_lm_head_tp_in_adp,
                nnodes=self.nnodes,
                node_rank=self.node_rank,
                dist_init_addr=self.dist_init_addr,
                data_parallel_size=self.data_parallel_size,
                enable_expert_parallel=self.enable_expert_parallel,
                expert_parallel_size=self.expert_parallel_size,
                enable_eplb=self.enable_eplb,
                num_redundant_experts=self.num_redundant_experts,
                eplb_step_interval=self.eplb_step_interval,
                eplb_window_size=self.eplb_window_size,
            ),
            device=device,
            speculative_config=spec,
            kv_transfer_config=self._kv_transfer_config(),
            graph_config=CUDAGraphConfig(
                enforce_eager=self.enforce_eager,
                cuda_graph_batch_sizes=(
                    None
                    if self.cuda_graph_batch_sizes is None
                    else tuple(self.cuda_graph_batch_sizes)
                ),
            ),
        )
