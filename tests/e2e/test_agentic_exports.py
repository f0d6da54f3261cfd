"""Every export of an agentic run (`tokenmill run --turns all` against the emulator writing tool
calls) is read by typed readers as written: the JSONL exports by `pyarrow.json.read_json`, the
Parquet shards by `pyarrow.parquet`, each field one type in every row (a tool call's `arguments`
an object, as docs/inputs.md shows it, in the history and in the last turn alike)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pyarrow.json
import pyarrow.parquet
import pytest

from ops.emulator_proc import start_emulator
from tests.support.agentic_chains import FAMILIES, Family, agentic_row
from tests.support.procs import clean_env, tokenmill

pytestmark = pytest.mark.e2e

ROWS = 24
# every JSONL export of a --turns all run, by its flags
JSONL_EXPORTS = {
    "specforge-per-turn": ["--format", "specforge", "--per-turn"],
    "specforge-whole": ["--format", "specforge", "--whole-conversation"],
    "conversations-whole": ["--format", "conversations", "--whole-conversation"],
    "conversations-per-turn": ["--format", "conversations", "--per-turn"],
}


def tool_calls(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        call
        for row in rows
        for turn in row.get("conversations", [])
        for call in turn.get("tool_calls") or []
    ]


@pytest.mark.parametrize("family", [FAMILIES["kimi"], FAMILIES["hermes"]], ids=["kimi", "hermes"])
def test_every_export_of_an_agentic_run_reads_with_pyarrow(tmp_path: Path, family: Family) -> None:
    folder = family.tokenizer(tmp_path)
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(agentic_row(n)) + "\n" for n in range(ROWS)))
    env = clean_env(tmp_path / "data")
    flags = ["--step-ms", "1", "--median-tokens", "6", "--sigma", "0", "--tokenizer", str(folder)]
    emulator = start_emulator([*flags, *family.emulator_flags])
    try:
        args = ["run", str(path), "--run", "agents", "--tokenizer", str(folder), "--turns", "all"]
        args += [*family.run_flags, "--max-new-tokens", "96", "--seed", "1"]
        ran = tokenmill([*args, "--server", emulator.url], env)
    finally:
        emulator.stop()
    assert ran.returncode == 0, ran.stdout[-2000:] + ran.stderr[-2000:]

    calls: list[dict[str, Any]] = []
    for name, flags in JSONL_EXPORTS.items():
        out = tmp_path / f"{name}.jsonl"
        exported = tokenmill(["export", "agents", *flags, "--out", str(out)], env)
        assert exported.returncode == 0, exported.stderr
        table = pyarrow.json.read_json(out)  # raises on a field of two types
        assert table.num_rows == len(out.read_text().splitlines()) > 0, name
        calls += tool_calls([json.loads(line) for line in out.read_text().splitlines()])
    assert calls, "the emulator's chains made tool calls"
    for call in calls:
        assert isinstance(call["function"]["arguments"], dict), call
        assert set(call) == {"id", "index", "type", "function"}, call

    shards = tmp_path / "parquet"
    exported = tokenmill(["export", "agents", "--format", "parquet", "--out", str(shards)], env)
    assert exported.returncode == 0, exported.stderr
    table = pyarrow.parquet.read_table(shards)
    assert table.num_rows > 0 and "turn" in table.column_names
