"""Agentic rows for the on-policy chain tests, the emulated model families that answer them, and
each row's chain as an agent loop against SGLang 0.5.23 makes it: the wheel's parse of every
output (SGLangAgentLoop, all outputs in one run of the wheel), the history it sends back, the
next prompt the chat path renders, and where the rules of docs/inputs.md end the chain (a
turn cut at max_new_tokens ends it there)."""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core import constants
from emulator.fixtures.kimi import IM_END, SPECIAL_TOKENS_BY_NAME, ensure_kimi_tokenizer
from tests.support import sglang_agent_loop
from tests.support.chat_templates import tokenizer_with_template
from tests.support.sglang_agent_loop import SGLangAgentLoop

NAMES = ("get_weather", "search", "read_file")
TOOLS = [
    {
        "type": "function",
        "function": {"name": n, "parameters": {"type": "object", "properties": {}}},
    }
    for n in NAMES
]
EOS = SPECIAL_TOKENS_BY_NAME[IM_END]


def agentic_row(n: int) -> dict[str, Any]:
    """2 to 6 tool calls, one per assistant turn, then a final answer; every other row declares
    one tool only (its chains run on while the target calls, and reach their end)."""
    rng = random.Random(n)
    tools = TOOLS if n % 2 else TOOLS[:1]
    names = [t["function"]["name"] for t in tools]
    turns: list[dict[str, Any]] = [
        {"role": "system", "content": "Use the tools."},
        {"role": "user", "content": f"Task {n}: look things up."},
    ]
    for k in range(rng.randint(2, 6)):
        name, call_id = rng.choice(names), f"orig_{k}"
        call = {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}
        turns.append({"role": "assistant", "content": "", "tool_calls": [call]})
        turns.append({"role": "tool", "tool_call_id": call_id, "content": f"{name} result {k}"})
    turns.append({"role": "assistant", "content": "All done."})
    return {"id": f"r{n}", "messages": turns, "tools": tools}


@dataclass(frozen=True)
class Family:
    """An emulated model family: the emulator's format, the run's parser, the server's."""

    name: str
    parser: str  # SGLang's --tool-call-parser
    reasoning_parser: str | None
    opening: str  # what opens one call in the family's format
    emulator_flags: tuple[str, ...]
    run_flags: tuple[str, ...]

    def tokenizer(self, tmp: Path) -> Path:
        """The family's tokenizer folder under tmp: the Kimi-K2.5 fixture, or the fixture with
        the Hermes/Qwen2.5-style template."""
        fixture = ensure_kimi_tokenizer(tmp / "cache")
        if self.name == "kimi":
            return Path(shutil.copytree(fixture, tmp / "tok"))
        return tokenizer_with_template(fixture, tmp / "tok", sglang_agent_loop.HERMES_TEMPLATE)

    def agent_loop(self, folder: Path) -> SGLangAgentLoop:
        return SGLangAgentLoop(folder, self.parser, self.reasoning_parser)


FAMILIES = {
    "kimi": Family(
        "kimi", "kimi_k2", "kimi_k2", "<|tool_call_begin|>", ("--tool-calls", "kimi"), ()
    ),
    "hermes": Family(
        "hermes",
        "hermes",
        None,
        "<tool_call>",
        ("--tool-calls", "hermes", "--think-end-id", "none"),
        ("--tool-call-parser", "hermes"),
    ),
}


def expected_ending(
    answer: dict[str, Any], dataset_next: list[dict[str, Any]], name: str | None, opening: str
) -> str | None:
    """The rules of docs/inputs.md applied to SGLang's parse of one regenerated turn."""
    calls = answer.get("calls") or []
    opened = (answer.get("raw") or "").count(opening)
    if opened > len(calls):
        return constants.CHAIN_END_MALFORMED_CALL
    if not calls:
        if name is not None:
            return constants.CHAIN_END_NO_CALL
        return constants.CHAIN_END_COMPLETE if not dataset_next else None
    if len(calls) > 1:
        return constants.CHAIN_END_PARALLEL_CALLS
    if name is None:
        return constants.CHAIN_END_RESULTS_EXHAUSTED
    return None if calls[0][1] == name else constants.CHAIN_END_OTHER_TOOL


