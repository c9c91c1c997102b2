"""Grammars of forced tool calls (``tool_choice`` "required" or a named function): llguidance
Lark that writes calls in the format the output is parsed in (server/tool_formats.py), so a
forced call always parses with that format's parser, and its arguments are valid against the
function's parameters.

JSON goes through llguidance's ``%json`` (no free whitespace: a sampled model cannot pad
forever). The per-argument formats (GLM-4.5, Qwen3-Coder) write each parameter in the schema's
order, the required ones always and the others optionally; a string parameter's value is raw
text that cannot hold the closing tag (its ``enum`` / ``const``, ``pattern`` and length
constraints kept), any other value JSON of the parameter's schema.
"""

from __future__ import annotations

import json
from functools import partial
from typing import Any

from tandem.server.errors import bad_request
from tandem.server.tool_formats import (
    DS_CALL_BEGIN,
    DS_CALL_END,
    DS_CALLS_BEGIN,
    DS_CALLS_END,
    DS_FENCE_CLOSE,
    DS_FENCE_OPEN,
    DS_SEP,
    GLM_KEY,
    GLM_KEY_END,
    GLM_VALUE,
    GLM_VALUE_END,
    HERMES_CLOSE,
    HERMES_OPEN,
    KIMI_ARGS,
    KIMI_CALL_BEGIN,
    KIMI_CALL_END,
    KIMI_CALLS_BEGIN,
    KIMI_CALLS_END,
    KIMI_ID_PREFIX,
    QWEN_FUNCTION,
    QWEN_FUNCTION_END,
    QWEN_PARAM,
    QWEN_PARAM_END,
    is_string_schema,
)

_COMPACT = {"whitespace_flexible": False}
# What a per-argument format can keep of a parameters schema: it writes the listed properties.
_OBJECT_KEYS = {
    "type", "properties", "required", "additionalProperties", "description", "title",
    "$schema", "$id", "$comment", "$defs", "definitions", "examples", "default",
}  # fmt: skip
# Each format's (text before a call, text after it, text between two calls) ...
_CALL = {
    "hermes": (f"{HERMES_OPEN}\n", f"\n{HERMES_CLOSE}", "\n"),
    "llama3_json": ("", "", "; "),
    "deepseek_v3": (f"{DS_CALL_BEGIN}function{DS_SEP}", f"{DS_FENCE_CLOSE}{DS_CALL_END}", "\n"),
    "deepseek_v31": (DS_CALL_BEGIN, DS_CALL_END, ""),
    "glm45": (HERMES_OPEN, HERMES_CLOSE, "\n"),
    "qwen3_coder": (
        f"{HERMES_OPEN}\n{QWEN_FUNCTION}",
        f"{QWEN_FUNCTION_END}\n{HERMES_CLOSE}",
        "\n",
    ),
    "kimi_k2": (KIMI_CALL_BEGIN, KIMI_CALL_END, ""),
}
# ... and around all the calls of a message.
_MESSAGE = {
    "deepseek_v3": (DS_CALLS_BEGIN, DS_CALLS_END),
    "deepseek_v31": (DS_CALLS_BEGIN, DS_CALLS_END),
    "kimi_k2": (KIMI_CALLS_BEGIN, KIMI_CALLS_END),
}


def forced_calls_grammar(
    call_format: str,
    funcs: list[tuple[int, dict[str, Any]]],
    parallel: bool,
    special: frozenset[str] = frozenset(),
) -> str:
    """The Lark grammar of one call (``parallel``: one or more) to one of ``funcs`` (each with
    its index among the request's tools, for error messages) in ``call_format``. Raises a 400
    for a parameters schema a per-argument format cannot write. ``special``: the format's
    markers the tokenizer holds as special tokens (GLM-4.5's ``<tool_call>``, ``<arg_key>``,
    ...): the grammar writes those as the token, which is how the model writes them."""
    if call_format == "harmony":
        return _harmony_grammar(funcs, special)
    if call_format not in _CALL:
        raise ValueError(f"no forced-call grammar for the tool-call format {call_format!r}")
    before, after, between = _CALL[call_format]
    lines: list[str] = []
    for k, (index, f) in enumerate(funcs):
        lines += _function_rules(call_format, k, index, f, special)
    names = " | ".join(f"f{k}" for k in range(len(funcs)))
    lit = partial(_lit, special=special)
    lines.insert(0, f"call: {_seq(lit(before), f'({names})', lit(after))}")
    calls = f"call ({_seq(lit(between), 'call')})*" if parallel else "call"
    head, tail = _MESSAGE.get(call_format, ("", ""))
    lines.insert(0, f"start: {_seq(lit(head), calls, lit(tail))}")
    return "\n".join(lines)


