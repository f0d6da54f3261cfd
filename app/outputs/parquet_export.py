"""Parquet exports of a run in object storage: shards streamed from the ledger, .manifest.json,
and check_export, which compares an export with the ledger row by row.

The shard format, filesystems and atomic writes live in app.storage.shards; this module adds
the run.
"""

from __future__ import annotations

import itertools
import json
import logging
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from sqlalchemy import Connection, Engine

from app.core.errors import ConfigurationError, NotFound
from app.core.models import ItemStatus
from app.ledger import common, counters, image_tokens, reads, registry, run_queries
from app.outputs.image_checks import ImageRefs, listed_image_problems, row_image_problems
from app.outputs.image_rows import ImageRows, count_problem, served_prompt
from app.outputs.provenance import ProvenanceCounts, weight_filter
from app.storage.shards import (
    Location,
    ShardInfo,
    ShardRow,
    ShardWriter,
    StorageError,
    iter_shard,
    list_names,
    open_location,
    read_object,
    remove_objects,
    sha256_of,
    shard_row_count,
    write_object,
)

log = logging.getLogger(__name__)

# A dot name, as Hadoop's hidden files: pyarrow, Spark, DuckDB globs and `datasets` (which skips
# only dot names, not `_`) all read the folder as its shards alone.
MANIFEST_NAME = ".manifest.json"
# what exports were named before; still read
OLD_MANIFEST_NAMES = ("manifest.json",)
MANIFEST_FORMAT = "tokenmill.parquet/1"
SHARD_PREFIX = "part-"
SHARD_SUFFIX = ".parquet"
MAX_PROBLEMS = 50


def shard_row(item: reads.StoredItem, images: ImageRows | None = None) -> ShardRow:
    """A done item as a row of a shard (exports and compaction write the same columns): an
    image item's prompt as served, with its images and image_token_counts. Without images
    (a run's image rows) an image item is refused (ImageExportError, naming it): a row of its
    ids as sent would not be what the model saw."""
    images = images or ImageRows(None, None)  # no pins: an image item is refused, named
    prompt = images.served_prompt(item)
    image_fields = images.fields(item)
    return ShardRow(
        id=item.item_key,
        sample=item.sample_index,
        turn=item.turn_index,
        prompt_ids=prompt,
        output_ids=item.output_ids or [],
        finish_reason=item.finish_reason,
        prompt_tokens=item.prompt_tokens,
        completion_tokens=item.completion_tokens,
        cached_tokens=item.cached_tokens,
        server=item.server,
        latency_s=item.latency_s,
        item_id=item.id,
        metadata=None if item.metadata is None else json.dumps(item.metadata, ensure_ascii=False),
        weight_version=item.weight_version,
        sampling_params=None if item.sampling_params is None else json.dumps(item.sampling_params),
        images=image_fields.get("images"),
        image_token_counts=image_fields.get("image_token_counts"),
        assistant_prefix=item.assistant_prefix,
    )


def run_manifest(run: run_queries.RunInfo) -> dict[str, Any]:
    return {
        "name": run.name,
        "id": run.id,
        "tokenizer_path": run.generation.tokenizer_path,
        "tokenizer_hash": run.generation.tokenizer_hash,
        "tokenizer_files": run.generation.tokenizer_files,
        "trust_remote_code": run.generation.trust_remote_code,
        "chat_template_hash": run.generation.chat_template_hash,
        "chat_template_kwargs": run.generation.chat_template_kwargs,
        "normalization_version": run.generation.normalization_version,
        "sampling_params": run.generation.sampling.to_json(),
        "samples_per_prompt": run.generation.samples_per_prompt,
        "eos_token_ids": run.generation.eos_token_ids,
        "think_end_id": run.generation.think_end_id,
        # `--turns all` on agentic rows: the parser that read the target's calls
        "tool_call_parser": (run.generation.chat_pins or {}).get("tool_call_parser"),
        "created_at": run.created_at.isoformat(),
    }


def manifest_counts(
    report: ParquetExport, counts: reads.RunCounts, chain_endings: dict[str, int]
) -> dict[str, Any]:
    """The manifest's counts: the rows written, the run's failed and unfinished items, and its
    agentic chains by how they ended (app.core.constants CHAIN_END_*)."""
    return {
        "rows": report.rows,
        "truncated": report.truncated,
        "prompt_tokens": report.prompt_tokens,
        "output_tokens": report.output_tokens,
        "failed": counts.failed,
        "unfinished": counts.total - counts.done - counts.failed,
        "chain_endings": chain_endings,
    }


