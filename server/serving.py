"""What the completion and chat endpoints share: sampling parameters, engine errors, usage,
server-sent events and disconnect handling."""

from __future__ import annotations

import asyncio
import itertools
import json
import logging
import re
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterable
from typing import Any, TypeVar

from starlette.requests import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from tandem.engine.client import (
    EngineDeadError,
    EngineError,
    EngineNotReadyError,
    QueueFullError,
    RequestAbortedError,
    RequestFailedError,
)
from tandem.engine.input_processor import ContextLengthExceededError
from tandem.engine.outputs import RequestOutput
from tandem.engine.request import SpecStats
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutputError, StructuredSpec
from tandem.server.errors import APIError, bad_request, error_body, server_fault, server_unavailable
from tandem.server.protocol import SamplingFields

logger = logging.getLogger(__name__)
T = TypeVar("T")
_PARAM_IN_MESSAGE = re.compile(r"^(\w+)=")
# Seconds a client should wait before retrying a request refused for a passing reason.
RETRY_AFTER_QUEUE_FULL_S = 1
RETRY_AFTER_NOT_READY_S = 5
_ID_PROCESS_PART = secrets.token_hex(8)  # differs between processes and restarts
_ID_COUNTER = itertools.count()  # next() is atomic under the GIL


def new_request_id(kind: str) -> str:
    """``kind-<16 hex random per process><counter>``: the counter makes ids unique within a
    process (they key the engine's request table); the random part tells processes apart."""
    return f"{kind}-{_ID_PROCESS_PART}{next(_ID_COUNTER):08x}"


class ClientDisconnected(Exception):
    """The client went away before the response was ready."""


def _dumps(schema: dict[str, Any], param: str) -> str:
    try:
        return json.dumps(schema)
    except RecursionError:
        raise bad_request("the schema is nested too deeply", param) from None


def structured_spec(req: SamplingFields) -> StructuredSpec | None:
    """``response_format`` / ``structured_outputs`` -> what the output must match (400 if both
    constrain it, or if ``structured_outputs`` sets other than exactly one field)."""
    rf, so = req.response_format, req.structured_outputs
    specs: list[StructuredSpec] = []
    if rf is not None and rf.type == "json_object":
        specs.append(StructuredSpec("json_object", param="response_format"))
    elif rf is not None and rf.type == "json_schema":
        if rf.json_schema is None or rf.json_schema.schema_ is None:
            raise bad_request(
                "response_format of type 'json_schema' needs json_schema.schema",
                "response_format.json_schema",
            )
        text = _dumps(rf.json_schema.schema_, "response_format.json_schema")
        specs.append(StructuredSpec("json_schema", text, "response_format.json_schema"))
    elif rf is not None and rf.json_schema is not None:
        raise bad_request(
            "response_format.json_schema needs type 'json_schema'", "response_format.type"
        )
    if so is not None:
        given = [n for n, v in so if v is not None and v is not False]
        if len(given) != 1:
            raise bad_request(
                f"structured_outputs takes exactly one of json, json_object, regex, choice, "
                f"grammar; got {len(given)}",
                "structured_outputs",
            )
        name = given[0].rstrip("_")
        param = f"structured_outputs.{name}"
        if name == "json":
            value = so.json_
            text = value if isinstance(value, str) else _dumps(value, param)
            specs.append(StructuredSpec("json_schema", text, param))
        elif name == "json_object":
            specs.append(StructuredSpec("json_object", param=param))
        elif name == "choice":
            specs.append(StructuredSpec.choice(so.choice or [], param))
        else:
            specs.append(StructuredSpec(name, getattr(so, name), param))  # type: ignore[arg-type]
    if len(specs) > 1:
        raise bad_request(
            "response_format and structured_outputs both constrain the output; send one",
            "structured_outputs",
        )
    return specs[0] if specs else None


def check_request_size(req: SamplingFields, settings: Any) -> None:
    """The limits that keep one request from costing the server what many would (each a
    ``tandem serve`` flag): ``n``, the bytes of a constraint (``response_format``,
    ``structured_outputs``: grammars compile from them), and for chat requests the number of
    messages and tools and each tool's parameters schema. A 400 naming the field and the flag."""

    def refuse(what: str, limit: int, flag: str, param: str) -> None:
        raise bad_request(f"{what}; this server's limit is {limit} ({flag})", param)

    if req.n > settings.max_n:
        refuse(f"n={req.n}", settings.max_n, "--max-n", "n")
    check_kv_transfer(req, settings)
    messages, tools = getattr(req, "messages", None), getattr(req, "tools", None) or []
    if messages is not None and len(messages) > settings.max_chat_messages:
        refuse(f"{len(messages)} messages", settings.max_chat_messages, "--max-chat-messages",
               "messages")  # fmt: skip
    if len(tools) > settings.max_tools:
        refuse(f"{len(tools)} tools", settings.max_tools, "--max-tools", "tools")
    constraints = [
        ("response_format", req.response_format),
        ("structured_outputs", req.structured_outputs),
        *((f"tools[{i}].function.parameters", t.function.parameters) for i, t in enumerate(tools)),
    ]
    for param, value in constraints:
        if value is None:
            continue
        dumped = value.model_dump(by_alias=True) if hasattr(value, "model_dump") else value
        size = len(json.dumps(dumped, separators=(",", ":")).encode())
        if size > settings.max_schema_bytes:
            refuse(f"{param} is {size} bytes", settings.max_schema_bytes, "--max-schema-size",
                   param)  # fmt: skip