def _harmony_grammar(funcs: list[tuple[int, dict[str, Any]]], special: frozenset[str]) -> str:
    """A forced call in the harmony format (gpt-oss; server/harmony.py), after the prompt's
    ``<|start|>assistant``: an optional ``analysis`` message (the model's reasoning), then the
    ``commentary`` message to ``functions.NAME`` whose body is the arguments' JSON, ended by
    ``<|call|>``. ``<|call|>`` ends the turn, so a turn holds one call whatever
    ``parallel_tool_calls`` says (the model calls again after the result)."""
    from tandem.server.harmony import CALL, CHANNEL, CONSTRAIN, END, FUNCTIONS, MESSAGE, START

    lit = partial(_lit, special=special)
    text, tag = _split_close(END, special)
    names = " | ".join(f"f{k}" for k in range(len(funcs)))
    lines = [
        f"start: analysis? {lit(f'{CHANNEL}commentary to={FUNCTIONS}')} ({names}) {lit(CALL)}",
        f"analysis: {lit(f'{CHANNEL}analysis{MESSAGE}')} REASONING {lit(tag)} "
        f"{lit(f'{START}assistant')}",
        f"REASONING: {_raw_text({}, text, closed_by_token=bool(tag))}",
    ]
    for k, (_, f) in enumerate(funcs):
        params = f.get("parameters") or {"type": "object"}
        header = f"{f['name']} {CONSTRAIN}json{MESSAGE}"
        lines.append(f"f{k}: {lit(header)} {_json(params)}")
    return "\n".join(lines)


def _seq(*items: str) -> str:
    return " ".join(i for i in items if i)


def _function_rules(
    call_format: str, k: int, index: int, f: dict[str, Any], special: frozenset[str]
) -> list[str]:
    name, params = f["name"], f.get("parameters") or {"type": "object"}
    lit = partial(_lit, special=special)
    if call_format in ("hermes", "llama3_json"):
        key = "parameters" if call_format == "llama3_json" else "arguments"
        call = {
            "type": "object",
            "properties": {"name": {"const": name}, key: params},
            "required": ["name", key],
            "additionalProperties": False,
            # The parameters' ``#/$defs/...`` references resolve against this root now.
            **{d: params[d] for d in ("$defs", "definitions") if d in params},
        }
        return [f"f{k}: {_json(call)}"]
    if call_format == "deepseek_v3":
        return [f"f{k}: {lit(name + DS_FENCE_OPEN)} {_json(params)}"]
    if call_format == "deepseek_v31":
        return [f"f{k}: {lit(name + DS_SEP)} {_json(params)}"]
    if call_format == "kimi_k2":  # the id functions.NAME:I, I a call index
        ident = f"{lit(KIMI_ID_PREFIX + name + ':')} /[0-9]{{1,3}}/"
        return [f"f{k}: {ident} {lit(KIMI_ARGS)} {_json(params)}"]
    glm = call_format == "glm45"  # else Qwen3-Coder
    rules, parts, newline = [], [], lit("\n")
    for j, (key, schema, required) in enumerate(_parameters(call_format, index, params)):
        head = f"{GLM_KEY}{key}{GLM_KEY_END}\n{GLM_VALUE}" if glm else f"{QWEN_PARAM}{key}>\n"
        close = GLM_VALUE_END if glm else f"\n{QWEN_PARAM_END}"
        rules.append(f"a{k}_{j}: {lit(head)} v{k}_{j} {newline}")
        if is_string_schema(schema):
            text, tag = _split_close(close, special)
            rules.append(f"v{k}_{j}: T{k}_{j}" + (f" {tag}" if tag else ""))
            rules.append(f"T{k}_{j}: {_raw_text(schema, text, closed_by_token=bool(tag))}")
        else:
            rules.append(f"v{k}_{j}: {_json(schema)} {lit(close)}")
        parts.append(f"a{k}_{j}" + ("" if required else "?"))
    opener = f"{name}\n" if glm else f"{name}>\n"
    return [f"f{k}: {' '.join([lit(opener), *parts])}", *rules]


