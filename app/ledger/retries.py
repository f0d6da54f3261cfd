"""Failed items given another go (`tokenmill retry`): which failed items of a run a selection
takes, and putting them back with fresh attempts; failed items by reason (status, verify).

A retried item is pending again, or waiting when it is a later turn that failed before it had
a prompt (the advancer builds it again); the later turns its failure failed with it wait again
behind it, so a `--turns all` chain resumes from the retried turn. Done items are never touched.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from sqlalchemy import Connection, Table, func, select, update

from app.core.failures import NO_REASON
from app.core.models import ItemStatus
from app.ledger import common

# ids per UPDATE of a retry
RETRY_PAGE = 5_000

SKIP_TRUNCATED = "a turn before it was truncated (done items are never regenerated)"
SKIP_PREVIOUS_FAILED = "a turn before it failed and is not selected"
SKIP_PREVIOUS_UNFINISHED = "a turn before it is not finished"


@dataclass(frozen=True)
class RetrySelection:
    """Which failed items: all of the run, or those whose reason holds `reason` (any case),
    that failed on `server`, or that failed at or after `since`."""

    reason: str | None = None
    server: str | None = None
    since: datetime | None = None

    def takes(self, row: Any) -> bool:
        if self.reason is not None and self.reason.lower() not in (row.fail_reason or "").lower():
            return False
        if self.server is not None and row.server != self.server:
            return False
        finished = common.as_utc(row.finished_at)
        return self.since is None or (finished is not None and finished >= self.since)

    def to_json(self) -> dict[str, Any]:
        return {
            "reason": self.reason,
            "server": self.server,
            "since": self.since.isoformat() if self.since else None,
        }


@dataclass
class RetryPlan:
    """What a retry changes: items back to pending (they have their prompt), back to waiting
    (later turns that failed before they had one), and the later turns of their chains that
    failed with them (back to waiting); by reason, and what the selection took but cannot
    retry, by why."""

    pending: list[int] = field(default_factory=list)
    waiting: list[int] = field(default_factory=list)
    followers: list[int] = field(default_factory=list)
    by_reason: Counter[str] = field(default_factory=Counter)
    skipped: Counter[str] = field(default_factory=Counter)

    @property
    def retried(self) -> int:
        return len(self.pending) + len(self.waiting)

    def to_json(self) -> dict[str, Any]:
        return {
            "retried": self.retried,
            "pending": len(self.pending),
            "waiting": len(self.waiting),
            "later_turns": len(self.followers),
            "by_reason": dict(self.by_reason.most_common()),
            "skipped": dict(self.skipped.most_common()),
        }


# a chain: an item's key and sample; its turns are retried from one turn on
Chain = tuple[str, int]
# what a chosen failed turn becomes, besides a SKIP_* reason
_PENDING = "pending"
_WAITING = "waiting"
_GOES_WITH_PREVIOUS = "goes with the failed turn before it"


def plan_retry(conn: Connection, run_id: int, selection: RetrySelection) -> RetryPlan:
    """The failed items of the run that the selection takes, sorted into a plan. Reads the
    failed items of the run only (the partial index of failed items), never a done one."""
    rows = _failed_rows(conn, run_id)
    plan = RetryPlan()
    roots, stuck = _plan_roots(plan, [r for r in rows if selection.takes(r)])
    _plan_later_turns(plan, rows, roots, stuck, selection)
    return plan


def _failed_rows(conn: Connection, run_id: int) -> list[Any]:
    """The run's failed items in id order, each with the status and finish of its turn before."""
    prev = common.items.alias("prev")
    stmt = (
        select(
            common.items.c.id,
            common.items.c.item_key,
            common.items.c.sample_index,
            common.items.c.turn_index,
            common.items.c.started_at,
            common.items.c.server,
            common.items.c.finished_at,
            common.items.c.fail_reason,
            prev.c.status.label("prev_status"),
            prev.c.finish_reason.label("prev_finish"),
        )
        .select_from(common.items.outerjoin(prev, prev.c.id == common.items.c.prev_item_id))
        .where(common.items.c.run_id == run_id, common.items.c.status == ItemStatus.FAILED.value)
        .order_by(common.items.c.id)
    )
    return list(conn.execute(stmt))


def _retried_as(row: Any) -> str:
    """What a chosen failed turn becomes: pending (it has its prompt), waiting (it failed as
    its prompt was built), nothing of its own (a later turn of a failed one), or skipped, why."""
    if row.turn_index == 0 or row.prev_status is None:
        return _PENDING
    if row.prev_status == ItemStatus.FAILED.value:
        return _GOES_WITH_PREVIOUS
    if row.prev_status != ItemStatus.DONE.value:
        return SKIP_PREVIOUS_UNFINISHED
    if row.prev_finish != "stop":
        return SKIP_TRUNCATED
    return _WAITING if row.started_at is None else _PENDING


