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
        user = {"role": "user", "content": f"Question {i}: how do tides work near {i} km?"}
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


def write_rows(path: Path, rows: list[Row]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path
