"""Fixture chat templates written after the features of real model families, for the oracle test:
each exercises what its family's template does with the chat path (named templates, string vs
list content, reasoning channels, tool JSON, bare function tools, turn fields, roles).

`family_folder(kind, base, dst)` makes the tokenizer folder of a family from a base folder: the
Kimi-shaped fixture for most, the DeepSeek-V3 vocabulary (a ByteLevel `tokenizer.json` under
`LlamaTokenizerFast`) for the DeepSeek family, the K2.5-shaped custom-code folder (a tiktoken
tokenizer of its own and a tool-declaration helper) for Kimi-K2.5.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Any

from tests.support.chat_templates import tokenizer_with_template

Json = dict[str, Any]
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Weather of a city",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "varchar(64)"}, "days": {"type": "int"}},
        },
    },
}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'},
}


def boundaries(messages: list[Json]) -> list[list[Json]]:
    """The raw turns before each assistant turn that has a turn of another role before it,
    and all of them after a final turn of another role."""
    cuts = [
        messages[:i]
        for i, turn in enumerate(messages)
        if turn["role"] == "assistant" and any(t["role"] != "assistant" for t in messages[:i])
    ]
    if messages[-1]["role"] != "assistant":
        cuts.append(messages)
    return cuts


GEN = "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"

# Kimi-K2: `name or role`, tools as JSON, string content, reasoning in history
KIMI = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "<|im_user|>{{ message.get('name') or message['role'] }}<|im_middle|>"
    "{%- if message.get('reasoning_content') -%}<think>{{ message['reasoning_content'] }}</think>"
    "{%- endif -%}{{ message['content'] }}"
    "{%- for call in message.get('tool_calls') or [] -%}"
    "[{{ call['function']['name'] }}:{{ call['function']['arguments'] | tojson }}]"
    "{%- endfor -%}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>"
    "{%- endif -%}{%- endif -%}"
)

# Hermes-3: two named templates; the deployed server renders the first ("default")
HERMES_DEFAULT = (
    "{%- for message in messages -%}<|im_user|>{{ message['role'] }}<|im_middle|>"
    "{{ message['content'] }}<|im_end|>{%- endfor -%}" + GEN
)
HERMES_TOOL_USE = (
    "<|im_system|>tools<|im_middle|>{{ tools | tojson }}<|im_end|>"
    "{%- for message in messages -%}<|im_user|>{{ message['role'] }}<|im_middle|>"
    "{{ message['content'] }}{%- if message.tool_calls is defined -%}"
    "{{ message.tool_calls | tojson }}{%- endif -%}<|im_end|>{%- endfor -%}" + GEN
)

# gpt-oss: history reasoning read from `thinking` (transformers 5.24 aliases reasoning_content
# into it; 5.19, the server's, does not), channels, reasoning_effort, developer turns
GPT_OSS = (
    "<|im_system|>system<|im_middle|>Reasoning: {{ reasoning_effort | default('medium') }}"
    "<|im_end|>"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'assistant' -%}"
    "{%- if message.thinking is defined -%}<|im_assistant|>analysis<|im_middle|>"
    "{{ message.thinking }}<|im_end|>{%- endif -%}"
    "{%- if message.tool_calls is defined -%}"
    "{%- for call in message.tool_calls -%}<|im_assistant|>commentary to="
    "{{ call.function.name }}<|im_middle|>{{ call.function.arguments | tojson }}<|im_end|>"
    "{%- endfor -%}{%- else -%}<|im_assistant|>final<|im_middle|>{{ message.content }}"
    "<|im_end|>{%- endif -%}"
    "{%- elif message['role'] == 'tool' -%}<|im_user|>functions<|im_middle|>"
    "{{ message.content }}<|im_end|>"
    "{%- else -%}<|im_user|>{{ message['role'] }}<|im_middle|>{{ message.content }}<|im_end|>"
    "{%- endif -%}{%- endfor -%}" + GEN
)

# Qwen3: content read part by part (the "openai" content format), tools in the system turn,
# reasoning_content in history, tool responses wrapped
QWEN3 = (
    "{%- if tools -%}<|im_system|>system<|im_middle|># Tools"
    "{%- for tool in tools %}\n{{ tool | tojson }}{%- endfor -%}<|im_end|>{%- endif -%}"
    "{%- for message in messages -%}<|im_user|>{{ message.role }}<|im_middle|>"
    "{%- if message.content is string -%}{{ message.content }}"
    "{%- else -%}{%- for part in message.content -%}{%- if part.type == 'text' -%}"
    "[{{ part.text }}]{%- endif -%}{%- endfor -%}{%- endif -%}"
    "{%- if message.reasoning_content is defined -%}<think>{{ message.reasoning_content }}"
    "</think>{%- endif -%}"
    "{%- if message.tool_calls is defined -%}{%- for call in message.tool_calls -%}"
    "<tool_call>{{ {'name': call.function.name, 'arguments': call.function.arguments} "
    "| tojson }}</tool_call>{%- endfor -%}{%- endif -%}<|im_end|>{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if enable_thinking is defined and not enable_thinking -%}<think></think>"
    "{%- endif -%}{%- endif -%}"
)

# Llama-3.3: tools as JSON in the first user turn, calls rendered from call.function
LLAMA = (
    "{%- for message in messages -%}<|im_user|>{{ message.role }}<|im_middle|>"
    "{%- if loop.first and tools -%}Tools: {{ tools | tojson(indent=2) }}\n{%- endif -%}"
    "{%- if message.tool_calls is defined -%}{%- for call in message.tool_calls -%}"
    '{"name": "{{ call.function.name }}", "parameters": {{ call.function.arguments | tojson }}}'
    "{%- endfor -%}{%- else -%}{{ message.content }}{%- endif -%}<|im_end|>{%- endfor -%}" + GEN
)

# Devstral / Mistral: tools taken as bare function objects (SGLang's second try)
DEVSTRAL = (
    "{%- for tool in tools or [] -%}"
    "{%- if tool['name'] is not defined -%}{{ raise_exception('tools must be bare') }}"
    "{%- endif -%}<|im_system|>{{ tool['name'] }}<|im_middle|>{{ tool['parameters'] | tojson }}"
    "<|im_end|>{%- endfor -%}"
    "{%- for message in messages -%}"
    "{%- if message.role == 'user' and message.content == '' -%}"
    "{{ raise_exception('empty user turns are not allowed') }}{%- endif -%}"
    "<|im_user|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}" + GEN
)

# GLM-4.6: arguments walked key by key (they must be an object), every turn field in order
GLM = (
    "{%- for message in messages -%}<|im_user|>{{ message.role }}<|im_middle|>"
    "{%- for key, value in message.items() if key not in ('role', 'content', 'tool_calls') -%}"
    "[{{ key }}={{ value }}]{%- endfor -%}{{ message.content }}"
    "{%- for call in message.tool_calls or [] -%}<tool_call>{{ call.function.name }}"
    "{%- for k, v in call.function.arguments.items() -%}<arg_key>{{ k }}</arg_key>"
    "<arg_value>{{ v | tojson }}</arg_value>{%- endfor -%}</tool_call>{%- endfor -%}"
    "<|im_end|>{%- endfor -%}" + GEN
)

# MiniMax-M2: developer and system turns merged into one system block, names on tool turns
MINIMAX = (
    "<|im_system|>system<|im_middle|>"
    "{%- for message in messages if message.role in ('system', 'developer') -%}"
    "{{ message.role }}: {{ message.content }};{%- endfor -%}<|im_end|>"
    "{%- for message in messages if message.role not in ('system', 'developer') -%}"
    "<|im_user|>{{ message.role }}{%- if message.name is defined %} ({{ message.name }})"
    "{%- endif -%}<|im_middle|>{{ message.content }}<|im_end|>{%- endfor -%}" + GEN
)

# Qwen3-VL: mentions images, so list content stays a list of parts
QWEN_VL = (
    "{%- for message in messages -%}<|im_user|>{{ message.role }}<|im_middle|>"
    "{%- if message.content is string -%}{{ message.content }}{%- else -%}"
    "{%- for part in message.content -%}{%- if part.type == 'image' -%}<|media_pad|>"
    "{%- elif part.type == 'text' -%}{{ part.text }}|{%- endif -%}{%- endfor -%}{%- endif -%}"
    "<|im_end|>{%- endfor -%}" + GEN
)

# Gemma-3: the system turn folded into the first user turn, roles strictly alternating (the
# template raises otherwise, and SGLang answers its message), `model` for assistant turns
GEMMA = (
    "{%- if messages[0]['role'] == 'system' -%}"
    "{%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}"
    "{%- set loop_messages = messages[1:] -%}"
    "{%- else -%}{%- set first_user_prefix = '' -%}{%- set loop_messages = messages -%}"
    "{%- endif -%}"
    "{%- for message in loop_messages -%}"
    "{%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}"
    "{%- endif -%}"
    "<|im_user|>{{ 'model' if message['role'] == 'assistant' else message['role'] }}"
    "<|im_middle|>{{ first_user_prefix if loop.first else '' }}"
    "{%- if message['content'] is string -%}{{ message['content'] | trim }}"
    "{%- else -%}{%- for part in message['content'] -%}{%- if part['type'] == 'text' -%}"
    "{{ part['text'] | trim }}{%- endif -%}{%- endfor -%}{%- endif -%}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>model<|im_middle|>{%- endif -%}"
)

FAMILIES: dict[str, Any] = {
    "gemma-3": GEMMA,
    "kimi-k2": KIMI,
    "hermes-3": [
        {"name": "default", "template": HERMES_DEFAULT},
        {"name": "tool_use", "template": HERMES_TOOL_USE},
    ],
    "gpt-oss": GPT_OSS,
    "qwen3": QWEN3,
    "llama-3.3": LLAMA,
    "devstral": DEVSTRAL,
    "glm-4.6": GLM,
    "minimax-m2": MINIMAX,
    "qwen3-vl": QWEN_VL,
    "deepseek-v3": None,  # the DeepSeek-V3 folder's own template
    # the K2.5-shaped custom-code folder's own template, tokenizer and tool-declaration code
    "kimi-k2.5": None,
}
# the families whose folder is its own code (loaded with trust_remote_code on both sides)
CUSTOM_CODE = frozenset({"kimi-k2.5"})


def family_folder(kind: str, base: Path, dst: Path) -> Path:
    """A copy of base whose chat template is the family's (kept for deepseek-v3)."""
    if dst.exists():
        shutil.rmtree(dst)
    template = FAMILIES[kind]
    if template is None:
        shutil.copytree(base, dst, ignore=shutil.ignore_patterns("__pycache__"))
        return dst
    return tokenizer_with_template(base, dst, template)
