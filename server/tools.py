"""Tool calling on /v1/chat/completions: what the template sees, what the model must write, and
how its text becomes ``tool_calls``.

- ``tool_choice`` ``"auto"`` (the default with tools): the tools reach the chat template (as
  ``tools``, Hugging Face's convention); a template that does not use them gets them in a system
  message that teaches the format the output is parsed in (Hermes, or ``--tool-call-parser``'s),
  and earlier calls written in that format. The output is parsed with the template's format
  (``server/tool_parsers.py``; ``--tool-call-parser`` overrides).
- ``"required"`` or a named function: generation is constrained by a grammar (llguidance Lark
  with each function's parameters as a JSON schema) to calls in the format the output is parsed
  with (Hermes tags, or Llama 3's bare JSON), so the calls always parse and their arguments are
  valid against the parameters. ``parallel_tool_calls`` false:
  exactly one call (``"auto"``: only the first call the model wrote is returned).
- ``"none"``: the template still sees the tools, nothing is parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.engine.structured_output import StructuredSpec
from tandem.server.tool_parsers import (
    HERMES_CLOSE,
    HERMES_OPEN,
    ToolParser,
    make_parser,
    parser_name_for_template,
)

# JSON as a forced call writes it: no free whitespace (a sampled model cannot pad forever).
_COMPACT = {"whitespace_flexible": False}

_TOOLS = """# Tools

You may call one or more functions to assist with the user query. The functions:
<tools>
{tools}
</tools>

"""
# How each parser's format is taught to a model whose template does not render tools.
_HOW_TO_CALL = {
    "hermes": """To call a function, write a JSON object with its name and arguments inside tags:
<tool_call>
{"name": <function-name>, "arguments": <args-json-object>}
</tool_call>""",
    "llama3_json": """To call a function, reply with only a JSON object with its name and parameters:
{"name": <function-name>, "parameters": <args-json-object>}
To call several, separate the objects with "; ".""",
}


@dataclass(frozen=True)
class ToolPlan:
    """What one chat request does with its tools."""

    tools: list[dict[str, Any]]  # OpenAI shape, as the template receives them
    choice: str  # "none", "auto", "required", or "function"
    forced_name: str | None
    parallel: bool

    @property
    def names(self) -> set[str]:
        return {t["function"]["name"] for t in self.tools}

    @property
    def parses(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def forced(self) -> bool:
        return self.choice in ("required", "function")

    def call_format(self, template: str | None, override: str | None) -> str:
        return call_format(template, override)

    def parser(self, template: str | None, override: str | None) -> ToolParser:
        return make_parser(self.call_format(template, override), self.names)

    def grammar(self, call_format: str = "hermes") -> StructuredSpec | None:
        """The Lark grammar of forced calls written in ``call_format`` (None unless
        ``required`` / a named function): Hermes ``<tool_call>`` blocks on their own lines, or
        Llama 3's bare ``{"name": ..., "parameters": ...}`` objects joined by ``"; "``."""
        if not self.forced:
            return None
        funcs = [t["function"] for t in self.tools]
        if self.forced_name is not None:
            funcs = [f for f in funcs if f["name"] == self.forced_name]
        args_key = "parameters" if call_format == "llama3_json" else "arguments"
        bodies = []
        for i, f in enumerate(funcs):
            schema = {
                "type": "object",
                "properties": {
                    "name": {"const": f["name"]},
                    args_key: f.get("parameters") or {"type": "object"},
                },
                "required": ["name", args_key],
                "additionalProperties": False,
                "x-guidance": _COMPACT,
            }
            bodies.append(f"body{i}: %json {json.dumps(schema)}")
        body = f"({' | '.join(f'body{i}' for i in range(len(funcs)))})"
        if call_format == "llama3_json":
            call, sep = body, '"; "'
        else:
            call, sep = f'"{HERMES_OPEN}\\n" {body} "\\n{HERMES_CLOSE}"', '"\\n"'
        calls = "call" if not self.parallel else f"call ({sep} call)*"
        lines = [f"start: {calls}", f"call: {call}", *bodies]
        return StructuredSpec("grammar", "\n".join(lines), "tools")

    def system_prompt(self, call_format: str = "hermes") -> str:
        """The tools for a template that does not render them itself, and how to call them in
        ``call_format`` (the format the output is parsed in)."""
        tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools)
        return _TOOLS.format(tools=tools) + _HOW_TO_CALL[call_format]


def plan_tools(tools: list[Any] | None, tool_choice: Any, parallel: bool | None) -> ToolPlan:
    """The request's tools and choice (already validated by the protocol model)."""
    dumped = [t.model_dump(exclude_none=True) for t in tools or []]
    if tool_choice is None:
        choice, name = ("auto" if dumped else "none"), None
    elif isinstance(tool_choice, str):
        choice, name = tool_choice, None
    else:
        choice, name = "function", tool_choice.function.name
    return ToolPlan(dumped, choice, name, parallel is not False)


def call_format(template: str | None, override: str | None) -> str:
    """The parser name calls are written and read in: ``--tool-call-parser``, else the
    template's; Hermes when the tools reach the model through our system message (which then
    teaches that format)."""
    if override:
        return override
    if not template_uses(template, "tools"):
        return "hermes"
    return parser_name_for_template(template)


def template_uses(template: str | None, word: str) -> bool:
    return bool(template) and word in (template or "")


def calls_text(calls: list[dict[str, Any]], call_format: str = "hermes") -> str:
    """An assistant message's ``tool_calls`` as text in ``call_format`` (Hermes blocks, or Llama
    3's objects joined by "; "), for templates that ignore them."""
    out = []
    args_key = "parameters" if call_format == "llama3_json" else "arguments"
    for c in calls:
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"])
        except (json.JSONDecodeError, TypeError):
            args = fn["arguments"]
        body = json.dumps({"name": fn["name"], args_key: args}, ensure_ascii=False)
        out.append(
            body if call_format == "llama3_json" else f"{HERMES_OPEN}\n{body}\n{HERMES_CLOSE}"
        )
    return ("; " if call_format == "llama3_json" else "\n").join(out)
