"""Parquet shards in object storage: fsspec filesystems from a URL, atomic object writes, the
shard schema, streaming shard writers and readers, and hydrating compacted token arrays.

Knows nothing of the ledger (app.ledger reads compacted rows through it;
app.outputs.parquet_export builds exports on top of it).
"""

from __future__ import annotations

import bisect
import contextlib
import hashlib
import logging
import os
import tempfile
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Self

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from app.core.errors import ConfigurationError, NotFound, TokenmillError

log = logging.getLogger(__name__)

COMPRESSION = "zstd"
# rows per Parquet row group: a reader of one compacted row decodes this many rows at most
ROW_GROUP_ROWS = 1000
HASH_CHUNK_BYTES = 4 << 20

# one image of an image row: its content hash, where it is (the store's URL, or the path
# relative to the export folder when the export carries its images) and its size in pixels
IMAGE_ENTRY = pa.struct(
    [
        pa.field("sha256", pa.string(), nullable=False),
        pa.field("uri", pa.string(), nullable=False),
        pa.field("width", pa.int32(), nullable=False),
        pa.field("height", pa.int32(), nullable=False),
    ]
)

# one row of a shard; exports and compaction write the same columns, so a compacted shard is
# itself a readable dataset file
SHARD_SCHEMA = pa.schema(
    [
        pa.field("id", pa.string(), nullable=False),
        pa.field("sample", pa.int32(), nullable=False),
        pa.field("turn", pa.int32(), nullable=False),
        pa.field("prompt_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("output_ids", pa.list_(pa.int32()), nullable=False),
        pa.field("finish_reason", pa.string()),
        pa.field("prompt_tokens", pa.int32()),
        pa.field("completion_tokens", pa.int32()),
        pa.field("cached_tokens", pa.int32()),
        pa.field("server", pa.string()),
        pa.field("latency_s", pa.float64()),
        pa.field("item_id", pa.int64(), nullable=False),
        # the row's fields that were not template inputs (source, category, ...), as JSON text
        pa.field("metadata", pa.string()),
        # provenance: the weights that made the sample, and its sampling_params as JSON text
        pa.field("weight_version", pa.string()),
        pa.field("sampling_params", pa.string()),
        # an image row (null for text): its images in prompt order and how many tokens each
        # became; prompt_ids are then the served ids, each image's placeholder repeated
        pa.field("images", pa.list_(IMAGE_ENTRY)),
        pa.field("image_token_counts", pa.list_(pa.int32())),
        # the continued final turn the prompt ends with (continue_final_message), else null
        pa.field("assistant_prefix", pa.string()),
    ]
)
COLUMNS: tuple[str, ...] = tuple(SHARD_SCHEMA.names)


class StorageError(TokenmillError):
    """Object storage could not be read or written."""


@dataclass(frozen=True)
class ShardRow:
    """One row of a shard, as Python values (the columns of SHARD_SCHEMA)."""

    id: str
    sample: int
    turn: int
    prompt_ids: list[int]
    output_ids: list[int]
    finish_reason: str | None
    prompt_tokens: int | None
    completion_tokens: int | None
    cached_tokens: int | None
    server: str | None
    latency_s: float | None
    item_id: int
    metadata: str | None = None
    weight_version: str | None = None
    sampling_params: str | None = None
    images: list[dict[str, Any]] | None = None
    image_token_counts: list[int] | None = None
    assistant_prefix: str | None = None


@dataclass(frozen=True)
class ShardInfo:
    """A committed shard: its path relative to the folder it was written in, and checksums."""

    path: str
    rows: int
    bytes: int
    sha256: str

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "rows": self.rows, "bytes": self.bytes, "sha256": self.sha256}


# --- filesystems ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Location:
    """A folder in object storage: the fsspec filesystem and the path inside it."""

    fs: fsspec.AbstractFileSystem
    root: str
    url: str

    def path(self, name: str) -> str:
        return f"{self.root.rstrip('/')}/{name}"

    def uri(self, name: str) -> str:
        """A full URL of name under this folder, which `open_location` opens again."""
        return f"{self.url.rstrip('/')}/{name}"

    @property
    def local(self) -> bool:
        return isinstance(self.fs, LocalFileSystem)


def open_location(url: str, options: dict[str, Any] | None = None) -> Location:
    """The folder at url: a local path, file://, s3:// or any fsspec URL, with fsspec options."""
    if not url:
        raise ConfigurationError("the storage URL is empty")
    if "://" not in url:
        url = Path(url).expanduser().absolute().as_uri()
    try:
        fs, root = fsspec.core.url_to_fs(url, **(options or {}))
    except (ImportError, ValueError, TypeError) as exc:
        raise ConfigurationError(f"storage URL {url!r} cannot be opened: {exc}") from exc
    return Location(fs=fs, root=str(root).rstrip("/") or "/", url=url.rstrip("/"))