def server_fingerprints(
    conn: Connection, run: run_queries.RunInfo, names: set[str]
) -> dict[str, Any]:
    """The registered fingerprint of each server that produced rows; a server the registry
    does not know (an embedded `tokenmill run` registers none) gets the run's pinned one."""
    out: dict[str, Any] = {}
    for name in sorted(names):
        try:
            fingerprint = registry.get_server(conn, name).fingerprint
        except NotFound:
            fingerprint = None
        out[name] = fingerprint if fingerprint is not None else run.fingerprint
    return out


@dataclass
class ParquetExport:
    url: str
    rows: int = 0
    truncated: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    shards: list[ShardInfo] = field(default_factory=list)
    removed: list[str] = field(default_factory=list)
    # with_images: the distinct images copied beside the shards
    images: int = 0

    @property
    def tokens(self) -> int:
        return self.prompt_tokens + self.output_tokens

    def add(self, row: ShardRow) -> None:
        self.rows += 1
        self.truncated += row.finish_reason == "length"
        self.prompt_tokens += len(row.prompt_ids)
        self.output_tokens += len(row.output_ids)


def check_export_folder(folder: Path) -> None:
    """A local Parquet export goes into a folder that exists or whose parent exists (the
    export makes that one folder, never a tree of them); a file there is refused."""
    if folder.exists() and not folder.is_dir():
        raise ConfigurationError(f"cannot export to {folder}: it is a file, not a folder")
    if not folder.parent.is_dir():
        raise ConfigurationError(
            f"cannot export to {folder}: the folder {folder.parent} does not exist; create it first"
        )


def export_parquet(
    db: Engine,
    run: run_queries.RunInfo,
    url: str,
    *,
    storage_options: dict[str, Any] | None = None,
    shard_rows: int = 50_000,
    weight_version: str | None = None,
    allow_mixed_weights: bool = False,
    image_store: Location | None = None,
    with_images: bool = False,
) -> ParquetExport:
    """Write every done sample of run as Parquet shards and a .manifest.json under url.

    Shards appear only complete (app.storage.shards writes them under a temporary name) and are
    named `part-NNNNN-<export id>.parquet`, new names every export: shards of an earlier export at
    the same url stay untouched until the new manifest has replaced the old one, so a crash at
    any point leaves the previous export whole and no manifest listing a partial or foreign
    shard. After the manifest, shards it does not list are removed, and so is a manifest of an
    older export under its old name (it would keep readers of the folder from opening it).
    One weight version per export (app.outputs.provenance): weight_version picks one, or
    allow_mixed_weights takes them all; the manifest counts samples per version and setting.
    Image rows point at image_store (default the configured one); with_images copies each
    image they reference to `<url>/images/<sha256>.<ext>` once (its sha256 checked), points at
    it by that relative path, and lists the copies in the manifest's `images`.
    """
    if shard_rows < 1:
        raise ValueError("shard_rows must be at least 1")
    loc = open_location(url, storage_options)
    if loc.local:
        check_export_folder(Path(loc.root))
    export_id = uuid.uuid4().hex[:8]
    report = ParquetExport(url=loc.url)
    servers: set[str] = set()
    made = ProvenanceCounts()
    with db.connect() as conn:
        keep = weight_filter(conn, run, weight_version, allow_mixed_weights)
        images = ImageRows.for_run(conn, run.id, image_store, loc if with_images else None)
        writer: ShardWriter | None = None
        try:
            for item in reads.iter_items(conn, run.id):
                if not keep(item):
                    continue
                made.add(item)
                if writer is None:
                    name = f"{SHARD_PREFIX}{len(report.shards):05d}-{export_id}{SHARD_SUFFIX}"
                    writer = ShardWriter(loc, name)
                row = shard_row(item, images)
                writer.write([row])
                report.add(row)
                if item.server:
                    servers.add(item.server)
                if writer.rows >= shard_rows:
                    report.shards.append(writer.commit())
                    writer = None
            if writer is not None:
                report.shards.append(writer.commit())
                writer = None
        finally:
            if writer is not None:
                writer.abort()
        counts = reads.run_counts(conn, run)
        ends = reads.chain_endings(conn, run.id)  # agentic chains by how they ended
        fingerprints = server_fingerprints(conn, run, servers)
    manifest = {
        "format": MANIFEST_FORMAT,
        "run": run_manifest(run),
        "server_fingerprints": fingerprints,
        "counts": manifest_counts(report, counts, ends),
        "provenance": made.to_json() | {"weight_version": weight_version},
        "shards": [s.to_json() for s in report.shards],
        "created_at": common.utcnow().isoformat(),
    }
    if with_images:
        manifest["images"] = images.manifest()
    report.images = len(images.copied)
    write_object(loc, MANIFEST_NAME, json.dumps(manifest, indent=1).encode("utf-8"))
    listed = {s.path for s in report.shards}
    stale = [
        n for n in list_names(loc, prefix=SHARD_PREFIX, suffix=SHARD_SUFFIX) if n not in listed
    ]
    remove_objects(loc, [*stale, *OLD_MANIFEST_NAMES])
    report.removed = stale
    log.info(
        "exported %d rows of run %s to %s in %d shards (%d old shards removed)",
        report.rows,
        run.name,
        loc.url,
        len(report.shards),
        len(stale),
        extra={"action": "exported"},
    )
    return report


