"""Compaction: moves the token arrays of a run's finished items out of the ledger into Parquet
shards under `<storage_url>/runs/<run name>/compacted/`, leaving a (shard, row) pointer.

Order and crash safety. For each batch of at most `shard_rows` compactable items (done, arrays
still in the ledger, no unfinished later turn reading them), in id order:
1. the shard `items-<first id>-<last id>.parquet` is written atomically (app.storage.shards);
2. one transaction points the items at it and empties their arrays, only where
   `shard_uri IS NULL`.
A crash before 2 leaves the items untouched and a shard nobody points at. The next compaction
first lists the folder and deletes every `items-*.parquet` that no item of the run points at
(and temporary files a killed writer left), then compacts again: the same ids give the same key,
so the shard is simply rewritten. Every compaction of a run holds the lock `compact-<run id>`
(Redis or a file, app.core.locks), so the cleanup never deletes a shard that another compaction has
written and not yet recorded; a compaction stops starting shards well before the lock expires.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from sqlalchemy import Engine

from app.core.locks import exclusive
from app.core.settings import Settings
from app.ledger import compaction, database, image_tokens, queue, reads, run_queries
from app.outputs.image_rows import ImageRows
from app.outputs.parquet_export import shard_row
from app.storage.image_store import image_location
from app.storage.shards import (
    Location,
    ShardWriter,
    list_names,
    open_location,
    remove_objects,
)

log = logging.getLogger(__name__)

SHARD_PREFIX = "items-"
SHARD_SUFFIX = ".parquet"
# the lock outlives a compaction: it starts no new shard after COMPACT_BUDGET_S
COMPACT_LOCK_TTL_S = 3600.0
COMPACT_BUDGET_S = 2700.0
# a shard's ids are read ID_PAGE_ITEMS at a time and its rows READ_PAGE_ITEMS at a time, so no
# statement's length grows with shard_rows: a 50,000-id read took 0.1-0.3 s beside a worker
# at 1M items, and a page of rows carries their token arrays
ID_PAGE_ITEMS = 5000
READ_PAGE_ITEMS = 250
# a compaction that moved at least this many items is followed by ANALYZE items
ANALYZE_AFTER_ITEMS = 50_000


@dataclass
class CompactionReport:
    run: str
    compactable: int = 0  # counted up to compact_min_items unless --all
    compacted: int = 0
    shards: list[str] = field(default_factory=list)
    orphans_removed: list[str] = field(default_factory=list)
    skipped: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "compactable": self.compactable,
            "compacted": self.compacted,
            "shards": self.shards,
            "orphans_removed": self.orphans_removed,
            "skipped": self.skipped,
        }


def compaction_location(
    settings: Settings, run_name: str, storage_url: str | None = None
) -> Location:
    """Where the compacted shards of a run live: under the run's pinned storage URL (a run
    older than the pin: TOKENMILL_STORAGE_URL)."""
    base = (storage_url or settings.resolved_storage_url()).rstrip("/")
    return open_location(f"{base}/runs/{run_name}/compacted", settings.storage_options)


def shard_name(first_id: int, last_id: int) -> str:
    return f"{SHARD_PREFIX}{first_id}-{last_id}{SHARD_SUFFIX}"


def compact_run(
    db: Engine,
    settings: Settings,
    run: run_queries.RunInfo,
    *,
    force: bool = False,
    shard_rows: int | None = None,
) -> CompactionReport:
    """Compact run's finished items (all of them if force, else only when at least
    compact_min_items are waiting); a second call with nothing new changes nothing."""
    report = CompactionReport(run=run.name)
    with exclusive(settings, f"compact-{run.id}", ttl_s=COMPACT_LOCK_TTL_S) as held:
        if not held:
            report.skipped = "another compaction of this run is running"
            return report
        _compact_locked(db, settings, run, report, force, shard_rows or settings.shard_rows)
    return report


def _compact_locked(
    db: Engine,
    settings: Settings,
    run: run_queries.RunInfo,
    report: CompactionReport,
    force: bool,
    shard_rows: int,
) -> None:
    loc = compaction_location(settings, run.name, run.storage_url)
    with db.connect() as conn:
        archived = run_queries.run_archived(conn, run.id)
    if archived:
        # its shards are referenced from the archive, and it has nothing left to compact
        report.skipped = "the run is archived"
        return
    report.orphans_removed = remove_orphans(db, run, loc)
    with db.connect() as conn:
        database.limit_periodic(conn, timeout_s=database.SCAN_TIMEOUT_S)
        # without --all, only "are there compact_min_items?" matters: counted up to that many
        report.compactable = (
            compaction.count_compactable(conn, run.id)
            if force
            else compaction.count_uncompacted(conn, run.id, at_most=settings.compact_min_items)
        )
    if report.compactable == 0:
        report.skipped = "nothing to compact"
        return
    if not force and report.compactable < settings.compact_min_items:
        report.skipped = (
            f"{report.compactable} finished items wait, fewer than TOKENMILL_COMPACT_MIN_ITEMS "
            f"({settings.compact_min_items}); use --all to compact them anyway"
        )
        return
    with db.connect() as conn:
        pins = image_tokens.run_image_pins(conn, run.id)
    # image rows are written as exports write them: served prompt ids, images, counts
    images = ImageRows(
        pins, image_location(settings, run.storage_url) if pins is not None else None
    )
    started = time.monotonic()
    after = 0
    while True:
        if time.monotonic() - started > COMPACT_BUDGET_S:
            report.skipped = "time budget used up; the rest is compacted next time"
            break
        ids = next_shard_ids(db, run.id, after_id=after, shard_rows=shard_rows)
        if not ids:
            break
        report.compacted += compact_ids(db, loc, ids, images)
        report.shards.append(shard_name(ids[0], ids[-1]))
        after = ids[-1]
    if report.compacted >= ANALYZE_AFTER_ITEMS:
        with db.begin() as conn:  # emptied arrays and moved rows: the planner should know
            queue.refresh_statistics(conn)
    log.info(
        "compacted %d items of run %s into %d shards under %s",
        report.compacted,
        run.name,
        len(report.shards),
        loc.url,
        extra={"action": "compacted"},
    )


def next_shard_ids(db: Engine, run_id: int, *, after_id: int, shard_rows: int) -> list[int]:
    """The ids of the next shard: up to shard_rows compactable ids after after_id, in id
    order, read in pages of ID_PAGE_ITEMS (each page its own short statement)."""
    ids: list[int] = []
    while len(ids) < shard_rows:
        want = min(ID_PAGE_ITEMS, shard_rows - len(ids))
        with db.connect() as conn:
            database.limit_periodic(conn, timeout_s=database.SCAN_TIMEOUT_S)
            page = compaction.compactable_ids(
                conn, run_id, after_id=ids[-1] if ids else after_id, limit=want
            )
        ids += page
        if len(page) < want:
            break
    return ids


def _pages(ids: list[int], size: int) -> Iterator[list[int]]:
    for start in range(0, len(ids), size):
        yield ids[start : start + size]


def shard_ids(name: str) -> tuple[int, int] | None:
    """The (first, last) item ids of a shard named by shard_name(); None for another name."""
    core = name[len(SHARD_PREFIX) : -len(SHARD_SUFFIX)]
    first, _, last = core.partition("-")
    if not (name.startswith(SHARD_PREFIX) and first.isdigit() and last.isdigit()):
        return None
    return int(first), int(last)


def compact_ids(db: Engine, loc: Location, ids: list[int], images: ImageRows | None = None) -> int:
    """Write one shard of these items, then point them at it; return how many were moved.
    images: how the run's image rows are written (needed when it has any)."""
    name = shard_name(ids[0], ids[-1])
    written: list[tuple[int, int]] = []
    with ShardWriter(loc, name) as writer:
        for page in _pages(ids, READ_PAGE_ITEMS):
            with db.connect() as conn:
                stored = reads.stored_items(conn, page)
            rows = [shard_row(item, images) for item in stored if item.shard_uri is None]
            written += [(row.item_id, len(written) + i) for i, row in enumerate(rows)]
            writer.write(rows)
        writer.commit()
    with db.begin() as conn:
        moved = compaction.mark_compacted(conn, loc.uri(name), written)
    log.info("compacted %d items into %s", moved, loc.uri(name), extra={"action": "compacted"})
    return moved


