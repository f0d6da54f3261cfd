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
        texts = [
            self.hf.decode(
                ids[:-1] if ids and ids[-1] == eos_id else ids, skip_special_tokens=False
            )
            for ids in outputs
        ]
        cases = [
            {
                "parser": self.parser,
                "text": text,
                "tools": tools,
                "reasoning_parser": self.reasoning_parser,
                "force_reasoning": True if self.reasoning_parser else None,
            }
            for text in texts
        ]
        answers = sglang_tool_parser.wheel_parses(cases)
        return [{**a, "raw": text} for a, text in zip(answers, texts, strict=True)]

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
