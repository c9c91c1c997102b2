"""Everything one app instance holds: settings, the engine client, template, metrics."""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from tandem.engine.client import EngineClient
from tandem.engine.config import EngineArgs
from tandem.engine.dp_client import make_engine_client
from tandem.server.chat import ChatRenderer, resolve_chat_template
from tandem.server.errors import model_not_found, server_unavailable
from tandem.server.logprobs import TokenText
from tandem.server.metrics import ServerMetrics
from tandem.server.protocol import MAX_N
from tandem.server.reasoning import THINK_END, resolve_parser, single_token_id
from tandem.server.serving import RETRY_AFTER_NOT_READY_S

logger = logging.getLogger(__name__)


@dataclass
class ServerSettings:
    """HTTP-side options (the engine's live in ``EngineArgs``)."""

    api_key: str | None = None
    served_model_names: list[str] = field(default_factory=list)  # first one is reported
    chat_template: str | None = None  # file or inline Jinja; default: the tokenizer's
    ready_timeout_s: float = 900.0
    heartbeat_timeout_s: float = 60.0
    log_level: str = "INFO"
    # After SIGTERM/SIGINT, requests in flight get this long to finish before they are aborted.
    shutdown_timeout_s: float = 30.0
    max_request_body_bytes: int = 16 << 20  # larger bodies get a 413
    max_header_count: int = 256  # more header fields get a 431
    max_header_bytes: int = 64 << 10  # so do more bytes of them
    # Larger requests get a 400 naming the field: chat messages, tools, the bytes of a schema or
    # grammar (response_format, structured_outputs, a tool's parameters), n.
    max_chat_messages: int = 4096
    max_tools: int = 128
    max_schema_bytes: int = 256 << 10
    max_n: int = MAX_N
    # Disaggregated serving (--role): which kv_transfer_params requests may carry.
    kv_role: str = "both"
    # A request's own "chat_template" is refused (400) unless the operator allows it.
    allow_request_chat_template: bool = False
    # How tool calls are read from the output (server/tool_parsers.py); None: the template's.
    tool_call_parser: str | None = None
    # How a reasoning model's thinking is split from its answer (server/reasoning.py): "auto"
    # (the chat template's family when it has a thinking section), a parser name, or "none".
    reasoning_parser: str = "auto"
    # Chat template variables for every request (a request's chat_template_kwargs win).
    default_chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Called once when the engine is gone for good (start-up failed or it died).
    on_engine_dead: Callable[[str], None] | None = None
    # Start the engine process as soon as its client exists (`tandem serve`: no thread has
    # started yet, so a CPU engine is a fork of this process); else the app's start-up does.
    launch_engine_first: bool = False


def is_special_token(tokenizer: Any, text: str) -> bool:
    """Whether ``tokenizer`` holds ``text`` as one special token (see
    ``ServerState.special_tokens``)."""
    token = single_token_id(tokenizer, text)
    return token is not None and (
        text in getattr(tokenizer, "all_special_tokens", ())
        or tokenizer.decode([token], skip_special_tokens=True) == ""
    )