def remove_orphans(db: Engine, run: run_queries.RunInfo, loc: Location) -> list[str]:
    """Delete shards of the folder no item points at (a compaction that died before its ledger
    update) and temporary files of killed writers; call only while holding the run's lock.

    Each shard is looked up by the id range its name carries (a probe that stops at its
    first item), so the check costs O(shards), not a read of every compacted item; by name,
    not full URL: a storage URL spelled differently must never make live shards look
    unreferenced."""
    names = list_names(loc, prefix=SHARD_PREFIX, suffix=SHARD_SUFFIX)
    orphans = []
    with db.connect() as conn:
        database.limit_periodic(conn, timeout_s=database.SCAN_TIMEOUT_S)
        for name in names:
            ids = shard_ids(name)
            if ids is not None and not compaction.shard_referenced(conn, run.id, name, *ids):
                orphans.append(name)
    if loc.local:
        orphans += list_names(loc, prefix=f".{SHARD_PREFIX}", suffix=".tmp")
    if orphans:
        log.info(
            "removing %d unreferenced shards of run %s: %s",
            len(orphans),
            run.name,
            orphans,
            extra={"action": "shards_removed"},
        )
        remove_objects(loc, orphans)
    return orphans


def compact_due(db: Engine, settings: Settings) -> list[CompactionReport]:
    """The periodic task's body: compact every run with at least compact_min_items finished
    items still in the ledger."""
    with db.connect() as conn:
        database.limit_periodic(conn, timeout_s=database.SCAN_TIMEOUT_S)
        due = compaction.runs_with_compactable(conn, settings.compact_min_items)
    return [compact_run(db, settings, run) for run in due]


def remove_run_shards(settings: Settings, run: run_queries.RunInfo) -> list[str]:
    """Delete every compacted shard (and a killed writer's temporary file) of a run that is
    being deleted: nothing refers to them any more. Returns the names removed."""
    loc = compaction_location(settings, run.name, run.storage_url)
    names = list_names(loc, prefix=SHARD_PREFIX, suffix=SHARD_SUFFIX)
    if loc.local:
        names += list_names(loc, prefix=f".{SHARD_PREFIX}", suffix=".tmp")
    remove_objects(loc, names)
    return names
