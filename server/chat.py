"""Chat templates: the tokenizer's Jinja template, rendered in a sandbox.

Templates come from the checkpoint (``tokenizer_config.json`` / ``chat_template.jinja``) or from
``--chat-template``, i.e. from files a user may not have written; they render in Jinja's
``ImmutableSandboxedEnvironment`` (no attribute access to internals, no mutation of the inputs),
with the helpers Hugging Face templates expect: ``raise_exception``, ``strftime_now`` and a
``tojson`` that keeps non-ASCII text and supports ``indent``.
"""

from __future__ import annotations

import datetime
import json
import os
from collections.abc import Callable
from typing import Any

import jinja2
from jinja2.ext import loopcontrols
from jinja2.sandbox import ImmutableSandboxedEnvironment

# Variables the renderer sets (and helpers it provides): a client's template kwargs may not
# replace them.
RESERVED_TEMPLATE_NAMES = frozenset(
    {
        "messages",
        "add_generation_prompt",
        "tools",
        "documents",
        "bos_token",
        "eos_token",
        "unk_token",
        "pad_token",
        "raise_exception",
        "strftime_now",
    }
)


def parse_template_kwargs(value: str | dict[str, Any] | None) -> dict[str, Any]:
    """``--default-chat-template-kwargs``: a JSON object's text (or the object, from a config
    file) -> template variables; ``ValueError`` naming the flag for anything else."""
    flag = "--default-chat-template-kwargs"
    if value is None:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError as e:
            raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object, got {type(value).__name__}")
    reserved = sorted(set(value) & RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise ValueError(f"{flag} may not set {', '.join(reserved)}: the server sets it")
    return value


class ChatTemplateError(ValueError):
    """The template could not render these messages (a client error: answered with 400)."""


def _raise_exception(message: str) -> None:
    raise ChatTemplateError(message)


def _strftime_now(fmt: str) -> str:
    return datetime.datetime.now().strftime(fmt)


def _tojson(
    value: Any,
    ensure_ascii: bool = False,
    indent: int | None = None,
    separators: tuple[str, str] | None = None,
    sort_keys: bool = False,
) -> str:
    return json.dumps(
        value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _environment() -> ImmutableSandboxedEnvironment:
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols], autoescape=False
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env


def resolve_chat_template(override: str | None, tokenizer: Any) -> str | None:
    """The template text: ``override`` (a file, or inline Jinja) else the tokenizer's own."""
    if override:
        if os.path.isfile(override):
            with open(override, encoding="utf-8") as fh:
                return fh.read()
        if "{{" in override or "{%" in override:
            return override
        raise ValueError(f"--chat-template {override!r} is neither a file nor a Jinja template")
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # named templates: use the default one
        template = template.get("default") or next(iter(template.values()), None)
    return template or None


class ChatRenderer:
    """Renders a conversation into the prompt text the model was trained on."""

    def __init__(self, template: str, tokenizer: Any) -> None:
        self.source = template
        try:
            self.template = _environment().from_string(template)
        except jinja2.TemplateSyntaxError as e:
            raise ValueError(f"the chat template does not compile: {e}") from e
        self.special_tokens: dict[str, Any] = {}
        for name in ("bos_token", "eos_token", "unk_token", "pad_token"):
            value = getattr(tokenizer, name, None)
            self.special_tokens[name] = value if isinstance(value, str) else ""

    def render(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        template_kwargs: dict[str, Any] | None = None,
    ) -> str:
        """``template_kwargs``: more variables for the template (``chat_template_kwargs``, such
        as ``enable_thinking``); the names the renderer sets itself win over them."""
        try:
            return self.template.render(
                {
                    **(template_kwargs or {}),
                    "messages": messages,
                    "add_generation_prompt": add_generation_prompt,
                    "tools": tools or None,
                    "documents": None,
                    **self.special_tokens,
                }
            )
        except ChatTemplateError:
            raise
        except jinja2.TemplateError as e:  # includes SecurityError from the sandbox
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e
        except (TypeError, ValueError, KeyError, IndexError, AttributeError) as e:
            raise ChatTemplateError(f"the chat template failed on these messages: {e}") from e


def messages_for_template(
    messages: list[Any],
    calls_as_text: Callable[[list[dict[str, Any]]], str] | None = None,
    parse_arguments: bool = True,
) -> list[dict[str, Any]]:
    """Protocol messages -> plain dicts; text parts are joined with newlines. An assistant's
    ``tool_calls`` keep OpenAI's shape with the arguments parsed (as Hugging Face templates
    expect them; ``parse_arguments`` False: the JSON text the client sent, which DeepSeek's
    templates concatenate); ``calls_as_text`` also writes them into the content, for templates
    that do not render ``tool_calls``."""
    out = []
    for m in messages:
        content = m.content
        if content is None:
            content = ""
        elif isinstance(content, list):
            content = "\n".join(part.text for part in content)
        role = "system" if m.role == "developer" else m.role
        d: dict[str, Any] = {"role": role, "content": content}
        if m.name is not None:
            d["name"] = m.name
        if m.tool_call_id is not None:
            d["tool_call_id"] = m.tool_call_id
        # An earlier answer's thinking, under the name templates read (Qwen3, GLM-4.5).
        reasoning = m.reasoning_content if m.reasoning_content is not None else m.reasoning
        if reasoning is not None:
            d["reasoning_content"] = reasoning
        if m.tool_calls:
            calls = [c.model_dump() for c in m.tool_calls]
            for c in calls if parse_arguments else ():
                try:
                    c["function"]["arguments"] = json.loads(c["function"]["arguments"])
                except json.JSONDecodeError:
                    pass  # the template gets the text as the client sent it
            d["tool_calls"] = calls
            if calls_as_text is not None:
                text = calls_as_text([c.model_dump() for c in m.tool_calls])
                d["content"] = f"{content}\n{text}" if content else text
        out.append(d)
    return out
