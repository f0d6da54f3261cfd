"""Table inputs: Parquet files (or folders of them) and `datasets` save_to_disk folders.

Streams them record batch by record batch as numbered plain rows; `app.prompts.inputs` builds
records.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from app.core.errors import InputError

logger = logging.getLogger(__name__)

# Rows turned into Python values at a time: at most the producer's chunk (512), so a table of
# long pre-tokenized prompts costs no more memory than the same JSONL.
BATCH_ROWS = 256
# The columns a row is read for when no --field names one (the JSONL field names).
DEFAULT_PROMPT_COLUMNS = ("messages", "conversations", "prompt", "input_ids")
_DATASET_MARKERS = ("state.json", "dataset_info.json")
# Arrow structs give every turn every field of the column; a null one means "not on this
# turn", except content, whose null is meaningful (an assistant turn that only calls tools).
_KEEP_NULL_TURN_FIELDS = frozenset({"content"})


@dataclass(frozen=True)
class TableInput:
    """A Parquet or datasets input: its kind, its data files in order, and its columns."""

    path: Path
    kind: str  # "parquet" or "datasets"
    files: tuple[Path, ...]
    columns: tuple[str, ...]


def open_table(path: Path) -> TableInput | None:
    """The table input at path, or None when path is a JSONL(.gz) file.

    A `.parquet` file, a folder holding `.parquet` files (read in sorted path order, rows
    numbered on across files), or a folder written by `datasets.Dataset.save_to_disk`
    (`state.json` / `dataset_info.json` and `data-*.arrow` Arrow stream files).
    """
    if path.is_file():
        if path.suffix.lower() != ".parquet":
            return None
        return _parquet_input(path, (path,))
    if not path.is_dir():
        return None
    if (path / "dataset_dict.json").is_file():
        splits = sorted(p.name for p in path.iterdir() if p.is_dir())
        example = f"{path / splits[0]}" if splits else f"{path}/<split>"
        raise InputError(
            f"{str(path)!r} is a datasets DatasetDict (splits: {', '.join(splits) or 'none'}); "
            f"give the folder of one split, e.g. {example!r}"
        )
    if any((path / marker).is_file() for marker in _DATASET_MARKERS):
        return _datasets_input(path)
    parquet = tuple(sorted(p for p in path.rglob("*.parquet") if p.is_file()))
    if parquet:
        return _parquet_input(path, parquet)
    raise InputError(
        f"{str(path)!r} is a folder with no .parquet files and no datasets save_to_disk "
        "files (state.json, dataset_info.json, data-*.arrow); give a JSONL file, a .parquet "
        "file or such a folder"
    )


def prompt_columns(table: TableInput, field: str | None) -> list[str]:
    """The columns to read: the --field column (checked to exist) or the default prompt
    columns present, then every other column (template inputs such as id, system, tools and
    chat_template_kwargs, and the rest, kept as row metadata)."""
    present = set(table.columns)
    if field is not None:
        if field not in present:
            raise InputError(
                f"--field {field!r}: no column {field!r} in {str(table.path)!r} "
                f"(columns: {_column_list(table.columns)})"
            )
        prompt = [field]
    else:
        prompt = [c for c in DEFAULT_PROMPT_COLUMNS if c in present]
        if not prompt:
            raise InputError(
                f"{str(table.path)!r} has no prompt column: expected one of 'messages', "
                f"'conversations', 'prompt' or 'input_ids' (columns: "
                f"{_column_list(table.columns)}); name the one to use with --field"
            )
    return prompt + [c for c in table.columns if c not in prompt]


def iter_rows(table: TableInput, columns: Sequence[str]) -> Iterator[tuple[int, dict[str, Any]]]:
    """(row number from 1, row as plain Python values) for every row, a batch at a time."""
    row_no = 0
    for file in table.files:
        for batch in _batches(table, file, columns):
            for row in batch:
                row_no += 1
                yield row_no, {name: _clean(name, value) for name, value in row.items()}


# --- opening ------------------------------------------------------------------------------


def _parquet_input(path: Path, files: tuple[Path, ...]) -> TableInput:
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: list[str] = []
    for file in files:
        try:
            schema = pq.read_schema(file)
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"cannot read the Parquet file {str(file)!r}: {exc}") from exc
        columns += [name for name in schema.names if name not in columns]
    return TableInput(path, "parquet", files, tuple(columns))


def _datasets_input(path: Path) -> TableInput:
    import pyarrow as pa

    files = _dataset_files(path)
    columns: list[str] = []
    for file in files:
        try:
            with pa.memory_map(str(file)) as source:
                schema = pa.ipc.open_stream(source).schema
        except (OSError, pa.ArrowException) as exc:
            raise InputError(f"cannot read the datasets file {str(file)!r}: {exc}") from exc
        columns += [name for name in schema.names if name not in columns]
    return TableInput(path, "datasets", files, tuple(columns))


def _dataset_files(path: Path) -> tuple[Path, ...]:
    """The data files in the order state.json lists them (else data-*.arrow sorted)."""
    state_file = path / "state.json"
    names: list[str] = []
    if state_file.is_file():
        try:
            state = json.loads(state_file.read_text(encoding="utf-8"))
            names = [entry["filename"] for entry in state.get("_data_files", [])]
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise InputError(f"cannot read {str(state_file)!r}: {exc}") from exc
    for name in names:
        # state.json is input too: it may not point us at files outside the folder
        if not isinstance(name, str) or Path(name).is_absolute() or ".." in Path(name).parts:
            raise InputError(f"{str(state_file)!r} names a data file outside its folder: {name!r}")
    files = [path / name for name in names] or sorted(path.glob("data-*.arrow"))
    missing = [str(f) for f in files if not f.is_file()]
    if missing:
        raise InputError(f"datasets folder {str(path)!r}: missing data file {missing[0]!r}")
    if not files:
        raise InputError(f"datasets folder {str(path)!r} has no data-*.arrow files")
    return tuple(files)


# --- reading ------------------------------------------------------------------------------


def _batches(
    table: TableInput, file: Path, columns: Sequence[str]
) -> Iterator[list[dict[str, Any]]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        if table.kind == "parquet":
            parquet = pq.ParquetFile(file)
            wanted = [c for c in columns if c in parquet.schema_arrow.names]
            for batch in parquet.iter_batches(batch_size=BATCH_ROWS, columns=wanted):
                yield batch.to_pylist()
            return
        with pa.memory_map(str(file)) as source:
            reader = pa.ipc.open_stream(source)
            wanted = [c for c in columns if c in reader.schema.names]
            for batch in reader:
                # datasets writes large batches (1000 rows by default); slice to bound memory
                for start in range(0, batch.num_rows, BATCH_ROWS):
                    yield batch.slice(start, BATCH_ROWS).select(wanted).to_pylist()
    except (OSError, pa.ArrowException) as exc:
        raise InputError(f"cannot read {str(file)!r}: {exc}") from exc


def _clean(name: str, value: Any) -> Any:
    """Drop the null fields Arrow structs give turns (and template kwargs) that do not have
    them."""
    if name == "chat_template_kwargs" and isinstance(value, dict):
        return {k: v for k, v in value.items() if v is not None}
    if isinstance(value, list) and value and all(isinstance(v, dict) for v in value):
        return [
            {k: v for k, v in turn.items() if v is not None or k in _KEEP_NULL_TURN_FIELDS}
            for turn in value
        ]
    return value


def _column_list(columns: Sequence[str]) -> str:
    shown = [repr(c) for c in columns[:20]]
    return ", ".join(shown) + (", ..." if len(columns) > 20 else "") if shown else "none"
