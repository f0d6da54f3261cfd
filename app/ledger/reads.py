"""Reading results: a run's counts (RunCounts) and its items as stored (StoredItem), streamed
in id order by keyset pages over items and the archive, compacted arrays read back from shards."""

from __future__ import annotations

import heapq
import itertools
import random
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Any

from sqlalchemy import (
    BigInteger,
    Connection,
    Select,
    String,
    Table,
    and_,
    case,
    func,
    literal,
    select,
    tuple_,
    union_all,
)

from app.core.images import ImageRef, refs_from_json
from app.core.models import ItemStatus, chain_end_counts
from app.ledger import common, counters, database, image_tokens, run_queries

if TYPE_CHECKING:  # pyarrow loads when items are streamed (export, verify), not with every command
    from app.storage.shards import ShardCache


@dataclass(frozen=True)
class RunCounts:
    run: str
    total: int
    pending: int
    queued: int
    leased: int
    done: int
    failed: int
    truncated: int
    output_tokens: int
    prompt_tokens: int
    # later turns of `--turns all` chains whose previous turn is not done yet
    waiting: int = 0

    @property
    def finished(self) -> bool:
        return self.pending == 0 and self.queued == 0 and self.leased == 0 and self.waiting == 0

    @classmethod
    def of(
        cls,
        run: str,
        statuses: dict[str, int],
        *,
        truncated: int,
        output_tokens: int,
        prompt_tokens: int,
    ) -> RunCounts:
        """The counts of a run from its items per status and its sums."""
        return cls(
            run=run,
            total=sum(statuses.values()),
            pending=statuses.get(ItemStatus.PENDING.value, 0),
            queued=statuses.get(ItemStatus.QUEUED.value, 0),
            leased=statuses.get(ItemStatus.LEASED.value, 0),
            done=statuses.get(ItemStatus.DONE.value, 0),
            failed=statuses.get(ItemStatus.FAILED.value, 0),
            truncated=truncated,
            output_tokens=output_tokens,
            prompt_tokens=prompt_tokens,
            waiting=statuses.get(ItemStatus.WAITING.value, 0),
        )

    def tallies(self) -> dict[str, int]:
        """Every count but the run's name (what an archived run keeps)."""
        return {k: v for k, v in self.to_json().items() if k != "run"}

    def to_json(self) -> dict[str, Any]:
        return {
            "run": self.run,
            "total": self.total,
            "waiting": self.waiting,
            "pending": self.pending,
            "queued": self.queued,
            "leased": self.leased,
            "done": self.done,
            "failed": self.failed,
            "truncated": self.truncated,
            "output_tokens": self.output_tokens,
            "prompt_tokens": self.prompt_tokens,
        }


def run_counts(conn: Connection, run: run_queries.RunInfo) -> RunCounts:
    """The run's items by status and its token sums, read from the item counters (no scan);
    an archived run's from the counts its archive kept (counted while it is archived)."""
    archived_at, kept = conn.execute(
        select(common.runs.c.archived_at, common.runs.c.archived_counts).where(
            common.runs.c.id == run.id
        )
    ).one()
    if archived_at is not None:  # the archive's rows left the counters with the hot table
        if kept is not None:
            return RunCounts(run=run.name, **kept)
        return scanned_run_counts(conn, run)
    groups = counters.counted_groups(conn, run.id)
    statuses = counters.by_status(groups.items())
    tallies = groups.values()
    return RunCounts.of(
        run.name,
        statuses,
        truncated=sum(t.items for k, t in groups.items() if k.finish_reason == "length"),
        output_tokens=sum(t.completion_tokens for t in tallies),
        prompt_tokens=sum(t.prompt_tokens for t in tallies),
    )


def scanned_run_counts(conn: Connection, run: run_queries.RunInfo) -> RunCounts:
    """An archived run's items by status and token sums, counted over items and the archive."""
    by_status: dict[str, int] = {}
    trunc = out_tokens = prompt_tokens = 0
    # an archived run's rows are in the archive (and in both while it is being archived)
    for table in (common.items, common.items_archive):
        truncated = case((table.c.finish_reason == "length", 1), else_=0)
        stmt = (
            select(
                table.c.status,
                func.count(),
                func.coalesce(func.sum(truncated), 0),
                func.coalesce(func.sum(table.c.completion_tokens), 0),
                func.coalesce(func.sum(table.c.prompt_tokens), 0),
            )
            .where(table.c.run_id == run.id)
            .group_by(table.c.status)
        )
        if table is common.items_archive:  # rows copied and not yet deleted are counted once
            stmt = stmt.where(
                ~select(common.items.c.id).where(common.items.c.id == table.c.id).exists()
            )
        for status, count, t, out, prompt in conn.execute(stmt):
            by_status[status] = by_status.get(status, 0) + int(count)
            trunc += int(t)
            out_tokens += int(out)
            prompt_tokens += int(prompt)
    return RunCounts.of(
        run.name, by_status, truncated=trunc, output_tokens=out_tokens, prompt_tokens=prompt_tokens
    )


