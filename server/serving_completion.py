"""POST /v1/completions (OpenAI's legacy text completions)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from tandem.engine.client import RequestGroup
from tandem.engine.outputs import RequestOutput
from tandem.server.logprobs import completion_logprobs
from tandem.server.protocol import CompletionRequest
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


def _prompts(req: CompletionRequest) -> list[str | list[int]]:
    p = req.prompt
    if isinstance(p, str):
        return [p]
    if p and isinstance(p[0], int):
        return [list(p)]  # type: ignore[arg-type]
    return list(p)  # type: ignore[arg-type]


class CompletionHandler:
    def __init__(self, state: ServerState, req: CompletionRequest) -> None:
        self.state = state
        self.req = req
        self.request_id = new_request_id("cmpl")
        self.created = now_s()
        self.model = state.response_model_name(req.model)
        self.prompts = _prompts(req)
        self.n = req.n
        self.want_logprobs = req.logprobs is not None

    async def submit(self) -> RequestGroup:
        """Validate and submit every (prompt, sample) pair; raises ``APIError``."""
        check_request_size(self.req, self.state.settings)
        params = build_sampling_params(
            self.req,
            self.state.generation_defaults,
            max_tokens=self.req.max_tokens,
            logprobs=self.req.logprobs,
        )
        await compile_grammar(self.state, params)
        items = []
        for p, prompt in enumerate(self.prompts):
            if isinstance(prompt, str | list) and not prompt:
                raise engine_error_to_api(ValueError(f"prompt {p} is empty"))
            for j in range(self.n):
                child = params.child(j) if self.n > 1 else params
                items.append((f"{self.request_id}-{p}-{j}", prompt, child))
        try:
            return self.state.llm.add_requests(items)
        except Exception as e:
            raise engine_error_to_api(e) from e

    def _prompt_text(self, index: int, out: RequestOutput) -> str:
        prompt = self.prompts[index // self.n]
        if isinstance(prompt, str):
            return prompt
        return self.state.tokenizer.decode(out.prompt_token_ids, skip_special_tokens=False)

    def _usage(self, outs: dict[int, RequestOutput]) -> dict[str, Any]:
        prompt_tokens = sum(
            len(outs[p * self.n].prompt_token_ids)
            for p in range(len(self.prompts))
            if p * self.n in outs
        )
        completion_tokens = sum(len(o.outputs[0].token_ids) for o in outs.values())
        cached = sum(
            cached_prompt_tokens(outs[i] for i in range(p * self.n, (p + 1) * self.n) if i in outs)
            for p in range(len(self.prompts))
        )
        return usage(prompt_tokens, completion_tokens, outs.values(), cached_tokens=cached)

    # -------------------------------------------------------------- full response

    def response(self, outs: list[RequestOutput]) -> dict[str, Any]:
        choices = []
        for i, out in enumerate(outs):
            c = out.outputs[0]
            text = c.text
            logprobs = None
            if self.want_logprobs:
                logprobs, _ = completion_logprobs(c.logprobs or [], self.state.token_text, 0)
            if self.req.echo:
                text = self._prompt_text(i, out) + text
            choices.append(
                {"index": i, "text": text, "logprobs": logprobs, "finish_reason": c.finish_reason}
            )
        usage = self._usage(dict(enumerate(outs)))
        return envelope(
            self,
            "text_completion",
            choices,
            usage=usage,
            system_fingerprint=None,
            **handover_fields(outs),
        )

    # -------------------------------------------------------------- streaming

    def _chunk(self, choices: list[dict[str, Any]]) -> dict[str, Any]:
        chunk = envelope(self, "text_completion", choices)
        if self.req.include_usage:
            chunk["usage"] = None
        return chunk

    async def stream(self, group: RequestGroup) -> AsyncIterator[str]:
        total = len(self.prompts) * self.n
        sent_text = [""] * total
        sent_tokens = [0] * total
        offsets = [0] * total
        echoed = [False] * total
        last: dict[int, RequestOutput] = {}
        try:
            async for i, out in group.stream():
                last[i] = out
                c = out.outputs[0]
                prefix = ""
                if self.req.echo and not echoed[i]:
                    prefix = self._prompt_text(i, out)
                    echoed[i] = True
                delta = c.text[len(sent_text[i]) :] if c.text.startswith(sent_text[i]) else ""
                new_lps = (c.logprobs or [])[sent_tokens[i] :] if self.want_logprobs else []
                finished = out.finished
                if not (prefix or delta or new_lps or finished):
                    continue
                logprobs = None
                if self.want_logprobs:
                    logprobs, offsets[i] = completion_logprobs(
                        new_lps, self.state.token_text, offsets[i]
                    )
                sent_text[i] += delta
                sent_tokens[i] = len(c.token_ids)
                choice = {
                    "index": i,
                    "text": prefix + delta,
                    "logprobs": logprobs,
                    "finish_reason": c.finish_reason if finished else None,
                }
                yield sse(self._chunk([choice]))
            if self.req.include_usage:
                final = self._chunk([])
                final["usage"] = self._usage(last)
                yield sse(final)
        except Exception as e:
            yield sse_error(e)
        yield sse("[DONE]")
