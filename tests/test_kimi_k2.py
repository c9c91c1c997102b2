"""Kimi-K2's tool calls over HTTP (issue #48 item 3): a scripted tiny model with Kimi-K2's own
chat template (tests/data/chat_templates/kimi_k2.jinja) writes exactly the text Kimi-K2 writes
for a call; the server tells the format from the template, and the official ``openai`` client
gets the call (its id the one the model wrote, ``functions.NAME:INDEX``), ``finish_reason``
"tool_calls" and the text before it as content, the same streamed (three drafts a step from a
perfect MTP layer: deltas of several tokens) and not; the call's result goes back under that
id."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import openai
import pytest
from scripted import Script, build_scripted_model

from server_utils import RemoteServer

TEMPLATE = Path(__file__).parent / "data" / "chat_templates" / "kimi_k2.jinja"
CALL_ID = "functions.get_weather:0"
# What Kimi-K2 writes after its generation prompt (``<|im_assistant|>assistant<|im_middle|>``).
ANSWER = (
    "Let me check the weather.",
    "<|tool_calls_section_begin|>",
    "<|tool_call_begin|>",
    CALL_ID,
    "<|tool_call_argument_begin|>",
    '{"city": "Rome"}',
    "<|tool_call_end|>",
    "<|tool_calls_section_end|>",
)
# Tokens of the template's prompt (the rest of it reads as <unk>).
PROMPT_TOKENS = ("<|im_system|>", "<|im_user|>", "<|im_assistant|>", "<|im_middle|>", "assistant")
TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Any:
    script = Script(sequences=(("<|im_middle|>", *ANSWER),), extra=PROMPT_TOKENS)
    folder = build_scripted_model(
        tmp_path_factory.mktemp("kimi") / "model", script, TEMPLATE.read_text(), mtp=True
    )
    spec = json.dumps({"method": "mtp", "num_speculative_tokens": 3})
    with RemoteServer(folder, ["--served-model-name", "m", "--speculative-config", spec]) as s:
        yield s


def test_a_kimi_call_reaches_the_client_streamed_and_not(server: RemoteServer) -> None:
    client = openai.OpenAI(base_url=server.url("/v1"), api_key="none", max_retries=0)
    body: dict[str, Any] = {
        "model": "m",
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [TOOL],
        "temperature": 0,
    }
    full = client.chat.completions.create(**body)
    choice = full.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check the weather."
    (call,) = choice.message.tool_calls
    assert (call.id, call.function.name) == (CALL_ID, "get_weather")
    assert json.loads(call.function.arguments) == {"city": "Rome"}
    assert full.usage.spec_decode["mean_tokens_per_step"] > 2  # type: ignore[attr-defined]

    content, calls, finish = "", [], None
    for chunk in client.chat.completions.create(**body, stream=True):
        if not chunk.choices:
            continue
        delta = chunk.choices[0].delta
        content += delta.content or ""
        calls += delta.tool_calls or []
        finish = chunk.choices[0].finish_reason or finish
    assert (content, finish) == ("Let me check the weather.", "tool_calls")
    assert [(c.id, c.function.name) for c in calls] == [(CALL_ID, "get_weather")]
    assert json.loads(calls[0].function.arguments) == {"city": "Rome"}

    # Without tools the same text is content: nothing is read as a call.
    plain = client.chat.completions.create(**{k: v for k, v in body.items() if k != "tools"})
    assert plain.choices[0].finish_reason == "stop"
    assert plain.choices[0].message.content == "".join(ANSWER)

    # The round trip: the result goes back under the model's id (the template writes
    # "## Return of functions.get_weather:0"), and the next answer is read the same way.
    body["messages"] += [
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "Sunny, 24 C"},
    ]
    again = client.chat.completions.create(**body)
    assert again.choices[0].finish_reason == "tool_calls"
    assert again.choices[0].message.tool_calls[0].id == CALL_ID
