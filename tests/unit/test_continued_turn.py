"""A row's continue_final_message (issue 31): read as SGLang's request model reads it, its final
assistant turn left out of the prompt turns and kept as the prefix SGLang appends, the last
boundary's alone in `--turns each`, refused by `--turns all`, appended as SGLang appends it, and
recorded in the exports. Every boundary's ids against SGLang's own code: the oracle tests."""

from __future__ import annotations

import dataclasses
import json
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from app.core.contracts import PromptRecord, SamplingParams
from app.core.errors import InputError
from app.ledger import reads, run_queries
from app.outputs.export import assistant_turn, specforge_row
from app.prompts.chat_path import ChatInputs
from app.prompts.inputs import read_prompts
from app.prompts.tokenization import ChatTokenizer, load_tokenizer
from tests.support.chat_templates import deepseek_copy
from workers.intake.turns import boundary_records, first_turns

U = {"role": "user", "content": "What is 2 + 2?"}
A = {"role": "assistant", "content": "4"}
U2 = {"role": "user", "content": "And 3 + 3?"}
PREFIX = {"role": "assistant", "content": " The answer is"}
CALL = {
    "id": "c",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
}


def records(tmp_path: Path, *rows: Any, **kwargs: Any) -> list[PromptRecord | InputError]:
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return list(read_prompts(path, **kwargs))


def record(tmp_path: Path, row: Any, **kwargs: Any) -> PromptRecord:
    (entry,) = records(tmp_path, row, **kwargs)
    assert isinstance(entry, PromptRecord), entry
    return entry


@pytest.mark.parametrize("value", [True, 1, "yes", "true"])
def test_the_final_assistant_turn_becomes_the_prefix(tmp_path: Path, value: Any) -> None:
    """Every value SGLang's pydantic bool reads as true continues the final turn: the prompt
    turns leave it out, its text is the prefix, and the row's field stays its metadata."""
    got = record(tmp_path, {"messages": [U, A, U2, PREFIX], "continue_final_message": value})
    assert got.messages == [U, A, U2]
    assert got.assistant_prefix == " The answer is"
    assert got.conversation == [U, A, U2, PREFIX]
    assert got.metadata == {"continue_final_message": value}


@pytest.mark.parametrize("value", [False, 0, "no", None])
def test_false_renders_as_without_it(tmp_path: Path, value: Any) -> None:
    got = record(tmp_path, {"messages": [U, A], "continue_final_message": value})
    assert got.messages == [U] and got.assistant_prefix is None


def test_no_request_fields_keeps_it_as_metadata_only(tmp_path: Path) -> None:
    row = {"messages": [U, A], "continue_final_message": True}
    got = record(tmp_path, row, request_fields=False)
    assert got.messages == [U] and got.assistant_prefix is None
    assert got.metadata == {"continue_final_message": True}


def test_a_value_sglang_refuses_is_refused_naming_the_field(tmp_path: Path) -> None:
    row = {"messages": [U, A], "continue_final_message": "maybe"}
    good = {"messages": [U]}
    bad, kept = records(tmp_path, row, good)
    assert isinstance(bad, InputError) and bad.line == 1
    assert bad.reason == "continue_final_message must be true or false, not the JSON string 'maybe'"
    assert isinstance(kept, PromptRecord) and kept.line == 2


def test_an_answer_before_the_prefix_stays_an_answer(tmp_path: Path) -> None:
    """Two assistant turns in a row: only the last is continued (SGLang handles the final
    turn once), the one before it is history."""
    got = record(tmp_path, {"messages": [U, A, PREFIX], "continue_final_message": True})
    assert got.messages == [U, A] and got.assistant_prefix == " The answer is"


def test_a_turn_without_text_is_continued_as_empty(tmp_path: Path) -> None:
    """A final assistant turn with tool calls only: SGLang reads its null content as "", so
    the turn is left out and nothing is appended."""
    final = {"role": "assistant", "tool_calls": [CALL]}
    got = record(tmp_path, {"messages": [U, final], "continue_final_message": True})
    assert got.messages == [U] and got.assistant_prefix == ""


def test_a_final_user_turn_has_nothing_to_continue(tmp_path: Path) -> None:
    got = record(tmp_path, {"messages": [U, A, U2], "continue_final_message": True})
    assert got.messages == [U, A, U2] and got.assistant_prefix is None