def _plan_roots(
    plan: RetryPlan, chosen: list[Any]
) -> tuple[dict[Chain, int], dict[Chain, tuple[int, str]]]:
    """The chosen turns put back into the plan: chain → the turn retried in it, and chain → the
    turn left failed and why."""
    roots: dict[Chain, int] = {}
    stuck: dict[Chain, tuple[int, str]] = {}
    for row in chosen:
        chain = (row.item_key, row.sample_index)
        verdict = _retried_as(row)
        if verdict == _GOES_WITH_PREVIOUS:
            continue  # goes with the failed turn before it, if that one is chosen
        if verdict not in (_PENDING, _WAITING):
            stuck[chain] = (row.turn_index, verdict)
            continue
        (plan.waiting if verdict == _WAITING else plan.pending).append(row.id)
        plan.by_reason[row.fail_reason or NO_REASON] += 1
        roots[chain] = row.turn_index
    return roots, stuck


def _plan_later_turns(
    plan: RetryPlan,
    rows: list[Any],
    roots: dict[Chain, int],
    stuck: dict[Chain, tuple[int, str]],
    selection: RetrySelection,
) -> None:
    """The later turns of the retried chains (back to waiting with them), and the selected
    turns that cannot be retried, counted by why."""
    taken = set(plan.pending) | set(plan.waiting)
    for row in rows:
        chain = (row.item_key, row.sample_index)
        root = roots.get(chain)
        if root is not None and row.turn_index > root:
            plan.followers.append(row.id)
        elif chain in stuck and row.turn_index >= stuck[chain][0]:
            if row.turn_index == stuck[chain][0] or selection.takes(row):
                plan.skipped[stuck[chain][1]] += 1
        elif (
            row.id not in taken
            and row.prev_status == ItemStatus.FAILED.value
            and selection.takes(row)
        ):
            plan.skipped[SKIP_PREVIOUS_FAILED] += 1


def apply_retry(conn: Connection, plan: RetryPlan) -> RetryPlan:
    """Put the plan's items back, each only if it is still failed (two retries at once take
    each item once); the plan of what was changed. Attempts start again at 0."""
    done = RetryPlan(by_reason=plan.by_reason, skipped=plan.skipped)
    done.pending = _reset(conn, plan.pending, ItemStatus.PENDING.value)
    done.waiting = _reset(conn, plan.waiting, ItemStatus.WAITING.value)
    done.followers = _reset(conn, plan.followers, ItemStatus.WAITING.value)
    return done


def _reset(conn: Connection, ids: Sequence[int], status: str) -> list[int]:
    changed: list[int] = []
    for i in range(0, len(ids), RETRY_PAGE):
        page = sorted(ids[i : i + RETRY_PAGE])
        stmt = (
            update(common.items)
            .where(common.items.c.id.in_(page), common.items.c.status == ItemStatus.FAILED.value)
            .values(
                status=status,
                attempts=0,
                error=None,
                fail_reason=None,
                server=None,
                refused_by=None,  # every server may take it again
                lease_owner=None,
                lease_expires_at=None,
                hedge_owner=None,
                queued_at=None,
                started_at=None,
                finished_at=None,
            )
            .returning(common.items.c.id)
        )
        changed += conn.execute(stmt).scalars()
    return sorted(changed)


def still_failed(conn: Connection, ids: Sequence[int]) -> list[int]:
    """Those of these items that are failed now (a retry since puts them back), in id order."""
    found: list[int] = []
    for i in range(0, len(ids), RETRY_PAGE):
        page = sorted(ids[i : i + RETRY_PAGE])
        stmt = select(common.items.c.id).where(
            common.items.c.id.in_(page), common.items.c.status == ItemStatus.FAILED.value
        )
        found += conn.execute(stmt).scalars()
    return sorted(found)


def failed_by_reason(conn: Connection, run_id: int) -> list[tuple[str, int]]:
    """The run's failed items counted by reason, the most common first (archived rows
    included): a read of the failed items only."""
    counts: Counter[str] = Counter()
    for table in (common.items, common.items_archive):
        stmt = _reason_counts(table, run_id)
        if table is common.items_archive:  # rows copied and not yet deleted are counted once
            stmt = stmt.where(
                ~select(common.items.c.id).where(common.items.c.id == table.c.id).exists()
            )
        for reason, n in conn.execute(stmt):
            counts[reason or NO_REASON] += int(n)
    return sorted(counts.items(), key=lambda rn: (-rn[1], rn[0]))


def _reason_counts(table: Table, run_id: int) -> Any:
    """Grouped by the column itself (not an expression of it), so the groups come in the order
    of the partial index of failed rows by reason (ix_items_failed_reason,
    ix_items_archive_failed_reason): no sort, whatever the statistics say."""
    return (
        select(table.c.fail_reason, func.count())
        .where(table.c.run_id == run_id, table.c.status == ItemStatus.FAILED.value)
        .group_by(table.c.fail_reason)
    )
