"""Claims and leases: items leased to one worker (by id, or straight from the ledger), the
candidates and marks for a hedged second copy, and the heartbeat that extends a worker's leases."""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any

from sqlalchemy import Connection, and_, bindparam, func, or_, select, tuple_, update

from app.core.images import ImageRef, refs_from_json
from app.core.models import ItemStatus, item_counts
from app.ledger import common, database

CLAIMABLE = (ItemStatus.PENDING.value, ItemStatus.QUEUED.value)


@dataclass(frozen=True)
class ClaimedItem:
    """An item leased to one worker: everything needed to send it, nothing more."""

    id: int
    run_id: int
    sample_index: int
    prompt_ids: list[int]
    attempts: int
    item_key: str = ""
    turn_index: int = 0
    # the row's own sampling_params, merged over the run's when the request is built
    row_sampling_params: dict[str, Any] | None = None
    # the prompt's images in the order of its placeholders (empty: a text item)
    images: tuple[ImageRef, ...] = ()
    # the server that refused it for a reason that can depend on the server (None: none did):
    # another server's refusal confirms the failure
    refused_by: str | None = None


_CLAIM_COLUMNS = (
    common.items.c.id,
    common.items.c.run_id,
    common.items.c.sample_index,
    common.items.c.prompt_ids,
    common.items.c.attempts,
    common.items.c.item_key,
    common.items.c.turn_index,
    common.items.c.row_sampling_params,
    common.items.c.images,
    common.items.c.refused_by,
)


def _claimed(row: Any) -> ClaimedItem:
    fields = dict(row._mapping)
    fields["images"] = refs_from_json(fields.get("images"))
    return ClaimedItem(**fields)


def _text_only() -> Any:
    """Items without images: all a server that reads no images may claim."""
    return common.items.c.images.is_(None)


def claimable(now: datetime) -> Any:
    """Whether a row found by its id or key may be claimed (its status read as
    common.status_of_found says, so the rows come from the primary key or the run's keys)."""
    status = common.status_of_found()
    return or_(
        status.in_(CLAIMABLE),
        and_(status == ItemStatus.LEASED.value, common.items.c.lease_expires_at < now),
    )


def claim_items(
    conn: Connection,
    ids: Sequence[int],
    *,
    owner: str,
    server: str,
    lease_s: float,
    text_only: bool = False,
) -> list[ClaimedItem]:
    """Lease the given items to owner if nobody holds them; already-leased or finished items
    are skipped, so a redelivered message claims nothing. text_only: items with images are
    skipped too (the server reads no images; `claimable_image_items` names them)."""
    if not ids:
        return []
    now = common.utcnow()
    where = [
        common.items.c.id.in_(common._in_id_order(conn, ids)),
        claimable(now),
        _not_refused_by(server),
    ]
    if text_only:
        where.append(_text_only())
    stmt = (
        update(common.items)
        .where(*where)
        .values(
            status=ItemStatus.LEASED.value,
            lease_owner=owner,
            lease_expires_at=now + timedelta(seconds=lease_s),
            server=server,
            started_at=now,
            hedge_owner=None,
        )
        .returning(*_CLAIM_COLUMNS)
    )
    claimed = [_claimed(row) for row in conn.execute(stmt)]
    claimed.sort(key=lambda c: c.id)
    return claimed


def _not_refused_by(server: str) -> Any:
    """Items this server did not refuse: one it refused waits for another server's verdict."""
    return or_(common.items.c.refused_by.is_(None), common.items.c.refused_by != server)


def refused_here(conn: Connection, ids: Sequence[int], server: str) -> list[int]:
    """Which of these items server refused and are still to be claimed: what its claim passed
    over, to go back to the queue for another server."""
    if not ids:
        return []
    stmt = select(common.items.c.id).where(
        common.items.c.id.in_(list(ids)),
        common.items.c.refused_by == server,
        claimable(common.utcnow()),
    )
    return sorted(int(i) for i in conn.execute(stmt).scalars())


def claimable_image_items(conn: Connection, ids: Sequence[int]) -> list[int]:
    """Which of these items have images and are still to be claimed: what a server that
    reads no images passed over, to go back to the queue for one that does."""
    if not ids:
        return []
    stmt = select(common.items.c.id).where(
        common.items.c.id.in_(list(ids)),
        common.items.c.images.is_not(None),
        claimable(common.utcnow()),
    )
    return sorted(int(i) for i in conn.execute(stmt).scalars())


