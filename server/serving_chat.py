"""POST /v1/chat/completions."""

from __future__ import annotations

import dataclasses
from collections.abc import AsyncIterator
from functools import partial
from typing import Any

from tandem.engine.client import RequestGroup
from tandem.engine.outputs import CompletionOutput, RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.server import harmony
from tandem.server.chat import ChatRenderer, ChatTemplateError, messages_for_template
from tandem.server.errors import bad_request, unsupported
from tandem.server.logprobs import chat_logprobs
from tandem.server.protocol import ChatCompletionRequest
from tandem.server.reasoning import ReasoningParser, resolve_parser
from tandem.server.serving import (
    build_sampling_params,
    cached_prompt_tokens,
    check_request_size,
    compile_grammar,
    engine_error_to_api,
    envelope,
    handover_fields,
    new_request_id,
    now_s,
    sse,
    sse_error,
    usage,
)
from tandem.server.state import ServerState
from tandem.server.tool_formats import MARKERS
from tandem.server.tool_parsers import ToolParser, ToolStream
from tandem.server.tools import ToolPlan, call_format, calls_text, plan_tools, template_uses

# SamplingParams' names -> this endpoint's names, for error messages.
_PARAM_NAMES = {"logprobs": "top_logprobs", "max_tokens": "max_completion_tokens"}


def request_renderer(state: ServerState, template: str) -> ChatRenderer:
    """A renderer for a template sent with the request, if the operator allows them."""
    if not state.settings.allow_request_chat_template:
        raise unsupported(
            "chat_template",
            "Templates sent with a request are refused on this server; the operator can allow "
            "them with --trust-request-chat-template.",
        )
    try:
        return ChatRenderer(template, state.tokenizer)
    except ValueError as e:
        raise bad_request(str(e), "chat_template") from e


