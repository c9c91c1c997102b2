"""Tandem's engine: requests, scheduler, KV cache, executor, model runner and sampler."""

from engine.config import EngineArgs
from engine.llm import LLM
from engine.llm_engine import LLMEngine
from engine.outputs import CompletionOutput, RequestOutput
from engine.sampling_params import SamplingParams

__all__ = ["LLM", "LLMEngine", "EngineArgs", "SamplingParams", "RequestOutput", "CompletionOutput"]