@dataclass(frozen=True)
class StoredItem:
    id: int
    item_key: str
    sample_index: int
    status: str
    messages: list[dict[str, Any]] | None
    prompt_ids: list[int]
    output_ids: list[int] | None
    finish_reason: str | None
    completion_tokens: int | None
    attempts: int
    server: str | None
    error: str | None
    latency_s: float | None
    # the server's reported prompt count once done (len(prompt_ids) before), the stop it
    # matched (an id, a stop string or a JSON list, as text) and the conversation turn
    prompt_tokens: int | None = None
    matched_stop: str | None = None
    turn_index: int = 0
    cached_tokens: int | None = None
    # compacted: the token arrays above were read from row shard_row of this Parquet shard
    shard_uri: str | None = None
    shard_row: int | None = None
    # what else built the prompt: the row's tools and its merged kwargs (None: the run's)
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # the row's fields that are not template inputs, exported with each sample
    metadata: dict[str, Any] | None = None
    # provenance once done: the weights that made it and the sampling_params it was sent;
    # and the row's own sampling_params (merged over the run's)
    weight_version: str | None = None
    sampling_params: dict[str, Any] | None = None
    row_sampling_params: dict[str, Any] | None = None
    # an image item: its images in prompt order (ImageRef.to_json each) and, once done, how
    # many ids the server made of each image's placeholder (prompt_ids hold one per image)
    images: list[dict[str, Any]] | None = None
    image_token_counts: list[int] | None = None
    run_id: int | None = None
    # continue_final_message applied: the text appended after the generation prompt
    assistant_prefix: str | None = None
    # an agentic chain's last kept turn: how the chain ended (CHAIN_END_*)
    chain_end: str | None = None

    @property
    def image_refs(self) -> tuple[ImageRef, ...]:
        """The item's images as ImageRefs (empty for a text item)."""
        return refs_from_json(self.images)


# StoredItem's fields that are columns of items (and of items_archive) under their own names
_STORED_FIELDS = (
    "id",
    "item_key",
    "sample_index",
    "status",
    "messages",
    "prompt_ids",
    "output_ids",
    "finish_reason",
    "completion_tokens",
    "attempts",
    "server",
    "error",
    "latency_s",
    "prompt_tokens",
    "matched_stop",
    "turn_index",
    "cached_tokens",
    "shard_uri",
    "shard_row",
    "chat_template_kwargs",
    "weight_version",
    "sampling_params",
    "row_sampling_params",
    "images",
    "image_token_counts",
    "run_id",
    "assistant_prefix",
    "chain_end",
)


def _stored_select(table: Table) -> Select[Any]:
    """StoredItems of items or items_archive, with their tools list."""
    return select(
        *(table.c[name] for name in _STORED_FIELDS),
        common.tool_sets.c.tools.label("tools"),
        table.c.row_metadata.label("metadata"),
    ).select_from(table.outerjoin(common.tool_sets, common.tool_sets.c.id == table.c.tool_set_id))


class _Placeholders:
    """The placeholder id of each run a page's items come from, looked up once per run."""

    def __init__(self, conn: Connection) -> None:
        self._conn = conn
        self._ids: dict[int, int | None] = {}

    def of(self, run_id: int | None) -> int | None:
        if run_id is None:
            return None
        if run_id not in self._ids:
            pins = image_tokens.run_image_pins(self._conn, run_id)
            self._ids[run_id] = None if pins is None else pins.placeholder_id
        return self._ids[run_id]


def request_ids(served: Sequence[int], placeholder_id: int) -> list[int]:
    """The request ids of a served prompt: each run of placeholder ids back to one. A compacted
    shard holds the served ids; the ledger (and the template check) the ids that were sent.
    Exact as long as a request never has two placeholders side by side, which the template
    cannot render (each image sits between its begin and end marks) and
    `app.core.images.served_counts` relies on as well."""
    out: list[int] = []
    for position, token in enumerate(served):
        if token == placeholder_id and position > 0 and served[position - 1] == placeholder_id:
            continue
        out.append(token)
    return out


