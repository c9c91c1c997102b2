"""The tool-call formats chat templates teach models, as text: each format's markers, earlier
calls written in it, and argument values read back with the function's JSON schema.

=============  ==================  ==========================================================
name           written by          one call
=============  ==================  ==========================================================
hermes         Hermes, Qwen 2.5/3  ``<tool_call>\\n{"name": N, "arguments": {...}}\\n</tool_call>``
llama3_json    Llama 3.1-3.3       ``{"name": N, "parameters": {...}}`` (several joined by ``; ``)
deepseek_v3    DeepSeek-V3, R1     ``<｜tool▁call▁begin｜>function<｜tool▁sep｜>N\\n```json\\n{...}\\n```<｜tool▁call▁end｜>``
deepseek_v31   DeepSeek-V3.1       ``<｜tool▁call▁begin｜>N<｜tool▁sep｜>{...}<｜tool▁call▁end｜>``
glm45          GLM-4.5, 4.6        ``<tool_call>N\\n<arg_key>k</arg_key>\\n<arg_value>v</arg_value>\\n</tool_call>``
qwen3_coder    Qwen3-Coder         ``<tool_call>\\n<function=N>\\n<parameter=k>\\nv\\n</parameter>\\n</function>\\n</tool_call>``
kimi_k2        Kimi-K2             ``<|tool_call_begin|>functions.N:I<|tool_call_argument_begin|>{...}<|tool_call_end|>``
=============  ==================  ==========================================================

DeepSeek's calls sit in one ``<｜tool▁calls▁begin｜>`` … ``<｜tool▁calls▁end｜>`` block (V3 puts a
newline between them, V3.1 nothing), Kimi-K2's in one ``<|tool_calls_section_begin|>`` …
``<|tool_calls_section_end|>`` section, each named by its id ``functions.NAME:INDEX`` (I: the
call's index in the message), which is also the call's ``id`` (Kimi's template writes tool
results under ``## Return of ID``, so the model reads back the id it wrote). GLM and
Qwen3-Coder write each argument on its own: a string
parameter's value is its raw text, any other value is JSON.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

FORMATS = (
    "hermes",
    "llama3_json",
    "deepseek_v3",
    "deepseek_v31",
    "glm45",
    "qwen3_coder",
    "kimi_k2",
)

HERMES_OPEN, HERMES_CLOSE = "<tool_call>", "</tool_call>"
PYTHON_TAG = "<|python_tag|>"
DS_CALLS_BEGIN, DS_CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
DS_CALL_BEGIN, DS_CALL_END = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>"
DS_SEP = "<｜tool▁sep｜>"
DS_FENCE_OPEN, DS_FENCE_CLOSE = "\n```json\n", "\n```"
GLM_KEY, GLM_KEY_END = "<arg_key>", "</arg_key>"
GLM_VALUE, GLM_VALUE_END = "<arg_value>", "</arg_value>"
QWEN_FUNCTION, QWEN_FUNCTION_END = "<function=", "</function>"
QWEN_PARAM, QWEN_PARAM_END = "<parameter=", "</parameter>"
KIMI_CALLS_BEGIN, KIMI_CALLS_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
KIMI_CALL_BEGIN, KIMI_CALL_END = "<|tool_call_begin|>", "<|tool_call_end|>"
KIMI_ARGS = "<|tool_call_argument_begin|>"
KIMI_ID_PREFIX = "functions."
# The marker strings each format writes (a tokenizer may hold them as special tokens).
MARKERS: dict[str, tuple[str, ...]] = {
    "hermes": (HERMES_OPEN, HERMES_CLOSE),
    "llama3_json": (PYTHON_TAG,),
    "deepseek_v3": (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP),
    "deepseek_v31": (DS_CALLS_BEGIN, DS_CALLS_END, DS_CALL_BEGIN, DS_CALL_END, DS_SEP),
    "glm45": (HERMES_OPEN, HERMES_CLOSE, GLM_KEY, GLM_KEY_END, GLM_VALUE, GLM_VALUE_END),
    "qwen3_coder": (HERMES_OPEN, HERMES_CLOSE, QWEN_FUNCTION_END, QWEN_PARAM_END),
    "kimi_k2": (KIMI_CALLS_BEGIN, KIMI_CALLS_END, KIMI_CALL_BEGIN, KIMI_CALL_END, KIMI_ARGS),
}


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str  # a JSON object's text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self, index: int | None = None) -> dict[str, Any]:
        out: dict[str, Any] = {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }
        if index is not None:
            out["index"] = index
        return out


@dataclass
class Parsed:
    content: str
    tool_calls: list[ToolCall]


# ----------------------------------------------------------------- argument values


def schema_types(schema: Any) -> set[str]:
    """The JSON types a schema names (``type``, or those of its ``enum`` / ``const`` values)."""
    if not isinstance(schema, dict):
        return set()
    kind = schema.get("type")
    if isinstance(kind, str):
        return {kind}
    if isinstance(kind, list):
        return {k for k in kind if isinstance(k, str)}
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if values is None and "const" in schema:
        values = [schema["const"]]
    return {_json_type(v) for v in values or []}


def _json_type(value: Any) -> str:
    if isinstance(value, str):
        return "string"
    if isinstance(value, bool):
        return "boolean"
    if value is None:
        return "null"
    if isinstance(value, int | float):
        return "number"
    return "array" if isinstance(value, list) else "object"


def is_string_schema(schema: Any) -> bool:
    """Whether a parameter's value is written as its raw text (it may be a string) rather than
    as JSON, in the formats that write each argument on its own."""
    return "string" in schema_types(schema)


def _no_constant(word: str) -> Any:
    raise ValueError(f"{word} is not JSON")


def typed_value(text: str, schema: Any) -> Any:
    """An argument's value from its text: a string parameter keeps the text as written; any
    other is JSON, else the text itself (what the model wrote). Python's ``True`` / ``False`` /
    ``None`` count for a boolean / null parameter (Qwen3-Coder's template writes values with
    Jinja's ``string`` filter)."""
    if is_string_schema(schema):
        return text
    try:
        return json.loads(text, parse_constant=_no_constant)
    except ValueError:
        pass
    word, types = text.strip(), schema_types(schema)
    if "boolean" in types and word in ("True", "False"):
        return word == "True"
    if "null" in types and word == "None":
        return None
    return text


def value_text(value: Any) -> str:
    """How an argument's value is written in a per-argument format (the inverse of
    ``typed_value``): a string as itself, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)


# ----------------------------------------------------------------- earlier calls as text


def write_calls(calls: list[tuple[str, Any]], call_format: str) -> str:
    """``(name, arguments)`` calls as the model writes them in ``call_format``; ``arguments``
    is an object, or text as a client sent it (the per-argument formats then write none)."""
    if call_format == "llama3_json":
        return "; ".join(
            json.dumps({"name": n, "parameters": a}, ensure_ascii=False) for n, a in calls
        )
    if call_format == "deepseek_v3":
        body = "\n".join(
            f"{DS_CALL_BEGIN}function{DS_SEP}{n}{DS_FENCE_OPEN}{_json(a)}{DS_FENCE_CLOSE}"
            f"{DS_CALL_END}"
            for n, a in calls
        )
        return f"{DS_CALLS_BEGIN}{body}{DS_CALLS_END}"
    if call_format == "deepseek_v31":
        body = "".join(f"{DS_CALL_BEGIN}{n}{DS_SEP}{_json(a)}{DS_CALL_END}" for n, a in calls)
        return f"{DS_CALLS_BEGIN}{body}{DS_CALLS_END}"
    if call_format == "kimi_k2":
        body = "".join(
            f"{KIMI_CALL_BEGIN}{kimi_id(n, i)}{KIMI_ARGS}{_json(a)}{KIMI_CALL_END}"
            for i, (n, a) in enumerate(calls)
        )
        return f"{KIMI_CALLS_BEGIN}{body}{KIMI_CALLS_END}"
    if call_format == "glm45":
        return "\n".join(
            f"{HERMES_OPEN}{n}\n"
            + "".join(
                f"{GLM_KEY}{k}{GLM_KEY_END}\n{GLM_VALUE}{value_text(v)}{GLM_VALUE_END}\n"
                for k, v in _items(a)
            )
            + HERMES_CLOSE
            for n, a in calls
        )
    if call_format == "qwen3_coder":
        return "\n".join(
            f"{HERMES_OPEN}\n{QWEN_FUNCTION}{n}>\n"
            + "".join(
                f"{QWEN_PARAM}{k}>\n{value_text(v)}\n{QWEN_PARAM_END}\n" for k, v in _items(a)
            )
            + f"{QWEN_FUNCTION_END}\n{HERMES_CLOSE}"
            for n, a in calls
        )
    return "\n".join(
        f"{HERMES_OPEN}\n{json.dumps({'name': n, 'arguments': a}, ensure_ascii=False)}\n"
        f"{HERMES_CLOSE}"
        for n, a in calls
    )


def kimi_id(name: str, index: int) -> str:
    """Kimi-K2's id of the message's ``index``-th call, to ``name``."""
    return f"{KIMI_ID_PREFIX}{name}:{index}"


def _json(arguments: Any) -> str:
    return arguments if isinstance(arguments, str) else json.dumps(arguments, ensure_ascii=False)


def _items(arguments: Any) -> list[tuple[str, Any]]:
    return list(arguments.items()) if isinstance(arguments, dict) else []