def _claimable_rows(
    conn: Connection,
    run_id: int,
    limit: int,
    now: datetime,
    *columns: Any,
    text_only: bool = False,
    server: str | None = None,
) -> Iterator[Any]:
    """Rows (of these columns) of the run's claimable items: pending, then queued (each one
    range of the (run_id, status, id) index, in id order), then expired leases (a range of
    (status, lease_expires_at)), at most limit of each. A claim reads what it takes, never
    the done rows before it. Rows another claim holds are skipped (Postgres). text_only:
    items without images only; server: not the items it refused."""
    only = [_text_only()] if text_only else []
    mine = [_not_refused_by(server)] if server is not None else []
    ranges = [
        select(*columns)
        .where(
            common.claimable_kind_range(conn, run_id, status, images=False)
            if text_only
            else common.run_status_range(conn, common.items, run_id, status, 0),
            *mine,
        )
        .order_by(*common.run_status_order(common.items))
        for status in CLAIMABLE
    ]
    ranges.append(
        select(*columns)
        .where(
            common.items.c.status == ItemStatus.LEASED.value,
            common.items.c.lease_expires_at < now,
            common.items.c.run_id == run_id,
            *only,
            *mine,
        )
        .order_by(common.items.c.status, common.items.c.lease_expires_at)
    )
    database.pin_index_plans(conn)
    for pick in ranges:
        if conn.dialect.name == "postgresql":
            pick = pick.with_for_update(skip_locked=True)
        yield from conn.execute(pick.limit(limit)).all()


def claim_next(
    conn: Connection,
    *,
    owner: str,
    server: str,
    lease_s: float,
    limit: int,
    run_id: int | None = None,
    text_only: bool = False,
) -> list[ClaimedItem]:
    """Lease up to limit claimable items of the run (of every run, oldest run first, without
    one) straight from the ledger (the embedded runner's feed); text_only: items without
    images only (the server reads none), the others stay queued for a server that does."""
    if limit <= 0:
        return []
    now = common.utcnow()
    everyone = select(common.runs.c.id).order_by(common.runs.c.id)
    run_ids = [run_id] if run_id is not None else list(conn.execute(everyone).scalars())
    found = itertools.chain.from_iterable(
        _claimable_rows(conn, r, limit, now, common.items.c.id, text_only=text_only, server=server)
        for r in run_ids
    )
    ids = [row.id for row in itertools.islice(found, limit)]
    return claim_items(conn, ids, owner=owner, server=server, lease_s=lease_s, text_only=text_only)


def item_keys(conn: Connection, ids: Sequence[int]) -> dict[int, tuple[int, str]]:
    """id → (run id, item key) of these items (what a message's ids group by)."""
    if not ids:
        return {}
    stmt = select(common.items.c.id, common.items.c.run_id, common.items.c.item_key).where(
        common.items.c.id.in_(list(ids))
    )
    return {int(r[0]): (int(r[1]), str(r[2])) for r in conn.execute(stmt)}


def claim_next_groups(
    conn: Connection,
    *,
    owner: str,
    server: str,
    lease_s: float,
    limit: int,
    run_id: int,
    text_only: bool = False,
) -> list[ClaimedItem]:
    """Lease the claimable items of up to limit keys of a run, every claimable item of a key
    together (a `--turns each` conversation runs on one server); keys in the order their
    first claimable item comes. The keys are read from the claimable ids in index order until
    limit of them are found (a conversation's items are consecutive), never by grouping
    every claimable row of the run. text_only: keys with no claimable image item only (a
    conversation with an image waits, whole, for a server that reads images)."""
    if limit <= 0:
        return []
    now = common.utcnow()
    keys: dict[str, None] = {}  # in the order their first claimable item comes
    seen: set[str] = set()
    rows = _claimable_rows(
        conn,
        run_id,
        16 * limit,
        now,
        common.items.c.id,
        common.items.c.item_key,
        text_only=text_only,
    )
    for row in rows:
        if row.item_key in seen:
            continue
        seen.add(row.item_key)
        keys.setdefault(row.item_key)
        if len(keys) >= limit and text_only:
            _drop_keys_with_images(conn, run_id, keys, now)
        if len(keys) >= limit:
            break
    if text_only:
        _drop_keys_with_images(conn, run_id, keys, now)
    if not keys:
        return []
    pick = select(common.items.c.id).where(_of_keys(run_id, keys), claimable(now))
    ids = list(conn.execute(pick).scalars())
    return claim_items(conn, ids, owner=owner, server=server, lease_s=lease_s, text_only=text_only)


def _of_keys(run_id: int, keys: Iterable[str]) -> Any:
    """The run's items of these keys, as (run_id, item_key) pairs: each pair one probe of
    the run's unique keys. `run_id = ? AND item_key IN (...)` let the planner, on the
    statistics of before an enqueue, read the run's whole range of (run_id, status, id)."""
    return tuple_(common.items.c.run_id, common.items.c.item_key).in_([(run_id, k) for k in keys])


