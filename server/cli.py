"""``tandem serve MODEL [options]``: its options, mapped onto ``EngineArgs``, and the HTTP server's
start (the socket, uvicorn, the engine's lifecycle). The ``tandem`` command is ``tandem.cli``.

``vllm serve`` command lines work as written (``server/launch_flags.py``: their spellings, dotted
keys, and the flags that describe what Tandem always does); MODEL may be a Hugging Face id."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import socket
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from tandem.engine.process_exit import exit_process
from tandem.server.launch_flags import (
    EXECUTOR_BACKENDS,
    LaunchArgumentParser,
    check_flags,
    flag_notes,
)

if TYPE_CHECKING:
    from tandem.engine.config import EngineArgs
    from tandem.engine.distributed import LaunchEnv
    from tandem.server.state import ServerSettings

logger = logging.getLogger("tandem")

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8000
# After the engine dies, /health answers 503 for this long before the server exits non-zero.
ENGINE_DEAD_EXIT_DELAY_S = 5.0
# uvicorn's own default backlog.
LISTEN_BACKLOG = 2048
# Seconds past --shutdown-timeout before uvicorn cancels what is still running.
SHUTDOWN_GRACE_S = 5
LOG_LEVELS = ("critical", "error", "warning", "info", "debug", "trace")


def _size(text: str) -> int:
    """'512MiB', '2GiB', '1e9' -> bytes."""
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}
    t = text.strip().lower().removesuffix("ib").removesuffix("b")
    try:
        if t and t[-1] in units:
            return int(float(t[:-1]) * units[t[-1]])
        return int(float(t))
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a size: {text!r} (e.g. 512MiB, 2GiB)") from None


def _model_len(text: str) -> int:
    """'8192', '32k' (32,000), '32K' (32,768), 'auto' or '-1' (``MAX_MODEL_LEN_AUTO``)."""
    from tandem.engine.config import parse_max_model_len

    try:
        length = parse_max_model_len(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e).replace("max_model_len=", "")) from None
    assert length is not None  # a string always parses to a length
    return length


def add_serve_arguments(s: argparse.ArgumentParser) -> None:
    """The options of ``tandem serve`` (the command itself lives in ``tandem.cli``)."""
    from tandem.server.protocol import MAX_N

    s.add_argument(
        "model",
        nargs="?",
        default=None,
        help="a local Hugging Face model folder, or a Hugging Face id (ORG/NAME; fetched into "
        "the hub cache; HF_TOKEN, HF_HUB_OFFLINE) (default: the built-in SmolLM2-135M-Instruct)",
    )
    s.add_argument(
        "--revision",
        default=None,
        help="the model's branch, tag or commit on the Hugging Face Hub (default: main)",
    )
    s.add_argument(
        "--download-dir",
        default=None,
        metavar="DIR",
        help="the Hugging Face cache to fetch ids into and read them from (default: HF_HUB_CACHE)",
    )
    s.add_argument(
        "--config",
        default=None,
        metavar="FILE|NAME",
        help="YAML preset of engine fields: a file, or the name of a shipped preset "
        "(configs/*.yaml, e.g. cpu); options given here override it",
    )

    http = s.add_argument_group("HTTP server")
    http.add_argument("--host", default=DEFAULT_HOST)
    http.add_argument("--port", type=int, default=DEFAULT_PORT)
    http.add_argument(
        "--api-key",
        default=os.environ.get("TANDEM_API_KEY"),
        help="require 'Authorization: Bearer KEY' on the API (default: $TANDEM_API_KEY)",
    )
    http.add_argument(
        "--served-model-name", nargs="+", default=None, help="name(s) clients use for the model"
    )
    http.add_argument("--chat-template", default=None, help="Jinja chat template file")
    from tandem.server.tool_formats import FORMATS

    http.add_argument(
        "--tool-call-parser",
        default=None,
        choices=list(FORMATS),
        help="how tool calls are read from the output (default: the chat template's format)",
    )
    from tandem.server.reasoning import CHOICES as REASONING_PARSERS

    http.add_argument(
        "--reasoning-parser",
        default="auto",
        choices=REASONING_PARSERS,
        help="split a reasoning model's thinking (<think>...</think>) into reasoning_content "
        "(default auto: the chat template's family when the template has a thinking section)",
    )
    http.add_argument(
        "--default-chat-template-kwargs",
        default=None,
        metavar="JSON",
        help="a JSON object of chat template variables for every request, e.g. "
        "'{\"enable_thinking\": false}' (a request's chat_template_kwargs win key by key)",
    )
    http.add_argument("--log-level", default="info", choices=LOG_LEVELS)
    http.add_argument(
        "--ready-timeout", type=float, default=900.0, help="seconds to wait for the engine to load"
    )
    http.add_argument(
        "--engine-heartbeat-timeout",
        type=float,
        default=60.0,
        help="seconds without a word from the engine (one step) before it counts as hung",
    )
    http.add_argument(
        "--shutdown-timeout",
        type=float,
        default=30.0,
        help="on SIGTERM/SIGINT, seconds requests in flight get to finish before they are aborted",
    )
    http.add_argument(
        "--max-request-body-size",
        type=_size,
        default=16 << 20,
        help="larger request bodies get a 413 (default 16MiB)",
    )
    http.add_argument(
        "--h11-max-incomplete-event-size",
        type=_size,
        default=64 << 10,
        help="the most bytes of header fields a request may send (more: a 431, or a 400 and "
        "the connection closed when they arrive in pieces; default 64KiB)",
    )
    http.add_argument(
        "--h11-max-header-count",
        type=int,
        default=256,
        help="requests with more header fields get a 431 (default 256)",
    )
    http.add_argument(
        "--timeout-keep-alive",
        type=float,
        default=5.0,
        help="seconds an idle kept-alive connection stays open (default 5)",
    )
    http.add_argument(
        "--max-chat-messages",
        type=int,
        default=4096,
        help="chat requests with more messages get a 400 (default 4096)",
    )
    http.add_argument(
        "--max-tools",
        type=int,
        default=128,
        help="chat requests with more tools get a 400 (default 128, OpenAI's)",
    )
    http.add_argument(
        "--max-schema-size",
        type=_size,
        default=256 << 10,
        help="a response_format, structured_outputs or tool parameters schema larger than this "
        "(its compact JSON) gets a 400 (default 256KiB)",
    )
    http.add_argument(
        "--max-n",
        type=int,
        default=MAX_N,
        help=f"requests asking for more choices (n) get a 400 (default and most: {MAX_N})",
    )
    http.add_argument(
        "--trust-request-chat-template",
        action="store_true",
        help="accept a 'chat_template' sent with a chat request (rendered in a sandbox, but it "
        "runs a client's template: off by default)",
    )

    eng = s.add_argument_group("engine")
    eng.add_argument("--tokenizer", default=None)
    eng.add_argument("--dtype", default="auto")
    eng.add_argument("--device", default="auto")
    eng.add_argument(
        "--cpu-weights",
        choices=["auto", "dtype", "q8", "q4"],
        default="auto",
        help="the CPU fast path's matrices: dtype (the weights in --dtype), q8 (Q8_0 blocks "
        "quantized at load, any Llama-family model), q4 (the built-in model's own GGUF Q4_1 "
        "blocks, Q8_0 LM head); auto: q4 for the built-in model without --dtype where the fast "
        "path runs, else dtype",
    )
    eng.add_argument("--seed", type=int, default=0)
    eng.add_argument(
        "--max-model-len",
        type=_model_len,
        default=None,
        help="tokens per request, prompt and output (default: the model's own context length; "
        "32k = 32,000, 32K = 32,768; auto: the longest the KV cache holds, up to the model's)",
    )
    eng.add_argument("--max-num-seqs", type=int, default=64)
    eng.add_argument("--max-num-batched-tokens", type=int, default=None)
    eng.add_argument(
        "--max-waiting-requests",
        type=int,
        default=1024,
        help="requests queued beyond --max-num-seqs before new ones get 503",
    )
    eng.add_argument("--block-size", type=int, default=16)
    eng.add_argument(
        "--kv-cache-memory", type=_size, default=1 << 30, help="CPU KV cache budget, e.g. 2GiB"
    )
    eng.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    eng.add_argument("--num-kv-blocks", type=int, default=None)
    eng.add_argument(
        "--kv-cache-dtype",
        default="auto",
        help="auto: the model's dtype; fp8 (fp8_e4m3): float8 e4m3 with per-layer scales (the "
        "checkpoint's k_scale / v_scale, else 1.0): twice the tokens for the same budget",
    )
    eng.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True)
    eng.add_argument(
        "--generation-config",
        default="auto",
        metavar="{auto,vllm,FOLDER}",
        help="sampling defaults: auto (the model folder's generation_config.json), vllm (none: "
        "OpenAI's defaults) or a folder with a generation_config.json",
    )

    same = s.add_argument_group(
        "accepted as other servers spell them (each logged once; what Tandem cannot honour is "
        "refused)"
    )
    same.add_argument(
        "--trust-remote-code",
        action=argparse.BooleanOptionalAction,
        default=False,
        help="accepted: no remote code is ever run (Tandem serves the architectures it "
        "implements and refuses others by name)",
    )
    same.add_argument(
        "--enable-chunked-prefill",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="always on: long prompts are prefilled in chunks of --max-num-batched-tokens (the "
        "--no- form is refused)",
    )
    same.add_argument(
        "--enable-auto-tool-choice",
        action="store_true",
        help="always on: tool calls are parsed whenever a request has tools",
    )
    same.add_argument(
        "--disable-log-requests",
        action="store_true",
        help="always so: request contents are never logged",
    )
    same.add_argument(
        "--swap-space",
        type=float,
        default=None,
        metavar="GiB",
        help="not used: a preempted request is recomputed, never swapped to CPU memory",
    )
    same.add_argument(
        "--distributed-executor-backend",
        default=None,
        choices=EXECUTOR_BACKENDS,
        help="mp: ranks in processes of their own (what Tandem does); uni: one process (needs "
        "-tp 1); external_launcher: started by torchrun; ray is refused",
    )

    par = s.add_argument_group("parallelism and speculation")
    par.add_argument(
        "--tensor-parallel-size",
        "-tp",
        type=int,
        default=1,
        help="rank processes in all (tensor-parallel-size / nnodes on each node)",
    )
    par.add_argument(
        "--data-parallel-size",
        "-dp",
        type=int,
        default=1,
        help="model replicas (each a tensor-parallel group of its own) behind this one API "
        "process; a request goes to the replica caching its prompt's prefix unless that one is "
        "much busier, else to the least loaded. With --enable-attention-dp it must equal -tp "
        "and means attention DP (no replicas)",
    )
    par.add_argument(
        "--nnodes", type=int, default=1, help="nodes the ranks span; start every node alike"
    )
    par.add_argument(
        "--node-rank",
        type=int,
        default=0,
        help="this node's index: node 0 serves HTTP, the others run headless ranks",
    )
    par.add_argument(
        "--dist-init-addr",
        default=None,
        metavar="HOST:PORT",
        help="node 0's rendezvous address, reachable from every node (when --nnodes > 1)",
    )
    par.add_argument(
        "--master-addr", default=None, help="with --master-port: another --dist-init-addr"
    )
    par.add_argument("--master-port", type=int, default=None)
    par.add_argument(
        "--enable-attention-dp",
        action="store_true",
        help="each rank owns its requests and KV cache; MLPs run across ranks",
    )
    par.add_argument(
        "--enable-lm-head-tp-in-adp",
        action="store_true",
        help="under attention DP, split the LM head's vocabulary across ranks for greedy drafts",
    )
    par.add_argument(
        "--enable-expert-parallel",
        action="store_true",
        help="MoE experts are always placed whole over the ranks; with this, under attention DP, "
        "rows go all-to-all to the ranks holding their experts instead of to every rank",
    )
    par.add_argument(
        "--ep-size",
        "--expert-parallel-size",
        dest="expert_parallel_size",
        type=int,
        default=None,
        help="ranks the experts spread over: must equal --tensor-parallel-size (> 1 turns on "
        "--enable-expert-parallel)",
    )
    par.add_argument(
        "--enable-eplb",
        action="store_true",
        help="expert load balancing: re-place experts (and their redundant copies) from the "
        "measured loads every --eplb-step-interval steps (needs expert parallelism)",
    )
    par.add_argument(
        "--num-redundant-experts",
        type=int,
        default=None,
        help="extra physical copies per MoE layer for EPLB to place (default 0)",
    )
    par.add_argument(
        "--eplb-step-interval",
        type=int,
        default=None,
        help="engine steps between EPLB rebalances (default 3000)",
    )
    par.add_argument(
        "--eplb-window-size",
        type=int,
        default=None,
        help="engine steps whose expert loads a rebalance reads (default 1000)",
    )
    par.add_argument(
        "--eplb-config",
        default=None,
        help="JSON (or dotted keys): window_size, step_interval, num_redundant_experts, "
        "log_balancedness (always logged here); the flags above in one option",
    )
    disagg = s.add_argument_group("disaggregated serving (tandem router in front)")
    disagg.add_argument(
        "--role",
        choices=("both", "prefill", "decode"),
        default="both",
        help="prefill: hand each request that asks (kv_transfer_params) over after its first "
        "token; decode: pull such requests' KV from their prefill instance; both (default)",
    )
    disagg.add_argument(
        "--kv-transfer-host",
        default="127.0.0.1",
        help="a prefill instance's KV transfer address, as decode instances reach it",
    )
    disagg.add_argument(
        "--kv-transfer-port", type=int, default=0, help="its port (default: a free one)"
    )
    disagg.add_argument(
        "--kv-transfer-timeout",
        type=float,
        default=60.0,
        metavar="S",
        help="how long a prefill instance holds a hand-over, and a transfer may take (60)",
    )
    par.add_argument(
        "--speculative-config",
        default=None,
        help="JSON, e.g. '{\"method\": ...}', or dotted keys (--speculative-config.method mtp), or "
        "none; the built-in model defaults to its shipped Eagle3 head (K = 3, paused from 4 "
        "running requests); its model may be a Hugging Face id",
    )

    graphs = s.add_argument_group("CUDA graphs")
    graphs.add_argument(
        "--enforce-eager",
        action="store_true",
        help="never capture CUDA graphs: every step runs eagerly",
    )
    graphs.add_argument(
        "--cuda-graph-batch-sizes",
        type=int,
        nargs="+",
        default=None,
        help="padded batch sizes to capture, ascending (default 1 2 4 8 16 ... max-num-seqs)",
    )


def dist_init_addr_from(ns: argparse.Namespace) -> str | None:
    """``--dist-init-addr``, or ``--master-addr`` and ``--master-port`` joined (they must agree)."""
    addr = ns.dist_init_addr
    if ns.master_addr is None and ns.master_port is None:
        return addr
    if ns.master_addr is None or ns.master_port is None:
        raise ValueError("--master-addr and --master-port go together (or use --dist-init-addr)")
    host = f"[{ns.master_addr}]" if ":" in ns.master_addr else ns.master_addr
    joined = f"{host}:{ns.master_port}"
    if addr is not None and addr != joined:
        raise ValueError(
            f"--dist-init-addr {addr} and --master-addr/--master-port {joined} disagree; give one"
        )
    return joined


# --eplb-config's keys and the flags that set the same (vLLM's names).
_EPLB_KEYS = {
    "num_redundant_experts": "num_redundant_experts",
    "step_interval": "eplb_step_interval",
    "window_size": "eplb_window_size",
}


def eplb_options(ns: argparse.Namespace) -> dict[str, int]:
    """The EPLB fields from ``--eplb-config`` and the single flags (one way per value)."""
    given: dict[str, Any] = {}
    if ns.eplb_config is not None:
        try:
            given = json.loads(ns.eplb_config)
        except ValueError as e:
            raise ValueError(f"--eplb-config is not valid JSON: {e}") from None
        if not isinstance(given, dict):
            raise ValueError("--eplb-config must be a JSON object, e.g. '{\"window_size\": 1000}'")
        unknown = sorted(set(given) - set(_EPLB_KEYS) - {"log_balancedness"})
        if unknown:
            raise ValueError(
                f"--eplb-config: unknown key(s) {', '.join(unknown)}; known: "
                f"{', '.join(sorted([*_EPLB_KEYS, 'log_balancedness']))}"
            )
        if not isinstance(given.get("log_balancedness", False), bool):
            raise ValueError("--eplb-config: log_balancedness must be true or false")
    out = {}
    for key, field in _EPLB_KEYS.items():
        flag = getattr(ns, field)
        if key in given and flag is not None:
            raise ValueError(
                f"--eplb-config's {key} and --{field.replace('_', '-')} both set it: give one"
            )
        value = given.get(key, flag)
        if value is not None:
            out[field] = value
    return out


def engine_args_from(ns: argparse.Namespace) -> Any:
    """Map parsed options onto ``EngineArgs`` (raises ``ValueError`` for what we cannot do).
    Hugging Face ids stay ids: ``serve`` fetches them (``EngineArgs.with_local_folders``)."""
    from tandem.engine.config import EngineArgs

    check_flags(ns)
    spec = None
    spec_off = False  # "none" / "null": no speculation, even for the built-in model
    if ns.speculative_config is not None:
        spec_off = ns.speculative_config.strip().lower() in ("none", "null")
        try:
            spec = None if spec_off else json.loads(ns.speculative_config)
        except ValueError as e:
            raise ValueError(f"--speculative-config is not valid JSON: {e}") from None
        if spec is not None and not isinstance(spec, dict):
            raise ValueError(
                '--speculative-config must be a JSON object, e.g. \'{"method": "mtp"}\''
            )
    names = ns.served_model_name or []
    model, dtype, cpu_weights = ns.model, ns.dtype, ns.cpu_weights
    if model is None:  # the built-in SmolLM2-135M-Instruct, converted once into the cache
        from tandem.models.builtin import (
            builtin_default_dtype,
            builtin_default_weights,
            builtin_model_path,
        )

        model = builtin_model_path()
        if dtype == "auto":  # the folder is float32; serve in what runs fastest here
            dtype = builtin_default_dtype(ns.device)
            # (an FP8 KV cache turns the fast path off: its matrices stay the dtype's then)
            if cpu_weights == "auto" and ns.kv_cache_dtype == "auto":
                cpu_weights = builtin_default_weights(ns.device)
        # The shipped Eagle3 head by default, and a shipped method gets its head; on the file's
        # own 4-bit blocks none by default: there plain decoding was faster at every load we
        # measured (README, "The built-in model at its file's precision").
        if not spec_off and (spec is not None or cpu_weights != "q4"):
            from tandem.models.heads import builtin_speculative_config

            spec = builtin_speculative_config(spec)
    return EngineArgs(
        model=model,
        tokenizer=ns.tokenizer,
        dtype=dtype,
        device=ns.device,
        seed=ns.seed,
        max_model_len=ns.max_model_len,
        max_num_seqs=ns.max_num_seqs,
        max_num_batched_tokens=ns.max_num_batched_tokens,
        max_waiting_requests=ns.max_waiting_requests,
        block_size=ns.block_size,
        kv_cache_memory_bytes=ns.kv_cache_memory,
        gpu_memory_utilization=ns.gpu_memory_utilization,
        enable_prefix_caching=ns.enable_prefix_caching,
        speculative_config=spec,
        num_kv_blocks=ns.num_kv_blocks,
        kv_cache_dtype=ns.kv_cache_dtype,
        tensor_parallel_size=ns.tensor_parallel_size,
        data_parallel_size=ns.data_parallel_size,
        enable_attention_dp=ns.enable_attention_dp,
        enable_lm_head_tp_in_adp=ns.enable_lm_head_tp_in_adp,
        enable_expert_parallel=ns.enable_expert_parallel,
        expert_parallel_size=ns.expert_parallel_size,
        enable_eplb=ns.enable_eplb,
        **eplb_options(ns),
        kv_role=ns.role,
        kv_transfer_host=ns.kv_transfer_host,
        kv_transfer_port=ns.kv_transfer_port,
        kv_transfer_timeout=ns.kv_transfer_timeout,
        nnodes=ns.nnodes,
        node_rank=ns.node_rank,
        dist_init_addr=dist_init_addr_from(ns),
        served_model_name=names[0] if names else None,
        enforce_eager=ns.enforce_eager,
        cuda_graph_batch_sizes=(
            None if ns.cuda_graph_batch_sizes is None else tuple(ns.cuda_graph_batch_sizes)
        ),
        revision=ns.revision,
        download_dir=ns.download_dir,
        generation_config=ns.generation_config,
        cpu_weights=cpu_weights,
    )


def server_settings_from(
    ns: argparse.Namespace, on_engine_dead: Callable[[str], None] | None = None
) -> ServerSettings:
    """Map parsed options onto ``ServerSettings`` (``ValueError`` for values out of range)."""
    from tandem.server.chat import parse_template_kwargs
    from tandem.server.protocol import MAX_N
    from tandem.server.state import ServerSettings

    if ns.shutdown_timeout < 0:
        raise ValueError(f"--shutdown-timeout must be >= 0 seconds, got {ns.shutdown_timeout}")
    if ns.max_request_body_size < 1:
        raise ValueError(
            f"--max-request-body-size must be positive, got {ns.max_request_body_size}"
        )
    for flag, value, low in (
        ("--h11-max-header-count", ns.h11_max_header_count, 1),
        ("--h11-max-incomplete-event-size", ns.h11_max_incomplete_event_size, 1024),
        ("--max-chat-messages", ns.max_chat_messages, 1),
        ("--max-tools", ns.max_tools, 0),
        ("--max-schema-size", ns.max_schema_size, 1),
        ("--max-n", ns.max_n, 1),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if ns.max_n > MAX_N:
        raise ValueError(f"--max-n must be <= {MAX_N}, got {ns.max_n}")
    if ns.timeout_keep_alive <= 0:
        raise ValueError(f"--timeout-keep-alive must be > 0 seconds, got {ns.timeout_keep_alive}")
    return ServerSettings(
        api_key=ns.api_key or None,
        served_model_names=list(ns.served_model_name or []),
        chat_template=ns.chat_template,
        tool_call_parser=ns.tool_call_parser,
        reasoning_parser=ns.reasoning_parser,
        default_chat_template_kwargs=parse_template_kwargs(ns.default_chat_template_kwargs),
        ready_timeout_s=ns.ready_timeout,
        heartbeat_timeout_s=ns.engine_heartbeat_timeout,
        log_level="DEBUG" if ns.log_level == "trace" else ns.log_level.upper(),
        on_engine_dead=on_engine_dead,
        shutdown_timeout_s=ns.shutdown_timeout,
        max_request_body_bytes=ns.max_request_body_size,
        max_header_count=ns.h11_max_header_count,
        max_header_bytes=ns.h11_max_incomplete_event_size,
        max_chat_messages=ns.max_chat_messages,
        max_tools=ns.max_tools,
        max_schema_bytes=ns.max_schema_size,
        max_n=ns.max_n,
        allow_request_chat_template=ns.trust_request_chat_template,
        kv_role=ns.role,
    )


def listen_socket(host: str, port: int) -> socket.socket:
    """The HTTP server's socket, bound and listening (uvicorn serves on it); ValueError naming
    the address when it cannot be bound.

    The protocol is ``IPPROTO_TCP``, not 0: asyncio sets ``TCP_NODELAY`` only on connections
    accepted from such sockets, and without it Nagle's algorithm holds each response's second
    write until the client's delayed ACK (~40 ms a request on a kept-alive connection). It
    listens at once: a socket only bound does not hold the port against another
    ``SO_REUSEADDR`` bind, so a second server could take it while this one loads."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(LISTEN_BACKLOG)
    except OSError as e:
        sock.close()
        raise ValueError(
            f"cannot serve on {host}:{port}: {e.strerror or e} (another server on that port? "
            "pick one with --port)"
        ) from e
    return sock


