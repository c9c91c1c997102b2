"""Scripted tiny models: a Llama checkpoint whose greedy output follows a fixed token script, for
end-to-end tests of output formats (reasoning, tool calls) in exactly the text a real model
writes.

How it works: every decoder layer is a no-op (``o_proj`` and ``down_proj`` are zero), so the
hidden state after token t is t's embedding; embeddings are one-hot rows and the LM head's row j
is the sum of the one-hot rows of the tokens whose successor is j, so the logits after token t
peak at its successor (by sqrt(hidden) over every other token). Tokens are exact strings (a
word-level tokenizer that matches the longest vocabulary entry; text it does not know becomes
one ``<unk>`` per run), so text round-trips exactly. The script is a successor map: the
prompt's last token decides where the output starts, and a sequence ends with EOS. An optional
MTP layer (DeepSeek layout) drafts the script perfectly: with ``num_speculative_tokens K`` every
decode step emits K + 1 tokens.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from checkpoints import add_mtp_layers

UNK, BOS, EOS = "<unk>", "<s>", "<|im_end|>"
IM_START = "<|im_start|>"
R1_BOS, R1_USER, R1_ASSISTANT, R1_EOS = (
    "<｜begin▁of▁sentence｜>",
    "<｜User｜>",
    "<｜Assistant｜>",
    "<｜end▁of▁sentence｜>",
)
SPECIAL = (UNK, BOS, EOS, IM_START, R1_BOS, R1_USER, R1_ASSISTANT, R1_EOS)


@dataclass(frozen=True)
class Script:
    """Token strings and who follows whom. ``sequences``: each is a run of tokens, token k
    followed by token k + 1 and the last by EOS (unless it already has a successor: runs may
    merge into one another, never fork). ``extra``: tokens that only prompts use."""

    sequences: tuple[tuple[str, ...], ...]
    extra: tuple[str, ...] = ()
    special: tuple[str, ...] = ()  # more special tokens (the format's markers)

    def vocab(self) -> list[str]:
        """Special tokens first, then every other token in first-seen order."""
        out = list(SPECIAL) + [t for t in self.special if t not in SPECIAL]
        for tok in [*(t for seq in self.sequences for t in seq), *self.extra]:
            if tok not in out:
                out.append(tok)
        return out

    def successors(self) -> dict[str, str]:
        """token -> the token greedy decoding writes after it (EOS unless a sequence says)."""
        nxt: dict[str, str] = {}
        for seq in self.sequences:
            for a, b in zip(seq, seq[1:], strict=False):
                if nxt.get(a, b) != b:
                    raise ValueError(f"token {a!r} has two successors: {nxt[a]!r} and {b!r}")
                nxt[a] = b
        return nxt

    def continuation(self, last: str, max_tokens: int = 1000) -> list[str]:
        """The tokens greedy decoding writes after a prompt ending in ``last`` (EOS excluded)."""
        nxt, out, tok = self.successors(), [], last
        while tok in nxt and len(out) < max_tokens:
            tok = nxt[tok]
            out.append(tok)
        return out


def build_tokenizer(folder: Path, script: Script, chat_template: str) -> Any:
    """A word-level tokenizer over ``script``'s vocabulary: the longest entry matches first,
    special tokens are added tokens, and decoding concatenates the token strings."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = script.vocab()
    special = (*SPECIAL, *script.special)
    words = sorted((t for t in vocab if t not in special), key=len, reverse=True)
    tok = Tokenizer(models.WordLevel({t: i for i, t in enumerate(vocab)}, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(
        Regex("|".join(re.escape(w) for w in words)), behavior="isolated"
    )
    # Decoding concatenates; the byte-fallback stage (no byte tokens here) is what lets
    # llguidance read the vocabulary (structured output on scripted models).
    tok.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    tok.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in special])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        unk_token=UNK,
        pad_token=UNK,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = chat_template
    fast.save_pretrained(str(folder))
    return fast


