"""The emulator's tool calls (`--tool-calls`): the tools read from the prompt, every branch drawn,
the output rewritten only where a stopped output of a prompt with tools has room."""

from __future__ import annotations

import json
import random

from app.prompts import tool_calls as product_parse
from emulator import tool_calls

TOOLS = [
    {"type": "function", "function": {"name": n, "parameters": {}}} for n in ("a_tool", "b.tool")
]
PROMPT = f"<|im_system|>tool_declare<|im_middle|>{json.dumps(TOOLS)}<|im_end|>"


def _writer() -> tool_calls.ToolCallWriter:
    # ids are characters: decode joins them, encode splits them
    return tool_calls.ToolCallWriter(
        "hermes",
        decode=lambda ids: "".join(map(chr, ids)),
        encode=lambda text: [ord(c) for c in text],
        eos_id=1,
        think_end_id=2,
    )


def test_the_prompts_tools_are_read_in_order() -> None:
    assert tool_calls.declared_tools(PROMPT + PROMPT) == ["a_tool", "b.tool"]
    assert tool_calls.declared_tools("no tools here") == []


def test_every_branch_is_drawn_and_parses_as_its_family() -> None:
    seen = set()
    for seed in range(200):
        names, malformed = tool_calls.choose_calls(["a_tool", "b.tool"], random.Random(seed))
        seen.add((len(names), malformed))
        for family, parser in (("kimi", "kimi_k2"), ("hermes", "hermes")):
            text = tool_calls.call_text(family, names, malformed=malformed)
            parsed = product_parse.parse(parser, text, TOOLS)
            ending = product_parse.chain_ending(parsed, "a_tool")
            if malformed:
                assert ending == "malformed_call"
            elif names:
                assert [c.name for c in parsed.calls] == names
    assert seen == {(1, False), (2, False), (1, True), (0, False)}


def test_only_stopped_outputs_of_prompts_with_tools_are_rewritten() -> None:
    writer, prompt = _writer(), [ord(c) for c in PROMPT]
    output = [70, 71, 2, 72, 1]
    rewritten = {tuple(writer.rewrite(prompt, output, 500, seed)) for seed in range(40)}
    assert tuple(output) in rewritten and len(rewritten) > 2  # no-call draws keep the output
    assert all(r[:3] == (70, 71, 2) and r[-1] == 1 for r in rewritten)  # reasoning kept
    assert writer.rewrite([ord("x")], output, 500, 3) == output  # no tools
    assert writer.rewrite(prompt, [70, 71], 500, 3) == [70, 71]  # cut at max_new_tokens
    assert all(writer.rewrite(prompt, output, 5, seed) == output for seed in range(40))
