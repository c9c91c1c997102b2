"""Tool calling on /v1/chat/completions: what the template sees, what the model must write, and
how its text becomes ``tool_calls``.

- ``tool_choice`` ``"auto"`` (the default with tools): the tools reach the chat template (as
  ``tools``, Hugging Face's convention); a template that does not use them gets them in a system
  message that teaches the format the output is parsed in (Hermes, or ``--tool-call-parser``'s
  when that is Llama 3's), and earlier calls written in that format. The output is parsed in
  the format the template writes calls in (``server/tool_parsers.py``; ``--tool-call-parser``
  overrides); tools with a template that renders them in a format we cannot tell are a 400.
- ``"required"`` or a named function: generation is constrained by a grammar
  (``server/tool_grammar.py``) to calls in the format the output is parsed with, so the calls
  always parse and their arguments are valid against the parameters. ``parallel_tool_calls``
  false: exactly one call (``"auto"``: only the first call the model wrote is returned).
- ``"none"``: the template still sees the tools, nothing is parsed.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from tandem.engine.structured_output import StructuredOutputError, StructuredSpec
from tandem.server.errors import bad_request
from tandem.server.tool_formats import FORMATS, write_calls
from tandem.server.tool_grammar import forced_calls_grammar
from tandem.server.tool_parsers import ToolParser, make_parser, parser_name_for_template

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

    @property
    def schemas(self) -> dict[str, Any]:
        return {t["function"]["name"]: t["function"].get("parameters") or {} for t in self.tools}

    def call_format(self, template: str | None, override: str | None) -> str:
        return call_format(template, override, tools=self.parses)

    def parser(self, template: str | None, override: str | None) -> ToolParser:
        return make_parser(self.call_format(template, override), self.names, self.schemas)

    def grammar(
        self, call_format: str = "hermes", special: frozenset[str] = frozenset()
    ) -> StructuredSpec | None:
        """The Lark grammar of forced calls written in ``call_format`` (None unless
        ``required`` / a named function), ``special`` markers as their tokens;
        server/tool_grammar.py."""
        if not self.forced:
            return None
        funcs = [
            (i, t["function"])
            for i, t in enumerate(self.tools)
            if self.forced_name in (None, t["function"]["name"])
        ]
        text = forced_calls_grammar(call_format, funcs, self.parallel, special)
        try:
            return StructuredSpec("grammar", text, "tools")
        except StructuredOutputError as e:  # parameter schemas past the grammar's size limit
            raise bad_request(
                f"tools: the grammar of the forced calls is {e.detail}", "tools"
            ) from None

    def system_prompt(self, call_format: str = "hermes") -> str:
        """The tools for a template that does not render them itself, and how to call them in
        ``call_format`` (the format the output is parsed in): in words for Hermes and Llama 3,
        by an example written in the format for the others (DeepSeek's templates write earlier
        calls but not the tools)."""
        tools = "\n".join(json.dumps(t, ensure_ascii=False) for t in self.tools)
        how = _HOW_TO_CALL.get(call_format)
        if how is None:
            example = write_calls([("function_name", {"argument_name": "value"})], call_format)
            how = f"To call a function, write the call in exactly this format:\n{example}"
        return _TOOLS.format(tools=tools) + how


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


def call_format(template: str | None, override: str | None, tools: bool = True) -> str:
    """The parser name calls are written and read in: ``--tool-call-parser``, else the
    format the template writes calls in; Hermes when the tools reach the model through our
    system message (which then teaches that format). A template that renders tools in no
    format we know is a 400 for a request whose calls are read (``tools``), Hermes otherwise
    (only earlier calls are written then)."""
    if override:
        return override
    found = parser_name_for_template(template)
    if not template_uses(template, "tools"):
        # The tools come in our system message, in the format the template writes earlier
        # calls in when it writes them (DeepSeek's), else Hermes.
        return found or "hermes"
    if found is not None:
        return found
    if not tools:
        return "hermes"
    raise bad_request(
        "the chat template renders tools, but not in a tool-call format this server can tell, "
        "so the model's calls could not be read; start the server with --tool-call-parser NAME "
        f"(one of: {', '.join(FORMATS)})",
        "tools",
    )


def template_uses(template: str | None, word: str) -> bool:
    return bool(template) and word in (template or "")


def calls_text(calls: list[dict[str, Any]], call_format: str = "hermes") -> str:
    """An assistant message's ``tool_calls`` as text in ``call_format``, for templates that
    ignore them."""
    pairs = []
    for c in calls:
        fn = c["function"]
        try:
            args = json.loads(fn["arguments"])
        except (json.JSONDecodeError, TypeError):
            args = fn["arguments"]
        pairs.append((fn["name"], args))
    return write_calls(pairs, call_format)
