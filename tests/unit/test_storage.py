"""Shards on a local folder: atomic writes, the schema, row groups read back one at a time by
the compacted-row reader, and secrets kept out of `tokenmill config`."""

from __future__ import annotations

from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from app.core.errors import NotFound
from app.core.settings import redact_options
from app.storage.shards import (
    SHARD_SCHEMA,
    ShardCache,
    ShardRow,
    ShardWriter,
    StorageError,
    iter_shard,
    list_names,
    open_location,
    read_object,
    sha256_of,
    write_object,
)


def row(item_id: int, n: int = 3) -> ShardRow:
    return ShardRow(
        id=f"k{item_id}",
        sample=item_id % 2,
        turn=0,
        prompt_ids=list(range(item_id, item_id + n)),
        output_ids=[item_id, 2**31 - 1],
        finish_reason="stop" if item_id % 3 else "length",
        prompt_tokens=n,
        completion_tokens=2,
        cached_tokens=None if item_id % 2 else item_id,
        server="gpu-a",
        latency_s=0.5,
        item_id=item_id,
    )


def test_open_location_takes_paths_and_urls(tmp_path: Path) -> None:
    by_path = open_location(str(tmp_path / "x"))
    by_url = open_location((tmp_path / "x").as_uri())
    assert by_path.local and by_url.local
    assert by_path.root == by_url.root == str(tmp_path / "x")
    assert by_path.uri("a.parquet") == (tmp_path / "x" / "a.parquet").as_uri()


def test_shard_round_trip_with_the_schema_and_row_groups(tmp_path: Path) -> None:
    loc = open_location(str(tmp_path))
    rows = [row(i) for i in range(1, 26)]
    with ShardWriter(loc, "s.parquet", row_group_rows=10) as writer:
        writer.write(rows[:7])
        writer.write(rows[7:])
        info = writer.commit()
    assert info.rows == 25 and info.path == "s.parquet"
    assert (info.sha256, info.bytes) == sha256_of(loc.fs, loc.path("s.parquet"))
    parquet = pq.ParquetFile(tmp_path / "s.parquet")
    assert parquet.schema_arrow.equals(SHARD_SCHEMA)
    assert parquet.schema_arrow.field("prompt_ids").type == pa.list_(pa.int32())
    assert [parquet.metadata.row_group(g).num_rows for g in range(3)] == [10, 10, 5]
    assert parquet.metadata.row_group(0).column(0).compression == "ZSTD"
    assert list(iter_shard(loc, "s.parquet")) == rows
    assert list_names(loc) == ["s.parquet"]  # no temporary file left behind


def test_a_shard_left_without_commit_leaves_nothing(tmp_path: Path) -> None:
    loc = open_location(str(tmp_path))
    with pytest.raises(RuntimeError), ShardWriter(loc, "s.parquet", row_group_rows=2) as writer:
        writer.write([row(i) for i in range(1, 6)])
        raise RuntimeError("crash mid-shard")
    assert list(tmp_path.iterdir()) == []


def test_shard_cache_reads_rows_and_refuses_a_wrong_item(tmp_path: Path) -> None:
    loc = open_location(str(tmp_path))
    for name, ids in (("a.parquet", range(1, 8)), ("b.parquet", range(8, 10))):
        with ShardWriter(loc, name, row_group_rows=3) as writer:
            writer.write([row(i) for i in ids])
            writer.commit()
    cache = ShardCache({})
    try:
        for shard, first, ids in (("a.parquet", 1, range(1, 8)), ("b.parquet", 8, range(8, 10))):
            for item_id in ids:
                got = cache.arrays(loc.uri(shard), item_id - first, item_id)
                assert got == (row(item_id).prompt_ids, row(item_id).output_ids)
        with pytest.raises(StorageError, match="row 2 holds item 3, not item 4"):
            cache.arrays(loc.uri("a.parquet"), 2, 4)
        with pytest.raises(StorageError, match="has no row 7"):
            cache.arrays(loc.uri("a.parquet"), 7, 8)
        with pytest.raises(StorageError, match="missing"):
            cache.arrays(loc.uri("gone.parquet"), 0, 1)
    finally:
        cache.close()


def test_objects_are_replaced_whole(tmp_path: Path) -> None:
    loc = open_location(str(tmp_path / "out"))
    with pytest.raises(NotFound):
        read_object(loc, "manifest.json")
    write_object(loc, "manifest.json", b"first")
    write_object(loc, "manifest.json", b"second")
    assert read_object(loc, "manifest.json") == b"second"
    assert list_names(loc) == ["manifest.json"]


def test_storage_secrets_are_redacted() -> None:
    options = {
        "endpoint_url": "http://127.0.0.1:9000",
        "key": "AKIA",
        "secret": "s3cr3t",
        "client_kwargs": {"aws_session_token": "t", "region_name": "us-east-1"},
    }
    assert redact_options(options) == {
        "endpoint_url": "http://127.0.0.1:9000",
        "key": "***",
        "secret": "***",
        "client_kwargs": {"aws_session_token": "***", "region_name": "us-east-1"},
    }