def _parameters(
    call_format: str, index: int, params: dict[str, Any]
) -> list[tuple[str, Any, bool]]:
    """(name, schema, required) of each parameter a per-argument call writes: the properties
    in their order, then required names the properties lack (any value)."""
    where = f"tools[{index}].function.parameters"
    extra = sorted(set(params) - _OBJECT_KEYS)
    if extra:
        raise bad_request(
            f"{where}: forced calls in the {call_format} format write each argument on its own, "
            f"so the parameters schema can use only {', '.join(sorted(_OBJECT_KEYS))}; it "
            f"uses {', '.join(extra)}",
            where,
        )
    props = params.get("properties") if isinstance(params.get("properties"), dict) else {}
    required = [r for r in params.get("required") or [] if isinstance(r, str)]
    defs = {k: params[k] for k in ("$defs", "definitions") if k in params}
    out = []
    for key, schema in [*props.items(), *((r, {}) for r in required if r not in props)]:
        bad = ("</arg_key>",) if call_format == "glm45" else (">", "\n")
        if key != key.strip() or not key or any(b in key for b in bad):
            raise bad_request(
                f"{where}: the parameter name {key!r} cannot be written in the {call_format} "
                "format",
                where,
            )
        body = {**defs, **schema} if isinstance(schema, dict) else {}
        out.append((key, body, key in required))
    return out


def _split_close(close: str, special: frozenset[str]) -> tuple[str, str]:
    """A closing tag that ends in a special token: (the text before it, the token); else
    (``close``, "")."""
    for tag in special:
        if tag and close.endswith(tag):
            return close[: -len(tag)], tag
    return close, ""


def _raw_text(schema: dict[str, Any], close: str, closed_by_token: bool = False) -> str:
    """A Lark terminal: a string parameter's raw text followed by ``close``, the text not
    holding the closing tag, within the schema's ``enum`` / ``const``, ``pattern`` (searched,
    as JSON Schema does, unless anchored) and ``minLength`` / ``maxLength``.
    ``closed_by_token``: a special token follows (text never holds one: no exclusion)."""
    end = _re(close)
    terms = []
    values = schema.get("enum") if isinstance(schema.get("enum"), list) else None
    if isinstance(schema.get("const"), str):
        values = [schema["const"]]
    strings = [v for v in values or [] if isinstance(v, str)]
    terms.append(
        f"/(?:{'|'.join(_re(v) for v in strings)}){end}/" if strings else f"/(?s:.*){end}/"
    )
    pattern = schema.get("pattern")
    if isinstance(pattern, str):
        import llguidance

        body = pattern.removeprefix("^")
        start = "" if body != pattern else "(?s:.*)"
        anchored = body.endswith("$") and not body.endswith("\\$")
        body = llguidance.regex_to_lark(body.removesuffix("$") if anchored else body, "dw")
        terms.append(f"/{start}(?:{body}){'' if anchored else '(?s:.*)'}{end}/")
    low, high = schema.get("minLength"), schema.get("maxLength")
    if isinstance(low, int) or isinstance(high, int):
        count = f"{low if isinstance(low, int) else 0},{high if isinstance(high, int) else ''}"
        terms.append(f"/(?s:.{{{count}}}){end}/")
    if not closed_by_token:
        tag = _re(close.lstrip("\n"))
        terms.append(f"~/(?s:.*){tag}(?s:.+)/")
    return " & ".join(terms)


def _re(text: str) -> str:
    """``text`` as a literal inside a Lark ``/regex/`` (ASCII punctuation as hex escapes)."""
    return "".join(c if c.isalnum() or ord(c) > 127 else f"\\x{{{ord(c):02X}}}" for c in text)


def _lit(text: str, special: frozenset[str] = frozenset()) -> str:
    """A Lark string literal (JSON's escapes), the ``special`` markers in it written as their
    tokens (``<tool_call>`` unquoted); nothing for no text."""
    if not text:
        return ""
    for tag in sorted(special, key=len, reverse=True):
        at = text.find(tag) if tag else -1
        if at >= 0:
            parts = (_lit(text[:at], special), tag, _lit(text[at + len(tag) :], special))
            return _seq(*parts)
    return json.dumps(text)


def _json(schema: Any) -> str:
    body = dict(schema) if isinstance(schema, dict) else {}
    return f"%json {json.dumps({**body, 'x-guidance': _COMPACT})}"
