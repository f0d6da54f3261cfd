"""Multi-turn chains (`--turns all`): each later turn linked to the one before it, moved from
waiting to pending once that one finishes, or failed with the rest of its chain."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from sqlalchemy import Connection, and_, delete, select, update

from app.core.failures import failure_reason
from app.core.models import ItemStatus
from app.ledger import common, database, outcomes, reads


def link_turns(conn: Connection, run_id: int, keys: Sequence[str]) -> int:
    """Point every later turn of these keys at the item of the turn before it (same key and
    sample); idempotent, only unlinked items are touched."""
    if not keys:
        return 0
    prev = common.items.alias("prev")
    prev_id = (
        select(prev.c.id)
        .where(
            prev.c.run_id == common.items.c.run_id,
            prev.c.item_key == common.items.c.item_key,
            prev.c.sample_index == common.items.c.sample_index,
            prev.c.turn_index == common.items.c.turn_index - 1,
        )
        .scalar_subquery()
    )
    stmt = (
        update(common.items)
        .where(
            common.items.c.run_id == run_id,
            common.items.c.item_key.in_(list(keys)),
            common.items.c.turn_index > 0,
            common.items.c.prev_item_id.is_(None),
        )
        .values(prev_item_id=prev_id)
    )
    return conn.execute(stmt).rowcount


@dataclass(frozen=True)
class WaitingTurn:
    """A waiting turn whose previous turn has finished (done or failed): ready to advance.

    context holds the original user/tool turns that lead to this turn's answer."""

    id: int
    run_id: int
    item_key: str
    sample_index: int
    turn_index: int
    context: list[dict[str, Any]]
    prev: reads.StoredItem


def ready_turns(
    conn: Connection,
    *,
    prev_ids: Sequence[int] | None = None,
    run_id: int | None = None,
    after_id: int = 0,
    limit: int = 500,
) -> list[WaitingTurn]:
    """Waiting items whose previous turn is done or failed: the successors of prev_ids (the
    worker's just-committed results), or of a whole run or every run (the catch-up). A run's
    catch-up reads its waiting items as one range of (run_id, status, id), whatever the
    statistics say."""
    if prev_ids is not None and not prev_ids:
        return []
    prev = common.items.alias("prev")
    if run_id is not None:
        database.pin_index_plans(conn)
        waiting = common.run_status_range(
            conn, common.items, run_id, ItemStatus.WAITING.value, after_id
        )
        order: Any = common.run_status_order(common.items)
    else:
        waiting = and_(
            common.items.c.status == ItemStatus.WAITING.value, common.items.c.id > after_id
        )
        order = (common.items.c.id,)
    stmt = (
        select(
            common.items.c.id,
            common.items.c.run_id,
            common.items.c.item_key,
            common.items.c.sample_index,
            common.items.c.turn_index,
            common.items.c.messages,
            common.items.c.prev_item_id,
        )
        .join(prev, prev.c.id == common.items.c.prev_item_id)
        .where(waiting, prev.c.status.in_([ItemStatus.DONE.value, ItemStatus.FAILED.value]))
        .order_by(*order)
        .limit(limit)
    )
    if prev_ids is not None:
        stmt = stmt.where(common.items.c.prev_item_id.in_(list(prev_ids)))
    rows = list(conn.execute(stmt))
    # a later turn is only ever waiting on an uncompacted item (compaction skips those), so
    # the previous turn's arrays are in the ledger
    previous = {s.id: s for s in reads.stored_items(conn, [r.prev_item_id for r in rows])}
    return [
        WaitingTurn(
            id=r.id,
            run_id=r.run_id,
            item_key=r.item_key,
            sample_index=r.sample_index,
            turn_index=r.turn_index,
            context=list(r.messages or []),
            prev=previous[r.prev_item_id],
        )
        for r in rows
    ]


def start_turn(
    conn: Connection, item_id: int, messages: list[dict[str, Any]], prompt_ids: list[int]
) -> bool:
    """waiting → pending with the prompt built from the regenerated history; False if another
    advancer got there first (the update is conditional on the item still waiting)."""
    stmt = (
        update(common.items)
        .where(common.items.c.id == item_id, common.items.c.status == ItemStatus.WAITING.value)
        .values(
            status=ItemStatus.PENDING.value,
            messages=messages,
            prompt_ids=prompt_ids,
            prompt_tokens=len(prompt_ids),
        )
    )
    return conn.execute(stmt).rowcount == 1


