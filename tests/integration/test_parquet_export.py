"""Parquet export on real Postgres to a local folder: shards and manifest read back, the folder
opened as is by pyarrow, DuckDB and `datasets`, checked against the ledger, replaced whole by a
re-export, never half-listed when the writer dies mid-shard, and older exports still read."""

from __future__ import annotations

import json
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine

from app.ledger import reads
from app.outputs import parquet_export as storage
from app.outputs.parquet_export import check_export, export_parquet, read_manifest
from tests.support.done_runs import make_done_run
from tests.support.procs import clean_env, tokenmill


def shard_paths(folder: Path) -> list[Path]:
    manifest = json.loads((folder / ".manifest.json").read_text())
    return [folder / s["path"] for s in manifest["shards"]]


def test_export_round_trip(pg_engine: Engine, tmp_path: Path) -> None:
    run = make_done_run(pg_engine, "px", 30)
    out = tmp_path / "export"
    report = export_parquet(pg_engine, run, str(out), shard_rows=25)
    assert report.rows == 60 and [s.rows for s in report.shards] == [25, 25, 10]

    manifest = read_manifest(str(out))
    assert manifest["format"] == "tokenmill.parquet/1"
    assert manifest["run"]["name"] == "px" and manifest["run"]["id"] == run.id
    assert manifest["run"]["sampling_params"]["max_new_tokens"] == 64
    assert manifest["run"]["eos_token_ids"] == [163586]
    assert manifest["server_fingerprints"] == {"gpu-a": None}
    counts = manifest["counts"]
    assert (counts["rows"], counts["failed"], counts["unfinished"]) == (60, 1, 1)
    assert counts["truncated"] == report.truncated > 0
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".manifest.json", *(s.path for s in report.shards)]
    )

    table = pa.concat_tables([pq.read_table(p) for p in shard_paths(out)])
    assert table.schema.field("prompt_ids").type == pa.list_(pa.int32())
    assert table.schema.field("output_ids").type == pa.list_(pa.int32())
    assert table.schema.field("cached_tokens").nullable
    first = pq.ParquetFile(shard_paths(out)[0])
    assert first.metadata.row_group(0).column(3).compression == "ZSTD"
    with pg_engine.connect() as conn:
        stored = list(reads.iter_items(conn, run.id))
    assert table.column("item_id").to_pylist() == [i.id for i in stored]
    assert table.column("id").to_pylist() == [i.item_key for i in stored]
    assert table.column("prompt_ids").to_pylist() == [i.prompt_ids for i in stored]
    assert table.column("output_ids").to_pylist() == [i.output_ids for i in stored]
    assert table.column("turn").to_pylist() == [0] * 60
    assert table.column("finish_reason").to_pylist() == [i.finish_reason for i in stored]
    assert table.column("completion_tokens").to_pylist() == [i.completion_tokens for i in stored]

    with pg_engine.connect() as conn:
        check = check_export(conn, run.id, str(out))
    assert (check.rows, check.shards, check.problems) == (60, 3, [])


def test_readers_open_the_export_folder_as_is(pg_engine: Engine, tmp_path: Path) -> None:
    import datasets
    import duckdb
    import pyarrow.dataset as ds

    run = make_done_run(pg_engine, "hf", 20)
    out = tmp_path / "export"
    export_parquet(pg_engine, run, out.as_uri(), shard_rows=15)
    with pg_engine.connect() as conn:
        stored = list(reads.iter_items(conn, run.id))
    by_item = {i.id: i for i in stored}

    table = ds.dataset(out).to_table()
    assert sorted(table.column("item_id").to_pylist()) == sorted(by_item)

    query = f"SELECT item_id, output_ids FROM read_parquet('{out}/*.parquet') ORDER BY item_id"
    rows = duckdb.sql(query).fetchall()
    assert rows == [(i, by_item[i].output_ids) for i in sorted(by_item)]

    loaded = datasets.load_dataset(
        "parquet", data_dir=str(out), split="train", cache_dir=str(tmp_path / "hf")
    )
    assert loaded.num_rows == 40
    assert {r["item_id"]: r["prompt_ids"] for r in loaded} == {
        i: by_item[i].prompt_ids for i in by_item
    }


def test_an_older_export_still_reads(pg_engine: Engine, tmp_path: Path) -> None:
    run = make_done_run(pg_engine, "old", 6)
    out = tmp_path / "export"
    export_parquet(pg_engine, run, str(out), shard_rows=5)
    (out / ".manifest.json").rename(out / "manifest.json")  # the name exports had before
    assert read_manifest(str(out))["run"]["name"] == "old"
    with pg_engine.connect() as conn:
        assert check_export(conn, run.id, str(out)).problems == []
    # a new export into that folder leaves only what readers of the folder can open
    report = export_parquet(pg_engine, run, str(out), shard_rows=5)
    assert sorted(p.name for p in out.iterdir()) == sorted(
        [".manifest.json", *(s.path for s in report.shards)]
    )