class ServerState:
    def __init__(self, engine_args: EngineArgs, settings: ServerSettings) -> None:
        self.settings = settings
        names = list(settings.served_model_names)
        if engine_args.served_model_name and engine_args.served_model_name not in names:
            names.insert(0, engine_args.served_model_name)
        # /v1/models lists these; requests may also name the model by the path it was started
        # with (as in `tandem serve PATH`) unless the names were chosen explicitly.
        self.listed_model_names = names or [os.path.basename(os.path.normpath(engine_args.model))]
        self.model_names = list(self.listed_model_names)
        if not names and engine_args.model not in self.model_names:
            self.model_names.append(engine_args.model)
        spec = engine_args.speculative_config
        self.metrics = ServerMetrics(
            self.model_names[0],
            lambda: self.llm.replica_stats,
            lambda: self.llm.num_in_flight,
            spec_method=spec.get("method") if isinstance(spec, dict) else None,
        )
        # One AsyncLLM, or a ReplicatedLLM with the same interface under -dp N.
        self.llm: EngineClient = make_engine_client(
            engine_args,
            ready_timeout_s=settings.ready_timeout_s,
            heartbeat_timeout_s=settings.heartbeat_timeout_s,
            stats_sink=self.metrics,
            on_dead=settings.on_engine_dead,
            log_level=settings.log_level,
        )
        if settings.launch_engine_first:  # before the tokenizer's thread pool starts below
            self.llm.launch()
        try:
            self._init_text_side(settings)
        except BaseException:
            self.llm.shutdown()
            raise
        self.created = int(time.time())
        self.generation_defaults: dict[str, Any] = {}
        self.start_error: str | None = None
        self.draining = False  # shutting down: new requests get 503, in-flight ones finish

    def _init_text_side(self, settings: ServerSettings) -> None:
        """The tokenizer's side: token texts, the chat template, the reasoning parser."""
        self.tokenizer: Any = self.llm.tokenizer
        self.token_text = TokenText(self.tokenizer)
        template = resolve_chat_template(settings.chat_template, self.tokenizer)
        self.renderer = ChatRenderer(template, self.tokenizer) if template else None
        parser = resolve_parser(settings.reasoning_parser, template)
        if parser is not None:
            logger.info(
                "reasoning parser %s (--reasoning-parser %s): thinking goes to reasoning_content",
                parser.name,
                settings.reasoning_parser,
            )
        # The end of the thinking as one token id, if the tokenizer has it (reasoning_tokens).
        self.think_end_id = single_token_id(self.tokenizer, THINK_END)
        self._special: dict[str, bool] = {}  # special_tokens' answers

    def special_tokens(self, texts: Iterable[str]) -> frozenset[str]:
        """Which of ``texts`` the tokenizer holds as one special token: one that decoding with
        ``skip_special_tokens`` drops (the tokenizer's own flag, whether or not its config also
        lists the token among ``all_special_tokens``)."""
        out = []
        for text in texts:
            if text not in self._special:
                self._special[text] = is_special_token(self.tokenizer, text)
            if self._special[text]:
                out.append(text)
        return frozenset(out)

    @property
    def model_name(self) -> str:
        return self.model_names[0]

    @property
    def max_model_len(self) -> int:
        return self.llm.max_model_len

    @property
    def vocab_size(self) -> int:
        return self.llm.config.model_config.vocab_size

    async def start(self) -> None:
        """Start the engine; on failure remember why and tell ``on_engine_dead``."""
        try:
            info = await self.llm.start()
        except Exception as e:
            self.start_error = str(e) or type(e).__name__
            logger.error("engine start-up failed: %s", self.start_error)
            if self.settings.on_engine_dead is not None:
                self.settings.on_engine_dead(self.start_error)
            return
        self.generation_defaults = dict(info.generation_defaults)
        if self.generation_defaults:
            logger.info(
                "sampling defaults from generation_config.json (used when a request does not "
                "set them): %s",
                self.generation_defaults,
            )
        else:
            logger.info("no sampling defaults in generation_config.json; using OpenAI's")
        logger.info("ready: serving %s (max_model_len %d)", self.model_names, info.max_model_len)

    def check_model(self, model: str | None) -> None:
        if model is not None and model not in self.model_names:
            raise model_not_found(model)

    def response_model_name(self, requested: str | None) -> str:
        return requested if requested is not None else self.model_name

    def require_ready(self) -> None:
        if self.draining:
            raise server_unavailable("the server is shutting down", "shutting_down")
        if self.llm.dead_reason is not None or self.start_error is not None:
            reason = self.llm.dead_reason or self.start_error
            raise server_unavailable(f"the engine is not running: {reason}", "engine_dead")
        if not self.llm.is_ready:
            raise server_unavailable(
                "the model is still loading; retry shortly",
                "engine_not_ready",
                RETRY_AFTER_NOT_READY_S,
            )

    def begin_drain(self) -> None:
        """Shutdown has begun: refuse new requests; abort those still running after
        ``shutdown_timeout_s``."""
        if self.draining:
            return
        self.draining = True
        n = self.llm.num_in_flight
        timeout = self.settings.shutdown_timeout_s
        logger.info("shutting down: %d request(s) in flight get %.1f s to finish", n, timeout)

        def abort_rest() -> None:
            aborted = self.llm.abort_all("the server is shutting down")
            if aborted:
                logger.warning("shutdown timeout: aborted %d request(s) in flight", aborted)

        asyncio.get_running_loop().call_later(timeout, abort_rest)

    def force_stop(self) -> None:
        """A second signal: abort what is in flight now (it answers 503) and stop the engine."""
        self.draining = True
        self.llm.abort_all("the server was forced to stop")
        self.llm.shutdown(timeout_s=2.0)