def _drop_keys_with_images(
    conn: Connection, run_id: int, keys: dict[str, None], now: datetime
) -> None:
    """Take out of keys the conversations with a claimable image item."""
    if not keys:
        return
    with_images = select(common.items.c.item_key).where(
        _of_keys(run_id, keys),
        common.items.c.images.is_not(None),
        claimable(now),
    )
    for key in conn.execute(with_images).scalars():
        keys.pop(key, None)


def hedge_candidates(
    conn: Connection,
    *,
    server: str,
    limit: int,
    skip_runs: Sequence[int] = (),
    text_only: bool = False,
) -> list[tuple[int, int]]:
    """(item id, run id) of up to `limit` items worth a second copy on `server` ("hedging"):
    leased to another server, not hedged yet, in runs with nothing left to claim (the end of
    a run, when `server` would otherwise idle) and not in skip_runs (runs `server` may not
    serve); the highest-priority run's first (the claim order's), then the longest-running.
    text_only: items without images only."""
    if limit <= 0:
        return []
    database.pin_index_plans(conn)
    # Three small steps instead of one anti-join, whose plan (a nested loop over a scan of
    # the whole table) the planner picked at the end of a run: the runs of the live leases
    # (read through an index of leases), one indexed probe per run, then the oldest leases.
    live = and_(
        common.items.c.status == ItemStatus.LEASED.value,
        common.items.c.lease_expires_at > common.utcnow(),
        common.items.c.server != server,
        common.items.c.hedge_owner.is_(None),
    )
    leased_runs = conn.execute(select(common.items.c.run_id).where(live).distinct()).scalars()
    ending = [r for r in leased_runs if r not in skip_runs and not claimable_left(conn, r)]
    if not ending:
        return []
    # one read of the runs' priorities, then the oldest leases of each priority in turn (each
    # step walks the lease index in its order; a join sorting by priority would sort them all)
    priority_of = {
        int(r[0]): int(r[1])
        for r in conn.execute(
            select(common.runs.c.id, common.runs.c.priority).where(common.runs.c.id.in_(ending))
        )
    }
    picked: list[tuple[int, int]] = []
    for level in sorted(set(priority_of.values()), reverse=True):
        level_runs = [r for r in ending if priority_of.get(r) == level]
        pick = (
            select(common.items.c.id, common.items.c.run_id)
            .where(
                live, common.items.c.run_id.in_(level_runs), *([_text_only()] if text_only else [])
            )
            .order_by(common.items.c.started_at, common.items.c.id)
            .limit(limit - len(picked))
        )
        picked += [(int(r[0]), int(r[1])) for r in conn.execute(pick)]
        if len(picked) >= limit:
            break
    return picked


def claimable_left(conn: Connection, run_id: int) -> bool:
    """Whether the run still has items to claim (pending or queued)."""
    return run_has_items(conn, run_id, CLAIMABLE)


def text_items_left(conn: Connection, run_id: int) -> bool:
    """Whether the run has claimable items without images (what a server that reads no
    images may still take)."""
    rows = _claimable_rows(conn, run_id, 1, common.utcnow(), common.items.c.id, text_only=True)
    return next(rows, None) is not None


def image_items_left(conn: Connection, run_id: int) -> bool:
    """Whether the run has claimable items with images (what only a server that understands
    images may take): a probe of ix_items_image_claimable per status, which holds the
    claimable image items only (a run of text items has none to read past)."""
    database.pin_index_plans(conn)
    for status in CLAIMABLE:
        probe = select(common.items.c.id).where(
            common.claimable_kind_range(conn, run_id, status, images=True)
        )
        if (
            conn.execute(probe.order_by(*common.run_status_order(common.items)).limit(1)).first()
            is not None
        ):
            return True
    return False


def run_has_items(conn: Connection, run_id: int, statuses: Iterable[str]) -> bool:
    """Whether the run has an item in one of these statuses, read from the item counters
    (the triggers keep them in the transaction of every change of an item): the run's
    counter rows, however many items it has. A probe of the (run_id, status, id) index
    instead costs what the index holds of that status, dead entries included: the first one
    after a bulk change of a million items took 1.5 s."""
    c = item_counts.c
    stmt = select(func.coalesce(func.sum(c.item_count), 0)).where(
        c.run_id == run_id, c.status.in_(list(statuses))
    )
    return int(conn.execute(stmt).scalar_one()) > 0


