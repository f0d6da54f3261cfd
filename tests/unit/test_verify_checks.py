"""verify's checks on hand-made ledger rows (SQLite) with a fake tokenizer: how stop strings,
foreign stop ids and template failures are worded, and that examples stay bounded."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, cast

from sqlalchemy import Engine, insert

from app.core.contracts import Message
from app.core.errors import InputError
from app.ledger import common, run_queries
from app.outputs.verify import (
    CHECK_STOP,
    CHECK_TEMPLATE,
    EXAMPLES_PER_CHECK,
    tokenizer_findings,
    verify_run,
)
from app.prompts.chat_path import ChatInputs
from app.prompts.tokenization import ChatTokenizer
from tests.support.runs import make_run

EOS = 163586


class FakeTokenizer:
    """Templates a conversation as [len(turns), len(first content)]; "boom" breaks it."""

    path = Path("/fake")
    tokenizer_hash = "a" * 64
    chat_template_hash = "b" * 64

    def apply(
        self, messages: Sequence[Message], kwargs: Mapping[str, Any] | None = None
    ) -> list[int]:
        if messages[0]["content"] == "boom":
            raise InputError("chat template failed: boom")
        return [len(messages), len(messages[0]["content"])]

    def apply_batch(
        self, conversations: Sequence[Sequence[Message]], kwargs: Mapping[str, Any] | None = None
    ) -> list[list[int]]:
        return [self.apply(c, kwargs) for c in conversations]

    def changes_from(self, pinned_hash: str, pinned_files: Mapping[str, str] | None) -> list[str]:
        return [] if pinned_hash == self.tokenizer_hash else ["tokenizer files: hash differs"]

    def apply_each(self, batch: Sequence[ChatInputs]) -> list[list[int] | InputError]:
        out: list[list[int] | InputError] = []
        for inputs in batch:
            try:
                out.append(self.apply(inputs.messages, inputs.chat_template_kwargs))
            except InputError as exc:
                out.append(exc)
        return out


def add(engine: Engine, run_id: int, key: str, **values: Any) -> None:
    row: dict[str, Any] = {
        "run_id": run_id,
        "item_key": key,
        "sample_index": 0,
        "messages": [{"role": "user", "content": "hi"}],
        "prompt_ids": [1, 2],
        "prompt_tokens": 2,
        "status": "done",
        "attempts": 1,
        "output_ids": [7, EOS],
        "completion_tokens": 2,
        "finish_reason": "stop",
        "matched_stop": str(EOS),
        "created_at": common.utcnow(),
    }
    row.update(values)
    with engine.begin() as conn:
        conn.execute(insert(common.items).values(**row))


def run_with(engine: Engine) -> run_queries.RunInfo:
    with engine.begin() as conn:
        return make_run(conn, "u")


def test_stop_mismatches_say_what_the_server_matched(sqlite_engine: Engine) -> None:
    run = run_with(sqlite_engine)
    add(sqlite_engine, run.id, "ok")
    add(sqlite_engine, run.id, "string", output_ids=[7, 8], matched_stop="</answer>")
    add(sqlite_engine, run.id, "foreign", output_ids=[7, 99], matched_stop="99")
    add(sqlite_engine, run.id, "none", output_ids=[7, 8], matched_stop=None)
    add(sqlite_engine, run.id, "odd", finish_reason="abort")
    report = verify_run(sqlite_engine, run, None)
    tally = report.checks[CHECK_STOP]
    assert (tally.checked, tally.mismatches) == (5, 4)
    details = {m.key: m.detail for m in tally.examples}
    assert "stop string '</answer>', which tokenmill does not send" in details["string"]
    assert "the sequence has no EOS" in details["string"]
    assert "stopped on id 99, which the run does not list" in details["foreign"]
    assert "reported no matched stop" in details["none"]
    assert details["odd"] == "finish_reason 'abort' is neither stop nor length"
    # no tokenizer: the template check is skipped, counted, and nothing else is a finding
    assert report.checks[CHECK_TEMPLATE].not_checkable == 5
    assert report.findings == []


def test_template_failure_and_difference_are_mismatches(sqlite_engine: Engine) -> None:
    run = run_with(sqlite_engine)
    add(sqlite_engine, run.id, "same")
    add(sqlite_engine, run.id, "boom", messages=[{"role": "user", "content": "boom"}])
    add(sqlite_engine, run.id, "longer", prompt_ids=[1, 2, 3], prompt_tokens=3)
    add(sqlite_engine, run.id, "ids", messages=None)
    tokenizer = cast(ChatTokenizer, FakeTokenizer())
    assert tokenizer_findings(run, tokenizer) == []
    report = verify_run(sqlite_engine, run, tokenizer)
    tally = report.checks[CHECK_TEMPLATE]
    assert (tally.checked, tally.not_checkable, tally.mismatches) == (3, 1, 2)
    details = {m.key: m.detail for m in tally.examples}
    assert details["boom"] == "chat template failed: boom"
    assert details["longer"] == (
        "prompt_ids differ from the re-applied template at position 2: stored 3, template "
        "(end) (3 stored ids, 2 from the template)"
    )


def test_examples_are_bounded_and_the_json_complete(sqlite_engine: Engine) -> None:
    run = run_with(sqlite_engine)
    for i in range(EXAMPLES_PER_CHECK + 3):
        add(sqlite_engine, run.id, f"k{i}", completion_tokens=5)
    report = verify_run(sqlite_engine, run, None)
    data = report.to_json()
    completion = next(c for c in data["checks"] if c["check"] == "completion_tokens")
    assert completion["mismatches"] == EXAMPLES_PER_CHECK + 3
    assert len(completion["examples"]) == EXAMPLES_PER_CHECK
    assert completion["examples"][0] == {
        "item_id": 1,
        "id": "k0",
        "sample": 0,
        "turn": 0,
        "detail": "2 output ids stored; the server reported completion_tokens 5",
    }
    assert data["clean"] is False and "export" not in data
