"""Offline API: ``LLM(model=...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

import dataclasses
from typing import Any

from tandem.engine.config import EngineArgs
from tandem.engine.llm_engine import LLMEngine
from tandem.engine.outputs import RequestOutput
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import StructuredOutputError


class LLM:
    """Runs the engine in this process until every prompt is done.

    ``model`` is a local folder or a Hugging Face id (fetched into the hub cache, see
    ``models/hub.py``); ``kwargs`` are ``EngineArgs`` fields (``dtype``, ``device``,
    ``max_num_seqs``, ``max_model_len``, ``seed``, ``revision``, ``download_dir``, ...)."""

    def __init__(self, model: str, **kwargs: Any) -> None:
        unknown = set(kwargs) - EngineArgs.field_names()
        if unknown:
            raise ValueError(
                f"unknown LLM arguments: {sorted(unknown)}; "
                f"known: {sorted(EngineArgs.field_names() - {'model'})}"
            )
        args = EngineArgs(model=model, **kwargs).with_local_folders()
        if args.data_parallel_size > 1 and not args.enable_attention_dp:
            raise ValueError(
                f"data_parallel_size={args.data_parallel_size}: replicas run behind the server "
                "(`tandem serve -dp N`); the offline LLM runs one replica"
            )
        self.engine = LLMEngine.from_engine_args(args)
        self.tokenizer = self.engine.tokenizer
        self._counter = 0

    def generate(
        self,
        prompts: str | list[int] | list[str] | list[list[int]],
        sampling_params: SamplingParams | list[SamplingParams] | None = None,
    ) -> list[RequestOutput]:
        """One ``RequestOutput`` per prompt, in order, with ``n`` samples each."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        params = sampling_params or SamplingParams()
        plist = params if isinstance(params, list) else [params] * len(prompts)
        if len(plist) != len(prompts):
            raise ValueError(
                f"got {len(plist)} SamplingParams for {len(prompts)} prompts; pass one or one each"
            )
        # Validate every prompt before running any of them.
        pending: list[tuple[str, int, int]] = []  # (engine id, prompt index, sample index)
        built = []
        for i, (prompt, p) in enumerate(zip(prompts, plist, strict=True)):
            for j in range(p.n):
                rid = f"{self._counter}-{i}-{j}"
                built.append(self.engine.make_request(rid, prompt, p.child(j) if p.n > 1 else p))
                pending.append((rid, i, j))
        self._counter += 1
        for request in built:
            self.engine.add_request(request.request_id, request)
        final: dict[str, RequestOutput] = {}
        try:
            while self.engine.has_unfinished_requests():
                for out in self.engine.step():
                    if out.finished:
                        final[out.request_id] = out
                for failure in self.engine.take_failed():
                    if failure.param is not None:  # the request's grammar
                        raise StructuredOutputError(failure.message, failure.param)
                    raise RuntimeError(f"request {failure.request_id} failed: {failure.message}")
        except BaseException:
            self.engine.abort_request([rid for rid, _, _ in pending if rid not in final])
            raise
        by_prompt: list[list[RequestOutput]] = [[] for _ in prompts]
        for rid, i, _ in pending:  # pending is in (prompt, sample) order
            by_prompt[i].append(final[rid])
        results: list[RequestOutput] = []
        for i, samples in enumerate(by_prompt):
            outputs = [dataclasses.replace(s.outputs[0], index=j) for j, s in enumerate(samples)]
            results.append(dataclasses.replace(samples[0], request_id=str(i), outputs=outputs))
        return results

    def shutdown(self) -> None:
        self.engine.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()
