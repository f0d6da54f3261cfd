"""Every rule of app.prompts.chat_path against SGLang 0.5.23's own functions from its wheel (content
format detection, content processing, tool-call arguments, tool results), and the rules read
from its request models (tool and tool-call shapes, template kwargs) against hand examples."""

from __future__ import annotations

import copy
import json
from typing import Any, Literal

import pytest

from app.core.constants import NORMALIZATION_VERSION
from app.core.errors import ConfigurationError, InputError
from app.ledger import queue
from app.prompts.chat_path import (
    bare_function_tools,
    check_reasoning_effort,
    check_version,
    final_assistant_as_user,
    merge_template_kwargs,
    normalize_messages,
    parse_tools,
    resolve_reasoning_aliases,
)
from app.prompts.template_reading import detect_content_format
from emulator.fixtures.kimi import CHAT_TEMPLATE
from tests.support import sglang_chat_path as sglang

# --- content format -------------------------------------------------------------------------

TEMPLATES = {
    "plain string": "{% for message in messages %}{{ message['content'] }}{% endfor %}",
    "loop by key": (
        "{% for message in messages %}{% for part in message['content'] %}"
        "{{ part['text'] }}{% endfor %}{% endfor %}"
    ),
    "loop by attribute": (
        "{% for message in messages %}{% for p in message.content %}{{ p.text }}{% endfor %}"
        "{% endfor %}"
    ),
    "msg variable": "{% for msg in messages %}{% for p in msg.content %}x{% endfor %}{% endfor %}",
    "m variable, filtered": (
        "{% for m in messages %}{% for p in m['content'] | list %}x{% endfor %}{% endfor %}"
    ),
    "sliced": "{% for message in messages %}{% for p in message.content[1:] %}x{% endfor %}"
    "{% endfor %}",
    "other variable name": (
        "{% for turn in messages %}{% for p in turn['content'] %}x{% endfor %}{% endfor %}"
    ),
    "loop over messages only": "{% for message in messages %}{{ message.role }}{% endfor %}",
    "mentions an image": "{{ messages[0]['content'] }}{# image placeholder #}",
    "does not parse": "{% for message in messages %}{{ message['content'] }",
    "generation tag": (
        "{% for message in messages %}{% generation %}{{ message['content'] }}"
        "{% endgeneration %}{% endfor %}"
    ),
    "kimi fixture": CHAT_TEMPLATE,
}


@pytest.mark.parametrize("name", list(TEMPLATES))
def test_content_format_is_sglangs(name: str) -> None:
    template = TEMPLATES[name]
    assert detect_content_format(template) == sglang.detect_content_format(template)


def test_content_format_examples() -> None:
    assert detect_content_format(TEMPLATES["plain string"]) == "string"
    assert detect_content_format(TEMPLATES["loop by key"]) == "openai"
    assert detect_content_format(TEMPLATES["other variable name"]) == "string"
    assert detect_content_format(TEMPLATES["mentions an image"]) == "openai"
    assert detect_content_format(TEMPLATES["does not parse"]) == "string"
    assert detect_content_format(None) == "string"


# --- messages -------------------------------------------------------------------------------


def call(arguments: Any, call_id: str | None = "c1", index: int | None = None) -> dict[str, Any]:
    """A tool call as SGLang's ToolCall model dumps it."""
    return {
        "id": call_id,
        "index": index,
        "type": "function",
        "function": {"name": "get_weather", "arguments": arguments},
    }


