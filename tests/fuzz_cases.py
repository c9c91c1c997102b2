"""The requests of the fuzz driver (`fuzz_driver.py`), each a pure function of (seed, server,
index): schema-based (schemathesis from the server's own OpenAPI), mutation-based (valid
completions and chat requests with one to three fields broken) and protocol-level (raw bytes on a
socket: truncated bodies, wrong content types, huge headers, slow bodies, a stream never read)."""

from __future__ import annotations

import copy
import json
import random
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlencode

KINDS = ("schema", "mutation", "protocol")
MODEL = "tiny"
MAX_MODEL_LEN = 512  # the tools' chat template alone is some 460 tokens of the tiny tokenizer
BODY_LIMIT = 1 << 20  # --max-request-body-size


@dataclass(frozen=True)
class Request:
    """One request to send. ``raw`` set: protocol-level, the bytes go to a socket as they are
    (``chunks`` with ``pause_s`` between them); else an HTTP request through httpx."""

    kind: str
    index: int
    variant: str  # which template, mutation or attack
    method: str = "POST"
    path: str = "/v1/completions"
    body: bytes | None = None
    headers: dict[str, str] = field(default_factory=dict)
    raw: tuple[bytes, ...] = ()
    pause_s: float = 0.0
    shut_write: bool = False  # half-close after the last chunk (a truncated body)
    abandon: bool = False  # hold the connection for pause_s without reading, then drop it


def kind_of(rng: random.Random) -> str:
    """About 20 % schema, 60 % mutation, 20 % protocol."""
    return rng.choices(KINDS, weights=(2, 6, 2))[0]


def request_rng(seed: int, server: str, index: int) -> random.Random:
    return random.Random(f"{seed}/{server}/{index}")


def dumps(value: Any) -> bytes:
    """JSON as a hostile client writes it: NaN and Infinity allowed, lone surrogates escaped."""
    return json.dumps(value, allow_nan=True).encode()


# ------------------------------------------------------------------ valid templates

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
            "required": ["city"],
        },
    },
}
SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
    "required": ["name"],
}
PROMPTS = ["Hello world!", "The quick brown fox", "0 1 2 3", "Paris is", "é ü 中文 🙂"]


def completion_template(rng: random.Random) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": MODEL,
        "prompt": rng.choice([rng.choice(PROMPTS), [5, 6, 7, 8], ["ab", "cd"]]),
        "max_tokens": rng.randint(1, 6),
        "temperature": rng.choice([0, 0.7, 1.3]),
    }
    options: dict[str, Any] = {
        "top_p": rng.choice([0.5, 0.9, 1.0]),
        "top_k": rng.choice([-1, 5, 50]),
        "min_p": 0.05,
        "n": rng.randint(1, 3),
        "seed": rng.randint(0, 2**31),
        "stop": rng.choice(["o", [" the", "."], []]),
        "stop_token_ids": [rng.randint(0, 319)],
        "logprobs": rng.randint(0, 5),
        "echo": rng.random() < 0.5,
        "min_tokens": rng.randint(0, 4),
        "presence_penalty": rng.uniform(-2, 2),
        "frequency_penalty": rng.uniform(-2, 2),
        "repetition_penalty": rng.uniform(0.5, 2),
        "ignore_eos": rng.random() < 0.5,
        "stream": rng.random() < 0.4,
        "stream_options": {"include_usage": True},
        "structured_outputs": rng.choice(
            [{"regex": "[a-e]{2,6}"}, {"choice": ["yes", "no"]}, {"json": SCHEMA}]
        ),
        "response_format": rng.choice(
            [
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
            ]
        ),
        "include_stop_str_in_output": True,
        "skip_special_tokens": False,
        "user": "fuzz",
    }
    body.update(_some(rng, options))
    if "structured_outputs" in body and "response_format" in body:
        del body["response_format"]  # one constraint per request (both: a 400 by design)
    if not body.get("stream"):
        body.pop("stream_options", None)
    return body


