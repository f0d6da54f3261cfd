"""Reading agentic rows: which top-level fields are template inputs and which are metadata,
reasoning aliases, tools and kwargs on JSONL and Parquet, content normalized per template."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.core.contracts import PromptRecord
from app.core.errors import InputError
from app.prompts.inputs import read_prompts

TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}
TOOL_DUMPED = {
    "type": "function",
    "function": {"name": "f", "parameters": {"type": "object"}, "description": None},
    "defer_loading": None,
}
PARTS = [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]


def read(tmp_path: Path, *rows: dict[str, Any], fmt: Any = "string") -> list[Any]:
    path = tmp_path / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return list(read_prompts(path, content_format=fmt))


def one(tmp_path: Path, row: dict[str, Any], fmt: Any = "string") -> PromptRecord:
    (record,) = read(tmp_path, row, fmt=fmt)
    assert isinstance(record, PromptRecord), record
    return record


def test_fields_split_into_template_inputs_and_metadata(tmp_path: Path) -> None:
    record = one(
        tmp_path,
        {
            "id": "r",
            "messages": [{"role": "user", "content": "q"}],
            "tools": [TOOL],
            "chat_template_kwargs": {"thinking": False},
            "reasoning_effort": "high",
            "source": "web",
            "extra": {"n": 1},
            "prompt": "unused, kept as metadata",
        },
    )
    assert record.tools == [TOOL_DUMPED]
    assert record.chat_template_kwargs == {"thinking": False}
    assert record.reasoning_effort == "high"
    assert record.metadata == {
        "source": "web",
        "extra": {"n": 1},
        "prompt": "unused, kept as metadata",
    }
    assert set(record.prompt_fields) == {
        "messages",
        "id",
        "tools",
        "chat_template_kwargs",
        "reasoning_effort",
    }


def test_tools_as_string_equal_tools_as_list(tmp_path: Path) -> None:
    turns = [{"role": "user", "content": "q"}]
    as_list = one(tmp_path, {"messages": turns, "tools": [TOOL]})
    as_string = one(tmp_path, {"messages": turns, "tools": json.dumps([TOOL])})
    assert as_list.tools == as_string.tools == [TOOL_DUMPED]
    assert as_list.key == as_string.key
    # a content key covers the tools: the same turns with other tools are another prompt
    assert as_list.key != one(tmp_path, {"messages": turns}).key


@pytest.mark.parametrize(
    ("row", "reason"),
    [
        ({"prompt": "q", "tools": "[oops"}, "'tools' is a string that is not valid JSON"),
        ({"prompt": "q", "chat_template_kwargs": ["thinking"]}, "must be a JSON object"),
        ({"prompt": "q", "reasoning_effort": "huge"}, "'reasoning_effort' must be one of"),
        ({"input_ids": [1, 2], "tools": [TOOL]}, "'tools' cannot be combined with pre-tokenized"),
        (
            {"messages": [{"role": "user", "content": "q", "reasoning": "x", "thinking": "y"}]},
            "messages[0] has different reasoning and thinking",
        ),
        (
            {
                "messages": [
                    {"role": "user", "content": "q"},
                    {
                        "role": "assistant",
                        "content": None,
                        "tool_calls": [{"id": "c", "function": {"name": "f", "arguments": "{x"}}],
                    },
                    {"role": "tool", "content": "r", "tool_call_id": "c"},
                ]
            },
            "messages[1].tool_calls[0].function.arguments is not valid JSON",
        ),
    ],
)
def test_bad_inputs_are_the_lines_error(tmp_path: Path, row: dict[str, Any], reason: str) -> None:
    (error,) = read(tmp_path, row)
    assert isinstance(error, InputError) and error.line == 1
    assert reason in error.reason


def test_reasoning_alias_and_content_per_format(tmp_path: Path) -> None:
    row = {
        "messages": [
            {"role": "user", "content": PARTS},
            {"role": "assistant", "content": "4", "thinking": "add"},
            {"role": "user", "content": "again"},
        ]
    }
    string = one(tmp_path, row, "string")
    assert string.messages == [
        {"role": "user", "content": "a b"},
        {"role": "assistant", "content": "4", "reasoning_content": "add"},
        {"role": "user", "content": "again"},
    ]
    openai = one(tmp_path, row, "openai")
    assert openai.messages is not None and openai.messages[0]["content"] == PARTS


def test_parquet_rows_carry_tools_kwargs_and_metadata(tmp_path: Path) -> None:
    path = tmp_path / "rows.parquet"
    table = pa.Table.from_pylist(
        [
            {
                "messages": [{"role": "user", "content": "q1"}],
                "tools": json.dumps([TOOL]),
                "chat_template_kwargs": {"thinking": False, "style": None},
                "source": "a",
            },
            {
                "messages": [{"role": "user", "content": "q2"}],
                "tools": None,
                "chat_template_kwargs": {"thinking": None, "style": "terse"},
                "source": "b",
            },
        ]
    )
    pq.write_table(table, path)
    first, second = read_prompts(path)
    assert isinstance(first, PromptRecord) and isinstance(second, PromptRecord)
    assert first.tools == [TOOL_DUMPED] and second.tools is None
    # Arrow gives every row every struct field: the null ones are not this row's kwargs
    assert first.chat_template_kwargs == {"thinking": False}
    assert second.chat_template_kwargs == {"style": "terse"}
    assert (first.metadata, second.metadata) == ({"source": "a"}, {"source": "b"})
