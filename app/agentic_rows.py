"""A deterministic corpus of agentic prompt rows covering every case issue 12 names.

Used by the tests, the demo of `--turns each` and the enqueue benchmark (any number of rows).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from typing import Any

Row = dict[str, Any]

CITIES = ("Paris", "Oslo", "Lima", "Osaka", "Cairo", "Quito", "Perth", "Accra")
TOPICS = ("sorting", "caching", "queues", "parsing", "hashing", "retries", "logging", "paging")

WEATHER_TOOL: Row = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather of a city.",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}
SEARCH_TOOL: Row = {
    "type": "function",
    "function": {
        "name": "search_docs",
        "description": "Search the documentation.\nReturns the best matching passages.",
        "parameters": {
            "type": "object",
            "properties": {
                "query": {"type": "string"},
                "limit": {"type": "integer", "description": "How many passages"},
                "tags": {"type": "array", "items": {"type": "string"}},
            },
            "required": ["query"],
        },
    },
}


def _call(call_id: str, name: str, arguments: Any) -> Row:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _weather_chat(i: int, city: str, topic: str) -> Row:
    """tools list, object arguments, content null, a trailing tool turn."""
    return {
        "tools": [WEATHER_TOOL],
        "messages": [
            {"role": "user", "content": f"What is the weather in {city} today? ({i})"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call(f"w{i}", "get_weather", {"city": city, "unit": "celsius"})],
            },
            {"role": "tool", "tool_call_id": f"w{i}", "content": f"{10 + i % 20} C, clear"},
        ],
    }


def _string_arguments(i: int, city: str, topic: str) -> Row:
    """tools as a JSON string, string arguments, an answer, then a trailing user turn."""
    arguments = json.dumps({"query": f"{topic} guide", "limit": 3})
    return {
        "tools": json.dumps([SEARCH_TOOL]),
        "messages": [
            {"role": "system", "content": "You are a careful assistant."},
            {"role": "user", "content": f"Find docs about {topic} ({i})."},
            {
                "role": "assistant",
                "content": "",
                "tool_calls": [_call(f"s{i}", "search_docs", arguments)],
            },
            {"role": "tool", "tool_call_id": f"s{i}", "content": f"3 passages about {topic}"},
            {"role": "assistant", "content": f"I found three passages on {topic}."},
            {"role": "user", "content": "Summarize the first one."},
        ],
    }


def _text_parts(i: int, city: str, topic: str) -> Row:
    """content and tool results given as lists of text parts."""
    return {
        "tools": [WEATHER_TOOL, SEARCH_TOOL],
        "messages": [
            {
                "role": "user",
                "content": [
                    {"type": "text", "text": f"Two questions ({i}):"},
                    {"type": "text", "text": f"weather in {city}?"},
                ],
            },
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [_call(f"p{i}", "get_weather", {"city": city})],
            },
            {
                "role": "tool",
                "tool_call_id": f"p{i}",
                "content": [{"type": "text", "text": "Rain,"}, {"type": "text", "text": "8 C"}],
            },
        ],
    }


def _reasoning(field: str) -> Callable[[int, str, str], Row]:
    def row(i: int, city: str, topic: str) -> Row:
        """reasoning in history (reasoning_content, or the vLLM-style aliases)."""
        return {
            "tools": [SEARCH_TOOL],
            "messages": [
                {"role": "user", "content": f"Explain {topic} briefly ({i})."},
                {
                    "role": "assistant",
                    field: f"The user wants {topic}; search first.",
                    "content": None,
                    "tool_calls": [_call(f"r{i}", "search_docs", {"query": topic})],
                },
                {"role": "tool", "tool_call_id": f"r{i}", "content": f"{topic}: a short passage"},
                {
                    "role": "assistant",
                    field: "The passage is enough.",
                    "content": f"{topic.capitalize()} in one line.",
                },
                {"role": "user", "content": "Now give an example."},
            ],
        }

    return row


def _kwargs(thinking: bool) -> Callable[[int, str, str], Row]:
    def row(i: int, city: str, topic: str) -> Row:
        """per-row chat_template_kwargs (thinking on or off) and metadata fields."""
        return {
            "chat_template_kwargs": {"thinking": thinking},
            "source": "agentic-corpus",
            "category": "thinking" if thinking else "no-thinking",
            "difficulty": i % 3,
            "messages": [
                {"role": "user", "content": f"Is {city} north of the equator? ({i})"},
                {
                    "role": "assistant",
                    "content": "Let me think.",
                    "reasoning_content": "Geography.",
                },
                {"role": "user", "content": "Answer in one word."},
            ],
        }

    return row


def _sharegpt(i: int, city: str, topic: str) -> Row:
    """ShareGPT function_call / observation turns with a tools string (LLaMA-Factory)."""
    return {
        "tools": json.dumps([WEATHER_TOOL["function"]]),
        "conversations": [
            {"from": "human", "value": f"Weather in {city} and Lima? ({i})"},
            {
                "from": "function_call",
                "value": json.dumps(
                    [
                        {"name": "get_weather", "arguments": {"city": city}},
                        {"name": "get_weather", "arguments": {"city": "Lima"}},
                    ]
                ),
            },
            {"from": "observation", "value": "15 C"},
            {"from": "observation", "value": "22 C"},
            {"from": "gpt", "value": f"{city} 15 C, Lima 22 C."},
            {"from": "human", "value": "Which is warmer?"},
        ],
    }


def _long_chat(i: int, city: str, topic: str) -> Row:
    """a multi-turn chat with several assistant turns and tool rounds, trailing tool turn."""
    turns: list[Row] = [{"role": "system", "content": f"Project notes on {topic}."}]
    for k in range(3):
        turns.append({"role": "user", "content": f"Step {k} of {topic} for run {i}?"})
        turns.append(
            {
                "role": "assistant",
                "content": f"Checking step {k}.",
                "tool_calls": [
                    _call(
                        f"l{i}_{k}", "search_docs", {"query": f"{topic} step {k}", "tags": [topic]}
                    )
                ],
            }
        )
        turns.append({"role": "tool", "tool_call_id": f"l{i}_{k}", "content": f"step {k}: done"})
        turns.append({"role": "assistant", "content": f"Step {k} is done."})
    turns.append({"role": "user", "content": "And the last step?"})
    turns.append(
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [_call(f"l{i}_9", "search_docs", {"query": "last step"})],
        }
    )
    turns.append(
        {"role": "tool", "tool_call_id": f"l{i}_9", "content": "the last step is a review"}
    )
    return {"tools": [SEARCH_TOOL], "metadata_note": f"long-{i}", "messages": turns}


CASES: tuple[Callable[[int, str, str], Row], ...] = (
    _weather_chat,
    _string_arguments,
    _text_parts,
    _reasoning("reasoning_content"),
    _reasoning("reasoning"),
    _reasoning("thinking"),
    _kwargs(True),
    _kwargs(False),
    _sharegpt,
    _long_chat,
)
"""One builder per case; row i uses case i % len(CASES)."""


def agentic_rows(count: int = 4 * len(CASES), *, prefix: str = "agentic") -> Iterator[Row]:
    """count distinct rows (ids `{prefix}-{i}`), cycling through every case in CASES."""
    for i in range(count):
        case = CASES[i % len(CASES)]
        row = case(i, CITIES[i % len(CITIES)], TOPICS[(i // len(CASES)) % len(TOPICS)])
        yield {"id": f"{prefix}-{i}", **row}
