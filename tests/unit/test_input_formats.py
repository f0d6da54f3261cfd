"""Parquet files, folders of them and datasets save_to_disk folders read as prompt records:
the same records as the JSONL, --field, bad rows by number, clear errors for wrong layouts."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.core.contracts import PromptRecord
from app.core.errors import InputError
from app.prompts.input_formats import BATCH_ROWS, open_table
from app.prompts.inputs import read_prompts

ROWS: list[dict[str, Any]] = [
    {"id": "a", "messages": [{"role": "user", "content": "Hello"}]},
    {
        "id": "b",
        "messages": [
            {"role": "system", "content": "Be brief.", "name": "ann"},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": "Again?"},
        ],
    },
    {"id": "c", "messages": [{"role": "user", "content": "Third"}]},
]


def records(path: Path, **kwargs: Any) -> list[PromptRecord | InputError]:
    return list(read_prompts(path, **kwargs))


def as_tuples(entries: list[PromptRecord | InputError]) -> list[tuple[Any, ...]]:
    out: list[tuple[Any, ...]] = []
    for e in entries:
        if isinstance(e, InputError):
            out.append(("error", e.line, e.reason))
        else:
            out.append((e.line, e.key, e.messages, e.input_ids))
    return out


def write_jsonl(path: Path, rows: list[dict[str, Any]]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict[str, Any]]) -> Path:
    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_parquet_gives_the_same_records_as_jsonl(tmp_path: Path) -> None:
    jsonl = records(write_jsonl(tmp_path / "p.jsonl", ROWS))
    parquet = records(write_parquet(tmp_path / "p.parquet", ROWS))
    assert as_tuples(parquet) == as_tuples(jsonl)
    # the struct gives every turn a "name"; only the turn that had one keeps it
    second = parquet[1]
    assert isinstance(second, PromptRecord) and second.messages is not None
    assert [("name" in t) for t in second.messages] == [True, False, False, False]


def test_a_folder_of_parquet_files_numbers_rows_across_files(tmp_path: Path) -> None:
    folder = tmp_path / "shards"
    folder.mkdir()
    write_parquet(folder / "part-0.parquet", ROWS[:2])
    write_parquet(
        folder / "part-1.parquet", [*ROWS[2:], {"id": "a", "messages": ROWS[0]["messages"]}]
    )
    entries = records(folder)
    assert [e.line for e in entries] == [1, 2, 3, 4]
    assert isinstance(entries[3], InputError)
    assert str(entries[3]) == "row 4: duplicate id 'a' (first seen on row 1)"


def test_datasets_folder_is_read_without_the_datasets_library(tmp_path: Path) -> None:
    datasets = pytest.importorskip("datasets")
    folder = tmp_path / "ds"
    datasets.Dataset.from_list(ROWS).save_to_disk(str(folder))
    table = open_table(folder)
    assert table is not None and table.kind == "datasets"
    jsonl = records(write_jsonl(tmp_path / "p.jsonl", ROWS))
    assert as_tuples(records(folder)) == as_tuples(jsonl)


def test_field_names_a_custom_column_of_any_kind(tmp_path: Path) -> None:
    rows = [
        {"id": 1, "chat": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]},
        {"id": 2, "chat": "Just a string prompt"},
        {"id": 3, "chat": [163587, 400, 401]},
    ]
    entries = records(write_jsonl(tmp_path / "c.jsonl", rows), field="chat")
    assert [type(e) for e in entries] == [PromptRecord] * 3
    first, second, third = entries
    assert isinstance(first, PromptRecord) and first.messages == [{"role": "user", "content": "Hi"}]
    assert isinstance(second, PromptRecord) and second.messages == [
        {"role": "user", "content": "Just a string prompt"}
    ]
    assert isinstance(third, PromptRecord) and third.input_ids == [163587, 400, 401]
    # Parquet columns hold one type: the ShareGPT turns alone
    parquet = records(write_parquet(tmp_path / "c.parquet", rows[:1]), field="chat")
    assert as_tuples(parquet) == as_tuples(entries[:1])


def test_a_bad_row_is_reported_by_number_and_the_rest_kept(tmp_path: Path) -> None:
    rows = [
        ROWS[0],
        {"id": "x", "messages": [{"role": "robot", "content": "beep"}]},
        {"id": "y", "messages": []},
        ROWS[2],
    ]
    entries = records(write_parquet(tmp_path / "bad.parquet", rows))
    assert [e.line for e in entries] == [1, 2, 3, 4]
    assert isinstance(entries[1], InputError) and isinstance(entries[2], InputError)
    assert str(entries[1]).startswith('row 2: messages[0] has unknown role "robot"')
    assert str(entries[2]) == "row 3: 'messages' is empty"
    assert isinstance(entries[3], PromptRecord) and entries[3].key == "c"


def test_missing_field_column_names_it_and_lists_the_columns(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "p.parquet", ROWS)
    with pytest.raises(InputError) as caught:
        records(path, field="dialogue")
    message = str(caught.value)
    assert "--field 'dialogue': no column 'dialogue'" in message
    assert "(columns: 'id', 'messages')" in message


def test_no_prompt_column_asks_for_field(tmp_path: Path) -> None:
    path = write_parquet(tmp_path / "p.parquet", [{"id": "a", "dialogue": "hi"}])
    with pytest.raises(InputError, match=r"no prompt column.*columns: 'id', 'dialogue'.*--field"):
        records(path)


def test_wrong_folders_are_refused_clearly(tmp_path: Path) -> None:
    (tmp_path / "empty").mkdir()
    with pytest.raises(InputError, match=r"no \.parquet files and no datasets save_to_disk"):
        records(tmp_path / "empty")
    splits = tmp_path / "dd"
    (splits / "train").mkdir(parents=True)
    (splits / "dataset_dict.json").write_text('{"splits": ["train"]}')
    with pytest.raises(InputError, match=r"DatasetDict \(splits: train\); give the folder of"):
        records(splits)


def test_rows_are_streamed_in_batches(tmp_path: Path) -> None:
    count = BATCH_ROWS * 2 + 5
    rows = [{"prompt": f"question {i}"} for i in range(count)]
    path = tmp_path / "many.parquet"
    pq.write_table(pa.Table.from_pylist(rows), path, row_group_size=BATCH_ROWS)
    stream = read_prompts(path)
    first = next(stream)
    assert isinstance(first, PromptRecord) and first.line == 1
    assert sum(1 for _ in stream) == count - 1


def test_jsonl_is_unchanged_and_missing_field_is_a_line_error(tmp_path: Path) -> None:
    path = write_jsonl(tmp_path / "p.jsonl", ROWS)
    assert open_table(path) is None
    entries = records(path, field="dialogue")
    assert all(isinstance(e, InputError) for e in entries)
    assert str(entries[0]) == "line 1: no value in the --field 'dialogue' (keys: 'id', 'messages')"
