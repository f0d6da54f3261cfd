"""Tool calls in the emulator's outputs (`--tool-calls FAMILY`): a stopped output whose prompt
declares tools ends with calls written in the family's format, so agentic chains meet every branch.

Driven by the prompt alone, deterministically (the output's own seed): the tools are the names
the template rendered into the prompt; the output makes one call to one of them, two parallel
calls, one malformed call, or no call, and keeps its reasoning and `</think>`.
"""

from __future__ import annotations

import json
import random
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

TOOL_CALL_FAMILIES = ("kimi", "hermes")
# a tool as the templates render it: `tools | tojson`, the function's name first
_DECLARED = re.compile(r'"function": \{"name": "([^"]+)"')
# the shares of the branches: one call, two parallel calls, a malformed call, no call
ONE_CALL, PARALLEL, MALFORMED = 0.70, 0.80, 0.90


def declared_tools(prompt_text: str) -> list[str]:
    """The tool names the prompt declares, in order, each once."""
    return list(dict.fromkeys(_DECLARED.findall(prompt_text)))


def call_text(family: str, names: Sequence[str], *, malformed: bool = False) -> str:
    """Calls to names as the family's model writes them (arguments `{}`; malformed: not JSON)."""
    arguments = "{]" if malformed else "{}"
    if family == "kimi":
        body = "".join(
            f"<|tool_call_begin|>functions.{name}:{i}<|tool_call_argument_begin|>{arguments}"
            "<|tool_call_end|>"
            for i, name in enumerate(names)
        )
        return f"<|tool_calls_section_begin|>{body}<|tool_calls_section_end|>"
    calls = [f'{{"name": {json.dumps(name)}, "arguments": {arguments}}}' for name in names]
    return "\n".join(f"<tool_call>\n{c}\n</tool_call>" for c in calls)


def choose_calls(tools: Sequence[str], rng: random.Random) -> tuple[list[str], bool]:
    """The calls one output makes (names, malformed); no names: no call."""
    draw = rng.random()
    if draw < ONE_CALL:
        return [rng.choice(list(tools))], False
    if draw < PARALLEL:
        return [rng.choice(list(tools)) for _ in range(2)], False
    if draw < MALFORMED:
        return [rng.choice(list(tools))], True
    return [], False


@dataclass(frozen=True)
class ToolCallWriter:
    """Rewrites stopped outputs of prompts that declare tools (the tokenizer's decode/encode)."""

    family: str
    decode: Callable[[Sequence[int]], str]
    encode: Callable[[str], list[int]]
    eos_id: int
    think_end_id: int | None

    def rewrite(
        self, prompt_ids: Sequence[int], output_ids: list[int], max_new_tokens: int, seed: int
    ) -> list[int]:
        """The output with its answer replaced by calls (an output cut at max_new_tokens, a
        prompt with no tools, a no-call draw, or calls that would not fit: unchanged)."""
        if not output_ids or output_ids[-1] != self.eos_id:
            return output_ids
        tools = declared_tools(self.decode(prompt_ids))
        if not tools:
            return output_ids
        names, malformed = choose_calls(tools, random.Random(seed))
        if not names:
            return output_ids
        head = output_ids[:-1]
        if self.think_end_id is not None and self.think_end_id in head:
            head = head[: head.index(self.think_end_id) + 1]
        else:
            head = []
        rewritten = [*head, *self.encode(call_text(self.family, names, malformed=malformed))]
        rewritten.append(self.eos_id)
        return rewritten if len(rewritten) <= max_new_tokens else output_ids