def split_uri(uri: str) -> tuple[str, str]:
    """(folder URL, object name) of a full object URL."""
    folder, _, name = uri.rstrip("/").rpartition("/")
    return folder, name


def sha256_of(fs: fsspec.AbstractFileSystem, path: str) -> tuple[str, int]:
    """sha256 hex digest and size in bytes of an object, read in chunks."""
    digest = hashlib.sha256()
    size = 0
    with fs.open(path, "rb") as fh:
        while chunk := fh.read(HASH_CHUNK_BYTES):
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def _sha256_local(path: str) -> tuple[str, int]:
    return sha256_of(LocalFileSystem(), path)


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _commit_local_file(loc: Location, tmp: str, name: str) -> None:
    """Put the complete local file tmp under its final name in loc, all at once.

    Local folders: tmp sits in the same folder, so os.replace is an atomic rename. Anything
    else (S3 and other object stores): a single upload of the complete file; an object only
    becomes visible when its PUT (or multipart upload) completes, so readers never see half
    of it. A streaming write straight to the final key is not used: fsspec's buffered files
    commit what they hold when closed, also when closed by an exception.
    """
    final = loc.path(name)
    if loc.local:
        _fsync(tmp)
        os.replace(tmp, final)
        return
    try:
        loc.fs.put_file(tmp, final)
    except Exception as exc:
        raise StorageError(f"could not upload {name} to {loc.url}: {exc}") from exc
    finally:
        Path(tmp).unlink(missing_ok=True)


def _temp_path(loc: Location, name: str) -> str:
    if loc.local:
        loc.fs.makedirs(loc.root, exist_ok=True)
        return loc.path(f".{name}.{uuid.uuid4().hex[:8]}.tmp")
    fd, tmp = tempfile.mkstemp(prefix=f"tokenmill-{name}.", suffix=".tmp")
    os.close(fd)
    return tmp


def write_object(loc: Location, name: str, data: bytes) -> None:
    """Write a small object (the manifest) atomically: readers see the old one or the new."""
    tmp = _temp_path(loc, name)
    try:
        with open(tmp, "wb") as fh:
            fh.write(data)
        _commit_local_file(loc, tmp, name)
    finally:
        Path(tmp).unlink(missing_ok=True)


def read_object(loc: Location, name: str) -> bytes:
    path = loc.path(name)
    try:
        with loc.fs.open(path, "rb") as fh:
            data: bytes = fh.read()
    except FileNotFoundError as exc:
        raise NotFound(f"{loc.uri(name)} does not exist") from exc
    return data


def list_names(loc: Location, *, prefix: str = "", suffix: str = "") -> list[str]:
    """Names of the objects directly in loc that start with prefix and end with suffix."""
    try:
        entries = loc.fs.ls(loc.root, detail=False, refresh=True)
    except FileNotFoundError:
        return []
    except TypeError:  # filesystems without a refresh option
        entries = loc.fs.ls(loc.root, detail=False)
    names = [str(e).rstrip("/").rpartition("/")[2] for e in entries]
    return sorted(n for n in names if n.startswith(prefix) and n.endswith(suffix))


def remove_objects(loc: Location, names: Sequence[str]) -> None:
    for name in names:
        with contextlib.suppress(FileNotFoundError):
            loc.fs.rm_file(loc.path(name))


# --- writing --------------------------------------------------------------------------------


def rows_to_table(rows: Sequence[ShardRow]) -> pa.Table:
    columns: dict[str, list[Any]] = {c: [] for c in COLUMNS}
    for row in rows:
        for c in COLUMNS:
            columns[c].append(getattr(row, c))
    return pa.Table.from_pydict(columns, schema=SHARD_SCHEMA)