def build_scripted_model(
    folder: Path, script: Script, chat_template: str, *, mtp: bool = False
) -> Path:
    """Save the scripted Llama + tokenizer (+ one perfect MTP layer) into ``folder``."""
    import transformers as tf
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    vocab = script.vocab()
    ids = {t: i for i, t in enumerate(vocab)}
    tokenizer = build_tokenizer(folder, script, chat_template)
    if tokenizer.convert_tokens_to_ids(vocab) != list(range(len(vocab))):
        raise ValueError("the tokenizer's ids do not follow the script's vocabulary")
    v = len(vocab)
    h = max(64, -(-v // 16) * 16)  # one-hot embeddings need hidden >= vocab
    config = tf.LlamaConfig(
        vocab_size=v,
        hidden_size=h,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=2 * h,
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        rms_norm_eps=1e-6,
        bos_token_id=ids[BOS],
        eos_token_id=ids[EOS],
        pad_token_id=ids[UNK],
    )
    torch.manual_seed(0)
    model = tf.LlamaForCausalLM(config).eval()
    model.save_pretrained(str(folder))
    state = {k: t.contiguous() for k, t in model.state_dict().items()}
    for name in state:
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            state[name] = torch.zeros_like(state[name])
        elif "norm" in name:
            state[name] = torch.ones_like(state[name])
    state["model.embed_tokens.weight"] = torch.eye(v, h)
    head = torch.zeros(v, h)
    nxt = script.successors()
    for tok, i in ids.items():
        head[ids[nxt.get(tok, EOS)], i] = 1.0
    state["lm_head.weight"] = head
    save_file(state, str(folder / "model.safetensors"))  # what save_pretrained wrote
    gen = {"eos_token_id": ids[EOS], "bos_token_id": ids[BOS]}
    (folder / "generation_config.json").write_text(json.dumps(gen))
    if mtp:
        add_mtp_layers(folder, 1, perfect=True)
    return folder


# ------------------------------------------------------------------ chat templates
# The parts of the real templates that decide the prompt's shape, rewritten.

QWEN3_TEMPLATE = (
    # Qwen3-8B: tools in the system turn (Hermes tags), reasoning of turns after the last user
    # query kept (from reasoning_content, else split from the content at </think>), and the
    # generation prompt closing an empty thinking block when enable_thinking is false.
    "{%- if enable_thinking is defined and enable_thinking is not boolean %}"
    "{{- raise_exception('enable_thinking must be true or false') }}{%- endif %}"
    "{%- if tools %}{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '# Tools\\n\\n<tools>' }}{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}"
    '{%- endfor %}{{- \'\\n</tools>\\n\\nFor each call: <tool_call>\\n{"name": <name>, '
    '"arguments": <args>}\\n</tool_call><|im_end|>\\n\' }}'
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}{%- endif %}"
    "{%- set ns = namespace(searching=true, last_query_index=messages|length - 1) %}"
    "{%- for message in messages[::-1] %}{%- set index = (messages|length - 1) - loop.index0 %}"
    "{%- if ns.searching and message.role == 'user' %}"
    "{%- set ns.searching = false %}{%- set ns.last_query_index = index %}{%- endif %}"
    "{%- endfor %}"
    "{%- for message in messages %}"
    "{%- set content = message.content if message.content is string else '' %}"
    "{%- if message.role == 'user' or (message.role == 'system' and not loop.first) %}"
    "{{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>\\n' }}"
    "{%- elif message.role == 'assistant' %}{%- set reasoning_content = '' %}"
    "{%- if message.reasoning_content is string %}"
    "{%- set reasoning_content = message.reasoning_content %}"
    "{%- elif '</think>' in content %}"
    "{%- set reasoning_content = content.split('</think>')[0].rstrip('\\n')"
    ".split('<think>')[-1].lstrip('\\n') %}"
    "{%- set content = content.split('</think>')[-1].lstrip('\\n') %}{%- endif %}"
    "{%- if loop.index0 > ns.last_query_index and reasoning_content %}"
    "{{- '<|im_start|>assistant\\n<think>\\n' + reasoning_content.strip('\\n')"
    " + '\\n</think>\\n\\n' + content.lstrip('\\n') }}"
    "{%- else %}{{- '<|im_start|>assistant\\n' + content }}{%- endif %}"
    "{%- for call in message.tool_calls or [] %}"
    '{{- \'\\n<tool_call>\\n{"name": "\' + call.function.name + \'", "arguments": \' '
    "+ (call.function.arguments | tojson) + '}\\n</tool_call>' }}{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|im_start|>user\\n<tool_response>\\n' + content + '\\n</tool_response><|im_end|>\\n' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined and enable_thinking is false %}"
    "{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}{%- endif %}"
)


def r1_template(think_in_prompt: bool) -> str:
    """DeepSeek-R1's template: earlier answers lose their thinking; the newer revisions open
    the thinking in the generation prompt (``<think>\\n``), the first one did not."""
    opening = "<think>\\n" if think_in_prompt else ""
    return (
        "{%- set ns = namespace(system_prompt='') %}"
        "{%- for message in messages %}{%- if message['role'] == 'system' %}"
        "{%- set ns.system_prompt = message['content'] %}{%- endif %}{%- endfor %}"
        "{{- '" + R1_BOS + "' + ns.system_prompt }}"
        "{%- for message in messages %}"
        "{%- if message['role'] == 'user' %}{{- '" + R1_USER + "' + message['content'] }}"
        "{%- elif message['role'] == 'assistant' %}{%- set content = message['content'] %}"
        "{%- if '</think>' in content %}{%- set content = content.split('</think>')[-1] %}"
        "{%- endif %}{{- '" + R1_ASSISTANT + "' + content + '" + R1_EOS + "' }}"
        "{%- endif %}{%- endfor %}"
        "{%- if add_generation_prompt %}{{- '" + R1_ASSISTANT + opening + "' }}{%- endif %}"
    )


# ------------------------------------------------------------------ the reasoning script

CITY_CALL = '\n{{"name": "get_weather", "arguments": {{"city": "{city}"}}}}\n'
# Qwen3 (thinking) and the first DeepSeek-R1 template: the output opens its thinking itself.
THINK_TOKENS = (
    "<think>",
    "\nThe",
    " user",
    " wants",
    " the",
    " weather.",
    " Maybe",
    " <tool_call>",
    CITY_CALL.format(city="Paris"),
    "</tool_call> first?\n",
    "</think>",
    "\n\n",
    "The",
    " answer",
    " is",
    " sunny.",
    "\n<tool_call>",
    CITY_CALL.format(city="Rome"),
    "</tool_call>",
)
# Newer DeepSeek-R1 template: the prompt ends in "<think>\n"; the end tag comes in two tokens.
OPEN_THINK_TOKENS = (
    "Okay,",
    " a",
    " greeting",
    " here.",
    " Just",
    " reply",
    " very",
    " kindly.\n",
    "</",
    "think>",
    "\n\nHello",
    " there!",
)
PROMPT_TOKENS = (
    "user\n",
    "system\n",
    "\n",
    "<tool_response>",
    "</tool_response>",
    "<tool_call>",
    "</tool_call>",
    "<think>\n",
)
REASONING_SCRIPT = Script(
    sequences=(
        ("assistant\n", *THINK_TOKENS),  # Qwen3's generation prompt
        (R1_ASSISTANT, "<think>"),  # the first R1 template
        ("<think>\n", *OPEN_THINK_TOKENS),  # the newer R1 template
    ),
    extra=PROMPT_TOKENS,
)


GPT_OSS_TEMPLATE = (
    # gpt-oss (harmony): a system message with the reasoning effort and the channels, the
    # developer message with the instructions and the functions namespace, earlier calls as
    # messages to functions.NAME on the commentary channel, their results as messages from
    # them, earlier answers on the final channel, and the generation prompt <|start|>assistant.
    "{{- '<|start|>system<|message|>You are ChatGPT, a large language model trained by OpenAI.\\n' }}"
    "{{- 'Reasoning: ' + (reasoning_effort if reasoning_effort is defined else 'medium') }}"
    "{{- '\\n\\n# Valid channels: analysis, commentary, final.' }}"
    "{%- if tools %}{{- '\\nCalls to these tools must go to the commentary channel: functions.' }}"
    "{%- endif %}{{- '<|end|>' }}"
    "{%- set rest = messages %}{%- set instructions = '' %}"
    "{%- if messages[0].role in ('system', 'developer') %}"
    "{%- set instructions = messages[0].content %}{%- set rest = messages[1:] %}{%- endif %}"
    "{%- if instructions or tools %}{{- '<|start|>developer<|message|>' }}"
    "{%- if instructions %}{{- '# Instructions\\n\\n' + instructions }}{%- endif %}"
    "{%- if tools %}{{- '\\n\\n# Tools\\n\\n## functions\\n\\nnamespace functions {\\n' }}"
    "{%- for tool in tools %}{{- '\\ntype ' + tool.function.name + ' = (_: ' }}"
    "{{- tool.function.parameters | tojson }}{{- ') => any;\\n' }}{%- endfor %}"
    "{{- '\\n} // namespace functions' }}{%- endif %}{{- '<|end|>' }}{%- endif %}"
    "{%- set last = namespace(name=none) %}"
    "{%- for message in rest %}"
    "{%- if message.role == 'user' %}"
    "{{- '<|start|>user<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'assistant' and message.tool_calls %}"
    "{%- set call = message.tool_calls[0].function %}{%- set last.name = call.name %}"
    "{{- '<|start|>assistant to=functions.' + call.name + '<|channel|>commentary json<|message|>' }}"
    "{{- call.arguments | tojson }}{{- '<|call|>' }}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|start|>assistant<|channel|>final<|message|>' + message.content + '<|end|>' }}"
    "{%- elif message.role == 'tool' %}"
    "{{- '<|start|>functions.' + last.name + ' to=assistant<|channel|>commentary<|message|>' }}"
    "{{- message.content | tojson }}{{- '<|end|>' }}"
    "{%- endif %}{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|start|>assistant' }}{%- endif %}"
)
