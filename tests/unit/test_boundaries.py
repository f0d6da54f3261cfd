"""Boundary samples (`--turns each`): one prompt per assistant turn on the original history,
plus one for a trailing user or tool turn; and the turns that `--turns all` refuses."""

from __future__ import annotations

import itertools
from typing import Any

import pytest

from app.core.errors import InputError
from app.prompts.conversation import split_boundaries, tool_turn_position

SYSTEM = {"role": "system", "content": "You are terse."}
USER1 = {"role": "user", "content": "What is the weather in Paris?"}
CALL: dict[str, Any] = {
    "role": "assistant",
    "content": None,
    "reasoning_content": "I should look it up.",
    "tool_calls": [
        {
            "id": "call_0",
            "type": "function",
            "function": {"name": "weather", "arguments": '{"city": "Paris"}'},
        }
    ],
}
RESULT = {"role": "tool", "tool_call_id": "call_0", "content": '{"temp": 18}'}
ANSWER = {"role": "assistant", "content": "18 degrees."}
USER2 = {"role": "user", "content": "And tomorrow?"}
ANSWER2 = {"role": "assistant", "content": "No idea."}


def shape(messages: list[dict[str, Any]]) -> list[tuple[int, list[str]]]:
    return [(b.index, [t["role"] for t in b.messages]) for b in split_boundaries(messages)]


def test_one_boundary_per_assistant_turn_on_the_original_history() -> None:
    conversation = [SYSTEM, USER1, ANSWER, USER2, ANSWER2]
    boundaries = split_boundaries(conversation)
    assert [b.index for b in boundaries] == [0, 1]
    assert boundaries[0].messages == [SYSTEM, USER1]
    # the earlier assistant turn is the dataset's own, not a regenerated one
    assert boundaries[1].messages == [SYSTEM, USER1, ANSWER, USER2]


def test_tool_calls_and_tool_results_are_history_and_boundaries() -> None:
    conversation = [USER1, CALL, RESULT, ANSWER]
    boundaries = split_boundaries(conversation)
    assert [(b.index, len(b.messages)) for b in boundaries] == [(0, 1), (1, 3)]
    # the tool-calling turn reaches the later prompt as given: calls and reasoning kept
    assert boundaries[1].messages[1] == CALL
    assert boundaries[1].messages[2] == RESULT


def test_a_trailing_user_turn_is_one_more_boundary() -> None:
    assert shape([SYSTEM, USER1, ANSWER, USER2]) == [
        (0, ["system", "user"]),
        (1, ["system", "user", "assistant", "user"]),
    ]


def test_a_trailing_tool_turn_is_one_more_boundary() -> None:
    assert shape([USER1, CALL, RESULT]) == [
        (0, ["user"]),
        (1, ["user", "assistant", "tool"]),
    ]


def test_a_single_user_turn_is_one_boundary() -> None:
    assert shape([SYSTEM, USER1]) == [(0, ["system", "user"])]


def test_many_assistant_turns_give_growing_prompts_shortest_first() -> None:
    conversation = [USER1, CALL, RESULT, CALL, RESULT, ANSWER, USER2, ANSWER2]
    boundaries = split_boundaries(conversation)
    assert [b.index for b in boundaries] == [0, 1, 2, 3]
    assert [len(b.messages) for b in boundaries] == [1, 3, 5, 7]
    for earlier, later in itertools.pairwise(boundaries):
        assert later.messages[: len(earlier.messages)] == earlier.messages


def test_boundaries_are_copies_of_the_input_turns() -> None:
    conversation = [USER1, ANSWER, USER2]
    boundaries = split_boundaries(conversation)
    boundaries[1].messages[0]["content"] = "changed"
    assert USER1["content"] == "What is the weather in Paris?"


@pytest.mark.parametrize(
    ("conversation", "prompts"),
    [
        ([SYSTEM, ANSWER, USER1], [[SYSTEM], [SYSTEM, ANSWER, USER1]]),
        ([USER1, ANSWER, ANSWER2], [[USER1], [USER1, ANSWER]]),
        ([SYSTEM], [[SYSTEM]]),
        ([USER1, ANSWER, SYSTEM], [[USER1], [USER1, ANSWER, SYSTEM]]),
        ([ANSWER, USER1, ANSWER2], [[ANSWER, USER1]]),
    ],
)
def test_every_shape_sglang_renders_has_its_boundaries(
    conversation: list[dict[str, Any]], prompts: list[list[dict[str, Any]]]
) -> None:
    assert [b.messages for b in split_boundaries(conversation)] == prompts


@pytest.mark.parametrize("conversation", [[], [ANSWER, ANSWER2]])
def test_no_turn_before_the_answers_is_no_boundary(conversation: list[dict[str, Any]]) -> None:
    with pytest.raises(InputError, match="no turn before its first assistant turn"):
        split_boundaries(conversation)


def test_the_first_tool_turn_or_tool_call_is_found() -> None:
    assert tool_turn_position([SYSTEM, USER1, ANSWER, USER2]) is None
    assert tool_turn_position([USER1, CALL, RESULT]) == 1
    assert tool_turn_position([USER1, RESULT]) == 1
    assert tool_turn_position([USER1, {**ANSWER, "tool_calls": []}]) is None