def test_the_prefix_is_part_of_the_content_key(tmp_path: Path) -> None:
    rows = [
        {"messages": [U, A], "continue_final_message": True},
        {"messages": [U, {"role": "assistant", "content": "5"}], "continue_final_message": True},
        {"messages": [U]},
    ]
    keys = {entry.key for entry in records(tmp_path, *rows) if isinstance(entry, PromptRecord)}
    assert len(keys) == 3


def test_only_the_last_boundary_is_continued(tmp_path: Path) -> None:
    got = record(tmp_path, {"messages": [U, A, U2, PREFIX], "continue_final_message": True})
    failed: list[InputError] = []
    out, turns = boundary_records([got], failed.append)
    assert not failed and turns == [0, 1]
    assert [(r.messages, r.assistant_prefix) for r in out] == [
        ([U], None),
        ([U, A, U2], " The answer is"),
    ]


def test_turns_all_refuses_a_continued_row(tmp_path: Path) -> None:
    got = record(tmp_path, {"messages": [U, A, U2, PREFIX], "continue_final_message": True})
    failed: list[InputError] = []
    assert first_turns([got], {}, failed.append) == []
    (error,) = failed
    assert error.line == 1
    assert "--turns all regenerates every assistant turn" in error.reason
    assert "--turns last or each" in error.reason and "--no-request-fields" in error.reason


@pytest.fixture(scope="module")
def deepseek(tmp_path_factory: pytest.TempPathFactory) -> ChatTokenizer:
    """DeepSeek's tokenizer set to add its BOS when encoding (`add_bos_token`)."""
    folder = deepseek_copy(tmp_path_factory.mktemp("bos") / "deepseek", add_bos_token=True)
    return load_tokenizer(folder)


def test_the_prefix_is_appended_without_its_bos(deepseek: ChatTokenizer) -> None:
    """The prefix's ids follow the generation prompt: encoded with the tokenizer's special
    tokens (DeepSeek's adds a BOS), the leading BOS dropped; the turns are rendered as given."""
    hf = deepseek.hf_tokenizer
    assert hf.encode(" The answer is")[0] == hf.bos_token_id
    base = deepseek.apply([U])
    (continued, empty) = deepseek.apply_each(
        [
            ChatInputs([U], assistant_prefix=" The answer is"),
            ChatInputs([U], assistant_prefix=""),
        ]
    )
    assert continued == base + hf.encode(" The answer is", add_special_tokens=False)
    assert empty == base


def run_info() -> run_queries.RunInfo:
    settings = run_queries.GenerationSettings("/t", "a", "b", {}, SamplingParams(), 1, None, [])
    return run_queries.RunInfo(1, "r", settings, None, datetime.now(UTC))


def test_the_exports_record_the_prefix(deepseek: ChatTokenizer) -> None:
    """A continued sample's rows name the prefix; its conversation's answer starts with it
    (the model wrote only the rest)."""
    hf = deepseek.hf_tokenizer
    output = hf.encode(" four.", add_special_tokens=False)
    item = reads.StoredItem(
        1, "k", 0, "done", [U], [1, 2], output, "length", len(output), 1, "s", None, 0.1
    )
    continued = dataclasses.replace(item, assistant_prefix=" The answer is")
    assert "assistant_prefix" not in specforge_row(item)
    assert specforge_row(continued)["assistant_prefix"] == " The answer is"
    turn = assistant_turn(continued, run_info(), deepseek)
    assert turn["content"] == " The answer is" + deepseek.decode(output)


def test_a_declared_response_template_refuses_a_continued_turn_here(tmp_path: Path) -> None:
    """SGLang's response-template reasoning parsers (read from the tokenizer's
    response_template) put an answer opener before the continued text: rendered here, such a
    prompt is refused naming --render-with; the other prompts of the batch are rendered."""
    folder = deepseek_copy(tmp_path / "templated", response_template={"type": "object"})
    tokenizer = load_tokenizer(folder)
    continued, plain = tokenizer.apply_each(
        [ChatInputs([U], assistant_prefix=" The"), ChatInputs([U], assistant_prefix="")]
    )
    assert isinstance(continued, InputError) and "--render-with" in continued.reason
    assert plain == tokenizer.apply([U])