def render_chat_prompt(
    state: ServerState,
    messages: list[Any],
    add_generation_prompt: bool,
    template: str | None = None,
    tools: ToolPlan | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> list[int]:
    """Messages -> prompt token ids through the chat template (see ``render_chat_text``)."""
    text = render_chat_text(
        state, messages, add_generation_prompt, template, tools, template_kwargs
    )
    # The template writes any BOS itself.
    return state.tokenizer.encode(text, add_special_tokens=False)


def render_chat_text(
    state: ServerState,
    messages: list[Any],
    add_generation_prompt: bool,
    template: str | None = None,
    tools: ToolPlan | None = None,
    template_kwargs: dict[str, Any] | None = None,
) -> str:
    """Messages -> prompt text through the chat template (400 if it cannot render).
    ``template`` is the request's own (see ``request_renderer``); ``tools`` reach the template,
    or a system message when the template does not use them (server/tools.py);
    ``template_kwargs`` are more template variables (``chat_template_kwargs``)."""
    renderer = state.renderer if template is None else request_renderer(state, template)
    if renderer is None:
        raise bad_request(
            "this model has no chat template; start the server with --chat-template FILE",
            "messages",
        )
    knows_calls = template_uses(renderer.source, "tool_calls")
    override = state.settings.tool_call_parser
    if harmony.is_harmony_template(renderer.source):
        fmt = "hermes"  # unused: the template renders the tools and earlier calls itself
    else:
        fmt = call_format(renderer.source, override, tools is not None and tools.parses)
    as_text = None if knows_calls else partial(calls_text, call_format=fmt)
    system = None
    if tools is not None and tools.tools and not template_uses(renderer.source, "tools"):
        if tools.choice != "none":
            system = tools.system_prompt(fmt)

    def render(parse_arguments: bool) -> str:
        dicts = messages_for_template(messages, as_text, parse_arguments)
        if system is not None:
            if dicts and dicts[0]["role"] == "system":
                dicts[0] = {**dicts[0], "content": f"{dicts[0]['content']}\n\n{system}"}
            else:
                dicts.insert(0, {"role": "system", "content": system})
        return renderer.render(
            dicts, add_generation_prompt, tools.tools if tools else None, template_kwargs
        )

    try:
        return render(parse_arguments=True)
    except ChatTemplateError as e:
        if any(getattr(m, "tool_calls", None) for m in messages):
            # Templates that concatenate earlier calls' arguments as text (DeepSeek's) fail
            # on the parsed objects Hugging Face's convention passes: give them the text.
            try:
                return render(parse_arguments=False)
            except ChatTemplateError:
                pass
        raise bad_request(str(e), "messages") from e


class ChatHandler:
    def __init__(self, state: ServerState, req: ChatCompletionRequest) -> None:
        self.state = state
        self.req = req
        self.request_id = new_request_id("chatcmpl")
        self.created = now_s()
        self.model = state.response_model_name(req.model)
        self.n = req.n
        self.want_logprobs = bool(req.logprobs)
        self.prompt_ids: list[int] = []
        check_request_size(req, state.settings)
        self.tools = plan_tools(req.tools, req.tool_choice, req.parallel_tool_calls)
        self.reasoning: ReasoningParser | None = None  # set by submit()
        self.opened = False  # the prompt opened the thinking: the output starts in it
        self.harmony = False  # the template writes the harmony format (server/harmony.py)

    async def submit(self) -> RequestGroup:
        req = self.req
        params = build_sampling_params(
            req,
            self.state.generation_defaults,
            max_tokens=req.max_output_tokens,
            logprobs=(req.top_logprobs or 0) if self.want_logprobs else None,
            param_names=_PARAM_NAMES,
        )
        self.harmony = harmony.is_harmony_template(self._template())
        if self.harmony:
            self._refuse_for_harmony(params)
        call_format = "harmony" if self.harmony else self._call_format()
        markers = harmony.MARKERS if self.harmony else MARKERS.get(call_format, ())
        special = self.state.special_tokens(markers)
        forced = self.tools.grammar(call_format, special)
        if forced is not None:
            params = dataclasses.replace(params, structured=forced)
        kwargs = {**self.state.settings.default_chat_template_kwargs}
        kwargs.update(req.chat_template_kwargs or {})
        if req.reasoning_effort is not None:
            kwargs["reasoning_effort"] = req.reasoning_effort
        text = render_chat_text(
            self.state,
            req.messages,
            req.add_generation_prompt,
            req.chat_template,
            self.tools,
            kwargs,
        )
        # The template writes any BOS itself.
        self.prompt_ids = self.state.tokenizer.encode(text, add_special_tokens=False)
        if not self.harmony:
            self.reasoning = resolve_parser(self.state.settings.reasoning_parser, self._template())
        self.opened = self.reasoning is not None and self.reasoning.opens_in_prompt(text)
        params = self._keep_markers(params)
        if params.structured is not None and self._thinks_first(text):
            # The grammar (response_format, forced calls) holds what follows the thinking.
            end = self.reasoning.end if self.reasoning else ""
            special = bool(self.state.special_tokens([end]))
            structured = dataclasses.replace(params.structured, after=end, after_special=special)
            params = dataclasses.replace(params, structured=structured)
        await compile_grammar(self.state, params, prompt_param="messages", param_names=_PARAM_NAMES)
        items = [
            (f"{self.request_id}-{j}", self.prompt_ids, params.child(j) if self.n > 1 else params)
            for j in range(self.n)
        ]
        try:
            return self.state.llm.add_requests(items)
        except Exception as e:
            raise engine_error_to_api(e, prompt_param="messages", param_names=_PARAM_NAMES) from e

    def _keep_markers(self, params: SamplingParams) -> SamplingParams:
        """The parsers read markers from the text: where the tokenizer holds one as a special
        token (GLM's), decoding keeps special tokens, or the calls and the thinking would be lost
        with them. A request that sets ``skip_special_tokens`` keeps its choice."""
        if "skip_special_tokens" in self.req.model_fields_set:
            return params
        markers: set[str] = set(harmony.MARKERS) if self.harmony else set()
        if self.reasoning is not None:
            markers |= {self.reasoning.start, self.reasoning.end}
        if self.tools.parses and not self.harmony:
            markers |= set(MARKERS.get(self._call_format(), ()))
        if self.state.special_tokens(markers):
            return dataclasses.replace(params, skip_special_tokens=False)
        return params

    def _refuse_for_harmony(self, params: SamplingParams) -> None:
        """What the harmony format does not take yet: a grammar over the whole output would
        stop the model from writing its channels (forced calls have a grammar in harmony's
        own syntax: server/tool_grammar.py)."""
        if params.structured is not None:
            raise bad_request(
                "structured outputs (response_format, structured_outputs) are not supported for "
                "models that write the harmony format (gpt-oss) yet",
                "response_format",
            )

    def _thinks_first(self, prompt: str) -> bool:
        """Whether the output may open with a thinking section: a reasoning parser is on and the
        prompt does not end with the thinking closed (``enable_thinking: false`` writes an empty
        one there)."""
        return self.reasoning is not None and not prompt.rstrip().endswith(self.reasoning.end)

    def _usage(self, outs: list[RequestOutput]) -> dict[str, Any]:
        reasoning_tokens = None
        if self.reasoning is not None:
            reasoning_tokens = sum(
                self._reasoning_tokens(self.reasoning, o.outputs[0]) for o in outs
            )
        return usage(
            len(self.prompt_ids),
            sum(len(o.outputs[0].token_ids) for o in outs),
            outs,
            cached_tokens=cached_prompt_tokens(outs),
            reasoning_tokens=reasoning_tokens,
        )

    def _reasoning_tokens(self, parser: ReasoningParser, c: CompletionOutput) -> int:
        skip = self.req.skip_special_tokens

        def decode(ids: list[int]) -> str:
            return self.state.tokenizer.decode(ids, skip_special_tokens=skip)

        return parser.count_tokens(
            c.token_ids, c.text, self.opened, decode, self.state.think_end_id
        )

    # -------------------------------------------------------------- full response

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            logprobs = None
            if self.want_logprobs:
                logprobs = chat_logprobs(c.logprobs or [], self.state.token_text)
            message: dict[str, Any] = {"role": "assistant", "content": c.text}
            text = c.text
            finish = c.finish_reason
            if self.harmony:
                parsed = harmony.parse(c.text, self.tools.parses)
                calls = parsed.calls[: None if self.tools.parallel else 1]
                message["content"] = parsed.content or None
                message["reasoning_content"] = message["reasoning"] = parsed.reasoning or None
                message["refusal"] = None
                if calls:
                    message["tool_calls"] = [call.to_openai() for call in calls]
                    finish = "tool_calls" if finish == "stop" else finish
                choices.append(
                    {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
                )
                continue
            if self.reasoning is not None:
                split = self.reasoning.split(c.text, self.opened)
                text = split.content or ""
                message["content"] = split.content
                message["reasoning_content"] = message["reasoning"] = split.reasoning
            message["refusal"] = None
            if self.tools.parses:  # calls are read from the answer, never from the thinking
                parsed = self._parser().parse(text)
                calls = parsed.tool_calls[: None if self.tools.parallel else 1]
                if calls:
                    message["content"] = parsed.content or None
                    message["tool_calls"] = [call.to_openai() for call in calls]
                    finish = "tool_calls" if finish == "stop" else finish
            choices.append(
                {"index": i, "message": message, "logprobs": logprobs, "finish_reason": finish}
            )
        return envelope(
            self,
            "chat.completion",
            choices,
            usage=self._usage(outs),
            system_fingerprint=None,
            **handover_fields(outs),
        )

    def _template(self) -> str | None:
        """The chat template's source: the request's own, else the server's."""
        if self.req.chat_template is not None:
            return self.req.chat_template
        renderer = self.state.renderer
        return renderer.source if renderer else None

    def _call_format(self) -> str:
        return self.tools.call_format(self._template(), self.state.settings.tool_call_parser)

    def _parser(self) -> ToolParser:
        return self.tools.parser(self._template(), self.state.settings.tool_call_parser)

    # -------------------------------------------------------------- streaming

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = envelope(self, "chat.completion.chunk", choices, system_fingerprint=None)
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        sent_text = [""] * self.n
        sent_tokens = [0] * self.n
        last: dict[int, RequestOutput] = {}
        channels = (
            [harmony.HarmonyStream(self.tools.parses) for _ in range(self.n)]
            if self.harmony
            else []
        )
        parses = self.tools.parses and not self.harmony
        streams = [self._parser().stream() for _ in range(self.n)] if parses else []
        thinking = (
            [self.reasoning.stream(self.opened) for _ in range(self.n)] if self.reasoning else []
        )
        num_calls = [0] * self.n
        try:
            for i in range(self.n):
                role = {"role": "assistant", "content": ""}
                yield sse(
                    self._chunk(
                        [{"index": i, "delta": role, "logprobs": None, "finish_reason": None}]
                    )
                )
            async for i, out in group.stream():
                last[i] = out
                c = out.outputs[0]
                delta = c.text[len(sent_text[i]) :] if c.text.startswith(sent_text[i]) else ""
                new_lps = (c.logprobs or [])[sent_tokens[i] :] if self.want_logprobs else []
                if not (delta or new_lps or out.finished):
                    continue
                sent_text[i] += delta
                sent_tokens[i] = len(c.token_ids)
                reasoning = ""
                finish = c.finish_reason if out.finished else None
                message: dict[str, Any]
                if channels:
                    message, reasoning, finish = self._harmony_delta(
                        channels[i], delta, out.finished, finish, num_calls, i
                    )
                else:
                    if thinking:
                        reasoning, delta = thinking[i].feed(delta)
                        if out.finished:
                            more_reasoning, more = thinking[i].finish()
                            reasoning, delta = reasoning + more_reasoning, delta + more
                    message = {"content": delta} if delta else {}
                    if streams:
                        message, finish = self._tool_delta(
                            streams[i], delta, out.finished, finish, num_calls, i
                        )
                if reasoning:
                    message = {"reasoning_content": reasoning, "reasoning": reasoning, **message}
                if (streams or thinking or channels) and not (message or new_lps or out.finished):
                    continue  # text held back: it may start a call, a tag or a marker
                choice = {
                    "index": i,
                    "delta": message,
                    "logprobs": chat_logprobs(new_lps, self.state.token_text)
                    if self.want_logprobs
                    else None,
                    "finish_reason": finish,
                }
                yield sse(self._chunk([choice]))
            if self.req.include_usage:
                final = self._chunk([])
                final["usage"] = self._usage(list(last.values()))
                yield sse(final)
        except Exception as e:
            yield sse_error(e)
        yield sse("[DONE]")

    def _harmony_delta(
        self,
        stream: harmony.HarmonyStream,
        delta: str,
        finished: bool,
        finish: str | None,
        num_calls: list[int],
        i: int,
    ) -> tuple[dict[str, Any], str, str | None]:
        """One choice's delta read as harmony messages: (the message's content and calls, its
        reasoning, the finish reason)."""
        reasoning, content, calls = stream.feed(delta)
        if finished:
            more_reasoning, more_content, more_calls = stream.finish()
            reasoning, content = reasoning + more_reasoning, content + more_content
            calls = calls + more_calls
        message: dict[str, Any] = {"content": content} if content else {}
        return message, reasoning, self._add_calls(message, calls, finish, num_calls, i)

    def _tool_delta(
        self,
        stream: ToolStream,
        delta: str,
        finished: bool,
        finish: str | None,
        num_calls: list[int],
        i: int,
    ) -> tuple[dict[str, Any], str | None]:
        """One choice's delta with its text run through the tool parser: content that cannot
        start a call, and each call once complete (OpenAI's shape: index, id, name, arguments)."""
        content, calls = stream.feed(delta)
        if finished:
            rest, more = stream.finish()
            content, calls = content + rest, calls + more
        message: dict[str, Any] = {}
        if content and not (num_calls[i] and not content.strip()):
            message["content"] = content
        return message, self._add_calls(message, calls, finish, num_calls, i)

    def _add_calls(
        self,
        message: dict[str, Any],
        calls: list[Any],
        finish: str | None,
        num_calls: list[int],
        i: int,
    ) -> str | None:
        """Put choice ``i``'s newly complete calls in ``message`` (one in all without parallel
        calls; OpenAI's shape: index, id, name, arguments); returns the finish reason, "stop"
        becoming "tool_calls" once the choice made a call."""
        if not self.tools.parallel:
            calls = calls[: max(0, 1 - num_calls[i])]
        if calls:
            message["tool_calls"] = [
                call.to_openai(num_calls[i] + k) for k, call in enumerate(calls)
            ]
            num_calls[i] += len(calls)
        return "tool_calls" if finish == "stop" and num_calls[i] else finish
