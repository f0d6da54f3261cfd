"""What an agent loop against SGLang 0.5.23's chat endpoint sees, from the wheel's own code: each
output decoded and parsed (its ReasoningParser, then its function-call detector), and each next
prompt rendered as `/v1/chat/completions` renders the history (its request model, its chat-path
functions, the template, encoded without special tokens)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from transformers import AutoTokenizer

from tests.support import sglang_chat_path as sglang
from tests.support import sglang_tool_parser
from tests.support.sglang_contract import load_protocol

# a template written after Qwen2.5's: tools declared in the system turn, calls as Hermes JSON
HERMES_TEMPLATE = """{%- if tools %}<|im_start|>system
{% if messages[0]['role'] == 'system' %}{{ messages[0]['content'] }}
{% endif %}# Tools
<tools>{% for tool in tools %}
{{ tool | tojson }}{% endfor %}
</tools><|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}{% if not tools %}<|im_start|>system
{{ message.content }}<|im_end|>
{% endif %}
{%- elif message.role == 'user' %}<|im_start|>user
{{ message.content }}<|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{{ message.content }}
{%- for tc in message.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""


class SGLangAgentLoop:
    """parser: SGLang's --tool-call-parser; reasoning_parser: its --reasoning-parser (None:
    none), forced on when the template's generation prompt opens the reasoning."""

    def __init__(self, folder: Path, parser: str, reasoning_parser: str | None) -> None:
        self.hf = AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        self.content_format = sglang.detect_content_format(self.hf.chat_template)
        self.protocol = load_protocol()
        self.parser = parser
        self.reasoning_parser = reasoning_parser

    def parse(
        self, outputs: list[list[int]], tools: list[Any], eos_id: int
    ) -> list[dict[str, Any]]:
        """Each output as the endpoint parses it (the detokenizer drops the matched stop id;
        with tools, special tokens stay in the text); the decoded text under "raw"."""
        return self.parse_all([(outputs, tools)], eos_id)[0]

    def parse_all(
        self, chains: list[tuple[list[list[int]], list[Any]]], eos_id: int
    ) -> list[list[dict[str, Any]]]:
        """parse() of many (outputs, tools) at once: the wheel's parsers start once."""
        texts = [
            [
                self.hf.decode(
                    ids[:-1] if ids and ids[-1] == eos_id else ids, skip_special_tokens=False
                )
                for ids in outputs
            ]
            for outputs, _ in chains
        ]
        cases = [
            {
                "parser": self.parser,
                "text": text,
                "tools": tools,
                "reasoning_parser": self.reasoning_parser,
                "force_reasoning": True if self.reasoning_parser else None,
            }
            for decoded, (_, tools) in zip(texts, chains, strict=True)
            for text in decoded
        ]
        answers = iter(sglang_tool_parser.wheel_parses(cases))
        return [[{**next(answers), "raw": text} for text in decoded] for decoded in texts]

    def render(self, history: list[dict[str, Any]], tools: list[Any]) -> list[int]:
        request = self.protocol.ChatCompletionRequest(model="m", messages=history, tools=tools)
        messages = sglang.reference_messages(
            [m.model_dump() for m in request.messages], self.content_format
        )
        text = self.hf.apply_chat_template(
            messages,
            tools=[t.model_dump() for t in request.tools],
            add_generation_prompt=True,
            tokenize=False,
        )
        return list(self.hf.encode(text, add_special_tokens=False))