class Parses:
    """SGLang's parse of each (output, tools) given, all of them from one run of the wheel."""

    def __init__(
        self, loop: SGLangAgentLoop, cases: Iterable[tuple[Sequence[int], list[Any]]]
    ) -> None:
        outputs: dict[str, dict[tuple[int, ...], None]] = {}
        for output, tools in cases:
            outputs.setdefault(json.dumps(tools, sort_keys=True), {})[tuple(output)] = None
        groups = [(key, list(found)) for key, found in outputs.items()]
        answers = loop.parse_all(
            [([list(o) for o in found], json.loads(key)) for key, found in groups], EOS
        )
        self._answers = {
            (output, key): answer
            for (key, found), parsed in zip(groups, answers, strict=True)
            for output, answer in zip(found, parsed, strict=True)
        }

    def __call__(self, output: Sequence[int], tools: list[Any]) -> dict[str, Any]:
        return self._answers[(tuple(output), json.dumps(tools, sort_keys=True))]


@dataclass(frozen=True)
class Chain:
    """One row's chain: each turn's (prompt ids, output ids), and how it ended (None: there is
    no output for the prompt after the last turn)."""

    turns: list[tuple[list[int], list[int]]]
    ending: str | None


def sglang_chain(
    loop: SGLangAgentLoop,
    family: Family,
    row: dict[str, Any],
    output_of: Callable[[tuple[int, ...]], list[int] | None],
    parses: Parses,
) -> Chain:
    """The row's chain as an agent loop against SGLang runs it: each prompt rendered by the chat
    path from the history so far, its output (output_of: what the target generated for those
    prompt ids, None if nothing) parsed by the wheel, the chain going on or ending by the rules."""
    conversation, tools = row["messages"], row["tools"]
    assistant_at = [i for i, t in enumerate(conversation) if t["role"] == "assistant"]
    history = [dict(t) for t in conversation[: assistant_at[0]]]
    turns: list[tuple[list[int], list[int]]] = []
    for k, at in enumerate(assistant_at):
        prompt = loop.render(history, tools)
        output = output_of(tuple(prompt))
        if output is None:
            return Chain(turns, None)
        turns.append((prompt, output))
        if not output or output[-1] != EOS:  # finish reason length: the loop has no whole turn
            return Chain(turns, constants.CHAIN_END_TRUNCATED)
        answer = parses(output, tools)
        nxt = assistant_at[k + 1] if k + 1 < len(assistant_at) else len(conversation)
        dataset_next = conversation[at + 1 : nxt]
        results = [t for t in dataset_next if t["role"] == "tool"]
        name = conversation[at]["tool_calls"][0]["function"]["name"] if results else None
        ending = expected_ending(answer, dataset_next, name, family.opening)
        if ending is not None:
            return Chain(turns, ending)
        message: dict[str, Any] = {"role": "assistant", "content": answer["normal_text"] or ""}
        if answer["reasoning_text"]:
            message["reasoning_content"] = answer["reasoning_text"]
        if answer["calls"]:
            ((_, called, arguments),) = answer["calls"]
            count = sum(len(t.get("tool_calls") or []) for t in history)
            # SGLang's `_process_tool_call_id`: kimi_k2 counts the history's calls; other
            # parsers draw call_ + 24 random hex digits, which the Hermes template never renders
            call_id = f"functions.{called}:{count}"
            function = {"name": called, "arguments": arguments}
            message["tool_calls"] = [{"id": call_id, "type": "function", "function": function}]
            result, *rest = dataset_next
            history += [message, {**result, "tool_call_id": call_id}, *rest]
        else:
            history += [message, *dataset_next]
    return Chain(turns, None)
