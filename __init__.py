"""Tandem: an OpenAI-compatible LLM inference server with one-model speculative decoding.

Everything Tandem installs lives under this one import name. The repository's top-level folders
are its subpackages (``engine/`` is ``tandem.engine``, ``benchmarks/`` is ``tandem.bench``; see
``[tool.setuptools.package-dir]`` in pyproject.toml). ``engine/``, ``server/``, ``kernels/`` and
``models/`` carry no ``__init__.py``: run from the checkout's root, where the current folder is on
``sys.path``, they must not shadow another distribution's top-level package of the same name
(Hugging Face's ``kernels``, which ``transformers`` imports).

The offline API, loaded on first use so that ``import tandem`` stays light::

    from tandem import LLM, SamplingParams
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from tandem.version import __version__

# Public name -> the module that defines it.
_EXPORTS = {
    "LLM": "tandem.engine.llm",
    "LLMEngine": "tandem.engine.llm_engine",
    "EngineArgs": "tandem.engine.config",
    "SamplingParams": "tandem.engine.sampling_params",
    "RequestOutput": "tandem.engine.outputs",
    "CompletionOutput": "tandem.engine.outputs",
}

__all__ = [
    "LLM",
    "CompletionOutput",
    "EngineArgs",
    "LLMEngine",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from tandem.engine.config import EngineArgs
    from tandem.engine.llm import LLM
    from tandem.engine.llm_engine import LLMEngine
    from tandem.engine.outputs import CompletionOutput, RequestOutput
    from tandem.engine.sampling_params import SamplingParams


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module 'tandem' has no attribute {name!r}")
    value = getattr(import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value