def read_manifest(url: str, storage_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """The manifest of the export at url (NotFound if there is none)."""
    loc = open_location(url, storage_options)
    return _read_manifest(loc)


def _read_manifest(loc: Location) -> dict[str, Any]:
    """The manifest under its name, or under the name older exports gave it."""
    for name in (MANIFEST_NAME, *OLD_MANIFEST_NAMES):
        try:
            raw = read_object(loc, name)
        except NotFound:
            continue
        break
    else:
        raise NotFound(f"{loc.uri(MANIFEST_NAME)} does not exist")
    try:
        manifest = json.loads(raw)
    except ValueError as exc:
        raise StorageError(f"{loc.uri(name)} is not JSON: {exc}") from exc
    if not isinstance(manifest, dict) or manifest.get("format") != MANIFEST_FORMAT:
        raise StorageError(f"{loc.uri(name)} is not a {MANIFEST_FORMAT} manifest")
    return manifest


# --- checking an export against the ledger ----------------------------------------------------


@dataclass
class ExportCheck:
    """What check_export found: rows and shards listed, and every problem as one line."""

    rows: int
    shards: int
    problems: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not self.problems


def check_export(
    conn: Connection,
    run_id: int,
    url: str,
    storage_options: dict[str, Any] | None = None,
) -> ExportCheck:
    """Check the Parquet export at url against the ledger: the manifest, each shard's presence,
    byte size, sha256 and row count, the total against the done items, then every row's
    (item_id, id, sample, prompt_ids, output_ids, finish_reason) against the ledger's; an image
    row's prompt_ids against the served ones, its images and counts against the ledger's, and
    each image it references (and each the manifest lists) against its sha256."""
    check = ExportCheck(rows=0, shards=0)
    problems = check.problems
    loc = open_location(url, storage_options)
    try:
        manifest = _read_manifest(loc)
    except (NotFound, StorageError) as exc:
        problems.append(str(exc))
        return check
    shards = manifest.get("shards") or []
    check.shards = len(shards)
    check.rows = sum(int(s.get("rows", 0)) for s in shards)
    run = run_queries.get_run_by_id(conn, run_id)
    listed_run = (manifest.get("run") or {}).get("id")
    if listed_run != run_id:
        problems.append(f"the manifest is of run id {listed_run}, not {run_id} ({run.name})")
    readable: list[str] = []
    for shard in shards:
        name = str(shard.get("path"))
        readable_now = _check_shard(loc, shard, problems)
        if readable_now:
            readable.append(name)
    # counted from the items themselves: a check does not trust the counters it could catch
    scanned = counters.scanned_groups(conn, run.id)
    done = sum(t.items for k, t in scanned.items() if k.status == ItemStatus.DONE.value)
    picked = (manifest.get("provenance") or {}).get("weight_version")
    if picked is not None:  # an export of one weight version (`--weight-version`)
        done = reads.done_weight_versions(conn, run.id).get(picked, 0)
    if check.rows != done:
        problems.append(f"the manifest lists {check.rows} rows; the ledger has {done} done items")
    counted = (manifest.get("counts") or {}).get("rows")
    if counted != check.rows:
        problems.append(f"manifest counts.rows is {counted}; its shards add up to {check.rows}")
    refs = ImageRefs(loc, storage_options)
    problems += listed_image_problems(manifest.get("images") or [], refs)
    if len(readable) == len(shards):
        _compare_rows(conn, run_id, loc, readable, problems, picked, refs)
    else:
        problems.append("rows were not compared with the ledger: a shard is unreadable")
    if len(problems) > MAX_PROBLEMS:
        extra = len(problems) - MAX_PROBLEMS
        del problems[MAX_PROBLEMS:]
        problems.append(f"... and {extra} more problems")
    return check


def _check_shard(loc: Location, shard: dict[str, Any], problems: list[str]) -> bool:
    """Append what is wrong with one listed shard; True if its rows can be read."""
    name = str(shard.get("path"))
    path = loc.path(name)
    if not loc.fs.exists(path):
        problems.append(f"shard {name}: missing")
        return False
    digest, size = sha256_of(loc.fs, path)
    if size != shard.get("bytes"):
        problems.append(f"shard {name}: {size} bytes, the manifest says {shard.get('bytes')}")
    if digest != shard.get("sha256"):
        problems.append(f"shard {name}: sha256 {digest} differs from the manifest's")
    try:
        rows = shard_row_count(loc, name)
    except Exception as exc:  # any pyarrow error: the bytes are not a Parquet file
        problems.append(f"shard {name}: not a readable Parquet file ({exc})")
        return False
    if rows != shard.get("rows"):
        problems.append(f"shard {name}: {rows} rows, the manifest says {shard.get('rows')}")
    return True


def _export_rows(loc: Location, names: list[str]) -> Iterator[tuple[str, ShardRow]]:
    for name in names:
        for row in iter_shard(loc, name):
            yield name, row


def _compare_rows(
    conn: Connection,
    run_id: int,
    loc: Location,
    names: list[str],
    problems: list[str],
    weight_version: str | None = None,
    refs: ImageRefs | None = None,
) -> None:
    refs = refs or ImageRefs(loc)
    pins = image_tokens.run_image_pins(conn, run_id)
    placeholder = None if pins is None else pins.placeholder_id
    mismatches = 0
    position = 0
    stored_items = (
        item
        for item in reads.iter_items(conn, run_id)
        if weight_version is None or item.weight_version == weight_version
    )
    try:
        pairs = itertools.zip_longest(_export_rows(loc, names), stored_items)
        for position, (exported, stored) in enumerate(pairs):  # noqa: B007
            if exported is None:
                assert stored is not None
                problems.append(f"item {stored.id} ({stored.item_key}) is not in the export")
                break
            name, row = exported
            if stored is None:
                problems.append(f"shard {name}: item {row.item_id} is not a done item")
                break
            diffs = _row_differences(row, stored, placeholder, refs)
            if diffs:
                mismatches += 1
                problems.append(
                    f"shard {name}: item {row.item_id} differs from the ledger: {', '.join(diffs)}"
                )
                if mismatches >= MAX_PROBLEMS:
                    break
    except Exception as exc:  # a shard failing mid-read
        problems.append(f"reading the export failed after {position} rows: {exc}")


def _row_differences(
    row: ShardRow, item: reads.StoredItem, placeholder: int | None, refs: ImageRefs
) -> list[str]:
    image_problems: list[str] = []
    prompt = item.prompt_ids
    if item.image_refs or row.images is not None or row.image_token_counts is not None:
        problem = count_problem(item, placeholder)
        if problem is None:
            prompt = served_prompt(item, placeholder)
        else:
            image_problems.append(f"the ledger's item has {problem}")
        image_problems += row_image_problems(row.images, row.image_token_counts, item, refs)
    wanted: dict[str, Any] = {
        "item_id": item.id,
        "id": item.item_key,
        "sample": item.sample_index,
        "prompt_ids": prompt,
        "output_ids": item.output_ids or [],
        "finish_reason": item.finish_reason,
    }
    if row.weight_version is not None or row.sampling_params is not None:
        # shards written before the provenance columns read them as null
        wanted["weight_version"] = item.weight_version
        wanted["sampling_params"] = (
            None if item.sampling_params is None else json.dumps(item.sampling_params)
        )
    differ = [f"{k} (ledger item {item.id})" for k, v in wanted.items() if getattr(row, k) != v]
    return differ + image_problems