def serve(ns: argparse.Namespace) -> int:
    import uvicorn

    from tandem.engine.process_exit import mark_fork_point, pace_garbage_collector
    from tandem.server.app import build_app
    from tandem.server.lifecycle import GracefulServer

    mark_fork_point()  # imported, nothing started: the engine may fork from here
    pace_garbage_collector()  # as the engine's: requests and their streams are many objects
    level = "DEBUG" if ns.log_level == "trace" else ns.log_level.upper()
    logging.basicConfig(level=level, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    engine_args = engine_args_from(ns)
    for note in flag_notes(ns):
        logger.info("%s", note)
    for name, value in getattr(ns, "config_engine_fields", {}).items():  # --config keys, no flag
        setattr(engine_args, name, value)
    engine_args = engine_args.with_local_folders()  # Hugging Face ids: fetched once, here
    if (launch := launched_rank(engine_args)) is not None and launch.rank != 0:
        # torchrun / srun started every rank as `tandem serve`: only global rank 0 serves HTTP.
        from tandem.engine.executor import check_launch
        from tandem.engine.rank_process import serve_launched_rank

        config = engine_args.create_engine_config()
        check_launch(config, launch)
        logger.info(
            "rank %d of %d (local rank %d), started by a launcher: rank 0's process at %s "
            "serves HTTP, this one runs its shard only (no HTTP port)",
            launch.rank,
            launch.world_size,
            launch.local_rank,
            launch.master,
        )
        serve_launched_rank(config, launch)
        logger.info("rank %d: rank 0 stopped the world; exiting", launch.rank)
        exit_process(0)
    if engine_args.node_rank != 0:  # headless: only this node's ranks, no HTTP port
        from tandem.engine.headless import run_headless_node
        from tandem.engine.multinode import report_invalid_arguments

        try:
            config = engine_args.create_engine_config()
        except ValueError as e:
            report_invalid_arguments(engine_args.dist_init_addr, engine_args.node_rank, str(e))
            raise
        exit_process(run_headless_node(config))
    holder: dict[str, Any] = {}

    def on_engine_dead(reason: str) -> None:
        holder["dead"] = reason
        server = holder.get("server")
        if server is None:
            return
        logger.error("the engine is gone (%s); exiting in %.0f s", reason, ENGINE_DEAD_EXIT_DELAY_S)

        def stop() -> None:
            server.should_exit = True

        asyncio.get_running_loop().call_later(ENGINE_DEAD_EXIT_DELAY_S, stop)

    settings = server_settings_from(ns, on_engine_dead)
    settings.launch_engine_first = True  # before uvicorn's loop: a CPU engine forks from here
    # The port is bound before anything loads: a busy port stops the server at once, not after
    # the engine has loaded the model, and nothing else can take the port meanwhile.
    sock = listen_socket(ns.host, ns.port)
    os.register_at_fork(after_in_child=sock.close)  # a forked engine holds no HTTP port
    try:
        app = build_app(engine_args, settings)
    except OSError as e:  # e.g. a folder without tokenizer files
        raise ValueError(f"cannot load {engine_args.model}: {e}") from e
    config = uvicorn.Config(
        app,
        host=ns.host,
        port=ns.port,
        log_level=ns.log_level,
        timeout_keep_alive=ns.timeout_keep_alive,
        h11_max_incomplete_event_size=ns.h11_max_incomplete_event_size,
        # A backstop: the app aborts what is still running after --shutdown-timeout.
        timeout_graceful_shutdown=int(ns.shutdown_timeout) + SHUTDOWN_GRACE_S,
    )
    state = app.state.tandem
    server = GracefulServer(
        config,
        on_drain=state.begin_drain,
        on_force_exit=state.force_stop,
    )
    holder["server"] = server
    logger.info("serving on http://%s:%d (API key %s)", ns.host, sock.getsockname()[1],
                "required" if settings.api_key else "not required")  # fmt: skip
    server.run(sockets=[sock])  # returns once the engine has stopped
    if "dead" in holder:
        logger.error("exiting non-zero: %s", holder["dead"])
        exit_process(1)
    exit_process(0)


def _options_given(argv: list[str]) -> set[str]:
    """Destinations of the ``serve`` options present in ``argv`` (``serve``'s own arguments;
    not filled in by defaults)."""
    parser = LaunchArgumentParser(add_help=False)
    add_serve_arguments(parser)
    for action in parser._actions:
        action.default = argparse.SUPPRESS
    return set(vars(parser.parse_known_args(argv)[0]))


def apply_config_file(ns: argparse.Namespace, argv: list[str]) -> None:
    """Fill ``ns`` from ``--config FILE``: options given in ``argv`` win over the file, the file
    over the defaults. File keys without a command-line option go to ``ns.config_engine_fields``
    (``serve`` sets them on ``EngineArgs``)."""
    ns.config_engine_fields = {}
    if getattr(ns, "config", None) is None:
        return
    from tandem.engine.presets import load_preset

    given = _options_given(argv)
    for key, value in load_preset(ns.config).items():
        dest = {"kv_cache_memory_bytes": "kv_cache_memory"}.get(key, key)
        if not hasattr(ns, dest):
            ns.config_engine_fields[key] = value
        elif dest not in given:
            if value is not None and key == "served_model_name":
                value = [value]
            elif value is not None and key == "speculative_config":
                value = json.dumps(value)  # what --speculative-config holds
            setattr(ns, dest, value)


def launched_rank(engine_args: EngineArgs) -> LaunchEnv | None:
    """This process's rank when torchrun (``RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``, ...) or
    srun with one task per rank started it; None when tandem starts the ranks itself."""
    from tandem.engine.distributed import (
        LaunchEnv,
        adopt_slurm_launch,
        start_launcher_watchdog,
    )

    slurm = adopt_slurm_launch(
        engine_args.tensor_parallel_size, engine_args.nnodes, engine_args.dist_init_addr
    )
    launch = LaunchEnv.from_env()
    if launch is not None:
        start_launcher_watchdog()
    if launch is not None and not slurm and engine_args.dist_init_addr is not None:
        raise ValueError(
            f"--dist-init-addr {engine_args.dist_init_addr} with a launcher's environment "
            f"(RANK={launch.rank}, MASTER_ADDR:MASTER_PORT={launch.master}): the launcher's "
            "rendezvous is the one used; drop --dist-init-addr (or --nnodes) under torchrun"
        )
    return launch


def run_serve(ns: argparse.Namespace, argv: list[str]) -> int:
    """``tandem serve`` with its parsed options (``argv``: the command line, for ``--config``):
    exit status 2 and one line for what the user must change."""
    try:
        apply_config_file(ns, argv)
        return serve(ns)
    except ValueError as e:
        print(f"tandem serve: error: {e}", file=sys.stderr)
        return 2