TEXT_PARTS = [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]
CONVERSATIONS: dict[str, list[dict[str, Any]]] = {
    "plain": [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello!"},
        {"role": "user", "content": "Weather?"},
    ],
    "tool call with string arguments": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call('{"city": "Paris"}')]},
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
    ],
    "tool call with object arguments and reasoning": [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "Let me look.",
            "reasoning_content": "Use the tool.",
            "tool_calls": [call({"city": "Paris", "days": [1, 2]}), call("{}", "c2", 1)],
        },
        {"role": "tool", "content": "18C", "tool_call_id": "c1"},
        {"role": "tool", "content": "none", "tool_call_id": "c2"},
    ],
    "None-valued keys": [
        {"role": "user", "content": "Hi", "name": None},
        {"role": "assistant", "content": "Yo", "reasoning_content": None, "tool_calls": None},
        {"role": "user", "content": "Again", "weight": None, "source": "x"},
    ],
    "content parts": [
        {"role": "system", "content": TEXT_PARTS},
        {"role": "user", "content": TEXT_PARTS},
        {"role": "assistant", "content": None, "tool_calls": [call('{"a": 1}')]},
        {"role": "tool", "content": TEXT_PARTS, "tool_call_id": "c1"},
        {"role": "user", "content": [{"type": "text", "text": "more"}]},
    ],
    "empty parts": [{"role": "user", "content": []}, {"role": "tool", "content": []}],
    "tool turn with one part": [{"role": "tool", "content": [TEXT_PARTS[0]], "name": "f"}],
    "tool calls on a non-assistant turn": [
        {"role": "user", "content": "x", "tool_calls": [call('{"kept": "as a string"}')]}
    ],
}
CASES = [(name, fmt) for name in CONVERSATIONS for fmt in ("string", "openai")]


@pytest.mark.parametrize(("name", "fmt"), CASES)
def test_messages_are_sglangs(name: str, fmt: Any) -> None:
    turns = CONVERSATIONS[name]
    original = copy.deepcopy(turns)
    ours = normalize_messages(turns, fmt)
    assert ours == sglang.reference_messages(turns, fmt)
    # key order too: a template that iterates over a turn or dumps it renders in this order
    assert [list(t) for t in ours] == [list(t) for t in sglang.reference_messages(turns, fmt)]
    assert turns == original  # the input is not changed


@pytest.mark.parametrize(("name", "fmt"), CASES)
def test_normalizing_twice_changes_nothing(name: str, fmt: Any) -> None:
    once = normalize_messages(CONVERSATIONS[name], fmt)
    assert normalize_messages(once, fmt) == once


def test_content_parts_by_format() -> None:
    turns = [{"role": "user", "content": TEXT_PARTS}, {"role": "tool", "content": TEXT_PARTS}]
    assert normalize_messages(turns, "string") == [
        {"role": "user", "content": "first second"},
        {"role": "tool", "content": "first second"},
    ]
    assert normalize_messages(turns, "openai") == [
        {"role": "user", "content": TEXT_PARTS},
        {"role": "tool", "content": "first second"},
    ]


def test_tool_calls_take_sglangs_shape() -> None:
    """protocol.py's ToolCall: id, index, type "function", function {name, arguments}; keys it
    does not declare are not kept."""
    given = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c9", "function": {"name": "f", "arguments": "{}", "x": 1}, "y": 2}],
    }
    (turn,) = normalize_messages([given], "string")
    assert turn == {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {
                "id": "c9",
                "index": None,
                "type": "function",
                "function": {"name": "f", "arguments": {}},
            }
        ],
    }


@pytest.mark.parametrize(
    ("arguments", "reason"),
    [("{not json", "is not valid JSON"), ("[1, 2]", "must hold a JSON object"), ('"x"', "object")],
)
def test_bad_tool_call_arguments_name_the_field(arguments: str, reason: str) -> None:
    turns = [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": None, "tool_calls": [call(arguments)]},
    ]
    with pytest.raises(InputError, match=reason) as caught:
        normalize_messages(turns, "string", field="conversations")
    assert caught.value.reason.startswith("conversations[1].tool_calls[0].function.arguments ")
    # SGLang refuses the same arguments (a 400)
    with pytest.raises(ValueError, match=r"function\.arguments must be"):
        sglang.reference_messages(turns, "string")