# What a decode instance's kv_transfer_params must hold (a prefill instance's answer).
_HANDOVER_KEYS = {
    "remote_addresses": list,
    "transfer_id": int,
    "num_blocks": int,
    "num_prompt_tokens": int,
    "first_token": int,
}


def check_kv_transfer(req: SamplingFields, settings: Any) -> None:
    """``kv_transfer_params`` (vLLM's field; set by ``tandem router``): on a prefill instance
    ``{"do_remote_decode": true}``, on a decode instance the prefill instance's answer; a 400
    elsewhere or in another shape."""
    kv = req.kv_transfer_params
    if kv is None:
        return
    role = settings.kv_role
    param = "kv_transfer_params"
    if role == "both":
        raise bad_request(
            "kv_transfer_params: this server prefills and decodes itself (--role both); send it "
            "to a --role prefill or --role decode instance (tandem router does)",
            param,
        )
    if req.n != 1:
        raise bad_request("kv_transfer_params: one sample per request (n=1)", "n")
    if role == "prefill":
        if kv.get("do_remote_decode") is not True or req.stream:
            raise bad_request(
                'a prefill instance takes kv_transfer_params {"do_remote_decode": true}, '
                "not streamed",
                param,
            )
        return
    for key, kind in _HANDOVER_KEYS.items():
        if not isinstance(kv.get(key), kind) or isinstance(kv.get(key), bool):
            raise bad_request(
                f"kv_transfer_params.{key}: a decode instance takes the prefill instance's "
                f"kv_transfer_params as it answered them ({key} missing or not {kind.__name__})",
                f"{param}.{key}",
            )


def handover_fields(outs: Iterable[RequestOutput]) -> dict[str, Any]:
    """A prefill instance's response names the hand-over (``kv_transfer_params``)."""
    for out in outs:
        if out.kv_transfer_params is not None:
            return {"kv_transfer_params": out.kv_transfer_params}
    return {}


def build_sampling_params(
    req: SamplingFields,
    defaults: dict[str, Any],
    *,
    max_tokens: int | None,
    logprobs: int | None,
    param_names: dict[str, str] | None = None,
) -> SamplingParams:
    """OpenAI fields -> ``SamplingParams``; unset fields take the checkpoint's defaults."""

    def pick(name: str, fallback: Any) -> Any:
        value = getattr(req, name)
        if value is not None:
            return value
        return defaults.get(name, fallback)

    try:
        structured = structured_spec(req)
        return SamplingParams(
            n=req.n,
            temperature=pick("temperature", 1.0),
            top_p=pick("top_p", 1.0),
            top_k=pick("top_k", 0),
            min_p=pick("min_p", 0.0),
            seed=req.seed,
            max_tokens=max_tokens,
            min_tokens=req.min_tokens,
            stop=req.stop,
            stop_token_ids=req.stop_token_ids,
            ignore_eos=req.ignore_eos,
            presence_penalty=pick("presence_penalty", 0.0),
            frequency_penalty=pick("frequency_penalty", 0.0),
            repetition_penalty=pick("repetition_penalty", 1.0),
            logit_bias=req.token_logit_bias(),
            logprobs=logprobs,
            skip_special_tokens=req.skip_special_tokens,
            include_stop_str_in_output=req.include_stop_str_in_output,
            structured=structured,
            kv_transfer=req.kv_transfer_params,
        )
    except ValueError as e:
        raise engine_error_to_api(e, param_names=param_names) from e