def _hydrated(
    page: list[StoredItem], shards: ShardCache, placeholders: _Placeholders
) -> list[StoredItem]:
    """The page with the token arrays of compacted items read back from their shards (an
    image item's prompt as it was sent: the shard holds it as served)."""
    out = []
    for item in page:
        if item.shard_uri is not None and item.shard_row is not None:
            prompt_ids, output_ids = shards.arrays(item.shard_uri, item.shard_row, item.id)
            placeholder = placeholders.of(item.run_id) if item.image_token_counts else None
            if placeholder is not None:
                prompt_ids = request_ids(prompt_ids, placeholder)
            item = replace(item, prompt_ids=prompt_ids, output_ids=output_ids)
        out.append(item)
    return out


def hydrated_items(conn: Connection, ids: Sequence[int]) -> list[StoredItem]:
    """stored_items with the token arrays of compacted items read back from their shards."""
    from app.storage.shards import ShardCache

    shards = ShardCache(None)
    try:
        return _hydrated(stored_items(conn, ids), shards, _Placeholders(conn))
    finally:
        shards.close()


def iter_items(
    conn: Connection,
    run_id: int,
    *,
    statuses: Sequence[str] = (ItemStatus.DONE.value,),
    page_size: int = 1000,
    storage_options: dict[str, Any] | None = None,
    final_turns_only: bool = False,
) -> Iterator[StoredItem]:
    """Stream a run's items in id order, a page at a time (memory stays flat).

    Compacted items come with their real token arrays, read from their shards (with
    storage_options, default the configured ones); one row group of a shard is held at a time.
    final_turns_only: only items no later turn follows (the last turn of each chain).
    """
    from app.storage.shards import ShardCache

    shards = ShardCache(storage_options)
    try:
        yield from _iter_items(conn, run_id, statuses, page_size, shards, final_turns_only)
    finally:
        shards.close()


def _iter_items(
    conn: Connection,
    run_id: int,
    statuses: Sequence[str],
    page_size: int,
    shards: ShardCache,
    final_turns_only: bool = False,
) -> Iterator[StoredItem]:
    streams = [
        _keyset_pages(conn, table, run_id, status, page_size, final_turns_only)
        for table in (common.items, common.items_archive)
        for status in dict.fromkeys(statuses)
    ]
    placeholders = _Placeholders(conn)
    for page in merged_pages(streams, page_size):
        yield from _hydrated(page, shards, placeholders)


def _keyset_pages(
    conn: Connection,
    table: Table,
    run_id: int,
    status: str,
    page_size: int,
    final_turns_only: bool,
) -> Iterator[list[StoredItem]]:
    """Pages of one status of a run in one table: `run_id = ? AND status = ? AND id > last
    ORDER BY id LIMIT n`, one range of the (run_id, status, id) index, so a page costs the
    same at row 10M as at row 0 (an IN list of statuses would read them all and sort)."""
    database.pin_index_plans(conn)
    after = 0
    while True:
        stmt = (
            _stored_select(table)
            .where(common.run_status_range(conn, table, run_id, status, after))
            .order_by(*common.run_status_order(table))
            .limit(page_size)
        )
        if final_turns_only:
            later = table.alias("later")
            stmt = stmt.where(
                ~select(later.c.id).where(later.c.prev_item_id == table.c.id).exists()
            )
        page = [StoredItem(**row._mapping) for row in conn.execute(stmt)]
        if not page:
            return
        yield page
        if len(page) < page_size:
            return
        after = page[-1].id


def prompt_item_ids(conn: Connection, run_id: int) -> list[int]:
    """Ids of the run's items whose prompt was rendered from messages (every turn that has
    its prompt; not pre-tokenized items, not later turns still waiting), in id order, from
    the hot table and the archive (a row in both while it is being archived comes once)."""
    found: set[int] = set()
    for table in (common.items, common.items_archive):
        stmt = select(table.c.id).where(
            table.c.run_id == run_id,
            table.c.messages.is_not(None),
            table.c.status != ItemStatus.WAITING.value,
        )
        found.update(int(i) for i in conn.execute(stmt).scalars())
    return sorted(found)


