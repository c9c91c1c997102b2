"""Request models of the OpenAI API, as this server accepts them.

Every model forbids unknown fields (answered with a 400 naming the field) and is strict about
types (``"1"`` is not a number, ``true`` is not an integer). Fields OpenAI defines that we do not
implement are declared so that their neutral values (what SDKs send by default) pass, and
``check_supported`` turns any other value into a 400 naming the field — never ignored silently.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from tandem.server.chat import RESERVED_TEMPLATE_NAMES
from tandem.server.errors import bad_request, unsupported

MAX_N = 128
MAX_LOGPROBS = 20
MAX_STOP = 16
SEED_MIN = -(2**63)
SEED_MAX = 2**63 - 1 - MAX_N  # room for the per-sample seeds seed + i
TOKEN_ID_MAX = 2**31 - 1
REASONING_EFFORTS = ("low", "medium", "high")


def _check_unicode(value: Any) -> None:
    """Raise ``ValueError`` if a string in ``value`` holds a lone surrogate (JSON can spell one,
    ``"\\ud800"``, but it is not text: the tokenizer and UTF-8 cannot encode it)."""
    if isinstance(value, str):
        if not value.isascii():
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                raise ValueError("the text is not valid Unicode (a lone surrogate)") from None
    elif isinstance(value, list | tuple):
        for item in value:
            if isinstance(item, str | list | tuple | dict):
                _check_unicode(item)
    elif isinstance(value, dict):
        for key, item in value.items():
            _check_unicode(key)
            _check_unicode(item)


class StrictModel(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _valid_unicode(cls, value: Any) -> Any:
        _check_unicode(value)  # nested models check their own fields
        return value


class StreamOptions(StrictModel):
    include_usage: bool | None = None
    include_obfuscation: bool | None = None  # OpenAI's padding field: only false is served


class JsonSchemaFormat(StrictModel):
    """``response_format.json_schema`` (OpenAI structured outputs)."""

    name: str = Field(max_length=64)
    description: str | None = None
    schema_: dict[str, Any] | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(StrictModel):
    """``{"type": "text" | "json_object" | "json_schema"}``; json_schema carries the schema."""

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None


class StructuredOutputs(StrictModel):
    """vLLM's ``structured_outputs`` extension: exactly one of these constrains the output."""

    json_: dict[str, Any] | str | None = Field(None, alias="json")
    json_object: bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None  # Lark syntax (llguidance's dialect)


class SamplingFields(StrictModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model: str | None = None
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=TOKEN_ID_MAX)
    min_p: float | None = Field(None, ge=0.0, lt=1.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = Field(None, max_length=1024)
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0, le=10.0)
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    # Constrained output: OpenAI's response_format, or vLLM's structured_outputs extension.
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputs | None = None
    # Informational: they do not change what is generated.
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    metadata: dict[str, str] | None = None
    # Token id (as a string, OpenAI's shape) -> value in [-100, 100] added to its logit.
    logit_bias: dict[str, Any] | None = None
    # Declared by OpenAI, not implemented here: only neutral values pass check_supported.
    store: bool | None = None
    service_tier: str | None = None
    # Disaggregated serving (vLLM's field): see server/serving.py check_kv_transfer.
    kv_transfer_params: dict[str, Any] | None = None

    def token_logit_bias(self) -> dict[int, Any] | None:
        """``logit_bias`` keyed by token id (its values are checked by ``SamplingParams``)."""
        if not self.logit_bias:
            return None
        out = {}
        for key, value in self.logit_bias.items():
            if not (key.isascii() and key.isdigit()) or int(key) > TOKEN_ID_MAX:
                raise bad_request(
                    f"logit_bias keys must be token ids (non-negative integers as strings), "
                    f"got {key!r}",
                    "logit_bias",
                )
            out[int(key)] = value
        return out

    def check_supported(self) -> None:
        """Raise a 400 for values this server does not implement or combinations that clash."""
        self.token_logit_bias()  # a 400 for keys that are not token ids
        if self.store:
            raise unsupported("store", "Completions are not stored; omit it or send false.")
        if self.service_tier not in (None, "auto", "default"):
            raise unsupported("service_tier", "Only 'auto' and 'default' are served.")
        stops = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        if len(stops) > MAX_STOP:
            raise bad_request(f"at most {MAX_STOP} stop strings are supported", "stop")
        if any(not s for s in stops):
            raise bad_request("stop strings must be non-empty", "stop")
        if any(not 0 <= t <= TOKEN_ID_MAX for t in self.stop_token_ids or []):
            raise bad_request("stop_token_ids must be non-negative token ids", "stop_token_ids")
        if self.stream_options is not None and not self.stream:
            raise bad_request(
                "stream_options is only allowed when stream is true", "stream_options"
            )
        if self.stream_options is not None and self.stream_options.include_obfuscation:
            raise unsupported("stream_options.include_obfuscation", "Send false or omit it.")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=1)
    echo: bool = False
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.best_of is not None and self.best_of != self.n:
            raise unsupported("best_of", "Use n for several samples.")
        if self.suffix:
            raise unsupported("suffix")
        if self.echo and self.logprobs is not None:
            raise unsupported(
                "echo", "echo together with logprobs (prompt logprobs) is not served."
            )
        if isinstance(self.prompt, list) and not self.prompt:
            raise bad_request("prompt must not be empty", "prompt")


class TextPart(StrictModel):
    type: Literal["text"]
    text: str


