"""Enqueue from Parquet and from a datasets save_to_disk folder into real Postgres: the same
items as the equivalent JSONL, --field on a custom column, bad rows skipped by row number."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine

from app.core.contracts import SamplingParams
from app.core.errors import InputError
from app.ledger import reads, run_queries
from app.prompts.tokenization import ChatTokenizer
from workers.intake.producer import EnqueueOptions, enqueue

ROWS: list[dict[str, Any]] = [
    {"id": "a", "messages": [{"role": "user", "content": "Hello there"}]},
    {
        "id": "b",
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "And now?"},
        ],
    },
    {"id": "c", "messages": [{"role": "user", "content": "Explain queues."}]},
]


@pytest.fixture(scope="module")
def tokenizer(kimi_tokenizer: ChatTokenizer) -> ChatTokenizer:
    return kimi_tokenizer


def stored(db: Engine, run_name: str) -> list[tuple[Any, ...]]:
    with db.connect() as conn:
        run = run_queries.get_run(conn, run_name)
        return [
            (i.item_key, i.sample_index, i.messages, i.prompt_ids)
            for i in reads.iter_items(conn, run.id, statuses=("pending",))
        ]


def run_enqueue(
    db: Engine, tokenizer: ChatTokenizer, path: Path, run: str, field: str | None = None
) -> Any:
    options = EnqueueOptions(path, run, SamplingParams(max_new_tokens=16), prompt_field=field)
    return enqueue(db, tokenizer, options, publish=None)


def test_parquet_and_datasets_give_the_items_of_the_jsonl(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    import datasets

    jsonl = tmp_path / "in.jsonl"
    jsonl.write_text("".join(json.dumps(r) + "\n" for r in ROWS), encoding="utf-8")
    parquet = tmp_path / "in.parquet"
    pq.write_table(pa.Table.from_pylist(ROWS), parquet)
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))

    reports = [
        run_enqueue(pg_engine, tokenizer, path, name)
        for path, name in ((jsonl, "j"), (parquet, "p"), (folder, "d"))
    ]
    assert [(r.prompts, r.inserted, r.skipped) for r in reports] == [(3, 3, 0)] * 3
    expected = stored(pg_engine, "j")
    assert expected[1][2][-1] == {"role": "user", "content": "And now?"}
    assert stored(pg_engine, "p") == expected
    assert stored(pg_engine, "d") == expected


def test_field_bad_rows_and_a_missing_column(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    rows = [
        {"id": "a", "dialogue": [{"from": "human", "value": "Hi"}]},
        {"id": "b", "dialogue": [{"from": "alien", "value": "?"}]},
        {"id": "c", "dialogue": [{"from": "human", "value": "Bye"}, {"from": "gpt", "value": ""}]},
    ]
    path = tmp_path / "custom.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    report = run_enqueue(pg_engine, tokenizer, path, "f", field="dialogue")
    assert (report.prompts, report.inserted, report.skipped) == (2, 2, 1)
    assert [str(e) for e in report.errors] == [
        "row 2: dialogue[0] has unknown 'from' \"alien\" (known: assistant, bard, bing, chatgpt, "
        "function, gpt, human, model, observation, system, tool, user)"
    ]
    assert [k for k, *_ in stored(pg_engine, "f")] == ["a", "c"]

    with pytest.raises(InputError) as caught:
        run_enqueue(pg_engine, tokenizer, path, "g", field="messages")
    assert "no column 'messages'" in str(caught.value)
    assert "(columns: 'id', 'dialogue')" in str(caught.value)
    with pg_engine.connect() as conn:
        assert [r.name for r in run_queries.list_runs(conn)] == ["f"]


def test_a_template_failure_on_a_row_says_row(
    pg_engine: Engine, tokenizer: ChatTokenizer, tmp_path: Path
) -> None:
    context = tokenizer.context_length
    assert context is not None
    rows = [
        {"id": "a", "prompt": "short"},
        {"id": "b", "input_ids": [400] * context},
    ]
    path = tmp_path / "long.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path)
    report = run_enqueue(pg_engine, tokenizer, path, "t", field=None)
    assert report.inserted == 1
    assert [str(e)[:6] for e in report.errors] == ["row 2:"]