def fail_waiting_chain(
    conn: Connection, run_id: int, item_key: str, sample_index: int, from_turn: int, reason: str
) -> int:
    """Fail every still-waiting turn from from_turn on of one chain (no attempt spent)."""
    stmt = (
        update(common.items)
        .where(
            common.items.c.run_id == run_id,
            common.items.c.item_key == item_key,
            common.items.c.sample_index == sample_index,
            common.items.c.turn_index >= from_turn,
            common.items.c.status == ItemStatus.WAITING.value,
        )
        .values(
            status=ItemStatus.FAILED.value,
            error=outcomes._trim(reason),
            fail_reason=failure_reason(reason),
            finished_at=common.utcnow(),
        )
    )
    return conn.execute(stmt).rowcount


def end_chain(
    conn: Connection,
    last_id: int,
    run_id: int,
    item_key: str,
    sample_index: int,
    from_turn: int,
    reason: str,
) -> int:
    """An agentic chain ends at its done item last_id with reason (CHAIN_END_*): the reason is
    recorded on it (once) and the chain's still-waiting turns from from_turn on are deleted
    (never run: no attempt, no failure). Returns how many were deleted; idempotent."""
    record_chain_end(conn, last_id, reason)
    stmt = delete(common.items).where(
        common.items.c.run_id == run_id,
        common.items.c.item_key == item_key,
        common.items.c.sample_index == sample_index,
        common.items.c.turn_index >= from_turn,
        common.items.c.status == ItemStatus.WAITING.value,
    )
    return int(conn.execute(stmt).rowcount)


def unended_last_turns(
    conn: Connection,
    *,
    prev_ids: Sequence[int] | None = None,
    run_id: int | None = None,
    after_id: int = 0,
    limit: int = 500,
) -> list[tuple[int, int]]:
    """(id, run_id) of the done last turns of agentic chains (ends_chain) with no chain ending
    recorded: among prev_ids (just committed), or of one run (the catch-up), in id order. The
    catch-up reads ix_items_unended, which holds these rows alone: O(the rows it returns),
    whatever the run's done items."""
    if prev_ids is not None and not prev_ids:
        return []
    stmt = (
        select(common.items.c.id, common.items.c.run_id)
        .where(
            common.items.c.ends_chain,
            common.items.c.status == ItemStatus.DONE.value,
            common.items.c.chain_end.is_(None),
            common.items.c.id > after_id,
        )
        .limit(limit)
    )
    if prev_ids is not None:
        stmt = stmt.where(common.items.c.id.in_(list(prev_ids)))
    if run_id is not None:
        # ordered as the index is, so the page is one range of it. The run is a range of one
        # value, not an equality: with an equality the primary key delivers the order too,
        # and with stale statistics a walk of it past the run's done items looked as cheap
        # (sorts are priced out: pin_index_plans)
        database.pin_index_plans(conn)
        stmt = stmt.where(common.items.c.run_id.between(run_id, run_id))
        stmt = stmt.order_by(common.items.c.run_id, common.items.c.id)
    else:
        stmt = stmt.order_by(common.items.c.id)
    return [(int(item_id), int(run)) for item_id, run in conn.execute(stmt)]


def unmark_plain_chains(conn: Connection, ids: Sequence[int]) -> int:
    """These last turns end plain chains (no tools, no tool turns): no ending to record, so
    they leave the catch-up's index."""
    if not ids:
        return 0
    stmt = update(common.items).where(common.items.c.id.in_(list(ids))).values(ends_chain=None)
    return int(conn.execute(stmt).rowcount)


def record_chain_end(conn: Connection, item_id: int, reason: str) -> bool:
    """Record how the chain ending at this done item ended; False if already recorded."""
    stmt = (
        update(common.items)
        .where(common.items.c.id == item_id, common.items.c.chain_end.is_(None))
        .values(chain_end=reason)
    )
    return conn.execute(stmt).rowcount == 1
