"""Parquet export and compaction against a real S3-compatible server (moto's, started here on
loopback): written through s3fs with storage options, read back, checked, then corrupted."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from sqlalchemy import Engine

from app.core.settings import Settings
from app.ledger import compaction, reads
from app.outputs.parquet_export import check_export, export_parquet, read_manifest
from tests.support.done_runs import make_done_run
from tests.support.moto_s3 import moto_s3
from workers.control.compaction import compact_run

BUCKET = "tokenmill-test"


@pytest.fixture(scope="module")
def s3_options() -> Iterator[dict[str, object]]:
    """Options as TOKENMILL_STORAGE_OPTIONS would carry them, for a fresh moto server."""
    with moto_s3(BUCKET) as options:
        yield options


def test_export_to_s3_round_trip_and_corruption(
    pg_engine: Engine, s3_options: dict[str, object], tmp_path: Path
) -> None:
    import s3fs

    run = make_done_run(pg_engine, "s3", 15)
    url = f"s3://{BUCKET}/exports/s3"
    report = export_parquet(pg_engine, run, url, storage_options=s3_options, shard_rows=12)
    assert report.rows == 30 and len(report.shards) == 3

    fs = s3fs.S3FileSystem(**s3_options)
    names = sorted(p.rsplit("/", 1)[1] for p in fs.ls(f"{BUCKET}/exports/s3"))
    assert names == sorted([".manifest.json", *(s.path for s in report.shards)])
    manifest = read_manifest(url, s3_options)
    assert [s["rows"] for s in manifest["shards"]] == [12, 12, 6]
    with fs.open(f"{BUCKET}/exports/s3/{report.shards[0].path}", "rb") as fh:
        table = pq.read_table(fh)
    with pg_engine.connect() as conn:
        stored = list(reads.iter_items(conn, run.id))
    assert table.column("output_ids").to_pylist() == [i.output_ids for i in stored[:12]]
    with pg_engine.connect() as conn:
        assert check_export(conn, run.id, url, s3_options).problems == []

    # one object's bytes flipped in place
    victim = f"{BUCKET}/exports/s3/{report.shards[1].path}"
    data = bytearray(fs.cat_file(victim))
    data[len(data) // 2] ^= 0xFF
    fs.pipe_file(victim, bytes(data))
    with pg_engine.connect() as conn:
        problems = check_export(conn, run.id, url, s3_options).problems
    assert any(f"shard {report.shards[1].path}: sha256" in p for p in problems)
    # the manifest itself replaced by garbage
    fs.pipe_file(f"{BUCKET}/exports/s3/.manifest.json", b"{not json")
    with pg_engine.connect() as conn:
        assert "is not JSON" in check_export(conn, run.id, url, s3_options).problems[0]


def test_compaction_to_s3_reads_back(
    pg_engine: Engine, s3_options: dict[str, object], tmp_path: Path
) -> None:
    run = make_done_run(pg_engine, "s3c", 10)
    settings = Settings(
        data_dir=tmp_path,
        storage_url=f"s3://{BUCKET}/store",
        storage_options=s3_options,
        shard_rows=8,
    )
    with pg_engine.connect() as conn:
        before = [(i.id, i.prompt_ids, i.output_ids) for i in reads.iter_items(conn, run.id)]
    report = compact_run(pg_engine, settings, run, force=True)
    assert report.compacted == 20 and len(report.shards) == 3
    with pg_engine.connect() as conn:
        uris = compaction.shard_uris(conn, run.id)
        after = [
            (i.id, i.prompt_ids, i.output_ids)
            for i in reads.iter_items(conn, run.id, storage_options=s3_options)
        ]
    assert all(u.startswith(f"s3://{BUCKET}/store/runs/s3c/compacted/items-") for u in uris)
    assert after == before
    assert json.dumps(report.to_json())


def test_an_image_export_to_s3_carries_its_images(
    pg_engine: Engine, s3_options: dict[str, object], tmp_path: Path
) -> None:
    import s3fs

    from tests.support.image_runs import make_image_run

    built = make_image_run(pg_engine, tmp_path, "s3-img")
    url = f"s3://{BUCKET}/exports/s3-img"
    report = export_parquet(
        pg_engine,
        built.run,
        url,
        storage_options=s3_options,
        image_store=built.store,
        with_images=True,
    )
    assert report.images == 3
    fs = s3fs.S3FileSystem(**s3_options)
    for ref in built.refs:
        assert (
            fs.cat_file(f"{BUCKET}/exports/s3-img/{ref.key}")
            == Path(built.store.path(ref.key)).read_bytes()
        )
    with pg_engine.connect() as conn:
        assert check_export(conn, built.run.id, url, s3_options).problems == []
    gone = built.refs[1]
    fs.rm_file(f"{BUCKET}/exports/s3-img/{gone.key}")
    with pg_engine.connect() as conn:
        problems = check_export(conn, built.run.id, url, s3_options).problems
    assert any(f"image 1: {gone.key} does not resolve" in p for p in problems)