def chat_template(rng: random.Random) -> dict[str, Any]:
    messages: list[dict[str, Any]] = [{"role": "user", "content": rng.choice(PROMPTS)}]
    if rng.random() < 0.3:
        messages.insert(0, {"role": "system", "content": "Be terse."})
    body: dict[str, Any] = {
        "model": MODEL,
        "messages": messages,
        "max_completion_tokens": rng.randint(1, 6),
        "temperature": rng.choice([0, 0.8]),
    }
    options: dict[str, Any] = {
        "tools": [WEATHER],
        "logprobs": True,
        "top_logprobs": rng.randint(0, 5),
        "n": rng.randint(1, 3),
        "seed": rng.randint(0, 2**31),
        "stop": rng.choice(["a", ["\n", "}"]]),
        "presence_penalty": rng.uniform(-2, 2),
        "frequency_penalty": rng.uniform(-2, 2),
        "repetition_penalty": rng.uniform(0.5, 2),
        "min_tokens": rng.randint(0, 4),
        "stream": rng.random() < 0.4,
        "stream_options": {"include_usage": True},
        "response_format": rng.choice(
            [
                {"type": "json_object"},
                {"type": "json_schema", "json_schema": {"name": "p", "schema": SCHEMA}},
                {"type": "text"},
            ]
        ),
        "structured_outputs": {"regex": "(yes|no)"},
        "max_tokens": rng.randint(1, 6),
    }
    body.update(_some(rng, options))
    if "tools" in body:
        body["tool_choice"] = rng.choice(
            ["auto", "none", "required", {"type": "function", "function": {"name": "get_weather"}}]
        )
        body["max_completion_tokens"] = rng.randint(2, 10)
        body.pop("max_tokens", None)
        body.pop("response_format", None)  # a forced call and a format: a 400 by design
        body.pop("structured_outputs", None)
    if "structured_outputs" in body and "response_format" in body:
        del body["response_format"]
    if not body.get("stream"):
        body.pop("stream_options", None)
    return body


def _some(rng: random.Random, options: dict[str, Any]) -> dict[str, Any]:
    keys = rng.sample(sorted(options), rng.randint(0, min(6, len(options))))
    return {k: options[k] for k in keys}


# ------------------------------------------------------------------ mutations

WRONG_TYPES: list[Any] = [None, True, False, 0, -1, 1.5, "", "x", [], {}, [None], {"a": 1}]
EXTREME: list[Any] = [
    0, -1, 1, 2**31, 2**31 - 1, -(2**31), 2**63, -(2**63), 2**64, 10**100,
    1e308, -1e308, 1e-308, 0.5, -0.0, float("nan"), float("inf"), float("-inf"),
]  # fmt: skip
UNICODE = ["\u0000", "\ud800", "\udfff", "é", "🙂" * 50, "\u202e\u200b", "\ufeff", "\x7f"]


