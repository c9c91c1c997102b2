"""The grammar caches stay within ``GRAMMAR_CACHE_SIZE`` however many distinct schemas come: the
API process's (``InputProcessor``, which checks each request's grammar) and the engine's
(``StructuredOutputManager``, whose compiler the draft masks share), both LRU by spec. A cached
grammar of the tiny test vocabulary holds some 50 KB, so an unbounded cache would grow by that
much per new schema (the soak, tests/test_reliability_soak.py, sends more schemas than the
bound and checks the processes' memory)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from checkpoints import build_tokenizer
from tandem.engine.input_processor import InputProcessor
from tandem.engine.sampling_params import SamplingParams
from tandem.engine.structured_output import (
    GRAMMAR_CACHE_SIZE,
    GrammarCompiler,
    StructuredOutputManager,
    StructuredSpec,
)

VOCAB = 320
EOS = frozenset({0})


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return build_tokenizer(Path(tmp_path_factory.mktemp("tok")))


def spec(k: int) -> StructuredSpec:
    key = f"a{k}"
    schema = {"type": "object", "properties": {key: {"type": "integer"}}, "required": [key]}
    return StructuredSpec("json_schema", json.dumps(schema))


def test_api_grammar_cache_is_bounded(tokenizer: Any) -> None:
    proc = InputProcessor(tokenizer, VOCAB, 256, EOS, block_size=16, num_blocks=64)
    for k in range(GRAMMAR_CACHE_SIZE + 40):
        proc.check_structured(SamplingParams(structured=spec(k)))
    cache = proc._grammars._cache
    assert len(cache) == GRAMMAR_CACHE_SIZE
    # LRU: the newest are kept, the oldest went first.
    assert spec(GRAMMAR_CACHE_SIZE + 39).key in cache and spec(0).key not in cache


def test_engine_grammar_cache_is_bounded(tokenizer: Any) -> None:
    manager = StructuredOutputManager(tokenizer, VOCAB, EOS)
    assert manager.compiler.cache_size == GRAMMAR_CACHE_SIZE


def test_a_used_grammar_stays_cached(tokenizer: Any) -> None:
    compiler = GrammarCompiler(tokenizer, VOCAB, EOS, cache_size=4)
    hot = compiler.template(spec(0))
    for k in range(1, 20):
        compiler.matcher(spec(k))
        assert compiler.template(spec(0)) is hot  # used again each time: never evicted
        assert len(compiler._cache) <= 4
