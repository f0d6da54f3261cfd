"""Export rows: SpecForge's input_ids/loss_mask, and the conversations turn whose reasoning is
split at the `</think>` token id (never by string search)."""

from __future__ import annotations

import json
import stat
from datetime import UTC, datetime
from pathlib import Path

import pytest
from sqlalchemy import Engine

from app.core.contracts import GenerateResult, SamplingParams
from app.core.errors import ConfigurationError
from app.ledger import claims, outcomes, queue, reads, run_queries
from app.outputs.export import assistant_turn, current_umask, export_run, specforge_row
from app.prompts.tokenization import ChatTokenizer

THINK, END_THINK, IM_END = 163606, 163607, 163586


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


def run_info() -> run_queries.RunInfo:
    settings = run_queries.GenerationSettings(
        "/t", "a", "b", {}, SamplingParams(), 1, END_THINK, [IM_END]
    )
    return run_queries.RunInfo(1, "r", settings, None, datetime.now(UTC))


def stored(prompt: list[int], output: list[int], finish: str = "stop") -> reads.StoredItem:
    return reads.StoredItem(
        1,
        "k",
        0,
        "done",
        [{"role": "user", "content": "hi"}],
        prompt,
        output,
        finish,
        len(output),
        1,
        "s",
        None,
        0.1,
    )


def test_specforge_row_masks_the_prompt() -> None:
    row = specforge_row(stored([1, 2, THINK], [5, END_THINK, 6, IM_END]))
    assert row["input_ids"] == [1, 2, THINK, 5, END_THINK, 6, IM_END]
    assert row["loss_mask"] == [0, 0, 0, 1, 1, 1, 1]


def test_reasoning_is_split_at_the_think_end_id(tokenizer: ChatTokenizer) -> None:
    reasoning = tokenizer.apply([{"role": "user", "content": "plan"}])[3:6]
    answer = [tokenizer.hf_tokenizer.convert_tokens_to_ids(t) for t in ["a", "b"]]
    turn = assistant_turn(
        stored([1, THINK], [*reasoning, END_THINK, *answer, IM_END]), run_info(), tokenizer
    )
    assert turn["reasoning_content"] == tokenizer.decode(reasoning)
    assert turn["content"] == tokenizer.decode(answer)


def test_truncated_inside_reasoning_is_all_reasoning(tokenizer: ChatTokenizer) -> None:
    turn = assistant_turn(stored([1, THINK], [400, 401, 402], "length"), run_info(), tokenizer)
    assert turn["content"] == "" and turn["reasoning_content"] == tokenizer.decode([400, 401, 402])


def test_export_file_is_complete_and_atomic(
    sqlite_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    spec = run_queries.RunSpec(
        "r", "/t", "a" * 64, "b" * 64, {}, SamplingParams(), 1, END_THINK, [IM_END]
    )
    with sqlite_engine.begin() as conn:
        run, _ = run_queries.get_or_create_run(conn, spec)
        queue.insert_items(
            conn, run.id, [queue.NewItem(f"k{i}", 0, i, None, [1, THINK]) for i in range(2500)]
        )
        ids = queue.pending_ids(conn, run.id)
        claims.claim_items(conn, ids, owner="w", server="s", lease_s=60)
        outcomes.record_outcomes(
            conn,
            [
                outcomes.Done(
                    i,
                    GenerateResult(
                        "r", [400, END_THINK, 401, IM_END], "stop", IM_END, 2, 4, 0, 0.1
                    ),
                )
                for i in ids[:-1]
            ]
            + [outcomes.Failed(ids[-1], "bad")],
            owner="w",
            lease_s=60,
        )
    out = tmp_path / "x" / "r.jsonl"
    with pytest.raises(ConfigurationError, match="does not exist; create it first"):
        export_run(sqlite_engine, run, "specforge", out)  # an export never creates folders
    assert not out.parent.exists()
    out.parent.mkdir()
    with pytest.raises(ConfigurationError, match="it is a folder; name a file in it"):
        export_run(sqlite_engine, run, "specforge", out.parent)
    report = export_run(sqlite_engine, run, "specforge", out)
    lines = out.read_text().splitlines()
    assert report.rows == len(lines) == 2499
    assert {json.loads(line)["id"] for line in lines} == {f"k{i}" for i in range(2499)}
    assert [p.name for p in out.parent.iterdir()] == ["r.jsonl"]  # no temp file left behind
    # as readable as any file the user writes (mkstemp's own 0600 is not kept)
    assert stat.S_IMODE(out.stat().st_mode) == 0o666 & ~current_umask()
    conv = export_run(
        sqlite_engine, run, "conversations", tmp_path / "c.jsonl", tokenizer=tokenizer
    )
    first = json.loads((tmp_path / "c.jsonl").read_text().splitlines()[0])
    assert conv.rows == 2499 and first["conversations"][-1]["role"] == "assistant"
    assert first["prompt"] == tokenizer.decode([1, THINK])
