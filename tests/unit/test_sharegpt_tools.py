"""ShareGPT tool turns (LLaMA-Factory's function_call / observation) become OpenAI turns with
tool_calls and tool results answering them in order; ids follow `call_{turn}_{k}`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from app.core.contracts import PromptRecord
from app.core.errors import InputError
from app.prompts.input_turns import sharegpt_tool_call_id
from app.prompts.inputs import read_prompts


def read(tmp_path: Path, *rows: dict[str, Any]) -> list[PromptRecord | InputError]:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return list(read_prompts(path))


def call(name: str, arguments: Any) -> dict[str, Any]:
    return {"name": name, "arguments": arguments}


def test_function_call_and_observation_become_tool_calls_and_tool_turns(tmp_path: Path) -> None:
    row = {
        "conversations": [
            {"from": "human", "value": "Weather in Paris?"},
            {"from": "function_call", "value": json.dumps(call("weather", {"city": "Paris"}))},
            {"from": "observation", "value": "12 C"},
            {"from": "gpt", "value": "It is 12 C."},
            {"from": "human", "value": "And Rome and Oslo?"},
            {
                "from": "function_call",
                "value": json.dumps(
                    [call("weather", {"city": "Rome"}), call("weather", '{"city": "Oslo"}')]
                ),
            },
            {"from": "observation", "value": "20 C"},
            {"from": "observation", "value": "3 C"},
        ]
    }
    (record,) = read(tmp_path, row)
    assert isinstance(record, PromptRecord)
    turns = record.messages or []
    assert [t["role"] for t in turns] == [
        "user", "assistant", "tool", "assistant", "user", "assistant", "tool", "tool",
    ]  # fmt: skip
    calls = turns[1]["tool_calls"]
    assert not turns[1]["content"]  # a call-only turn: no content (null, normalized to "")
    assert [(c["id"], c["type"], c["function"]) for c in calls] == [
        ("call_1_0", "function", {"name": "weather", "arguments": {"city": "Paris"}})
    ]
    assert (turns[2]["content"], turns[2]["tool_call_id"]) == ("12 C", "call_1_0")
    parallel = turns[5]["tool_calls"]
    assert [c["id"] for c in parallel] == ["call_5_0", "call_5_1"]
    # string arguments are parsed by the chat path, as SGLang parses OpenAI ones
    assert parallel[1]["function"]["arguments"] == {"city": "Oslo"}
    # the observations answer the calls in order
    assert [t["tool_call_id"] for t in turns[6:]] == ["call_5_0", "call_5_1"]


def test_a_tools_string_of_bare_functions_becomes_openai_tools(tmp_path: Path) -> None:
    weather = {"name": "weather", "description": "Weather now", "parameters": {"type": "object"}}
    row = {
        "tools": json.dumps([weather]),
        "conversations": [
            {"from": "human", "value": "Weather?"},
            {"from": "function_call", "value": json.dumps(call("weather", {}))},
            {"from": "observation", "value": "sunny"},
        ],
    }
    bad = {**row, "tools": "[{"}
    record, error = read(tmp_path, row, bad)
    assert isinstance(record, PromptRecord)
    assert record.tools is not None
    assert [(t["type"], t["function"]["name"]) for t in record.tools] == [("function", "weather")]
    assert record.tools[0]["function"]["description"] == "Weather now"
    assert isinstance(error, InputError)
    assert error.line == 2
    assert "'tools' is a string that is not valid JSON" in error.reason


def test_the_id_rule() -> None:
    assert sharegpt_tool_call_id(3, 0) == "call_3_0"
    assert sharegpt_tool_call_id(11, 2) == "call_11_2"


def test_a_function_call_value_may_already_be_an_object(tmp_path: Path) -> None:
    row = {
        "conversations": [
            {"from": "human", "value": "Search for cats"},
            {"from": "function_call", "value": call("search", {"q": "cats"})},
            {"from": "observation", "value": "3 results"},
        ]
    }
    (record,) = read(tmp_path, row)
    assert isinstance(record, PromptRecord)
    assert (record.messages or [])[1]["tool_calls"][0]["function"]["name"] == "search"


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ('{"name": "x", "arguments": ', "conversations[1].value is not valid JSON"),
        ('{"arguments": {}}', "conversations[1].value has no string 'name'"),
        ("[]", "conversations[1].value is an empty list"),
        ('[{"name": "x"}, 3]', "conversations[1].value[1] must be"),
        ('{"name": "x", "arguments": 3}', "arguments must be an object or a JSON string"),
    ],
)
def test_a_bad_function_call_is_an_error_naming_the_line(
    tmp_path: Path, value: str, reason: str
) -> None:
    good = {"conversations": [{"from": "human", "value": "hello"}]}
    bad = {
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "function_call", "value": value},
            {"from": "observation", "value": "r"},
        ]
    }
    first, error = read(tmp_path, good, bad)
    assert isinstance(first, PromptRecord)
    assert isinstance(error, InputError)
    assert error.line == 2
    assert reason in error.reason


def test_an_observation_with_no_call_to_answer_is_an_error(tmp_path: Path) -> None:
    row = {
        "conversations": [
            {"from": "human", "value": "hi"},
            {"from": "function_call", "value": json.dumps(call("f", {}))},
            {"from": "observation", "value": "one"},
            {"from": "observation", "value": "two"},
        ]
    }
    (error,) = read(tmp_path, row)
    assert isinstance(error, InputError)
    assert error.line == 1
    assert "conversations[3] is an observation with no function_call" in error.reason