def test_check_export_reports_tampering(pg_engine: Engine, tmp_path: Path) -> None:
    run = make_done_run(pg_engine, "tamper", 10, extra=False)
    out = tmp_path / "export"
    report = export_parquet(pg_engine, run, str(out), shard_rows=8)
    # a valid Parquet file with one output changed: same rows, other bytes
    victim = out / report.shards[1].path
    table = pq.read_table(victim)
    outputs = table.column("output_ids").to_pylist()
    outputs[0] = [*outputs[0], 7]
    table = table.set_column(
        4, table.schema.field("output_ids"), pa.array(outputs, pa.list_(pa.int32()))
    )
    pq.write_table(table, victim, compression="zstd")
    (out / report.shards[2].path).unlink()
    with pg_engine.connect() as conn:
        check = check_export(conn, run.id, str(out))
    text = "\n".join(check.problems)
    assert f"shard {report.shards[1].path}: sha256" in text
    assert f"shard {report.shards[2].path}: missing" in text
    assert "rows were not compared" in text
    (out / ".manifest.json").unlink()
    with pg_engine.connect() as conn:
        assert ".manifest.json does not exist" in check_export(conn, run.id, str(out)).problems[0]


def test_row_differences_are_named(pg_engine: Engine, tmp_path: Path) -> None:
    run = make_done_run(pg_engine, "diff", 5, extra=False)
    out = tmp_path / "export"
    report = export_parquet(pg_engine, run, str(out))
    victim = out / report.shards[0].path
    table = pq.read_table(victim)
    outputs = table.column("output_ids").to_pylist()
    outputs[3] = outputs[3][:-1]
    column = pa.array(outputs, pa.list_(pa.int32()))
    pq.write_table(table.set_column(4, table.schema.field("output_ids"), column), victim)
    with pg_engine.connect() as conn:
        problems = check_export(conn, run.id, str(out)).problems
    item_id = table.column("item_id")[3].as_py()
    assert any(f"item {item_id} differs from the ledger: output_ids" in p for p in problems)


def test_a_crash_mid_shard_keeps_the_previous_export(
    pg_engine: Engine, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = make_done_run(pg_engine, "crash", 30)
    out = tmp_path / "export"
    with pg_engine.connect() as conn:
        done = list(reads.iter_items(conn, run.id))

    def dying_after(n: int) -> object:
        real = storage.shard_row
        seen = 0

        def shard_row(item: reads.StoredItem, images: object = None) -> object:
            nonlocal seen
            seen += 1
            if seen > n:
                raise OSError("disk gone")
            return real(item, images)  # type: ignore[arg-type]

        return shard_row

    # first export dies in its second shard: nothing is listed, no temporary file stays
    monkeypatch.setattr(storage, "shard_row", dying_after(40))
    with pytest.raises(OSError, match="disk gone"):
        export_parquet(pg_engine, run, str(out), shard_rows=25)
    assert not (out / ".manifest.json").exists()
    assert [p.name for p in out.iterdir() if p.name.startswith(".")] == []

    monkeypatch.undo()
    first = export_parquet(pg_engine, run, str(out), shard_rows=25)
    assert first.removed  # the crashed export's complete first shard, never listed
    before = (out / ".manifest.json").read_bytes()

    # a re-export dies mid-shard: the old manifest and every shard it lists are untouched
    monkeypatch.setattr(storage, "shard_row", dying_after(len(done) - 5))
    with pytest.raises(OSError):
        export_parquet(pg_engine, run, str(out), shard_rows=25)
    assert (out / ".manifest.json").read_bytes() == before
    with pg_engine.connect() as conn:
        assert check_export(conn, run.id, str(out)).problems == []

    # the next export replaces the old one and removes its shards
    monkeypatch.undo()
    second = export_parquet(pg_engine, run, str(out), shard_rows=100)
    assert sorted(p.name for p in out.iterdir()) == [".manifest.json", second.shards[0].path]
    with pg_engine.connect() as conn:
        assert check_export(conn, run.id, str(out)).problems == []


def test_export_command_writes_parquet(pg_engine: Engine, pg_url: str, tmp_path: Path) -> None:
    make_done_run(pg_engine, "cli", 6)
    env = clean_env(tmp_path / "data", TOKENMILL_DATABASE_URL=pg_url, TOKENMILL_SHARD_ROWS="5")
    out = tmp_path / "export"
    done = tokenmill(["export", "cli", "--format", "parquet", "--out", str(out)], env)
    assert done.returncode == 0, done.stderr
    assert "wrote 12 samples" in done.stderr and "3 Parquet shards" in done.stderr
    assert json.loads((out / ".manifest.json").read_text())["counts"]["rows"] == 12
    missing = tokenmill(["export", "nope", "--format", "parquet", "--out", str(out)], env)
    assert missing.returncode == 2 and "no run named 'nope'" in missing.stderr