def _paths(value: Any, done: set[int], prefix: tuple = ()) -> list[tuple]:
    """Every path into a JSON value (object keys and list indices), the root excluded, but
    none inside a value already mutated (ids in ``done``): a repeated value is one object many
    times, and a change inside it would be multiplied by every copy."""
    out: list[tuple] = []
    if id(value) in done:
        return out
    if isinstance(value, dict):
        for k, v in value.items():
            out.append((*prefix, k))
            out += _paths(v, done, (*prefix, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out.append((*prefix, i))
            out += _paths(v, done, (*prefix, i))
    return out


def _mutated_value(rng: random.Random, old: Any) -> tuple[str, Any]:
    op = rng.choice(["type", "extreme", "huge", "empty", "nest", "unicode", "repeat", "wide"])
    if op == "type":
        return op, copy.deepcopy(rng.choice(WRONG_TYPES))  # never the shared object itself
    if op == "extreme":
        return op, rng.choice(EXTREME)
    if op == "huge":
        return op, rng.choice(["x", "word ", "🙂", "{"]) * rng.choice([1000, 30_000, 200_000])
    if op == "empty":
        return op, rng.choice(["", [], {}, [[]], [""]])
    if op == "nest":
        value = old
        for _ in range(rng.choice([2, 20, 250])):
            value = rng.choice([[value], {"a": value}])
        return op, value
    if op == "wide":  # an object of many keys: a schema's properties, a tool's arguments
        value = next(iter(old.values())) if isinstance(old, dict) and old else old
        size = len(dumps(value)) + 8  # up to twice the body limit, as "repeat"
        n = min(rng.choice([50, 600, 3000]), max(2, 2 * BODY_LIMIT // size))
        return op, {f"k{i}": copy.deepcopy(value) for i in range(n)}
    if op == "unicode":
        s = old if isinstance(old, str) else "x"
        cut = rng.randint(0, len(s))
        return op, s[:cut] + rng.choice(UNICODE) + s[cut:]
    size = len(dumps(old))  # repeated, up to twice the body limit (a 413 past it anyway)
    return op, [old] * min(rng.choice([2, 100, 5000]), max(2, 2 * BODY_LIMIT // max(1, size)))


def mutate(rng: random.Random, body: dict[str, Any]) -> tuple[str, dict[str, Any]]:
    """``body`` with one to three fields deleted, retyped or replaced; the mutations' names."""
    body = copy.deepcopy(body)
    names = []
    done: set[int] = set()  # the containers made by the mutations so far
    for _ in range(rng.randint(1, 3)):
        paths = _paths(body, done)
        if not paths or rng.random() < 0.1:
            key = rng.choice(
                ["logit_bias", "best_of", "suffix", "tool_choice", "\u00e9", "x" * 300]
            )
            body[key] = copy.deepcopy(rng.choice([*WRONG_TYPES, *EXTREME[:6]]))
            done.add(id(body[key]))
            names.append(f"add:{key[:12]}")
            continue
        path = rng.choice(paths)
        parent: Any = body
        for step in path[:-1]:
            parent = parent[step]
        if rng.random() < 0.2:
            del parent[path[-1]]
            names.append(f"delete:{path[-1]}")
            continue
        op, parent[path[-1]] = _mutated_value(rng, parent[path[-1]])
        done.add(id(parent[path[-1]]))
        names.append(f"{op}:{path[-1]}")
    return ",".join(str(n) for n in names), body


def mutation_request(rng: random.Random, index: int) -> Request:
    chat = rng.random() < 0.5
    body = chat_template(rng) if chat else completion_template(rng)
    variant = "valid"
    if rng.random() < 0.75:  # a quarter stay valid: generation under load, too
        variant, body = mutate(rng, body)
    path = "/v1/chat/completions" if chat else "/v1/completions"
    return Request("mutation", index, f"{'chat' if chat else 'completions'} {variant}", path=path,
                   body=dumps(body), headers={"content-type": "application/json"})  # fmt: skip


# ------------------------------------------------------------------ protocol level

ATTACKS = ("truncated", "truncated_close", "content_type", "huge_header", "many_headers",
           "slow_body", "never_read", "bad_chunked", "garbage", "no_length")  # fmt: skip
CONTENT_TYPES = ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data",
                 "application/json; charset=latin-1", "application/xml", "", "*/*",
                 "application/json\x00", "application/jsonx"]  # fmt: skip


def _head(path: str, headers: dict[str, str], length: int | None) -> bytes:
    lines = [f"POST {path} HTTP/1.1", "Host: 127.0.0.1", "Connection: close"]
    lines += [f"{k}: {v}" for k, v in headers.items()]
    if length is not None:
        lines.append(f"Content-Length: {length}")
    return ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1", "replace")


def protocol_request(rng: random.Random, index: int) -> Request:
    attack = rng.choice(ATTACKS)
    path = rng.choice(["/v1/completions", "/v1/chat/completions", "/tokenize"])
    body = dumps(completion_template(rng) if path != "/v1/chat/completions" else chat_template(rng))
    json_type = {"Content-Type": "application/json"}
    raw: tuple[bytes, ...]
    kw: dict[str, Any] = {}
    if attack in ("truncated", "truncated_close"):
        cut = rng.randint(0, max(0, len(body) - 1))
        raw = (_head(path, json_type, len(body)), body[:cut])
        # Half-closed (the server sees the end of the body early), or dropped a moment later.
        kw = {"shut_write": True} if attack == "truncated" else {"abandon": True, "pause_s": 0.2}
    elif attack == "content_type":
        raw = (_head(path, {"Content-Type": rng.choice(CONTENT_TYPES)}, len(body)), body)
    elif attack == "huge_header":
        size = rng.choice([8 << 10, 64 << 10, 1 << 20])
        raw = (_head(path, {**json_type, "X-Fuzz": "a" * size}, len(body)), body)
    elif attack == "many_headers":
        many = {f"X-Fuzz-{i}": str(i) for i in range(rng.choice([100, 1000, 10_000]))}
        raw = (_head(path, {**json_type, **many}, len(body)), body)
    elif attack == "slow_body":
        parts = rng.randint(3, 8)
        step = -(-len(body) // parts)
        chunks = [body[i : i + step] for i in range(0, len(body), step)]
        raw = (_head(path, json_type, len(body)), *chunks)
        kw = {"pause_s": rng.uniform(0.02, 0.15)}
    elif attack == "never_read":
        stream = json.loads(body)
        stream.update(stream=True, ignore_eos=True, n=1)
        stream.pop("max_completion_tokens", None)
        stream["max_tokens"] = 48
        path = "/v1/completions" if "prompt" in stream else "/v1/chat/completions"
        body = dumps(stream)
        raw = (_head(path, json_type, len(body)), body)
        kw = {"abandon": True, "pause_s": rng.uniform(0.1, 1.0)}
    elif attack == "bad_chunked":
        chunked = {**json_type, "Transfer-Encoding": "chunked"}
        size = rng.choice([f"{len(body):x}", "zz", "-1", "ffffffffffffffff", f"{len(body) + 9:x}"])
        raw = (_head(path, chunked, None), f"{size}\r\n".encode() + body + b"\r\n0\r\n\r\n")
        kw = {"shut_write": True}
    elif attack == "garbage":
        raw = (rng.choice([b"\x16\x03\x01\x02\x00\x01\x00", b"GET / HTTP/9.9\r\n\r\n",
                           b"POST\r\n\r\n", b"\r\n" * 100, bytes(range(256))]),)  # fmt: skip
        kw = {"shut_write": True}
    else:  # no_length: a body with neither Content-Length nor chunked encoding
        raw = (_head(path, json_type, None), body)
        kw = {"shut_write": True}
    return Request("protocol", index, attack, path=path, raw=raw, **kw)


# ------------------------------------------------------------------ schema based


def schema_requests(openapi: dict[str, Any], count: int, seed: int) -> list[Request]:
    """``count`` cases drawn by schemathesis from ``openapi`` (positive and negative, every
    operation; rounds with new seeds until there are enough), in a fixed order for ``seed``."""
    import schemathesis
    from schemathesis import GenerationMode

    ops = [result.ok() for result in schemathesis.openapi.from_dict(openapi).get_all_operations()]
    out: list[Request] = []
    per_round = max(4, count // (2 * len(ops)) + 1)
    for round_ in range(1000):
        for op in ops:
            for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
                if len(out) >= count:
                    return out
                n = min(per_round, count - len(out))
                out += _draw(op, mode, n, seed * 1000 + round_, len(out))
    return out


def _draw(op: Any, mode: Any, n: int, seed: int, first: int) -> list[Request]:
    """Up to ``n`` cases of one operation and generation mode (fewer where the operation has
    fewer inputs to vary; none where a negative case cannot be made)."""
    from hypothesis import HealthCheck, Phase, given, settings
    from hypothesis import seed as hypothesis_seed
    from hypothesis.errors import Unsatisfiable

    out: list[Request] = []

    @hypothesis_seed(seed)
    @settings(
        max_examples=n, deadline=None, database=None, phases=[Phase.generate],
        suppress_health_check=list(HealthCheck),
    )  # fmt: skip
    @given(case=op.as_strategy(generation_mode=mode))
    def draw(case: Any) -> None:
        if len(out) < n:
            out.append(_from_case(case, first + len(out), mode.value))

    try:
        draw()
    except Unsatisfiable:  # nothing to make invalid (an operation without inputs)
        pass
    return out


def _from_case(case: Any, index: int, mode: str) -> Request:
    kw = case.as_transport_kwargs(base_url="")
    headers = {k: str(v) for k, v in kw.get("headers", {}).items()
               if k.lower() not in ("connection", "x-schemathesis-testcaseid")}  # fmt: skip
    if "json" in kw:
        body: bytes | None = dumps(kw["json"])
    elif "data" in kw:
        data = kw["data"]
        if isinstance(data, dict):
            data = urlencode(data, doseq=True)
        body = data.encode("utf-8", "surrogatepass") if isinstance(data, str) else bytes(data)
    else:
        body = None
    path = kw["url"]
    if kw.get("params"):
        path += "?" + urlencode(kw["params"], doseq=True)
    return Request("schema", index, f"{case.method} {case.path} {mode}", method=case.method,
                   path=path, body=body, headers=headers)  # fmt: skip