class ShardWriter:
    """Streams rows into one Parquet shard under a temporary name; `commit` makes it appear
    under its final name with its checksum, leaving the context without commit discards it."""

    def __init__(self, loc: Location, name: str, *, row_group_rows: int = ROW_GROUP_ROWS):
        self.loc = loc
        self.name = name
        self.rows = 0
        self.row_group_rows = row_group_rows
        self._pending: list[ShardRow] = []
        self._tmp = _temp_path(loc, name)
        self._writer: pq.ParquetWriter | None = pq.ParquetWriter(
            self._tmp, SHARD_SCHEMA, compression=COMPRESSION
        )
        self._done = False

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if not self._done:
            self.abort()

    def write(self, rows: Sequence[ShardRow]) -> None:
        self._pending.extend(rows)
        self.rows += len(rows)
        while len(self._pending) >= self.row_group_rows:
            self._flush(self._pending[: self.row_group_rows])
            self._pending = self._pending[self.row_group_rows :]

    def _flush(self, rows: Sequence[ShardRow]) -> None:
        assert self._writer is not None
        if rows:
            self._writer.write_table(rows_to_table(rows), row_group_size=len(rows))

    def commit(self) -> ShardInfo:
        """Close the file, checksum it, and put it under its final name atomically."""
        self._flush(self._pending)
        self._pending = []
        assert self._writer is not None
        self._writer.close()
        self._writer = None
        digest, size = _sha256_local(self._tmp)
        _commit_local_file(self.loc, self._tmp, self.name)
        self._done = True
        log.info(
            "wrote shard %s (%d rows, %d bytes)",
            self.loc.uri(self.name),
            self.rows,
            size,
            extra={"action": "shard_written"},
        )
        return ShardInfo(path=self.name, rows=self.rows, bytes=size, sha256=digest)

    def abort(self) -> None:
        self._done = True
        if self._writer is not None:
            try:
                self._writer.close()
            except Exception:  # the file is being thrown away; its own error is moot
                log.debug("closing an aborted shard failed", exc_info=True)
            self._writer = None
        Path(self._tmp).unlink(missing_ok=True)


# --- reading --------------------------------------------------------------------------------


def _row_from(columns: dict[str, list[Any]], i: int) -> ShardRow:
    # shards written before a column existed read it as null
    return ShardRow(**{c: columns[c][i] for c in COLUMNS if c in columns})


def iter_shard(loc: Location, name: str, *, batch_rows: int = ROW_GROUP_ROWS) -> Iterator[ShardRow]:
    """Every row of a shard in order, a batch at a time (memory stays flat)."""
    with loc.fs.open(loc.path(name), "rb") as fh:
        parquet = pq.ParquetFile(fh)
        present = [c for c in COLUMNS if c in parquet.schema_arrow.names]
        for batch in parquet.iter_batches(batch_size=batch_rows, columns=present):
            columns = batch.to_pydict()
            for i in range(batch.num_rows):
                yield _row_from(columns, i)


def shard_row_count(loc: Location, name: str) -> int:
    with loc.fs.open(loc.path(name), "rb") as fh:
        return int(pq.ParquetFile(fh).metadata.num_rows)


class ShardCache:
    """Reads single rows of compacted shards for ledger readers: keeps the current shard open
    and its current row group decoded, so a page of rows in id order reads each row group once.
    Memory: one row group of token arrays."""

    def __init__(self, options: dict[str, Any] | None = None):
        self._options = options
        self._uri: str | None = None
        self._handle: IO[bytes] | None = None
        self._file: pq.ParquetFile | None = None
        self._starts: list[int] = []
        self._group: int | None = None
        self._columns: dict[str, list[Any]] = {}

    def _resolved_options(self) -> dict[str, Any]:
        if self._options is None:
            from app.core.settings import get_settings

            self._options = dict(get_settings().storage_options)
        return self._options

    def _open(self, uri: str) -> None:
        self.close()
        folder, name = split_uri(uri)
        loc = open_location(folder, self._resolved_options())
        try:
            handle: IO[bytes] = loc.fs.open(loc.path(name), "rb")
        except FileNotFoundError as exc:
            raise StorageError(f"compacted shard {uri} is missing") from exc
        self._handle = handle
        self._file = pq.ParquetFile(handle)
        starts, total = [], 0
        for g in range(self._file.metadata.num_row_groups):
            starts.append(total)
            total += self._file.metadata.row_group(g).num_rows
        starts.append(total)
        self._starts = starts
        self._uri = uri

    def arrays(self, uri: str, row: int, item_id: int) -> tuple[list[int], list[int]]:
        """(prompt_ids, output_ids) of row `row` in shard uri, which must hold item item_id."""
        if uri != self._uri:
            self._open(uri)
        assert self._file is not None
        if not 0 <= row < self._starts[-1]:
            raise StorageError(f"compacted shard {uri} has no row {row} (item {item_id})")
        group = bisect.bisect_right(self._starts, row) - 1
        if group != self._group:
            table = self._file.read_row_group(
                group, columns=["item_id", "prompt_ids", "output_ids"]
            )
            self._columns = table.to_pydict()
            self._group = group
        i = row - self._starts[group]
        if self._columns["item_id"][i] != item_id:
            raise StorageError(
                f"compacted shard {uri} row {row} holds item {self._columns['item_id'][i]}, "
                f"not item {item_id}"
            )
        return list(self._columns["prompt_ids"][i]), list(self._columns["output_ids"][i])

    def close(self) -> None:
        if self._handle is not None:
            self._handle.close()
        self._handle = None
        self._file = None
        self._uri = None
        self._group = None
        self._columns = {}
        self._starts = []