# The sampled read of the parity preflight: a run of fewer ids than this (or than
# SAMPLE_SCAN_FACTOR times the sample) is read whole; a larger one is sampled by drawing ids
# in its id range and taking, for each, the first prompt at or after it within
# SAMPLE_WINDOW_IDS ids (through the primary key), in at most SAMPLE_ROUNDS rounds of draws.
SAMPLE_SCAN_IDS = 1000
SAMPLE_SCAN_FACTOR = 16
SAMPLE_WINDOW_IDS = 64
SAMPLE_ROUNDS = 4
_PROMPT_STATUSES = tuple(s.value for s in ItemStatus if s is not ItemStatus.WAITING)


def sample_prompt_item_ids(conn: Connection, run_id: int, sample: int, seed: int) -> list[int]:
    """Up to `sample` ids of prompt_item_ids(run_id), drawn with the seed (the same seed and
    rows, the same ids), in id order. A few statements of O(sample) index reads, whatever the
    run's size: its id range comes from the ends of its status ranges of the (run_id, status,
    id) index, and each draw reads at most SAMPLE_WINDOW_IDS rows of the primary key. A large
    run whose prompts are sparse (mostly pre-tokenized) may give fewer than `sample`."""
    if sample <= 0:
        return []
    database.pin_index_plans(conn)
    span = _id_span(conn, run_id)
    if span is None:
        return []
    lo, hi = span
    rng = random.Random(seed)
    if hi - lo < max(SAMPLE_SCAN_IDS, SAMPLE_SCAN_FACTOR * sample):
        ids = prompt_item_ids(conn, run_id)
        return ids if sample >= len(ids) else sorted(rng.sample(ids, sample))
    found: set[int] = set()
    for _ in range(SAMPLE_ROUNDS):  # each round draws what is still missing
        drawn = _prompts_at(conn, run_id, [rng.randint(lo, hi) for _ in range(sample - len(found))])
        found.update(drawn)
        if not drawn or len(found) >= sample:  # a round that finds nothing: prompts are rare
            break
    return sorted(found)


def _id_span(conn: Connection, run_id: int) -> tuple[int, int] | None:
    """The lowest and highest id of the run's items that may hold a prompt (not waiting), in
    the hot table and the archive: both ends of each status range of the (run_id, status, id)
    index, each an `ORDER BY run_id, status, id LIMIT 1` (descending for the last) over a range
    that only that index delivers in order (as run_status_range), in subqueries correlated
    with the statuses (a union of ten arms took 6-12 ms to plan). `min(id)` with the same
    filters let the planner walk the primary key instead: 12.7 s at 1M items on stale
    statistics, for a status the run had no item of."""
    statuses = union_all(
        *(select(literal(s, String).label("status")) for s in _PROMPT_STATUSES)
    ).subquery()

    def end(table: Table, last: bool) -> Any:
        status = statuses.c.status
        if conn.dialect.name != "postgresql":
            where: Any = and_(table.c.run_id == run_id, table.c.status == status)
        elif last:
            where = and_(
                table.c.run_id == run_id,
                tuple_(table.c.status, table.c.id) <= tuple_(status, _MAX_ID),
                table.c.status >= status,
            )
        else:
            where = and_(
                table.c.run_id == run_id,
                tuple_(table.c.status, table.c.id) > tuple_(status, 0),
                table.c.status <= status,
            )
        order = common.run_status_order(table)
        probe = select(table.c.id).where(where)
        probe = probe.order_by(*(c.desc() for c in order) if last else order)
        return probe.limit(1).correlate(statuses).scalar_subquery()

    stmt = select(
        *(
            end(table, last)
            for table in (common.items, common.items_archive)
            for last in (False, True)
        )
    ).select_from(statuses)
    ends = [int(i) for row in conn.execute(stmt) for i in row if i is not None]
    return (min(ends), max(ends)) if ends else None


_MAX_ID = 2**63 - 1


