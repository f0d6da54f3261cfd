"""The pure parts of on-policy agentic chains: which parser a run gets, how a conversation with
tool turns is split, and each way a regenerated turn meets the dataset's cached results."""

from __future__ import annotations

import json
from typing import Any

import pytest

from app.core import constants
from app.core.contracts import PromptRecord
from app.core.errors import InputError
from app.prompts import tool_calls
from app.prompts.conversation import split_turns
from workers.intake import turns


def _tool(name: str) -> dict[str, Any]:
    schema = {"type": "object", "properties": {"q": {"type": "string"}}}
    return {"type": "function", "function": {"name": name, "parameters": schema}}


TOOLS = [_tool("search"), _tool("fetch")]


def _call(name: str, call_id: str) -> dict[str, Any]:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": "{}"}}


CONVERSATION: list[dict[str, Any]] = [
    {"role": "user", "content": "go"},
    {"role": "assistant", "content": "", "tool_calls": [_call("search", "a")]},
    {"role": "tool", "tool_call_id": "a", "content": "found"},
    {"role": "assistant", "content": "", "tool_calls": [_call("fetch", "b"), _call("search", "c")]},
    {"role": "tool", "tool_call_id": "c", "content": "second"},
    {"role": "tool", "tool_call_id": "b", "content": "page"},
    {"role": "assistant", "content": "done"},
]


def _hermes(*names: str) -> dict[str, Any]:
    calls = [json.dumps({"name": n, "arguments": {"q": "x"}}) for n in names]
    text = "".join(f"<tool_call>{c}</tool_call>" for c in calls)
    return {"role": "assistant", "content": text, "reasoning_content": "hm"}


def test_the_parser_is_the_flag_else_sglangs_kimi_rule() -> None:
    assert tool_calls.choose_parser(None, {"<|tool_calls_section_begin|>", "a"}) == "kimi_k2"
    assert tool_calls.choose_parser(None, {"<tool_call>"}) is None
    # an earlier SGLang rule names a parser not implemented here (gpt-oss): none
    kimi = {"<|tool_calls_section_begin|>"}
    assert tool_calls.choose_parser(None, kimi, "{{ x }}<|channel|>") is None
    assert tool_calls.detected_parser("{{ x }}<|channel|>", kimi) == "gpt-oss"
    assert tool_calls.choose_parser("qwen", set()) == "qwen25"
    with pytest.raises(InputError, match="not supported"):
        tool_calls.choose_parser("glm45", set())


def test_a_tool_conversation_keeps_each_call_turn_for_the_turn_after_it() -> None:
    plans = split_turns(CONVERSATION, keep_calls=True)
    assert [p.context[0]["role"] for p in plans] == ["user", "assistant", "assistant"]
    assert [t["role"] for t in plans[2].context] == ["assistant", "tool", "tool"]
    names, results, rest = tool_calls.cached_results(plans[2].context)
    # by tool_call_id, not by position
    assert names == ["search", "fetch"] and [r["content"] for r in results] == ["second", "page"]
    assert rest == []
    # without keep_calls, the same turns a plain chain has
    assert [p.context for p in split_turns(CONVERSATION)][1] == [CONVERSATION[2]]


def test_each_way_a_turn_meets_the_cached_results() -> None:
    plans = split_turns(CONVERSATION, keep_calls=True)
    history = plans[0].context

    def step(message: dict[str, Any], plan: int = 1) -> tool_calls.ChainStep:
        return tool_calls.chain_step("hermes", message, TOOLS, history, plans[plan].context, "k")

    going = step(_hermes("search"))
    assert going.ending is None
    message, result = going.turns
    regenerated = message["tool_calls"][0]["id"]
    assert result == {**CONVERSATION[2], "tool_call_id": regenerated}
    assert message["content"] == "" and message["reasoning_content"] == "hm"
    assert step(_hermes("fetch")).ending == constants.CHAIN_END_OTHER_TOOL
    assert step(_hermes("search", "search")).ending == constants.CHAIN_END_PARALLEL_CALLS
    assert step({"role": "assistant", "content": "no"}).ending == constants.CHAIN_END_NO_CALL
    broken = {"role": "assistant", "content": "<tool_call>{</tool_call>"}
    assert step(broken).ending == constants.CHAIN_END_MALFORMED_CALL
    # the dataset's own calls were parallel: its results answer two calls, not one
    assert step(_hermes("search"), 2).ending == constants.CHAIN_END_PARALLEL_CALLS
    assert tool_calls.final_ending("hermes", "done", TOOLS) == constants.CHAIN_END_COMPLETE
    exhausted = tool_calls.final_ending("hermes", _hermes("search")["content"], TOOLS)
    assert exhausted == constants.CHAIN_END_RESULTS_EXHAUSTED


def test_parallel_calls_in_order_go_on_when_they_match_the_datasets_one_by_one() -> None:
    plans = split_turns(CONVERSATION, keep_calls=True)
    history = [*plans[0].context, {"role": "assistant", "content": ""}, CONVERSATION[2]]

    def step(message: dict[str, Any], plan: int = 2) -> tool_calls.ChainStep:
        return tool_calls.chain_step(
            "hermes", message, TOOLS, history, plans[plan].context, "k", "in-order"
        )

    # the dataset called fetch (b) then search (c), and answered c first
    going = step(_hermes("fetch", "search"))
    assert going.ending is None
    message, *results = going.turns
    fetch_id, search_id = (c["id"] for c in message["tool_calls"])
    assert [c["function"]["name"] for c in message["tool_calls"]] == ["fetch", "search"]
    assert fetch_id != search_id
    assert results == [
        {**CONVERSATION[4], "tool_call_id": search_id},
        {**CONVERSATION[5], "tool_call_id": fetch_id},
    ]
    assert step(_hermes("search", "fetch")).ending == constants.CHAIN_END_OTHER_TOOL
    assert step(_hermes("fetch")).ending == constants.CHAIN_END_PARALLEL_CALLS
    assert step(_hermes("fetch", "search", "search")).ending == constants.CHAIN_END_PARALLEL_CALLS
    assert step({"role": "assistant", "content": "no"}).ending == constants.CHAIN_END_NO_CALL
    # one call against one result is read as without the option; two against one end it
    assert step(_hermes("search"), 1).ending is None
    assert step(_hermes("search", "search"), 1).ending == constants.CHAIN_END_PARALLEL_CALLS
    # without the option, parallel calls end the chain however well they match
    ended = tool_calls.chain_step(
        "hermes", _hermes("fetch", "search"), TOOLS, history, plans[2].context, "k"
    )
    assert ended.ending == constants.CHAIN_END_PARALLEL_CALLS


def test_tool_rows_without_a_parser_are_refused_with_the_flag_named() -> None:
    record = PromptRecord(line=7, key="r", messages=CONVERSATION[:1], conversation=CONVERSATION)
    errors: list[InputError] = []
    plans: dict[str, Any] = {}
    assert turns.first_turns([record], plans, errors.append, None) == []
    assert errors[0].line == 7 and "--tool-call-parser" in errors[0].reason
    kept = turns.first_turns([record], plans, errors.append, "hermes")
    assert len(kept) == 1 and len(plans["r"]) == 3