def mark_hedged(conn: Connection, ids: Sequence[int], *, owner: str) -> list[ClaimedItem]:
    """Mark items as hedged by owner and return what a copy needs; the lease stays with its
    holder and the first result written wins. Conditional, so of two hedgers racing for an
    item one gets it; an item finished or released meanwhile is skipped."""
    if not ids:
        return []
    stmt = (
        update(common.items)
        .where(
            common.items.c.id.in_(common._in_id_order(conn, ids)),
            common.items.c.status == ItemStatus.LEASED.value,
            common.items.c.hedge_owner.is_(None),
        )
        .values(hedge_owner=owner)
        .returning(*_CLAIM_COLUMNS)
    )
    order = {item_id: i for i, item_id in enumerate(ids)}
    hedged = [_claimed(row) for row in conn.execute(stmt)]
    hedged.sort(key=lambda c: order[c.id])
    return hedged


def unmark_hedged(conn: Connection, ids: Sequence[int], *, owner: str) -> int:
    """Take back owner's hedge marks (copies that were never sent), so others may hedge."""
    if not ids:
        return 0
    stmt = (
        update(common.items)
        .where(common.items.c.id.in_(list(ids)), common.items.c.hedge_owner == owner)
        .values(hedge_owner=None)
    )
    return conn.execute(stmt).rowcount


_FINISHED_AMONG = select(common.items.c.id, common.items.c.status).where(
    common.items.c.id.in_(bindparam("ids", expanding=True))
)


def finished_among(conn: Connection, ids: Sequence[int]) -> set[int]:
    """Which of these items are done or failed (so a copy still running is wasted)."""
    if not ids:
        return set()
    database.pin_index_plans(conn)
    # by primary key only, the status tested here: no plan can prefer a status index
    final = (ItemStatus.DONE.value, ItemStatus.FAILED.value)
    # one expanding parameter, bound at execution: the hedge round asks this of every request
    # a window has out (1,024 at a time) 5 times a second, and coercing each id into the
    # statement cost the worker more CPU per item the bigger its window (bench/README.md)
    rows = conn.execute(_FINISHED_AMONG, {"ids": list(ids)})
    return {int(item_id) for item_id, status in rows if status in final}


def extend_leases(
    conn: Connection, *, owner: str, lease_s: float, heartbeat_s: float | None = None
) -> int:
    """Heartbeat: push out the expiry of this owner's leases that are past half their term.

    A lease with more than max(lease_s / 2, 2 * heartbeat_s) left is left alone: every renewal
    rewrites the item's row and its index entries (bench/fleet.py), so a row is rewritten once
    per half term (every 150 s by default) instead of at every beat (30 s), and a lease still
    has two beats' worth left when its turn comes. Without heartbeat_s, every lease past half
    its term.

    On Postgres the rows are locked by a `FOR UPDATE SKIP LOCKED` query first: a row that a
    result write holds is being finished (or its retry extends the lease itself), and
    waiting for it while holding other rows is how a heartbeat deadlocked against its own
    worker's writer."""
    now = common.utcnow()
    renew_below_s = max(lease_s / 2, 2 * (heartbeat_s or 0.0))
    mine = and_(
        common.items.c.lease_owner == owner,
        common.items.c.status == ItemStatus.LEASED.value,
        common.items.c.lease_expires_at < now + timedelta(seconds=renew_below_s),
    )
    stmt = update(common.items).values(lease_expires_at=now + timedelta(seconds=lease_s))
    if conn.dialect.name != "postgresql":
        return conn.execute(stmt.where(mine)).rowcount
    # a CTE is locked once (as an IN subquery it was run again for every lease: O(leases²)),
    # and its rows, locked and checked, are then found by primary key only
    locked = select(common.items.c.id).where(mine).with_for_update(skip_locked=True).cte("locked")
    return conn.execute(stmt.where(common.items.c.id == locked.c.id)).rowcount


def lease_owners(conn: Connection, run_id: int) -> list[str]:
    """The owners holding leases of the run's items (one range of the run's leased items)."""
    stmt = (
        select(common.items.c.lease_owner)
        .where(
            common.run_status_range(conn, common.items, run_id, ItemStatus.LEASED.value, 0),
            common.items.c.lease_owner.is_not(None),
        )
        .distinct()
    )
    return sorted(str(owner) for owner in conn.execute(stmt).scalars())


def drop_hedge_marks(conn: Connection, run_id: int, owner: str) -> int:
    """Clear the hedge marks an owner left on the run's leased items (it died), so other
    servers may hedge them."""
    stmt = (
        update(common.items)
        .where(
            common.run_status_range(conn, common.items, run_id, ItemStatus.LEASED.value, 0),
            common.items.c.hedge_owner == owner,
        )
        .values(hedge_owner=None)
    )
    return int(conn.execute(stmt).rowcount)