def engine_error_to_api(
    e: BaseException, prompt_param: str = "prompt", param_names: dict[str, str] | None = None
) -> APIError:
    """Map what ``AsyncLLM`` / ``SamplingParams`` raise onto OpenAI errors."""
    if isinstance(e, APIError):
        return e
    if isinstance(e, ContextLengthExceededError):
        return bad_request(str(e), prompt_param, "context_length_exceeded")
    if isinstance(e, QueueFullError):
        return server_unavailable(str(e), "queue_full", RETRY_AFTER_QUEUE_FULL_S)
    if isinstance(e, EngineNotReadyError):
        return server_unavailable(str(e), "engine_not_ready", RETRY_AFTER_NOT_READY_S)
    if isinstance(e, EngineDeadError):
        return server_unavailable(str(e), "engine_dead")
    if isinstance(e, RequestAbortedError):
        return server_unavailable(str(e), "request_aborted")
    if isinstance(e, RequestFailedError | EngineError):
        return server_fault(str(e))
    if isinstance(e, StructuredOutputError):
        return bad_request(str(e), e.param)
    if isinstance(e, ValueError):
        m = _PARAM_IN_MESSAGE.match(str(e))
        param = m.group(1) if m else prompt_param
        if param_names:
            param = param_names.get(param, param)
        return bad_request(str(e), param)
    return server_fault(f"Internal server error: {type(e).__name__}")


async def compile_grammar(state: Any, params: SamplingParams, **error_args: Any) -> None:
    """Compile the request's grammar, if it has one, in a worker thread: a new schema can take
    long to compile and the event loop serves every other stream meanwhile. The engine's own
    check when the request is added then finds it cached. Raises ``APIError``."""
    if params.structured is None:
        return
    try:
        await asyncio.to_thread(state.llm.check_grammar, params)
    except Exception as e:
        raise engine_error_to_api(e, **error_args) from e


def usage(
    prompt_tokens: int,
    completion_tokens: int,
    outs: Iterable[RequestOutput] = (),
    *,
    cached_tokens: int = 0,
    reasoning_tokens: int | None = None,
) -> dict[str, Any]:
    """OpenAI usage: ``cached_tokens`` of the prompt came from the prefix cache;
    ``reasoning_tokens`` (with a reasoning parser) of the completion were thinking. Under
    speculation a ``spec_decode`` object adds draft and accepted counts."""
    body: dict[str, Any] = {
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
        "prompt_tokens_details": {"cached_tokens": cached_tokens},
    }
    if reasoning_tokens is not None:
        body["completion_tokens_details"] = {"reasoning_tokens": reasoning_tokens}
    stats = [o.spec_stats for o in outs if o.spec_stats is not None]
    if stats:
        total = SpecStats()
        for s in stats:
            total.merge(s)
        body["spec_decode"] = {
            "num_drafts": total.num_drafts,
            "num_draft_tokens": total.num_draft_tokens,
            "num_accepted_tokens": total.num_accepted_tokens,
            "acceptance_rate": total.acceptance_rate,
            "mean_tokens_per_step": total.mean_tokens_per_step,
            # Draft tokens verified per step: K for a chain, the verified tree's size.
            "mean_draft_tokens_per_step": total.mean_draft_tokens_per_step,
            # Steps that accepted a draft token at depth d + 1 (entry d).
            "num_accepted_tokens_per_depth": list(total.accepted_per_pos),
        }
    return body


def cached_prompt_tokens(samples: Iterable[RequestOutput]) -> int:
    """Prefix-cache hits of one prompt sampled ``n`` times: the tokens no sample computed (the
    samples share the prompt, which usage counts once)."""
    return min((o.num_cached_tokens for o in samples), default=0)


def sse(data: dict[str, Any] | str) -> str:
    """One server-sent event. Non-ASCII text is escaped: a raw U+2028, U+0085 or the like inside
    the JSON is a line break to clients that split lines with ``str.splitlines`` (httpx's
    ``aiter_lines`` among them), which would cut the event in two."""
    payload = data if isinstance(data, str) else json.dumps(data)
    return f"data: {payload}\n\n"


def sse_error(e: BaseException) -> str:
    """An error that happens after the 200 went out is reported as an event in the stream."""
    err = engine_error_to_api(e)
    return sse(error_body(err.message, err.type, err.param, err.code))


def envelope(handler: Any, obj: str, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    """The fields every completion / chat response and chunk starts with, then ``extra``."""
    return {
        "id": handler.request_id,
        "object": obj,
        "created": handler.created,
        "model": handler.model,
        "choices": choices,
        **extra,
    }


def now_s() -> int:
    return int(time.time())


class SSEResponse(StreamingResponse):
    """A text/event-stream response that runs ``on_close`` however it ends — normally, on
    error, or when the client disconnects before or while the body streams."""

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(
            content,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self.on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Await ``work``; if the client disconnects first, cancel it and raise
    ``ClientDisconnected`` (the work's own cleanup aborts its engine requests)."""
    task = asyncio.ensure_future(work)

    async def wait_disconnect() -> None:
        while True:
            message = await request.receive()
            if message["type"] == "http.disconnect":
                return

    watcher = asyncio.ensure_future(wait_disconnect())
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        watcher.cancel()
        raise
    if task in done:
        watcher.cancel()
        return task.result()
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
    raise ClientDisconnected()
