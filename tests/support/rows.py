"""Prompt rows for the render and parity tests: chat rows in the OpenAI message format, some
with system turns, multi-turn history, tool calls and tool results, written as JSONL."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

Row = dict[str, Any]


def chat_rows(count: int, *, multi_turn: bool = True, tools: bool = True) -> list[Row]:
    """count rows of a few shapes, each different (the index is in every text)."""
    rows: list[Row] = []
    for i in range(count):
        shape = i % 4
        user: dict[str, Any] = {
            "role": "user",
            "content": f"Question {i}: how do tides work near {i} km?",
        }
        messages: list[dict[str, Any]]
        if shape == 0 or (shape == 3 and not tools) or (shape == 2 and not multi_turn):
            messages = [user]
        elif shape == 1:
            messages = [{"role": "system", "content": f"Answer briefly ({i})."}, user]
        elif shape == 2:
            messages = [
                user,
                {"role": "assistant", "content": f"Answer {i}: the moon pulls the sea."},
                {"role": "user", "content": [{"type": "text", "text": f"And the sun {i}?"}]},
            ]
        else:
            messages = [
                user,
                {
                    "role": "assistant",
                    "content": None,
                    "tool_calls": [
                        {
                            "id": f"call_{i}",
                            "type": "function",
                            "function": {"name": "tide_table", "arguments": f'{{"km": {i}}}'},
                        }
                    ],
                },
                {"role": "tool", "tool_call_id": f"call_{i}", "content": f"high tide at {i}:00"},
            ]
        rows.append({"id": f"row-{i:04d}", "messages": messages})
    return rows


def prompt_rows(count: int) -> list[Row]:
    """count one-line prompts with ids q0, q1, ..."""
    return [{"id": f"q{i}", "prompt": f"hi {i}"} for i in range(count)]


def write_rows(path: Path, rows: list[Row]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}
CLOCK_TOOL = {"type": "function", "function": {"name": "now", "parameters": {"type": "object"}}}


def agentic_rows(count: int) -> list[Row]:
    """count agentic rows for `--turns each`: tools (a list, or a JSON string of one), tool
    calls with string arguments, tool results as text parts, reasoning on history turns under
    its three names, list content, per-row template kwargs and metadata fields."""
    rows: list[Row] = []
    for i in range(count):
        city = f"City{i}"
        call = {
            "id": f"call_{i}",
            "type": "function",
            "function": {"name": "get_weather", "arguments": json.dumps({"city": city})},
        }
        reasoning_key = ("reasoning_content", "reasoning", "thinking")[i % 3]
        messages: list[dict[str, Any]] = [
            {"role": "system", "content": f"You are agent {i}."},
            {"role": "user", "content": [{"type": "text", "text": f"Weather in {city}?"}]},
            {
                "role": "assistant",
                "content": None,
                reasoning_key: f"Look it up {i}.",
                "tool_calls": [call],
            },
            {
                "role": "tool",
                "tool_call_id": f"call_{i}",
                "content": [{"type": "text", "text": f"{i} C"}, {"type": "text", "text": "dry"}],
            },
            {"role": "assistant", "content": f"It is {i} C in {city}.", "weight": 1},
            {"role": "user", "content": f"And what time is it, {i}?"},
        ]
        tools: Any = [WEATHER_TOOL, CLOCK_TOOL]
        if i % 4 == 1:
            tools = json.dumps(tools)
        row: Row = {"id": f"agent-{i:03d}", "messages": messages, "tools": tools}
        if i % 5 == 2:
            row["chat_template_kwargs"] = {"thinking": False}
        if i % 2:
            row["source"] = "synthetic"
            row["category"] = f"weather-{i % 3}"
        rows.append(row)
    return rows