def _prompts_at(conn: Connection, run_id: int, ats: Sequence[int]) -> set[int]:
    """For each drawn id, the first id at or after it (within SAMPLE_WINDOW_IDS) of the run's
    items rendered from messages, in the hot table or the archive: one statement for all."""
    # a union of literals, not VALUES: SQLite names no columns of a VALUES list
    draws = union_all(*(select(literal(at, BigInteger).label("at")) for at in ats)).subquery()

    def first(table: Table) -> Any:
        return (
            select(table.c.id)
            .where(
                table.c.id >= draws.c.at,
                table.c.id < draws.c.at + SAMPLE_WINDOW_IDS,
                table.c.run_id == run_id,
                table.c.messages.is_not(None),
                table.c.status != ItemStatus.WAITING.value,
            )
            .order_by(table.c.id)
            .limit(1)
            .correlate(draws)
            .scalar_subquery()
        )

    stmt = select(first(common.items), first(common.items_archive)).select_from(draws)
    return {min(i for i in row if i is not None) for row in conn.execute(stmt) if any(row)}


def stored_prompts(
    conn: Connection, ids: Sequence[int], storage_options: dict[str, Any] | None = None
) -> list[StoredItem]:
    """These items with their real prompt ids (read back from shards once compacted)."""
    from app.storage.shards import ShardCache

    shards = ShardCache(storage_options)
    try:
        return _hydrated(stored_items(conn, ids), shards, _Placeholders(conn))
    finally:
        shards.close()


def merged_pages(streams: Sequence[Iterator[list[Any]]], page_size: int) -> Iterator[list[Any]]:
    """Pages of rows (anything with an `id`) from id-ordered page streams, merged in id order;
    a row in two streams (a run being archived: copied, not yet deleted) comes once."""
    rows = heapq.merge(*(itertools.chain.from_iterable(s) for s in streams), key=lambda r: r.id)
    page: list[Any] = []
    last = None
    for row in rows:
        if row.id == last:
            continue
        last = row.id
        page.append(row)
        if len(page) >= page_size:
            yield page
            page = []
    if page:
        yield page


def stored_items(conn: Connection, ids: Sequence[int]) -> list[StoredItem]:
    """These items as stored in the ledger (not hydrated), in id order, from the hot table
    and the archive (a row in both while it is being archived comes once): primary-key probes,
    even of an archive the statistics think empty."""
    if not ids:
        return []
    database.pin_index_plans(conn)
    found: dict[int, StoredItem] = {}
    for table in (common.items_archive, common.items):  # the hot row wins: the archive copies it
        stmt = _stored_select(table).where(table.c.id.in_(list(ids)))
        found.update((row.id, StoredItem(**row._mapping)) for row in conn.execute(stmt))
    return [found[i] for i in sorted(found)]


def done_weight_versions(conn: Connection, run_id: int) -> dict[str | None, int]:
    """The run's done samples per weight version (None: results stored before versions were)."""
    counts: dict[str | None, int] = {}
    for table in (common.items, common.items_archive):
        stmt = (
            select(table.c.weight_version, func.count())
            .where(table.c.run_id == run_id, table.c.status == ItemStatus.DONE.value)
            .group_by(table.c.weight_version)
        )
        for version, n in conn.execute(stmt):
            counts[version] = counts.get(version, 0) + int(n)
    return counts


def chain_endings(conn: Connection, run_id: int) -> dict[str, int]:
    """The run's agentic chains counted by how they ended, archived rows included: read from
    its chain ending counters (O(reasons)); while the run is being archived (its rows in both
    tables) counted from its ended chains' last turns, each row once."""
    archived_at, kept = conn.execute(
        select(common.runs.c.archived_at, common.runs.c.archived_counts).where(
            common.runs.c.id == run_id
        )
    ).one()
    if archived_at is not None and kept is None:
        return scanned_chain_endings(conn, run_id)
    c = chain_end_counts.c
    stmt = (
        select(c.chain_end, func.sum(c.chain_count)).where(c.run_id == run_id).group_by(c.chain_end)
    )
    return {str(reason): int(n) for reason, n in sorted(conn.execute(stmt)) if int(n) != 0}


def scanned_chain_endings(conn: Connection, run_id: int) -> dict[str, int]:
    """The same counts as chain_endings, counted over the rows (O(the run's chains))."""
    counts: dict[str, int] = {}
    for table in (common.items, common.items_archive):
        stmt = (
            select(table.c.chain_end, func.count())
            .where(table.c.run_id == run_id, table.c.chain_end.is_not(None))
            .group_by(table.c.chain_end)
        )
        if table is common.items_archive:
            stmt = stmt.where(
                ~select(common.items.c.id).where(common.items.c.id == table.c.id).exists()
            )
        for reason, n in conn.execute(stmt):
            counts[str(reason)] = counts.get(str(reason), 0) + int(n)
    return dict(sorted(counts.items()))