class FunctionDef(StrictModel):
    name: str = Field(pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict[str, Any] | None = None  # a JSON schema of the arguments object
    strict: bool | None = None

    @field_validator("parameters", mode="after")
    @classmethod
    def _object_schema(cls, value: dict[str, Any] | None, info: ValidationInfo) -> Any:
        """A call's arguments are a JSON object, so its schema must be one (as OpenAI asks);
        missing or ``{}``: no parameters. A forced call's grammar and the parsers then agree."""
        if value and value.get("type") != "object":
            raise ValueError(
                f"Invalid schema for function {info.data.get('name')!r}: parameters must be a "
                f"JSON Schema of type 'object', got type {value.get('type')!r}"
            )
        return value


class ChatTool(StrictModel):
    type: Literal["function"]
    function: FunctionDef


class CalledFunction(StrictModel):
    name: str
    arguments: str  # a JSON object's text


class ToolCallMessage(StrictModel):
    id: str
    type: Literal["function"] = "function"
    function: CalledFunction


class ChosenFunction(StrictModel):
    name: str


class NamedToolChoice(StrictModel):
    type: Literal["function"]
    function: ChosenFunction


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallMessage] | None = None  # an assistant's earlier calls
    tool_call_id: str | None = None  # a tool message answers this call
    refusal: str | None = None  # echoed back by clients that resend a response's message
    # An assistant's earlier thinking (the template decides whether the model sees it);
    # ``reasoning`` is the newer name of the same field.
    reasoning_content: str | None = None
    reasoning: str | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    add_generation_prompt: bool = True
    # A Jinja chat template for this request only; refused unless the operator allows it
    # (--trust-request-chat-template). Rendered in the same sandbox as the server's own.
    chat_template: str | None = None
    # More variables for the chat template (``enable_thinking``, ``thinking``, ...); they
    # replace the server's --default-chat-template-kwargs key by key.
    chat_template_kwargs: dict[str, Any] | None = None
    # Passed to the chat template as ``reasoning_effort``.
    reasoning_effort: str | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    # Declared by OpenAI, not implemented here (check_supported refuses other than neutral).
    functions: list[Any] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    verbosity: str | None = None
    web_search_options: Any = None

    def check_supported(self) -> None:
        super().check_supported()
        self._check_tools()
        if self.functions:
            raise unsupported("functions")
        if self.function_call not in (None, "none", "auto"):
            raise unsupported("function_call")
        for name in ("audio", "prediction", "verbosity", "web_search_options"):
            if getattr(self, name) is not None:
                raise unsupported(name)
        if self.reasoning_effort not in (None, *REASONING_EFFORTS):
            raise bad_request(
                f"reasoning_effort must be one of {', '.join(map(repr, REASONING_EFFORTS))}, "
                f"got {self.reasoning_effort!r}",
                "reasoning_effort",
            )
        check_template_kwargs(self.chat_template_kwargs)
        if self.modalities not in (None, ["text"]):
            raise unsupported("modalities", "Only ['text'] is served.")
        if self.top_logprobs and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
        for i, m in enumerate(self.messages):
            if m.role == "tool" and not m.tool_call_id:
                raise bad_request(
                    f"messages[{i}].tool_call_id is required for role 'tool'",
                    f"messages[{i}].tool_call_id",
                )
            if m.tool_calls and m.role != "assistant":
                raise bad_request(
                    f"messages[{i}].tool_calls is only for role 'assistant'",
                    f"messages[{i}].tool_calls",
                )
            for name in ("reasoning_content", "reasoning"):
                if getattr(m, name) is not None and m.role != "assistant":
                    raise bad_request(
                        f"messages[{i}].{name} is only for role 'assistant'",
                        f"messages[{i}].{name}",
                    )
            if (
                None not in (m.reasoning_content, m.reasoning)
                and m.reasoning_content != m.reasoning
            ):
                raise bad_request(
                    f"messages[{i}] has both reasoning_content and reasoning, and they differ; "
                    "send one",
                    f"messages[{i}].reasoning",
                )
            if m.content is None and m.role != "assistant":
                raise bad_request(
                    f"messages[{i}].content is required for role '{m.role}'",
                    f"messages[{i}].content",
                )

    def _check_tools(self) -> None:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise bad_request("tools must have distinct function names", "tools")
        choice = self.tool_choice
        if choice in ("required",) or isinstance(choice, NamedToolChoice):
            if not names:
                raise bad_request("tool_choice needs tools to choose from", "tool_choice")
            if self.response_format is not None and self.response_format.type != "text":
                raise bad_request(
                    "tool_choice and response_format both constrain the output; send one",
                    "tool_choice",
                )
            if self.structured_outputs is not None:
                raise bad_request(
                    "tool_choice and structured_outputs both constrain the output; send one",
                    "tool_choice",
                )
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise bad_request(
                f"tool_choice names function {choice.function.name!r}, which is not among "
                f"the tools ({', '.join(names)})",
                "tool_choice",
            )

    @property
    def max_output_tokens(self) -> int | None:
        if self.max_completion_tokens is not None:
            return self.max_completion_tokens
        return self.max_tokens


def check_template_kwargs(kwargs: dict[str, Any] | None) -> None:
    """A request's chat_template_kwargs may not set what the server passes the template."""
    reserved = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_NAMES)
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}: the server sets it",
            f"chat_template_kwargs.{reserved[0]}",
        )


class TokenizeRequest(StrictModel):
    model: str | None = None
    prompt: str | list[int] | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    # With messages: template variables, as on /v1/chat/completions (over the server's
    # --default-chat-template-kwargs, key by key).
    chat_template_kwargs: dict[str, Any] | None = None

    def check_template_kwargs(self) -> None:
        if self.chat_template_kwargs is not None and self.messages is None:
            raise bad_request("chat_template_kwargs apply to messages", "chat_template_kwargs")
        check_template_kwargs(self.chat_template_kwargs)


class DetokenizeRequest(StrictModel):
    model: str | None = None
    tokens: list[int]
