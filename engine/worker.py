"""One rank: device, model weights, KV cache and the model runner."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial
from typing import Any

import torch
import torch.distributed as dist

from tandem.engine.config import EngineConfig
from tandem.engine.cuda_graph import CUDAGraphRunner, graph_batch_sizes, graph_mode
from tandem.engine.graph_runner import GraphRunner
from tandem.engine.kv_transfer import DistKVTransfer, KVTransfer, Pull
from tandem.engine.model_runner import ModelRunner
from tandem.engine.speculative.decoder import DraftlessDecoder, SpecDecoder
from tandem.engine.speculative.draft_grammar import DraftGrammars
from tandem.engine.speculative.draft_model import DraftModelDecoder
from tandem.engine.speculative.suffix_decoder import SuffixTreeDecoder
from tandem.engine.speculative.tree_decoder import TreeDecoder
from tandem.engine.step import (
    OTHER_RANK_FAILED,
    DPStepInput,
    StepInput,
    StepOutput,
    num_dummy_blocks,
)
from tandem.engine.structured_output import GrammarCompiler
from tandem.engine.tokenizer import load_tokenizer, model_eos_token_ids
from tandem.kernels.cpu_decode import MAX_ROWS
from tandem.kernels.paged_attention import FP8_KV_DTYPE
from tandem.models.cpu_linears import (
    builtin_blocks,
    pack_cpu_linears,
    quantize_blocks_,
    release_dense_weights_,
    use_cpu_matvec_linears,
    use_cpu_matvec_lm_heads,
)
from tandem.models.llama import enable_cpu_fast_path
from tandem.models.loader import load_draft, load_model
from tandem.models.moe import ExpertBalancer
from tandem.models.parallel import ParallelMapping
from tandem.models.rotary import cover_positions

logger = logging.getLogger(__name__)


def blocks_required(config: EngineConfig) -> tuple[int, int]:
    """(blocks one request of ``max_model_len`` holds, blocks kept back for dummy requests):
    a request holds its tokens plus the draft loop's look-ahead (``kv_lookahead``: 2K slots
    for a chain, more for a tree); attention DP and CUDA graphs keep ``num_dummy_blocks`` for
    the padding requests."""
    cc, sc = config.cache_config, config.scheduler_config
    spec = config.speculative_config
    lookahead = spec.kv_lookahead if spec is not None else 0
    per_request = -(-(sc.max_model_len + lookahead) // cc.block_size)
    pc = config.parallel_config
    dummies = pc.enable_attention_dp and pc.tensor_parallel_size > 1
    dummies |= graph_mode(config.device, config.graph_config.enforce_eager) is not None
    return per_request, num_dummy_blocks(cc.block_size, lookahead) if dummies else 0


def window_group_blocks(config: EngineConfig, window: int) -> int:
    """Blocks of the window group (sliding-window layers; engine/block_manager.py): each
    running request holds its window's blocks (``window / block_size + 2``, the window
    straddling block edges) and its look-ahead's; the step's new tokens need one block per
    ``block_size`` of the token budget over all requests; one null block, and the dummy
    requests' blocks (``blocks_required``)."""
    cc, sc = config.cache_config, config.scheduler_config
    spec = config.speculative_config
    lookahead = spec.kv_lookahead if spec is not None else 0
    per_request = -(-(window + lookahead) // cc.block_size) + 2
    step = -(-sc.max_num_batched_tokens // cc.block_size)
    return 1 + sc.max_num_seqs * per_request + step + blocks_required(config)[1]


def kv_budget(config: EngineConfig) -> tuple[int, str]:
    """(bytes this rank may spend on the KV cache, the flags that change it). CUDA: a fraction
    of the memory free after the weights loaded; CPU: ``--kv-cache-memory``."""
    cc = config.cache_config
    if config.device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(config.device)
        return int(free * cc.gpu_memory_utilization), (
            f"raise --gpu-memory-utilization (now {cc.gpu_memory_utilization}) or free GPU memory"
        )
    return cc.kv_cache_memory_bytes, "raise --kv-cache-memory"


def longest_request(config: EngineConfig, num_blocks: int) -> int:
    """The longest request (prompt and output) that ``num_blocks`` hold beside the dummy
    requests' blocks, with the draft look-ahead (``blocks_required``'s rule inverted; < 1: none)."""
    spec = config.speculative_config
    lookahead = spec.kv_lookahead if spec is not None else 0
    _, reserved = blocks_required(config)
    return (num_blocks - reserved) * config.cache_config.block_size - lookahead


def kv_scales(attn: Any) -> tuple[float, float]:
    """An attention layer's FP8 KV scales (K, V); MLA's latent row has one for both."""
    if hasattr(attn, "kv_scale"):
        return attn.kv_scale, attn.kv_scale
    return attn.k_scale, attn.v_scale


def num_kv_blocks(config: EngineConfig, bytes_per_block: int, held_bytes: int = 0) -> int:
    """Blocks that fit the memory budget, capped at what the scheduler could ever use. A budget
    that cannot hold one request of ``max_model_len`` (with the draft look-ahead and the dummy
    requests' blocks) is refused here, naming the longest length that fits and the memory to
    add, rather than at the first long request; under ``--max-model-len auto`` the length is
    lowered to fit instead (``fitted_max_model_len``, once the ranks agree on the count)."""
    cc, sc = config.cache_config, config.scheduler_config
    if cc.num_blocks_override is not None:
        return cc.num_blocks_override
    budget, knob = kv_budget(config)
    budget -= held_bytes  # the window group's pool (``window_group_blocks``)
    per_request, reserved = blocks_required(config)
    cap = sc.max_num_seqs * per_request + reserved + 1
    blocks = min(budget // bytes_per_block, cap)
    need = per_request + reserved
    if blocks < need and not config.model_config.fit_max_model_len:
        add = (need - blocks) * bytes_per_block
        longest = longest_request(config, blocks)
        fix = (
            f"the longest max_model_len that fits is {longest}: pass --max-model-len {longest} "
            "(or --max-model-len auto)"
            if longest >= 1
            else "no max_model_len fits"
        )
        spec = config.speculative_config
        held = " (with the draft look-ahead)" if spec is not None else ""
        held += f" and {reserved} more are kept for dummy requests" if reserved else ""
        raise ValueError(
            f"the KV cache budget ({budget} bytes) holds {blocks} blocks of {cc.block_size} "
            f"tokens; one request of max_model_len={sc.max_model_len} needs {per_request}"
            f"{held}: {fix}, or add {add} bytes ({add / (1 << 20):.1f} MiB) to serve "
            f"{sc.max_model_len} ({knob})"
        )
    return blocks


def fitted_max_model_len(config: EngineConfig, num_blocks: int) -> int:
    """``max_model_len`` as served with ``num_blocks`` (the count all ranks agreed on, so every
    rank gets the same): the configured one, or under ``--max-model-len auto`` the longest
    request those blocks hold, up to the model's own length."""
    mc = config.model_config
    if not mc.fit_max_model_len:
        return mc.max_model_len
    longest = min(longest_request(config, num_blocks), mc.max_model_len)
    if longest < 1:
        _, reserved = blocks_required(config)
        raise ValueError(
            f"--max-model-len auto: the KV cache holds {num_blocks} blocks of "
            f"{config.cache_config.block_size} tokens, {reserved} of them kept for dummy "
            f"requests, which leaves no room for a request with the draft look-ahead "
            f"({kv_budget(config)[1]})"
        )
    return longest


def eagle3_capture_layers(spec: object, draft_config: object, num_layers: int) -> tuple[int, ...]:
    """The configured layers, else the draft checkpoint's (wherever its layout stores them,
    as output-of-layer indices: ``draft_config.eagle3_layout``, else
    ``eagle_config.eagle_aux_hidden_state_layer_ids``), else (1, L//2 - 1, L - 4) clamped
    into [0, L) (our default, so a very shallow target still gets three). Configured or
    checkpoint layers are used as given: outside [0, L) or not three is a ``ValueError`` that
    names the valid range. A layer may repeat: a head trained on a shallow target carries what
    the clamped default gave it, e.g. [1, 1, 0] for 4 layers."""
    layers = getattr(spec, "eagle3_layers_to_capture", None)
    source = "speculative_config.eagle3_layers_to_capture"
    layout = getattr(draft_config, "eagle3_layout", None)
    if layers is None and layout is not None:
        if layout.capture_error is not None:
            raise ValueError(layout.capture_error)
        layers, source = layout.capture_layers, layout.capture_source
    elif layers is None:
        eagle = getattr(draft_config, "eagle_config", None) or {}
        layers = eagle.get("eagle_aux_hidden_state_layer_ids") if isinstance(eagle, dict) else None
        source = "the draft checkpoint's eagle_config.eagle_aux_hidden_state_layer_ids"
    if layers is None:
        default = (1, num_layers // 2 - 1, num_layers - 4)
        return tuple(max(0, min(i, num_layers - 1)) for i in default)
    layers = tuple(int(i) for i in layers)
    if len(layers) != 3 or not all(0 <= i < num_layers for i in layers):
        raise ValueError(
            f"{source}={list(layers)}: an Eagle3 head reads 3 target layers in "
            f"[0, {num_layers}) (the target has {num_layers} layers)"
        )
    return layers


def grammar_compiler(config: EngineConfig) -> GrammarCompiler:
    """A rank's own grammar compiler for masked drafting, built as the engine builds its own
    (the model's tokenizer and end-of-sequence ids): the engine's matchers cannot travel here."""
    mc = config.model_config
    tokenizer = load_tokenizer(mc.tokenizer)
    return GrammarCompiler(tokenizer, mc.vocab_size, model_eos_token_ids(mc, tokenizer))


class Worker:
    def __init__(
        self,
        config: EngineConfig,
        mapping: ParallelMapping | None = None,
        agree_num_blocks: Callable[[int], int] | None = None,
    ) -> None:
        """``agree_num_blocks`` maps this rank's KV block count to the one all ranks use."""
        self.config = config
        self.mapping = mapping or ParallelMapping()
        mc = config.model_config
        self.model = load_model(mc.model, mc.dtype, config.device, self.mapping, mc.hf_config)
        spec = None
        capture: tuple[int, ...] = ()
        sc = config.speculative_config
        if sc is not None and sc.method == "suffix":  # the engine's trees, verified here
            spec = SuffixTreeDecoder(
                sc, self.mapping, config.cache_config.block_size, self.model.attention_layers()
            )
        elif sc is not None and not sc.has_draft_model:
            spec = DraftlessDecoder(sc, self.mapping, config.cache_config.block_size)
        elif sc is not None:
            draft = load_draft(sc, self.model, mc.model, mc.dtype, config.device, self.mapping)
            if sc.is_tree:
                spec = TreeDecoder(
                    draft,
                    sc,
                    self.mapping,
                    config.cache_config.block_size,
                    self.model.attention_layers(),
                )
            elif sc.method == "draft_model":
                spec = DraftModelDecoder(draft, sc, self.mapping, config.cache_config.block_size)
            else:
                spec = SpecDecoder(draft, sc, self.mapping, config.cache_config.block_size)
            if sc.method == "eagle3":
                capture = eagle3_capture_layers(sc, draft.config, mc.num_layers)
        # Every position the engine serves, whatever each config says: a public Eagle3 head's
        # config says 2048 behind a target served at 8192.
        positions = mc.max_model_len + (sc.kv_lookahead if sc else 0)
        cover_positions(self.model, positions)
        if spec is not None and spec.draft is not None:
            cover_positions(spec.draft, positions)
        pc = config.parallel_config
        self.eplb = None
        if pc.enable_eplb:  # the target's MoE layers and the MTP layers'
            modules = [self.model] + ([spec.draft] if spec is not None and spec.draft else [])
            self.eplb = ExpertBalancer(modules, pc.eplb_step_interval)
        int8 = sc is not None and sc.draft_quantization == "int8"
        reason: str | None = f"the device is {config.device.type}"
        if config.device.type == "cpu":
            if mc.cpu_weights != "dtype":  # before the fast path packs its matrices
                n = quantize_blocks_(self.model, builtin_blocks(mc.model, mc.cpu_weights))
                logger.info("CPU weights %s: %d matrices in quantized blocks", mc.cpu_weights, n)
            if config.cache_config.fp8_kv:  # its kernels read KV in the model's dtype
                reason = f"--kv-cache-dtype {config.cache_config.kv_cache_dtype}"
            else:
                reason = enable_cpu_fast_path(self.model)
            if reason is None:
                logger.info("CPU decode fast path on (steps of <= %d rows)", MAX_ROWS)
                if spec is not None and spec.draft is not None:
                    if int8 or mc.cpu_weights != "dtype":  # the head's matrices in Q8_0 too
                        n = quantize_blocks_(spec.draft)
                        logger.info("draft head: %d matrices in Q8_0 blocks", n)
                    use_cpu_matvec_lm_heads(spec.draft)
                    why = spec.draft.enable_cpu_fast_path()
                    logger.info("CPU draft fast path %s", "on" if why is None else f"off: {why}")
                    use_cpu_matvec_linears(spec.draft)  # what the draft runs eagerly
            else:
                logger.info("CPU decode fast path off: %s", reason)
            # bf16 weights the fast path does not serve: oneDNN's faster layout (no-op otherwise).
            pack_cpu_linears(self.model)
            if spec is not None and spec.draft is not None:
                pack_cpu_linears(spec.draft)
            if reason is None:  # every product reads a packed copy: hold the model once
                n = release_dense_weights_(self.model)
                if spec is not None and spec.draft is not None:
                    n += release_dense_weights_(spec.draft)
                logger.info("CPU fast path: %d dense matrices freed (packed copies serve)", n)
        if mc.cpu_weights != "dtype" and reason is not None:
            raise ValueError(
                f"cpu_weights={mc.cpu_weights!r} needs the CPU decode fast path (a CPU device, "
                f"one rank, a Llama-family target), and it is off here: {reason}"
            )
        if int8 and reason is not None:
            # int8 blocks only pay where the fast path's products read them.
            raise ValueError(
                "speculative_config.draft_quantization 'int8' needs the CPU decode fast path "
                f"(a CPU device, one rank, a Llama-family target), and it is off here: {reason}"
            )
        self.runner = ModelRunner(
            self.model,
            config.device,
            config.cache_config.block_size,
            mc.seed,
            spec,
            capture,
            dp_rank=self.mapping.tp_rank if self.mapping.enable_attention_dp else 0,
        )
        if spec is not None and spec.draft is not None:  # masked drafting in the draft loop
            self.runner.grammars = DraftGrammars(partial(grammar_compiler, config))
        gc = config.graph_config
        mode = graph_mode(config.device, gc.enforce_eager)
        self.runner.graphs = CUDAGraphRunner(
            config.scheduler_config.max_num_seqs,
            self.runner.k,
            self.mapping,
            config.device,
            enabled=self.mapping.uses_adp_collectives or mode is not None,
            batch_sizes=gc.cuda_graph_batch_sizes,
            topk=sc.topk if sc is not None else 1,
        )
        kv_dtype = FP8_KV_DTYPE if config.cache_config.fp8_kv else mc.dtype
        if config.cache_config.fp8_kv and self.mapping.tp_rank == 0:
            layers = [a for a, _ in self.runner.cache_layers(kv_dtype)]
            scaled = [a for a in layers if kv_scales(a) != (1.0, 1.0)]
            if scaled:
                logger.info("KV cache in FP8 (e4m3): the checkpoint's scales for %d of %d "
                            "layers", len(scaled), len(layers))  # fmt: skip
            else:
                logger.warning(
                    "KV cache in FP8 (e4m3) with scale 1.0 for every layer (the checkpoint has "
                    "no k_scale / v_scale): values past +-448 saturate"
                )
        self.bytes_per_block = self.runner.kv_bytes_per_block(kv_dtype)
        # Sliding-window layers keep their KV in a pool of their own, sized for the windows
        # of every running request (engine/block_manager.py); the rest of the budget is the
        # other layers'.
        self.window = self.runner.kv_window()
        self.window_num_blocks = 0
        window_bytes = 0
        if self.window is not None:
            # Never more than one pool for every layer would hold (and the null block).
            shared = num_kv_blocks(config, self.bytes_per_block) + 1
            self.window_num_blocks = min(window_group_blocks(config, self.window), shared)
            window_bytes = self.runner.kv_bytes_per_block(kv_dtype, window_group=True)
            self.bytes_per_block -= window_bytes
        self.num_blocks = num_kv_blocks(
            config, self.bytes_per_block, self.window_num_blocks * window_bytes
        )
        if agree_num_blocks is not None:
            self.num_blocks = agree_num_blocks(self.num_blocks)
            if self.window is not None:  # every rank's window group the same size too
                self.window_num_blocks = agree_num_blocks(self.window_num_blocks)
        # What the engine serves: under --max-model-len auto, what the agreed blocks hold.
        self.max_model_len = fitted_max_model_len(config, self.num_blocks)
        if mc.fit_max_model_len and self.mapping.tp_rank == 0:
            logger.info(
                "max_model_len auto: %d (the longest request the KV cache holds, up to the "
                "model's own %d)",
                self.max_model_len,
                mc.max_model_len,
            )
        self.runner.allocate_kv_cache(self.num_blocks, kv_dtype, self.window_num_blocks)
        self._start_kv_transfer(config)
        if mode is not None:  # capture every graph key now (reads the reserved dummy blocks)
            sizes = graph_batch_sizes(
                config.scheduler_config.max_num_seqs, gc.cuda_graph_batch_sizes
            )
            self.runner.graph_runner = GraphRunner(
                self.runner, sizes, self.max_model_len, self.mapping, mode
            )
            self.runner.graph_runner.capture_all()
            logger.info("graphs (%s): captured %d keys", mode, len(self.runner.graph_runner.graphs))
        logger.info(
            "KV cache: %d blocks x %d tokens (%.1f MiB)",
            self.num_blocks,
            config.cache_config.block_size,
            self.num_blocks * self.bytes_per_block / 2**20,
        )
        if self.window is not None:
            logger.info(
                "KV cache of the sliding-window layers (window %d): %d blocks (%.1f MiB)",
                self.window,
                self.window_num_blocks,
                self.window_num_blocks * window_bytes / 2**20,
            )

    def execute(self, step: StepInput | DPStepInput) -> StepOutput:
        """A plain step, or (attention DP) every rank's entries, of which this rank runs its own
        and returns its own output."""
        mine = step.steps[self.mapping.tp_rank] if isinstance(step, DPStepInput) else step
        if self.kv is not None:  # offers first: the step makes the ranks forget them
            self._kv_start(mine)
        if isinstance(step, DPStepInput):
            out = self.runner.execute_dp(step)
        else:
            out = self.runner.execute_plain(step)
        if self.kv is not None:
            self._kv_progress(mine, out)
        if self.eplb is not None:  # between steps, on every rank alike
            out.eplb = self.eplb.step()
        return out

    def close(self) -> None:
        """Stop what runs beside the steps (the KV transfer's threads)."""
        if getattr(self, "kv", None) is not None:
            self.kv.close()

    # ---------------------------------------------------------------- disaggregation

    def _start_kv_transfer(self, config: EngineConfig) -> None:
        """This rank's end of disaggregated serving: a prefill rank serves its KV at the
        configured host (port + rank, or a free port), a decode rank pulls from its peer."""
        kc = config.kv_transfer_config
        self.kv: KVTransfer | None = None  # another transport is built here instead
        self.kv_addresses: list[str] = []
        self.kv_done: dict[int, bool] = {}
        self.kv_futures: dict[str, Pull] = {}
        self.kv_pulled: dict[str, str | None] = {}
        if kc is None:
            return
        rank, size = self.mapping.tp_rank, self.mapping.tp_size
        self.kv = DistKVTransfer(
            self.runner.kv_caches,
            kc.host,
            kc.port + rank if kc.port else 0,
            kc.timeout_s,
            serve=kc.role == "prefill",
        )
        if kc.role == "prefill":  # every rank's address, in rank order
            ports = torch.zeros(size, dtype=torch.int64, device=self.config.device)
            ports[rank] = int(self.kv.address.rpartition(":")[2])
            if size > 1:
                dist.all_reduce(ports, group=self.mapping.group)
            self.kv_addresses = [f"{kc.host}:{p}" for p in ports.tolist()]

    def _kv_start(self, step: StepInput) -> None:
        assert self.kv is not None
        for rid, tid, blocks in step.kv_offers:
            self.kv.offer(tid, blocks, self.runner.handover_state(rid))
        for rid, addresses, source, tid, blocks in step.kv_pulls:
            address = addresses[self.mapping.tp_rank if source < 0 else source]
            self.kv_futures[rid] = self.kv.pull(address, tid, blocks)

    def _kv_progress(self, step: StepInput, out: StepOutput) -> None:
        """What this rank finished, then (one collective when the engine waits on some) what
        every rank finished: only those go back to the engine."""
        assert self.kv is not None
        for tid, sent in self.kv.finished():
            self.kv_done[tid] = sent
        now = time.monotonic()
        for rid, handle in list(self.kv_futures.items()):
            assert handle.future is not None
            if handle.future.done():
                del self.kv_futures[rid]
                try:
                    self.runner.adopt_state(rid, handle.future.result())
                    self.kv_pulled[rid] = None
                except Exception as e:
                    self.kv_pulled[rid] = str(e)
            elif now > handle.deadline:  # the prefill instance stopped answering
                del self.kv_futures[rid]
                self.kv.abandon(handle)
                self.kv_pulled[rid] = f"no answer from {handle.address} within the timeout"
        pending, pulling = step.kv_pending, step.kv_pulling
        if not pending and not pulling:
            return
        me = self.mapping.tp_rank
        # A transfer another rank holds (attention DP) is no news here: "ended" and "fine".
        flags = [t in self.kv_done or o not in (-1, me) for t, o in pending]
        flags += [r in self.kv_pulled or o not in (-1, me) for r, o in pulling]
        flags += [self.kv_pulled.get(r, "missing") is None or o not in (-1, me) for r, o in pulling]
        both = torch.tensor(flags, dtype=torch.int64, device=self.config.device)
        if self.mapping.tp_size > 1:
            dist.all_reduce(both, op=dist.ReduceOp.MIN, group=self.mapping.group)
        every = both.tolist()
        n = len(pending)
        for (tid, _), ended in zip(pending, every[:n], strict=True):
            if ended:
                self.kv_done.pop(tid, None)
                out.kv_released.append(tid)
        ended_pulls = every[n : n + len(pulling)]
        pulled_ok = every[n + len(pulling) :]
        for (rid, _), ended, ok in zip(pulling, ended_pulls, pulled_ok, strict=True):
            if ended:
                error = self.kv_pulled.pop(rid, None)
                out.kv_pulled.append((rid, None if ok else error or OTHER_RANK_FAILED))