@pytest.mark.parametrize(
    ("turn", "field"),
    [
        ({"role": "user", "content": [{"type": "video_url", "video_url": "x"}]}, "content[0]"),
        (
            {"role": "assistant", "tool_calls": [{"id": "c", "function": "f"}]},
            "tool_calls[0].function",
        ),
        ({"role": "assistant", "tool_calls": [call("{}", call_id=7)]}, "tool_calls[0].id"),
        (
            {"role": "assistant", "tool_calls": [{"type": "code", "function": {}}]},
            "tool_calls[0].type",
        ),
    ],
)
def test_unusable_turns_name_the_field(turn: dict[str, Any], field: str) -> None:
    with pytest.raises(InputError) as caught:
        normalize_messages([turn], "openai")
    assert caught.value.reason.startswith(f"messages[0].{field} ")


def test_final_assistant_turn_becomes_a_user_turn() -> None:
    turns = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a", "name": "n"}]
    assert final_assistant_as_user(turns) == [
        {"role": "user", "content": "q"},
        {"role": "user", "content": "a"},
    ]
    parts = [{"role": "assistant", "content": TEXT_PARTS}]
    assert final_assistant_as_user(parts) == parts


# --- reasoning aliases ------------------------------------------------------------------------


@pytest.mark.parametrize("alias", ["reasoning", "thinking"])
def test_reasoning_aliases(alias: str) -> None:
    turn = {"role": "assistant", alias: "think first", "content": "a"}
    assert resolve_reasoning_aliases(turn) == {
        "role": "assistant",
        "content": "a",
        "reasoning_content": "think first",
    }
    same = {**turn, "reasoning_content": "think first"}
    assert resolve_reasoning_aliases(same)["reasoning_content"] == "think first"
    with pytest.raises(InputError, match=f"reasoning_content and {alias}"):
        resolve_reasoning_aliases({**turn, "reasoning_content": "other"}, "messages[1]")
    assert resolve_reasoning_aliases({"role": "assistant", alias: None, "content": "a"}) == {
        "role": "assistant",
        "content": "a",
    }


# --- tools ------------------------------------------------------------------------------------

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}},
    },
}


def test_tools_as_list_or_json_string() -> None:
    as_list = parse_tools([WEATHER])
    assert as_list == parse_tools(json.dumps([WEATHER]))
    assert as_list == [
        {
            "type": "function",
            "function": WEATHER["function"],
            "defer_loading": None,  # Tool.model_dump() keeps its null field
        }
    ]
    for nothing in (None, [], "", "  ", "null"):
        assert parse_tools(nothing) is None


def test_tool_shape_keeps_the_given_key_order() -> None:
    """protocol.py's Function serializer: the client's key order, then the fields it left
    out (description and parameters as null); strict / defer_loading only when given."""
    tool = {"function": {"parameters": {}, "name": "f", "strict": True, "examples": [1]}}
    (out,) = parse_tools([tool]) or []
    assert list(out["function"].items()) == [
        ("parameters", {}),
        ("name", "f"),
        ("strict", True),
        ("description", None),
    ]
    assert out["type"] == "function"
    deferred = parse_tools([{"function": {"name": "g"}, "defer_loading": True}]) or []
    assert deferred[0]["function"] == {
        "name": "g",
        "description": None,
        "parameters": None,
        "defer_loading": True,
    }


@pytest.mark.parametrize(
    ("value", "reason"),
    [
        ("[{not json", "'tools' is a string that is not valid JSON"),
        ({"type": "function"}, "'tools' must be a list of tools"),
        ([{"type": "function"}], "tools[0] has no 'function' object"),
        ([{"function": {"description": "no name"}}], "tools[0].function.name must be a string"),
        ([WEATHER, {"function": {"name": "f", "strict": "yes"}}], "tools[1].function.strict"),
    ],
)
def test_bad_tools_name_the_field(value: Any, reason: str) -> None:
    with pytest.raises(InputError, match=reason.replace("[", r"\[")):
        parse_tools(value)


def test_bare_function_tools() -> None:
    tools = parse_tools([WEATHER]) or []
    assert bare_function_tools(tools) == [WEATHER["function"]]
    assert bare_function_tools(None) is None


