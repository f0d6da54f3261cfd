"""The request fields a row may hold that change no prompt at SGLang 0.5.23's chat path
(add_generation_prompt, parallel_tool_calls): kept as row metadata, and the enqueue report names
them with their row counts, so no one takes them for applied. Their prompts: the oracle test."""

from __future__ import annotations

import json
from pathlib import Path

from app.core.contracts import PromptRecord
from app.prompts.inputs import read_prompts
from workers.intake.reporting import EnqueueReport

U = {"role": "user", "content": "Hi"}


def test_the_report_names_the_fields_not_applied(tmp_path: Path) -> None:
    rows = [
        {"id": "a", "messages": [U], "add_generation_prompt": False, "source": "a"},
        {"id": "b", "messages": [U], "add_generation_prompt": True, "parallel_tool_calls": False},
        {"id": "c", "messages": [U], "add_generation_prompt": None},
        {"id": "d", "messages": [U]},
    ]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    report = EnqueueReport("r")
    for record in read_prompts(path):
        assert isinstance(record, PromptRecord), record
        report.count_fields(record)
    assert report.not_applied_fields == {"add_generation_prompt": 2, "parallel_tool_calls": 1}
    assert report.metadata_fields["add_generation_prompt"] == 3
    assert report.to_json()["not_applied_fields"] == report.not_applied_fields