def test_tools_hash_follows_key_order() -> None:
    reordered = {"function": WEATHER["function"], "type": "function"}
    assert queue.tools_hash([WEATHER]) != queue.tools_hash([reordered])
    assert queue.tools_hash([WEATHER]) == queue.tools_hash(json.loads(json.dumps([WEATHER])))


# --- template kwargs --------------------------------------------------------------------------


def test_row_kwargs_merge_over_the_runs() -> None:
    run = {"thinking": True, "style": "terse"}
    assert merge_template_kwargs(run, {"thinking": False}) == {"thinking": False, "style": "terse"}
    assert merge_template_kwargs(run, None) == run
    assert merge_template_kwargs(None, None) == {}


def test_reasoning_effort_as_sglang_applies_it() -> None:
    """protocol.py: a request's reasoning_effort defaults thinking and enable_thinking to
    effort != "none"; serving_chat.py passes it as the template variable, a
    chat_template_kwargs reasoning_effort taking its place."""
    assert merge_template_kwargs({}, None, "none") == {
        "thinking": False,
        "enable_thinking": False,
        "reasoning_effort": "none",
    }
    assert merge_template_kwargs({"thinking": False}, None, "high") == {
        "thinking": False,
        "enable_thinking": True,
        "reasoning_effort": "high",
    }
    assert merge_template_kwargs({}, {"reasoning_effort": "low"}, "high")["reasoning_effort"] == (
        "low"
    )
    assert merge_template_kwargs({}, {"reasoning_effort": "low"}) == {"reasoning_effort": "low"}


def test_reasoning_effort_values() -> None:
    assert check_reasoning_effort("max") == "max"
    assert check_reasoning_effort(0.5) == 0.5
    assert check_reasoning_effort(None) is None
    for bad in ("extreme", 1.5, True):
        with pytest.raises(InputError, match="'reasoning_effort' must be one of"):
            check_reasoning_effort(bad)


# --- versions ---------------------------------------------------------------------------------


def test_only_known_versions_pass() -> None:
    assert check_version(NORMALIZATION_VERSION) == NORMALIZATION_VERSION
    with pytest.raises(ConfigurationError, match="before tokenmill pinned"):
        check_version(None, run="old")
    with pytest.raises(ConfigurationError, match=r"'sglang-9\.9\.9\.1', which this tokenmill"):
        check_version("sglang-9.9.9.1", run="future")


def test_a_turns_own_tools_must_be_a_list_as_in_sglangs_request_model() -> None:
    system = {"role": "system", "content": "Use them.", "tools": '[{"type": "function"}]'}
    with pytest.raises(InputError, match=r"^messages\[0\]\.tools must be a list of tools, not"):
        normalize_messages([system, {"role": "user", "content": "Hi"}], "string")
    # a user turn's tools are no field of its request model: dropped, as SGLang drops them
    user = {"role": "user", "content": "Hi", "tools": "not a list"}
    assert normalize_messages([user], "string") == [{"role": "user", "content": "Hi"}]


@pytest.mark.parametrize("content_format", ["string", "openai"])
def test_a_thinking_part_is_checked_and_left_out_as_sglang_leaves_it_out(
    content_format: Literal["string", "openai"],
) -> None:
    parts = [{"type": "reasoning", "text": "Greet."}, {"type": "text", "text": "Hello!"}]
    turns = normalize_messages([{"role": "assistant", "content": parts}], content_format)
    text = "Hello!" if content_format == "string" else [{"type": "text", "text": "Hello!"}]
    assert turns == [{"role": "assistant", "content": text}]
    with pytest.raises(InputError, match="only valid in assistant messages"):
        normalize_messages([{"role": "user", "content": parts}], content_format)
    both = [{"type": "thinking", "thinking": "a", "text": "b"}]
    with pytest.raises(InputError, match=r"messages\[0\]\.content\[0\]: .*exactly one of"):
        normalize_messages([{"role": "assistant", "content": both}], content_format)
